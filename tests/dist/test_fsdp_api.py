"""The FSDPModule API on a 2x2 (dp, tp) Llama: summon_full_params, unshard/reshard,
reshard policies, gradient accumulation without sync, the gradient divide factor, explicit
prefetch, the meta-device (torchtitan) initialisation flow, and eval / no_grad forwards.

Every job builds the small Llama of ``_parity`` (TP plan on ``tp``, ``fully_shard`` on
each block and the root over ``dp``) next to a single-process reference from the same
seed. Shapes used below: ``layers.*.attention.wq.weight`` is (32, 32) globally, (16, 32)
TP-local (ColwiseParallel on tp=2) and (8, 32) as an FSDP shard (dp=2).

Tolerances: outputs, losses and gradients of the parallel model differ from the
reference only by the order of fp32 sums (TP all-reduces, the dp reduce-scatter):
outputs and losses by ~1e-7 relative (bound 1e-6); gradients, per tensor relative to
max(its norm, 1e-3 x the whole gradient's norm), by up to ~4e-7 (bound GRAD_TOL = 1e-5,
as ``_parity``; a missing or doubled reduction is an O(1) error). Parameters moved by
all-gathers and copies are compared exactly, and changes that only alter timing
(prefetch, reshard policies) must give bitwise-identical results.
"""

from __future__ import annotations

import copy

import pytest

from .pool import get_mesh

WQ = "layers.0.attention.wq.weight"
TP_LOCAL, SHARD = (16, 32), (8, 32)
GRAD_TOL = 1e-5


def _lshape(t) -> tuple:
    """The local shape of a parameter (DTensors at rest: their shard)."""
    from fsdp2d._dtensor import local_of

    return tuple(local_of(t).shape)


def _setup(mp=None):
    """(mesh, reference, parallel model), the model TP + FSDP on 2x2."""
    import fsdp2d

    from . import _parity as P

    mesh = get_mesh((2, 2), ("dp", "tp"))
    ref = P.build("llama")
    model = copy.deepcopy(ref)
    fsdp2d.parallelize_module(model, mesh["tp"], P.llama_tp_plan())
    kw = {"mp_policy": mp} if mp is not None else {}
    for block in model.layers:
        fsdp2d.fully_shard(block, mesh=mesh["dp"], **kw)
    fsdp2d.fully_shard(model, mesh=mesh["dp"], **kw)
    return mesh, ref, model


def _tp_local(model, ref):
    """The TP-local value of every FSDP parameter, cut from the reference's full tensor."""
    import fsdp2d

    tp = dict(fsdp2d.tp_params(model))
    out = {}
    for fqn, _ in fsdp2d.fsdp_params(model):
        full = ref.get_parameter(fqn).detach()
        out[fqn] = tp[fqn].layout.shard(full) if fqn in tp else full
    return out


def _batch(global_batch=8, step=0):
    """This rank's dp slice and the global batch."""
    from . import _parity as P

    mesh = get_mesh((2, 2), ("dp", "tp"))
    x, y = P.batch_for(step, P.Setup(batch=global_batch))
    i = mesh.get_local_rank("dp")
    return x.chunk(2)[i], y.chunk(2)[i], x, y


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _grad_errs(model, ref, mesh) -> float:
    """Worst error of the parallel model's gathered gradients vs the reference's, per
    tensor, relative to max(its norm, 1e-3 x the whole gradient's norm) as in
    ``_parity.grad_error`` (near-cancelling q/k gradients carry their terms' rounding)."""
    import torch

    from . import _parity as P

    grads = P.full_tensors(model, mesh, "grad")
    whole = torch.stack([p.grad.norm() for p in ref.parameters()]).norm()
    return max(((grads[n] - p.grad).norm() / torch.maximum(p.grad.norm(), 1e-3 * whole)).item()
               for n, p in ref.named_parameters())


def _summon_job():
    import torch

    import fsdp2d

    from . import _parity as P

    mesh, ref, model = _setup()
    expected = _tp_local(model, ref)
    xs, ys, x, y = _batch()
    out = {}
    with fsdp2d.summon_full_params(model):
        out["shapes"] = {fqn: (_lshape(model.get_parameter(fqn)), tuple(v.shape))
                         for fqn, v in expected.items()}
        out["values"] = all(model.get_parameter(fqn).equal(v) for fqn, v in expected.items())
        with torch.no_grad():  # edits: a TP-sharded block weight and a root (norm) weight
            model.get_parameter(WQ).add_(1.0)
            model.norm.weight.mul_(3.0)
    with torch.no_grad():
        ref.get_parameter(WQ).add_(1.0)
        ref.norm.weight.mul_(3.0)
    out["shape_after"] = _lshape(model.get_parameter(WQ))
    full = P.full_tensors(model, mesh, "param")
    out["written_back"] = all(full[n].equal(p.detach()) for n, p in ref.named_parameters())
    out["next_step"] = _step_errors(model, ref, mesh, xs, ys, x, y)  # the edits are used

    with fsdp2d.summon_full_params(model, writeback=False), torch.no_grad():
        model.get_parameter(WQ).add_(100.0)
        model.norm.weight.zero_()
    full = P.full_tensors(model, mesh, "param")
    out["discarded"] = all(full[n].equal(p.detach()) for n, p in ref.named_parameters())
    out["step_after_discard"] = _step_errors(model, ref, mesh, xs, ys, x, y)

    # the method on one block unshards only that block
    with model.layers[1].summon_full_params():
        out["block_only"] = (_lshape(model.get_parameter("layers.1.attention.wq.weight")),
                             _lshape(model.get_parameter(WQ)))
    out["step_after_block"] = _step_errors(model, ref, mesh, xs, ys, x, y)
    return out


def _step_errors(model, ref, mesh, xs, ys, x, y):
    """(loss, gradient) relative errors of one forward + backward against the reference;
    gradients are zeroed afterwards."""
    import torch.distributed as dist
    import torch.nn.functional as F

    loss = F.cross_entropy(model(xs).flatten(0, 1), ys.flatten())
    ref_loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
    loss.backward()
    ref_loss.backward()
    # the mean of the dp slices' losses is the global loss
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.get_group("dp"))
    errs = (abs(total.item() / 2 - ref_loss.item()) / ref_loss.item(), _grad_errs(model, ref, mesh))
    model.zero_grad(), ref.zero_grad()
    return errs


def _summon_mixed_precision_job():
    """summon_full_params with bf16 compute and no edits must not touch the fp32 shards."""
    import torch

    import fsdp2d

    _, _, model = _setup(mp=fsdp2d.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with fsdp2d.summon_full_params(model):
        dtype = str(model.get_parameter(WQ).dtype)
    after = dict(model.named_parameters())
    changed = sorted(n for n, v in before.items() if not v.equal(after[n].detach()))
    return {"dtype_inside": dtype, "changed": changed, "n": len(before)}


def _unshard_job():
    import torch.nn.functional as F

    mesh, ref, model = _setup()
    expected = _tp_local(model, ref)
    block0, block1 = model.layers[0], model.layers[1]
    sharded = block0.attention.wq.weight
    out = {"at_rest": _lshape(sharded)}
    out["unshard_none"] = block0.unshard() is None
    out["unsharded"] = _lshape(block0.attention.wq.weight)
    out["unsharded_values"] = block0.attention.wq.weight.equal(expected[WQ])
    block0.reshard()
    out["resharded"] = _lshape(block0.attention.wq.weight)
    out["same_object"] = block0.attention.wq.weight is sharded  # what the optimizer holds
    handle = block1.unshard(async_op=True)
    out["handle"] = type(handle).__name__
    handle.wait()
    out["async_unsharded"] = _lshape(block1.attention.wq.weight)
    out["async_values"] = block1.attention.wq.weight.equal(expected["layers.1.attention.wq.weight"])
    block1.reshard()
    out["async_resharded"] = _lshape(block1.attention.wq.weight)

    xs, ys, x, y = _batch()
    # default: blocks reshard after forward, the root keeps its parameters
    loss = F.cross_entropy(model(xs).flatten(0, 1), ys.flatten())
    out["default_after_forward"] = (_lshape(block0.attention.wq.weight), _lshape(model.output.weight))
    loss.backward()
    out["default_after_backward"] = (_lshape(block0.attention.wq.weight), _lshape(model.output.weight))
    gathers = block0._fsdp2d_fsdp.group.counts["all_gather"]
    grads_default = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    model.set_reshard_after_forward(False)
    loss = F.cross_entropy(model(xs).flatten(0, 1), ys.flatten())
    out["kept_after_forward"] = [_lshape(b.attention.wq.weight) for b in model.layers]
    loss.backward()
    out["kept_after_backward"] = _lshape(block0.attention.wq.weight)
    # no second all-gather in backward
    out["gathers"] = (gathers, block0._fsdp2d_fsdp.group.counts["all_gather"] - gathers)
    out["same_grads"] = all(p.grad.equal(grads_default[n]) for n, p in model.named_parameters())
    F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
    out["grads"] = _grad_errs(model, ref, mesh)
    model.set_reshard_after_forward(True)
    model.zero_grad()
    return out


def _divide_factor_job():
    """set_gradient_divide_factor(1.0) on every FSDP module (torchtitan's way: its loss is
    already divided by the global token count) sums the dp gradients instead of averaging
    them: exactly 2x the default on dp=2 (a power of two). Bad factors are refused."""
    import torch.nn.functional as F

    import fsdp2d

    from .pool import capture_error

    _, _, avg = _setup()
    _, _, summed = _setup()
    for m in summed.modules():
        if isinstance(m, fsdp2d.FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # accepted: fsdp2d always sums, then divides
    xs, ys, _, _ = _batch()
    for model in (avg, summed):
        F.cross_entropy(model(xs).flatten(0, 1), ys.flatten()).backward()
    pairs = zip(avg.named_parameters(), summed.named_parameters())
    return {"exact_2x": all(_local(b.grad).equal(2 * _local(a.grad)) for (_, a), (_, b) in pairs),
            "zero": capture_error(lambda: summed.set_gradient_divide_factor(0.0)),
            "not_bool": capture_error(lambda: summed.set_force_sum_reduction_for_comms(1))}


def _local(t):
    from fsdp2d._dtensor import local_of

    return local_of(t)


def _accum_job(reshard_after_backward):
    """4 microbatches, gradient sync only on the last, against one step on the whole
    dp slice (a second model) and the reference on the global batch."""
    import torch.nn.functional as F

    import fsdp2d

    mesh, ref, model = _setup()
    _, _, whole = _setup()
    _guard(model)
    xs, ys, x, y = _batch(global_batch=16)
    F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
    F.cross_entropy(whole(xs).flatten(0, 1), ys.flatten()).backward()
    out = {"grads_before_sync": [], "kept": []}
    for m, (xm, ym) in enumerate(zip(xs.chunk(4), ys.chunk(4))):
        last = m == 3
        model.set_requires_gradient_sync(last)
        if not reshard_after_backward:
            model.set_reshard_after_backward(last)
        try:
            (F.cross_entropy(model(xm).flatten(0, 1), ym.flatten()) / 4).backward()
        except RuntimeError as e:  # reported to the test (keeps the pool alive)
            return {"error": f"microbatch {m}: {str(e)[:200]}"}
        if not last:  # no reduce-scatter yet: no sharded gradient anywhere
            out["grads_before_sync"].append(sum(fp.sharded.grad is not None for _, fp in fsdp2d.fsdp_params(model)))
            out["kept"].append(_lshape(model.layers[1].attention.wq.weight))
    grads = dict(model.named_parameters())
    out["vs_whole"] = max(_rel(grads[n].grad, p.grad) for n, p in whole.named_parameters())
    out["vs_ref"] = _grad_errs(model, ref, mesh)
    out["shape_at_end"] = _lshape(model.get_parameter(WQ))
    out["fsdp"] = isinstance(model, fsdp2d.FSDPModule)
    return out


def _prefetch_job():
    import torch
    import torch.nn.functional as F

    from . import _parity as P

    mesh, _, default = _setup()
    _, _, explicit = _setup()
    layers = list(explicit.layers)
    explicit.set_modules_to_forward_prefetch([layers[0]])
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1:i + 2])
        layer.set_modules_to_backward_prefetch(layers[i - 1:i] if i else [])

    def probe(model, seen):
        group = model.layers[1]._fsdp2d_fsdp.group

        def hook(mod, args):  # runs before fully_shard's own pre-forward hook
            seen.append(group._gather is not None or group.unsharded)

        model.layers[1].register_forward_pre_hook(hook, prepend=True)

    seen_default, seen_explicit = [], []
    probe(default, seen_default), probe(explicit, seen_explicit)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=P.EPS) for m in (default, explicit)]
    out = {"losses": [], "grads_equal": [], "params_equal": None}
    for step in range(3):
        xs, ys, _, _ = _batch(step=step)
        losses, grads = [], []
        for m, opt in zip((default, explicit), opts):
            loss = F.cross_entropy(m(xs).flatten(0, 1), ys.flatten())
            loss.backward()
            losses.append(loss.item())
            grads.append(P.full_tensors(m, mesh, "grad"))
            opt.step(), opt.zero_grad()
        out["losses"].append(losses)
        out["grads_equal"].append(all(grads[0][n].equal(grads[1][n]) for n in grads[0]))
    a, b = P.full_tensors(default, mesh, "param"), P.full_tensors(explicit, mesh, "param")
    out["params_equal"] = all(a[n].equal(b[n]) for n in a)
    out["gathers"] = [[blk._fsdp2d_fsdp.group.counts["all_gather"] for blk in m.layers] for m in (default, explicit)]
    out["seen"] = (seen_default, seen_explicit)
    return out


def _meta_job():
    """torchtitan's flow: meta model -> parallelize_module -> fully_shard -> to_empty ->
    init_weights -> optimizer -> train."""
    import math

    import torch
    import torch.nn.functional as F

    import fsdp2d
    from fsdp2d.models import Llama, LlamaArgs, llama_tp_plan

    from . import _parity as P

    mesh = get_mesh((2, 2), ("dp", "tp"))
    with torch.device("meta"):
        model = Llama(LlamaArgs(dim=32, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=P.VOCAB,
                                multiple_of=8, max_seq_len=P.SEQ))
    out = {"meta": all(p.device.type == "meta" for p in model.parameters())}
    fsdp2d.parallelize_module(model, mesh["tp"], llama_tp_plan())
    for block in model.layers:
        fsdp2d.fully_shard(block, mesh=mesh["dp"])
    fsdp2d.fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["shapes"] = (_lshape(model.get_parameter(WQ)), _lshape(model.norm.weight))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=P.EPS)
    xs, ys, _, _ = _batch()
    out["losses"], out["no_grad"], out["nonfinite"] = [], [], []
    for step in range(3):
        loss = F.cross_entropy(model(xs).flatten(0, 1), ys.flatten())
        loss.backward()
        out["losses"].append(loss.item())
        named = dict(model.named_parameters())
        out["no_grad"].append(sorted(n for n, p in named.items() if p.grad is None))
        out["nonfinite"].append(sorted(n for n, p in named.items() if p.grad is not None
                                       and not torch.isfinite(p.grad).all()))
        if step == 0:  # the initialised values are what the first step trained
            out["init_kept"] = all(named[n].detach().equal(v) for n, v in init.items())
            out["norm_ones"] = bool((model.norm.weight == 1).all())
            out["clip"] = fsdp2d.clip_grad_norm_(model.parameters(), 1e6).item()
        opt.step()
        opt.zero_grad()
    out["finite"] = all(math.isfinite(v) for v in out["losses"])
    out["moved"] = sorted(n for n, p in model.named_parameters() if not p.detach().equal(init[n]))
    out["n_params"] = len(init)
    return out


def _eval_job():
    """One eval forward under no_grad, as the first forward of the model (lazy init)."""
    import torch

    _, ref, model = _setup()
    _, _, x, _ = _batch()
    model.eval(), ref.eval()
    with torch.no_grad():
        out = {"no_grad": _rel(model(x), ref(x))}
    out["block_shape"] = _lshape(model.get_parameter(WQ))
    return out


def _guard(model):
    """Raise (instead of reading freed memory, which can segfault the worker) when an
    FSDP module starts computing with a parameter whose storage was freed."""
    import fsdp2d

    def check(mod, args):
        freed = [n for n, p in mod.named_parameters() if p.untyped_storage().size() == 0]
        if freed:
            raise RuntimeError(f"forward of {type(mod).__name__} with freed parameters {freed[:3]}")

    for m in model.modules():
        if isinstance(m, fsdp2d.FSDPModule):
            m.register_forward_pre_hook(check)  # after fully_shard's own (prepended) hook


def _forward_only_job():
    """Forwards that are not followed by backward (evaluation, a validation loss, a
    hand-made unshard), then more forwards / summon_full_params / training."""
    import torch

    import fsdp2d

    def attempt(fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - reported to the test
            return f"{type(e).__name__}: {str(e)[:200]}"

    out = {}
    mesh, ref, model = _setup()
    _guard(model)
    xs, ys, x, y = _batch()

    def two_evals():
        with torch.no_grad():
            return max(_rel(model(x), ref(x)), _rel(model(x), ref(x)))

    out["two_no_grad_forwards"] = attempt(two_evals)
    out["train_after_eval"] = attempt(lambda: max(_step_errors(model, ref, mesh, xs, ys, x, y)))

    mesh, ref, model = _setup()
    _guard(model)
    expected = _tp_local(model, ref)

    def summon_after_forward():
        with torch.no_grad():
            model(x)  # e.g. a validation loss; the root keeps its parameters unsharded
        with fsdp2d.summon_full_params(model):
            params = {fqn: model.get_parameter(fqn) for fqn in expected}
            freed = [n for n, p in params.items() if p.untyped_storage().size() == 0]
            if freed:
                return f"freed parameters inside summon_full_params: {freed[:3]}"
            return all(params[fqn].equal(v) for fqn, v in expected.items())

    out["summon_after_forward"] = attempt(summon_after_forward)

    mesh, ref, model = _setup()
    _guard(model)

    def unshard_then_step():
        model.layers[0].unshard()  # prefetch by hand
        return max(_step_errors(model, ref, mesh, xs, ys, x, y))

    out["unshard_then_step"] = attempt(unshard_then_step)
    return out


def _inference_mode_job():
    import torch

    _, ref, model = _setup()
    _, _, x, _ = _batch()
    try:
        with torch.inference_mode():
            return _rel(model(x), ref(x))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------------- tests


def test_summon_full_params(pool):
    for rank, r in enumerate(pool.run(_summon_job)):
        for fqn, (got, want) in r["shapes"].items():
            assert got == want, f"rank {rank}: {fqn} has shape {got} inside summon, TP-local is {want}"
        assert r["shapes"][WQ][0] == TP_LOCAL
        assert r["values"], f"rank {rank}: summoned values are not the TP-local parameters"
        assert r["shape_after"] == SHARD, r["shape_after"]
        assert r["written_back"], f"rank {rank}: edits inside summon_full_params were not written back"
        loss_err, grad_err = r["next_step"]
        assert loss_err < 1e-6 and grad_err < GRAD_TOL, f"rank {rank}: the edits are not used: {r['next_step']}"
        assert r["discarded"], f"rank {rank}: writeback=False kept the edits"
        assert r["step_after_discard"][0] < 1e-6 and r["step_after_discard"][1] < GRAD_TOL, r["step_after_discard"]
        assert r["block_only"] == (TP_LOCAL, SHARD), r["block_only"]
        assert r["step_after_block"][0] < 1e-6 and r["step_after_block"][1] < GRAD_TOL, r["step_after_block"]


def test_summon_full_params_keeps_fp32_shards_under_bf16(pool):
    for r in pool.run(_summon_mixed_precision_job):
        assert not r["changed"], f"{len(r['changed'])}/{r['n']} shards changed, e.g. {r['changed'][:3]}"
        assert r["dtype_inside"] == "torch.float32"


def test_unshard_reshard_and_reshard_after_forward(pool):
    for rank, r in enumerate(pool.run(_unshard_job)):
        assert r["at_rest"] == SHARD
        assert r["unshard_none"] and r["unsharded"] == TP_LOCAL and r["unsharded_values"]
        assert r["resharded"] == SHARD and r["same_object"]
        assert r["handle"] == "UnshardHandle"
        assert r["async_unsharded"] == TP_LOCAL and r["async_values"] and r["async_resharded"] == SHARD
        # output.weight: (96, 32) globally, ColwiseParallel -> (48, 32), FSDP shard (24, 32)
        assert r["default_after_forward"] == (SHARD, (48, 32)), r["default_after_forward"]
        assert r["default_after_backward"] == (SHARD, (24, 32)), r["default_after_backward"]
        assert r["kept_after_forward"] == [TP_LOCAL, TP_LOCAL], r["kept_after_forward"]
        assert r["kept_after_backward"] == SHARD
        # one all-gather in the explicit unshard, forward + backward in the default step;
        # with reshard_after_forward=False only the forward one
        assert r["gathers"] == (3, 1), r["gathers"]
        assert r["same_grads"], f"rank {rank}: reshard_after_forward=False changed the gradients"
        assert r["grads"] < GRAD_TOL, r["grads"]


@pytest.mark.parametrize("reshard_after_backward", [
    pytest.param(True, id="reshard"),
    pytest.param(False, id="keep-unsharded"),
])
def test_gradient_accumulation_without_sync(pool, reshard_after_backward):
    for rank, r in enumerate(pool.run(_accum_job, reshard_after_backward)):
        assert "error" not in r, f"rank {rank}: {r.get('error')}"
        assert r["fsdp"]
        assert r["grads_before_sync"] == [0, 0, 0], f"rank {rank}: gradients synced early {r['grads_before_sync']}"
        assert r["kept"] == [SHARD if reshard_after_backward else TP_LOCAL] * 3, r["kept"]
        assert r["shape_at_end"] == SHARD
        # 4 microbatch sums vs one: fp32 reordering only
        assert r["vs_whole"] < GRAD_TOL, f"rank {rank}: {r['vs_whole']:.2e} vs one step on the whole batch"
        assert r["vs_ref"] < GRAD_TOL, f"rank {rank}: {r['vs_ref']:.2e} vs the reference"


def test_gradient_divide_factor_sums_gradients(pool):
    for rank, r in enumerate(pool.run(_divide_factor_job)):
        assert r["exact_2x"], rank
        assert r["zero"][0] == "ValueError" and "positive" in r["zero"][1], r["zero"]
        assert r["not_bool"][0] == "TypeError", r["not_bool"]


def test_explicit_prefetch_is_identical_to_default(pool):
    for rank, r in enumerate(pool.run(_prefetch_job)):
        assert all(a == b for a, b in r["losses"]), f"rank {rank}: {r['losses']}"
        assert all(r["grads_equal"]) and r["params_equal"], rank
        assert r["gathers"][0] == r["gathers"][1], f"rank {rank}: all-gathers {r['gathers']}"
        seen_default, seen_explicit = r["seen"]
        # first step: the default records the order and cannot prefetch; the explicit
        # plan has layers.1 already gathering when its forward starts
        assert seen_default == [False, True, True], seen_default
        assert seen_explicit == [True, True, True], seen_explicit


def test_meta_device_init_flow(pool):
    for rank, r in enumerate(pool.run(_meta_job)):
        assert r["meta"]
        assert r["shapes"] == (SHARD, (16,)), r["shapes"]
        assert r["finite"], r["losses"]
        assert r["no_grad"] == [[]] * 3, f"rank {rank}: parameters without gradients {r['no_grad']}"
        assert r["nonfinite"] == [[]] * 3, r["nonfinite"]
        assert r["init_kept"], f"rank {rank}: the first step did not start from init_weights' values"
        assert r["norm_ones"]
        assert 0 < r["clip"] < float("inf")
        assert len(r["moved"]) == r["n_params"], "some parameters were never updated"
        assert r["losses"][2] < r["losses"][0], r["losses"]  # same batch, AdamW lr 1e-2


def test_eval_no_grad_forward(pool):
    for rank, r in enumerate(pool.run(_eval_job)):
        assert r["no_grad"] < 1e-6, f"rank {rank}: {r['no_grad']:.2e}"
        assert r["block_shape"] == SHARD, r["block_shape"]


def test_forwards_without_backward(pool):
    for rank, r in enumerate(pool.run(_forward_only_job)):
        for case in ("two_no_grad_forwards", "train_after_eval", "unshard_then_step"):
            assert isinstance(r[case], float) and r[case] < GRAD_TOL, f"rank {rank}: {case}: {r[case]}"
        assert r["summon_after_forward"] is True, f"rank {rank}: {r['summon_after_forward']}"


def test_inference_mode_forward(pool):
    for r in pool.run(_inference_mode_job):
        assert isinstance(r, float) and r < 1e-6, r
