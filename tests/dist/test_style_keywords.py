"""Every TP style keyword torch 2.13 accepts, with torch's semantics, against one process.

Each case parallelizes a small module on TP=4 and compares the forward output (made
whole: ``full_tensor()`` of a DTensor output, fsdp2d's gather of a local one), the
parameter gradients (gathered DTensors) and the input gradient with an unparallelized
copy on the full input. Tolerance 1e-6 relative: TP only reorders fp32 sums (~1e-7).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .pool import get_mesh

TOL = 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _compare(model, ref, out_full, ref_out, x_grad, ref_x_grad) -> dict:
    """Largest relative errors of the output, the input gradient and each parameter gradient."""
    from fsdp2d import gather_full
    from torch.distributed.tensor import DTensor

    errs = {"out": _rel(out_full, ref_out), "x_grad": _rel(x_grad, ref_x_grad)}
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        g = gather_full(p.grad) if isinstance(p.grad, DTensor) else p.grad
        errs[f"grad {n}"] = _rel(g, q.grad)
    return errs


def _run(module, plan, x_full, shard_input, whole_output, **kw) -> dict:
    """Parallelize a copy of ``module`` with ``plan``, feed it this rank's input
    (``shard_input(x)``), make its output whole (``whole_output(y)``), backprop the
    same loss as the reference and compare."""
    import fsdp2d

    mesh = get_mesh((4,), ("tp",))
    ref = copy.deepcopy(module)
    fsdp2d.parallelize_module(module, mesh, plan, **kw)
    x_ref = x_full.clone().requires_grad_(x_full.is_floating_point())
    ref_out = ref(x_ref)
    weights = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(7))
    (ref_out * weights).sum().backward()
    x = shard_input(x_full.clone()).detach().requires_grad_(x_full.is_floating_point())
    out_full = whole_output(module(x))
    (out_full * weights).sum().backward()
    x_grad = whole_input_grad(x, shard_input, x_full) if x.requires_grad else torch.zeros(1)
    ref_x_grad = x_ref.grad if x_ref.requires_grad else torch.zeros(1)
    return _compare(module, ref, out_full, ref_out.detach(), x_grad, ref_x_grad)


def whole_input_grad(x, shard_input, x_full):
    """The input gradient back at full size (this rank's part in its place, gathered)."""
    from fsdp2d._collectives import all_reduce
    import torch.distributed as dist

    full = torch.zeros_like(x_full, dtype=x.grad.dtype)
    placed = shard_input(full)  # a view of this rank's part (or the whole, replicated)
    if placed.shape == full.shape:  # replicated input: every rank holds the whole gradient
        return x.grad
    placed.copy_(x.grad)
    return all_reduce(full, dist.group.WORLD, inplace=False)


def _seq(d):
    return lambda t: t.chunk(4, dim=d)[torch.distributed.get_rank()]


def _gather(d):
    """A sharded output made whole, differentiably (fsdp2d's gather, or full_tensor())."""
    import fsdp2d.tensor_parallel as tp
    import torch.distributed as dist

    return lambda y: tp.gather_from_tp(y, d, group=dist.group.WORLD) if not _is_dt(y) else y.full_tensor()


def _is_dt(y):
    from torch.distributed.tensor import DTensor

    return isinstance(y, DTensor)


def _full(y):
    return y.full_tensor() if _is_dt(y) else y


def _summed(y):
    """A Partial output made whole: full_tensor() of a DTensor, an all-reduce (whose
    backward passes the gradient to every summand) of a local one."""
    import fsdp2d.tensor_parallel as tp
    import torch.distributed as dist

    return y.full_tensor() if _is_dt(y) else tp.reduce_from_tp(y, group=dist.group.WORLD)


class _Heads(nn.Module):
    """q projection viewed with the GLOBAL head count, as PyTorch's 2D tutorial does."""

    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(16, 16)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, 8, 2)  # global heads: needs DTensor (global-shape) activations
        q = q * q.sum(-1, keepdim=True)  # per-head math on the DTensor
        return q.view(B, T, 16)


def job_keywords() -> dict:
    from fsdp2d import (ColwiseParallel, Partial, PrepareModuleInputOutput, Replicate, RowwiseParallel,
                        SequenceParallel, Shard)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    ids = torch.randint(0, 20, (2, 8))
    ident = lambda t: t  # noqa: E731
    lin = lambda: nn.Linear(16, 12)  # noqa: E731
    cases = {
        "colwise output Shard(1)": (lin(), ColwiseParallel(output_layouts=Shard(1)), x, ident, _gather(1)),
        "colwise output Shard(1) DTensor": (lin(), ColwiseParallel(output_layouts=Shard(1), use_local_output=False),
                                            x, ident, _full),
        "colwise DTensor + global-shape view": (_Heads(), {"wq": ColwiseParallel(use_local_output=False)},
                                                x, ident, _full),
        "uneven DTensor features into the next style": (  # 5 features over 4 ranks: 2, 2, 1, 0
            nn.Sequential(nn.Linear(16, 5), nn.Linear(5, 4)),
            {"0": ColwiseParallel(use_local_output=False), "1": ColwiseParallel(output_layouts=Replicate())},
            x, ident, ident),
        "rowwise output Partial": (lin(), RowwiseParallel(output_layouts=Partial()), x, _seq(-1), _summed),
        "rowwise output Partial DTensor": (lin(), RowwiseParallel(output_layouts=Partial(), use_local_output=False),
                                           x, _seq(-1), _summed),
        "rowwise output Shard(-1)": (lin(), RowwiseParallel(output_layouts=Shard(-1)), x, _seq(-1), _gather(-1)),
        "rowwise input Replicate, DTensor out": (lin(), RowwiseParallel(input_layouts=Replicate(),
                                                                        use_local_output=False), x, ident, _full),
        "embedding ids Shard(1)": (nn.Embedding(20, 16), RowwiseParallel(input_layouts=Shard(1)),
                                   ids, _seq(1), ident),
        "embedding ids Shard(1) -> Shard(1)": (nn.Embedding(20, 16),
                                               RowwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1)),
                                               ids, _seq(1), _gather(1)),
        "colwise embedding ids Shard(1)": (nn.Embedding(20, 16), ColwiseParallel(input_layouts=Shard(1),
                                                                                 output_layouts=Replicate()),
                                           ids, _seq(1), ident),
        "sequence_dim=0 DTensor": (nn.LayerNorm(16), SequenceParallel(sequence_dim=0),
                                   x.transpose(0, 1).contiguous(), _seq(0), _full),  # (T, B, C)
        "sequence_dim=1 local": (nn.LayerNorm(16), SequenceParallel(use_local_output=True), x, _seq(1), _gather(1)),
        "PrepareModuleInputOutput": (nn.Sequential(nn.LayerNorm(16)),
                                     PrepareModuleInputOutput(input_layouts=Shard(1),
                                                              desired_input_layouts=Replicate(),
                                                              use_local_input=True,
                                                              output_layouts=Replicate(),
                                                              desired_output_layouts=Shard(1)),
                                     x, _seq(1), _gather(1)),
    }
    out = {}
    for name, (module, plan, inp, shard, whole) in cases.items():  # plan: a style or {fqn: style}
        out[name] = _run(module, plan, inp, shard, whole)
    return out


def test_every_style_keyword_matches_one_process(pool):
    for rank, res in enumerate(pool.run(job_keywords)):
        for case, errs in res.items():
            worst = max(errs.values())
            assert worst < TOL, f"rank {rank}, {case}: {errs}"


def job_src_data_rank() -> dict:
    """Ranks initialised differently: src_data_rank=0 (torch's default) broadcasts rank 0's
    values before slicing, None slices each rank's own."""
    import fsdp2d
    import torch.distributed as dist
    from fsdp2d import ColwiseParallel, gather_full

    mesh = get_mesh((4,), ("tp",))
    out = {}
    for src in (0, None):
        torch.manual_seed(100 + dist.get_rank())  # different on every rank
        m = nn.Linear(4, 8)
        own = m.weight.detach().clone()
        fsdp2d.parallelize_module(m, mesh, ColwiseParallel(), src_data_rank=src)
        full = gather_full(m.weight.detach())
        rank0 = own.clone()
        dist.broadcast(rank0, 0)
        expected = rank0 if src == 0 else torch.cat([t.chunk(4)[i] for i, t in enumerate(_all(own))])
        out[str(src)] = torch.equal(full, expected)
    return out


def _all(t):
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def test_src_data_rank(pool):
    for r in pool.run(job_src_data_rank):
        assert r == {"0": True, "None": True}, r


def job_loss_parallel_dtensor_logits() -> dict:
    """``ColwiseParallel(use_local_output=False)`` logits (a Shard(-1) DTensor) under
    ``fsdp2d.loss_parallel()``: the same loss and head gradient as one process."""
    import fsdp2d
    import torch.nn.functional as F
    from fsdp2d import ColwiseParallel, gather_full

    torch.manual_seed(0)
    head, x, y = nn.Linear(16, 20, bias=False), torch.randn(2, 8, 16), torch.randint(0, 20, (2, 8))
    ref = copy.deepcopy(head)
    fsdp2d.parallelize_module(head, get_mesh((4,), ("tp",)), ColwiseParallel(use_local_output=False))
    ref_loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
    ref_loss.backward()
    with fsdp2d.loss_parallel():
        loss = F.cross_entropy(head(x).flatten(0, 1), y.flatten())
        loss.backward()
    return {"loss": abs(loss.item() - ref_loss.item()) / ref_loss.item(),
            "grad": _rel(gather_full(head.weight.grad), ref.weight.grad)}


def test_loss_parallel_on_dtensor_logits(pool):
    for r in pool.run(job_loss_parallel_dtensor_logits):
        assert max(r.values()) < TOL, r


def job_loss_parallel_on_class_sharded_dtensors() -> dict:
    """torch's loss_parallel contract on DTensor logits sharded on the class dim (dim 1),
    (N, C) and (N, C, d): a Replicate DTensor loss equal to one process's, the gradient
    sharded as the logits; 2 all-reduces forward (torch: 3), none backward; logits sharded
    on another dim raise."""
    import torch.nn.functional as F
    from torch.distributed.tensor import distribute_tensor, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    import fsdp2d

    mesh, out = get_mesh((4,), ("tp",)), {}
    torch.manual_seed(0)
    w = torch.rand(16)
    for shape in ((8, 16), (8, 16, 12)):
        x = torch.rand(shape, requires_grad=True)
        y = torch.randint(16, (shape[0], *shape[2:]))
        for reduction in ("none", "mean", "sum"):
            ref = F.cross_entropy(x, y, w, reduction=reduction)
            (grad,) = torch.autograd.grad(ref.sum(), x)
            logits = distribute_tensor(x.detach(), mesh, [Shard(1)]).requires_grad_()
            with fsdp2d.loss_parallel():
                with CommDebugMode() as fwd:
                    loss = F.cross_entropy(logits, y, w, reduction=reduction)
                with CommDebugMode() as bwd:
                    loss.sum().backward()
                try:
                    F.cross_entropy(distribute_tensor(x.detach(), mesh, [Shard(0)]), y, reduction=reduction)
                    raised = ""
                except ValueError as e:
                    raised = str(e)
            out[(shape, reduction)] = (
                max(_rel(loss.to_local(), ref.detach()), _rel(logits.grad.full_tensor(), grad)),
                loss.placements[0].is_replicate(), logits.grad.placements == (Shard(1),),
                fwd.get_comm_counts()[torch.ops.c10d_functional.all_reduce], fwd.get_total_counts(),
                bwd.get_total_counts(), "loss_parallel" in raised)
    return out


def test_loss_parallel_on_class_sharded_dtensors(pool):
    for r in pool.run(job_loss_parallel_on_class_sharded_dtensors):
        for case, (err, *checks) in r.items():
            assert err < TOL and checks == [True, True, 2, 2, 0, True], (case, err, checks)


def job_loss_parallel_weight() -> dict:
    """``F.cross_entropy(..., weight=w, ignore_index=...)`` under ``loss_parallel()`` on
    vocab-sharded logits (20 classes over tp=4, some targets ignored): every reduction
    gives torch's value and head gradient (torch's own loss_parallel takes weight too)."""
    import fsdp2d
    import torch.nn.functional as F
    from fsdp2d import ColwiseParallel, Shard, gather_full

    torch.manual_seed(0)
    out = {}
    for reduction in ("mean", "sum", "none"):
        head, x = nn.Linear(16, 20, bias=False), torch.randn(2, 8, 16)
        y = torch.randint(0, 20, (2, 8))
        y[0, :3] = -100
        w = torch.rand(20) + 0.5
        ref = copy.deepcopy(head)
        fsdp2d.parallelize_module(head, get_mesh((4,), ("tp",)), ColwiseParallel(output_layouts=Shard(-1)))
        ref_loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten(), weight=w, reduction=reduction)
        ref_loss.sum().backward()
        with fsdp2d.loss_parallel():
            loss = F.cross_entropy(head(x).flatten(0, 1), y.flatten(), weight=w, reduction=reduction)
            loss.sum().backward()
        out[reduction] = max(_rel(loss.detach(), ref_loss.detach()),
                             _rel(gather_full(head.weight.grad), ref.weight.grad))
    return out


def test_loss_parallel_takes_class_weights(pool):
    for r in pool.run(job_loss_parallel_weight):
        assert max(r.values()) < TOL, r
