"""``check_parallel``: a user's parallel plan against one process, step by step and
module by module, on CPU gloo workers started from a plain pytest process."""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ._compare import call_model, capture, gathered, rel_error
from ._misuse import build_differs, forward_differs, not_scalar
from ._pool import get_mesh, module_root, worker_pool

# Tolerances (fp32 on CPU). Parallelism changes only the order of floating-point sums
# (a TP row-wise matmul adds per-rank partial sums; FSDP averages gradients over dp), so
# each figure differs from one process by rounding: about eps32 (1.2e-7) x sqrt(terms) x
# (sum of |terms|) / |result|. Errors are taken against the largest magnitude of the
# tensor (not per element: elements that are sums of nearly cancelling terms carry the
# rounding of their terms): fsdp2d's Llama and GPT-2 plans over (2, 2), (4, 1), (1, 4)
# measure at most 5.9e-7 (a row-wise MLP output), so RTOL leaves 17x; a wrong plan (a
# norm over a shard, a missing or doubled reduction) is off by 1e-2 or more.
RTOL = 1e-5
# Gradients: a tensor whose gradient is far below the model's largest (q/k projections
# under near-uniform attention) is itself a cancelling sum: its floor is 1e-3 of the
# largest gradient of the model, as in fsdp2d's own parity tests.
GRAD_FLOOR = 1e-3
# Parameters after one optimizer step from equal weights, absolute. Adam's first update
# g / (|g| + eps) is steepest where |g| ~ eps (slope 1 / (4 eps)): there a rounding
# difference dg of a gradient moves the weight by lr x dg / (4 eps). The default AdamW
# (lr 1e-3, eps 1e-6) and dg <= 1e-8 bound that at 2.5e-6; ATOL leaves 4x. (Measured: at
# lr 1e-2 a Hugging Face Llama's weights differed by 1.95e-5 after one step, dg ~ 8e-9.)
# A wrong update (a lost optimizer state, a gradient scaled by dp) moves weights by ~lr.
ATOL = 1e-5


def default_optimizer(params) -> torch.optim.Optimizer:
    """AdamW(lr=1e-3, weight_decay=0.1, eps=1e-6): eps 1e-6 (a common LLM setting) bounds
    how much Adam amplifies a rounding difference in a near-zero gradient (see ATOL)."""
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)


@dataclass(frozen=True)
class _Job:
    build: Callable
    parallelize: Callable
    batches: list
    loss_fn: Callable
    optimizer: Callable
    forward: Callable | None
    steps: int
    seed: int
    rtol: float
    atol: float


def check_parallel(build: Callable[[], torch.nn.Module], parallelize: Callable, batches: Sequence[Any],
                   loss_fn: Callable, *, meshes: Sequence[tuple[int, int]] = ((2, 2),), steps: int = 3,
                   optimizer: Callable | None = None, atol: float | None = None, rtol: float | None = None,
                   forward: Callable | None = None, seed: int = 0, timeout: float = 300.0) -> None:
    """Train ``build()`` parallelized by ``parallelize(model, mesh)`` on CPU gloo workers
    and check it against ``build()`` in one process; raise ``AssertionError`` at the
    first figure that differs, naming the mesh, the step and the module or parameter.

    ``build``, ``parallelize``, ``loss_fn`` (and ``forward``, ``optimizer``) must be
    module-level functions (or picklable objects): the workers import them by name.
    ``batches``: global batches (a tensor, or a dict of tensors), dim 0 split over dp
    (``torch.chunk``); step ``s`` uses ``batches[s % len(batches)]``. ``meshes``: (dp, tp)
    shapes; each gets a torch ``DeviceMesh`` with axes ``("dp", "tp")`` over a pool of
    ``dp * tp`` worker processes, started on first use and reused by later calls.

    On every rank, every step: (1) the parallel model's parameters, gathered to full
    tensors, are compared with the reference's and then copied into it, so each step is
    measured from equal weights and rounding never compounds (the first step checks that
    ``parallelize`` kept the weights); (2) both run forward (the parallel model on its dp
    slice: ``forward(model, batch)``, default ``model(batch)`` or ``model(**batch)``
    without ``"labels"``) and every module's output is compared in the order modules
    finish, so a mismatch names the first module that is off, not the loss (a plain
    output is matched against the reference's dp slice, or against its ``torch.chunk``
    along the one dim where the shapes differ, by tp rank; a DTensor output is gathered;
    outputs that match neither are skipped); (3) ``loss_fn(output, batch)`` (a mean over
    the batch), averaged over dp, against the reference's on the global batch; (4) every
    gradient, gathered; (5) after ``optimizer(params)`` steps both (default
    :func:`default_optimizer`; the reference keeps its own optimizer state), every
    parameter. ``rtol`` (default 1e-5) bounds max|difference| / max|reference| of
    outputs, losses and gradients; ``atol`` (default 1e-5) the absolute difference of
    parameters after a step (see the comments at ``RTOL`` and ``ATOL`` for why). A
    parameter of the reference that the parallel model lacks (``parallelize`` made it a
    buffer, or dropped it) fails the check: it would never be trained.

    Before any of that, the test itself is checked, and a misuse raises instead of
    blaming the plan: ``ValueError`` if two ``build()`` calls after
    ``torch.manual_seed(seed)`` differ (a build that seeds itself), or if two forwards of
    the reference on ``batches[0]`` differ (dropout in training mode: set ``p=0`` or call
    ``eval()`` in ``build``), naming the parameter or the first module that differs;
    ``TypeError`` if ``loss_fn`` returns anything but a one-element tensor.
    """
    for name, fn in (("build", build), ("parallelize", parallelize), ("loss_fn", loss_fn)):
        if not callable(fn):
            raise TypeError(f"check_parallel: {name} must be callable, got {type(fn).__name__}")
    batches = list(batches)
    if not batches:
        raise ValueError("check_parallel: batches is empty; pass a list of global batches")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"check_parallel: steps must be a positive int, got {steps!r}")
    shapes = [_mesh_shape(m) for m in meshes]
    if not shapes:
        raise ValueError("check_parallel: meshes is empty; pass (dp, tp) shapes such as [(2, 2)]")
    for dp, _ in shapes:
        for i, batch in enumerate(batches):
            _check_divisible(batch, dp, f"batches[{i}]")
    job = _Job(build, parallelize, batches, loss_fn, optimizer or default_optimizer, forward, steps, seed,
               RTOL if rtol is None else float(rtol), ATOL if atol is None else float(atol))
    fns = [getattr(f, "func", f) for f in (build, parallelize, loss_fn, optimizer, forward)]  # partials
    roots = sorted({module_root(f, "check_parallel") for f in fns
                    if f is not None and not isinstance(f, type) and hasattr(f, "__qualname__")})
    try:
        payload = pickle.dumps(job)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(f"check_parallel: the functions and batches must pickle (module-level functions, "
                        f"tensors): {e}") from e
    for dp, tp in shapes:
        results = worker_pool(dp * tp).run(_run_on_rank, roots, payload, (dp, tp), timeout=timeout)
        found = [r for rank_records in results for r in rank_records]
        misuse = [r for r in found if len(r) == 3]  # the test is wrong, not the plan: (key, text, type)
        if misuse:
            _, text, kind = min(misuse)
            raise _MISUSE[kind](f"check_parallel: {text}")
        if found:
            key, text = min(found)
            raise AssertionError(f"check_parallel on mesh (dp={dp}, tp={tp}): {text}")


def _mesh_shape(m: Any) -> tuple[int, int]:
    shape = tuple(m) if isinstance(m, (tuple, list)) else None
    if shape is None or len(shape) != 2 or not all(isinstance(s, int) and s >= 1 for s in shape):
        raise ValueError(f"check_parallel: a mesh is a (dp, tp) pair of positive ints, got {m!r}")
    return shape


def _check_divisible(batch: Any, dp: int, where: str) -> None:
    for key, t in _batch_tensors(batch):
        if t.ndim == 0 or t.shape[0] % dp:
            raise ValueError(f"check_parallel: {where}{key} has {t.shape[0] if t.ndim else 'no'} rows (dim 0), "
                             f"not a multiple of dp={dp}; make the global batch divisible by every mesh's dp")


def _batch_tensors(batch: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        return [("", batch)]
    if isinstance(batch, dict):
        return [(f"[{k!r}]", v) for k, v in batch.items() if isinstance(v, torch.Tensor)]
    raise TypeError(f"check_parallel: a batch is a tensor or a dict of tensors, got {type(batch).__name__}")


def _slice(batch: Any, dp: int, index: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.chunk(dp)[index]
    return {k: v.chunk(dp)[index] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


_MISUSE = {"TypeError": TypeError, "ValueError": ValueError}


# -- on every rank -------------------------------------------------------------------------
def _run_on_rank(roots: list[str], payload: bytes, shape: tuple[int, int]) -> list:
    """One rank's run; returns its mismatches as ((step, phase, order), text), or one
    misuse of check_parallel as (key, text, exception type name)."""
    import sys

    for root in roots:
        if root not in sys.path:
            sys.path.insert(0, root)
    job: _Job = pickle.loads(payload)
    torch.set_num_threads(1)
    mesh = get_mesh(shape, ("dp", "tp"))
    dp_index = mesh.get_local_rank("dp")
    where = f"rank {torch.distributed.get_rank()} (dp {dp_index}, tp {mesh.get_local_rank('tp')})"
    torch.manual_seed(job.seed)
    ref = job.build()
    torch.manual_seed(job.seed)
    model = job.build()
    # The comparison means something only if the reference is a function of the seed and
    # the batch: check build() against itself and the reference's forward against itself
    # first, so neither is blamed on parallelize (every rank finds the same: they agree).
    misuse = build_differs(ref, model, job.seed) or forward_differs(ref, job, job.batches[0])
    if _any_rank(misuse is not None):
        return [misuse] if misuse is not None else []
    job.parallelize(model, mesh)
    opt, ref_opt = job.optimizer(list(model.parameters())), job.optimizer(list(ref.parameters()))
    seen: dict[str, list] = {}
    ref_seen: dict[str, list] = {}
    hooks = capture(model, seen, gather=True) + capture(ref, ref_seen, gather=False)
    out: list = []
    try:
        for step in range(job.steps):
            out += _compare_params(model, ref, step, 0, "before the step" if step else "after parallelize",
                                   job.atol, where, copy=True)
            batch = job.batches[step % len(job.batches)]
            mine = _slice(batch, shape[0], dp_index)
            seen.clear(), ref_seen.clear()
            output, ref_loss = call_model(model, mine, job.forward), job.loss_fn(call_model(ref, batch, job.forward), batch)
            off = _compare_outputs(seen, ref_seen, step, shape, mesh, job.rtol, where)
            loss, failed = _loss_or_error(job.loss_fn, output, mine)
            misuse = not_scalar(ref_loss, "the reference's output") or (
                None if failed is not None else not_scalar(loss, "the parallel model's output"))
            if _any_rank(bool(off) or failed is not None or misuse is not None):  # every rank stops together
                if misuse is not None:
                    return [misuse]
                if off or failed is None:
                    return out + off
                raise failed  # the loss broke, with no module output to blame
            out += off
            mean = loss.detach().float().clone()
            torch.distributed.all_reduce(mean, group=mesh.get_group("dp"))
            err = abs(mean.item() / shape[0] - ref_loss.item()) / max(abs(ref_loss.item()), 1e-12)
            if err > job.rtol:
                out.append(((step, 2, 0), f"step {step}: the loss (mean over dp) is {mean.item() / shape[0]!r}, "
                            f"the reference's {ref_loss.item()!r}: relative error {err:.3g} > rtol {job.rtol:g} "
                            f"({where})"))
            loss.backward()
            ref_loss.backward()
            out += _compare_grads(model, ref, step, job.rtol, where)
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        out += _compare_params(model, ref, job.steps - 1, 4, "after the optimizer step", job.atol, where, copy=False)
    finally:
        for h in hooks:
            h.remove()
    return out


def _loss_or_error(loss_fn: Callable, output: Any, batch: Any):
    """(loss, None), or (None, the exception): a plan that is already wrong often makes
    the loss raise (shapes); the module that went wrong first is the better answer."""
    try:
        return loss_fn(output, batch), None
    except Exception as e:  # noqa: BLE001 - re-raised unless a module output explains it
        return None, e


def _any_rank(flag: bool) -> bool:
    t = torch.tensor([float(flag)])
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def _aligned(local: torch.Tensor, ref: torch.Tensor, dp: int, dp_index: int, tp: int, tp_index: int):
    """The part of the reference output this rank's ``local`` output should equal, and
    how it was found; None if no part fits (the output is not comparable)."""
    candidates = []
    if dp > 1 and ref.ndim and ref.shape[0] % dp == 0:
        candidates.append((ref.chunk(dp)[dp_index], "its dp slice"))
    candidates.append((ref, "the whole output"))
    for want, what in candidates:
        if want.shape == local.shape:
            return want, what
        differ = [d for d in range(want.ndim) if want.ndim == local.ndim and want.shape[d] != local.shape[d]]
        if len(differ) == 1 and tp > 1:
            pieces = want.chunk(tp, dim=differ[0])
            if tp_index < len(pieces) and pieces[tp_index].shape == local.shape:
                return pieces[tp_index], f"tp chunk {tp_index} of {what} along dim {differ[0]}"
    return None


def _compare_outputs(seen: dict, ref_seen: dict, step: int, shape, mesh, rtol: float, where: str) -> list:
    dp, tp = shape
    dp_index, tp_index = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    out = []
    for order, (name, leaves) in enumerate(seen.items()):
        ref_leaves = ref_seen.get(name, [])
        for i, (got, ref) in enumerate(zip(leaves, ref_leaves)):
            found = _aligned(got, ref, dp, dp_index, tp, tp_index)
            if found is None:
                continue
            want, what = found
            err = rel_error(got, want)
            if err > rtol:
                label = f"module {name!r}" if name else "the model (root module)"
                part = f" (output {i})" if len(leaves) > 1 else ""
                out.append(((step, 1, order), f"step {step}: the output of {label}{part} differs from the "
                            f"single-process reference ({what}): max|diff| / max|ref| = {err:.3g} > rtol {rtol:g} "
                            f"({where}); it is the first module, in the order modules finish, whose output is off"))
                break
    return out


def _compare_grads(model, ref, step: int, rtol: float, where: str) -> list:
    ref_params = dict(ref.named_parameters())
    largest = max((p.grad.abs().max().item() for p in ref_params.values() if p.grad is not None
                   and p.grad.numel()), default=0.0)
    out = []
    for order, (fqn, p) in enumerate(model.named_parameters()):
        r = ref_params.get(fqn)
        got = None if p.grad is None else gathered(p.grad)
        want = None if r is None or r.grad is None else r.grad.float()
        if (got is None) != (want is None):
            out.append(((step, 3, order), f"step {step}: parameter {fqn!r} has "
                        f"{'no' if got is None else 'a'} gradient, the reference {'no' if want is None else 'one'} "
                        f"({where})"))
            continue
        if got is None:
            continue
        err = rel_error(got, want, GRAD_FLOOR * largest)
        if err > rtol:
            out.append(((step, 3, order), f"step {step}: the gradient of parameter {fqn!r} differs from the "
                        f"reference's: max|diff| / max(max|ref|, {GRAD_FLOOR:g} x the largest gradient) = "
                        f"{err:.3g} > rtol {rtol:g} ({where})"))
    return out


def _compare_params(model, ref, step: int, phase: int, when: str, atol: float, where: str, copy: bool) -> list:
    ref_params = dict(ref.named_parameters())
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    # A reference parameter the parallel model lacks is never trained there: a failure
    # (sorted after the parameters that are compared), not a name left out of the comparison.
    out = [((step, phase, len(params) + i), f"step {step}: reference parameter {fqn!r} is not a parameter of the "
            f"parallel model ({when}: {'a buffer' if fqn in buffers else 'missing'} there), so it is never trained; "
            f"parallelize must keep every parameter an nn.Parameter ({where})")
           for i, fqn in enumerate(n for n in ref_params if n not in params)]
    for order, (fqn, p) in enumerate(params.items()):
        r = ref_params.get(fqn)
        if r is None:
            out.append(((step, phase, order), f"step {step}: parameter {fqn!r} is not in the reference model "
                        f"({when}); parallelize must keep parameter names ({where})"))
            continue
        full = gathered(p)
        if full.shape != r.shape:
            out.append(((step, phase, order), f"step {step}: parameter {fqn!r} gathers to shape "
                        f"{tuple(full.shape)}, the reference's is {tuple(r.shape)} ({when}; {where})"))
            continue
        diff = (full - r.detach().float()).abs().max().item() if r.numel() else 0.0
        if diff > atol or math.isnan(diff):
            out.append(((step, phase, order), f"step {step}: parameter {fqn!r} differs from the reference's "
                        f"{when}: max|diff| = {diff:.3g} > atol {atol:g} ({where})"))
        if copy:
            with torch.no_grad():
                r.copy_(full.to(r.dtype))
    return out
