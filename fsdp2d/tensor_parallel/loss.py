"""``loss_parallel()``: cross-entropy on vocab-sharded logits without gathering them.

A ``ColwiseParallel`` layer whose output stays ``Shard(-1)`` tags its (local) logits
with the TP group and the global vocab size. Inside ``with loss_parallel():`` a torch
function mode follows that tag through shape-only ops that keep the last dim
(``flatten``, ``view``, ``reshape``, slicing, ``float``...) and routes
``F.cross_entropy`` on a tagged tensor to :class:`_VocabParallelCrossEntropy`, which
needs three small all-reduces of (N,) vectors instead of an all-gather of (N, V)
logits. Call ``backward()`` inside the context too, as with torch's.

Outside the context, a tagged tensor is just this rank's slice of the vocab: compute
losses on it only under ``loss_parallel()`` (or use ``output_layouts=Replicate()``).

DTensor logits (``use_local_output=False``, or any DTensor sharded on the class dim, as
torch's ``loss_parallel`` takes them, including (N, C, d1, ...) inputs) give a Replicate
DTensor loss, and their gradient arrives with their own placement.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from torch.distributed.tensor import DTensor, Replicate

from .. import _collectives as C
from ..placement import chunk_range

__all__ = ["loss_parallel", "vocab_parallel_cross_entropy"]

_SHAPE_OPS = {
    torch.Tensor.flatten, torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.contiguous,
    torch.Tensor.float, torch.Tensor.to, torch.Tensor.__getitem__, torch.flatten, torch.reshape,
    torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.double,
}


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row loss ``logsumexp(x) - x[target]`` over vocab shards. Shapes: logits
    (N, V/k) local, target (N,) global ids; returns (N,) losses (0 where ignored)."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, ignore_index):
        x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        row_max = x.max(dim=-1).values
        row_max = C.all_reduce(row_max, group, dist.ReduceOp.MAX)
        shifted = x - row_max.unsqueeze(-1)  # (N, V/k)
        exp = shifted.exp()
        local_t = target - vocab_start
        mine = (local_t >= 0) & (local_t < x.shape[-1]) & (target != ignore_index)
        picked = shifted.gather(-1, local_t.clamp(0, max(x.shape[-1] - 1, 0)).unsqueeze(-1)).squeeze(-1)
        stats = torch.stack([exp.sum(-1), torch.where(mine, picked, torch.zeros_like(picked))])  # (2, N)
        stats = C.all_reduce(stats, group)
        loss = stats[0].log() - stats[1]
        valid = target != ignore_index
        loss = torch.where(valid, loss, 0.0)
        ctx.save_for_backward(exp / stats[0].unsqueeze(-1), local_t, mine, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, mine, valid = ctx.saved_tensors
        # d loss / d logits = softmax - onehot(target): subtract 1 where this rank holds the
        # target (adding -0.0 elsewhere changes nothing). A scatter, not nonzero(): no
        # data-dependent shape, so no host sync.
        index = local_t.clamp(0, max(softmax.shape[-1] - 1, 0)).unsqueeze(-1)
        grad = softmax.scatter_add(-1, index, -mine.to(softmax.dtype).unsqueeze(-1))
        grad *= (grad_loss * valid).unsqueeze(-1)
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, group: C.Group,
                                 vocab_size: int, ignore_index: int = -100, reduction: str = "mean",
                                 weight: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of (N, V/k) vocab-sharded ``logits`` against (N,) global ``target``.

    Matches ``F.cross_entropy``: ``weight`` (V,) rescales each target class's loss (a
    full tensor on every rank, or a DTensor, gathered), and ``mean`` divides by the sum
    of the non-ignored targets' weights (their count without ``weight``); ``sum``, ``none``.
    """
    if logits.ndim != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"loss_parallel cross_entropy needs logits (N, V) with the vocab last and target (N,); "
            f"got {tuple(logits.shape)} and {tuple(target.shape)}. Flatten batch and sequence first"
        )
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    start, _ = chunk_range(vocab_size, C.group_size(group), C.group_rank(group))
    loss = _VocabParallelCrossEntropy.apply(logits, target, group, start, ignore_index)  # (N,), 0 where ignored
    valid = target != ignore_index
    if weight is not None:
        weight = weight.full_tensor() if isinstance(weight, DTensor) else weight
        if tuple(weight.shape) != (vocab_size,):
            raise ValueError(f"loss_parallel cross_entropy: weight must have one entry per class ({vocab_size},), "
                             f"got {tuple(weight.shape)}")
        # a gather, not boolean indexing: no data-dependent shape, so no host sync
        per_row = weight.gather(0, torch.where(valid, target, 0)) * valid  # (N,)
        loss = loss * per_row
    else:
        per_row = valid
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / per_row.sum()


class _LossParallelMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func is F.cross_entropy and isinstance(src, DTensor):  # torch's loss_parallel input
            return _dtensor_cross_entropy(*args, **kwargs)
        tag = getattr(src, "_fsdp2d_vocab", None) if src is not None else None
        if tag is not None and func is F.cross_entropy:
            return _cross_entropy(*args, **kwargs)
        out = func(*args, **kwargs)
        if tag is not None and func in _SHAPE_OPS and isinstance(out, torch.Tensor) \
                and out.ndim and out.shape[-1] == src.shape[-1]:
            out._fsdp2d_vocab = tag
        return out


def _check_options(size_average=None, reduce=None, label_smoothing=0.0) -> None:
    unsupported = {"size_average": size_average is not None, "reduce": reduce is not None,
                   "label_smoothing": label_smoothing != 0.0}
    for name, given in unsupported.items():
        if given:
            raise NotImplementedError(f"loss_parallel cross_entropy does not support the {name} argument")


def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    """``F.cross_entropy`` on a tagged local (N, V/k) vocab shard (ColwiseParallel logits)."""
    _check_options(size_average, reduce, label_smoothing)
    group, vocab_size = input._fsdp2d_vocab
    return vocab_parallel_cross_entropy(input, target, group=group, vocab_size=vocab_size,
                                        ignore_index=ignore_index, reduction=reduction, weight=weight)


def _dtensor_cross_entropy(input: DTensor, target, weight=None, size_average=None, ignore_index=-100,
                           reduce=None, reduction="mean", label_smoothing=0.0) -> DTensor:
    """``F.cross_entropy`` on DTensor logits, as torch's ``loss_parallel``: input (N, C) or
    (N, C, d1, ...) sharded on the class dim C (dim 1) over a 1-D mesh, target (N, d1, ...)
    plain or Replicate; returns a Replicate DTensor (the gradient reaches ``input`` with its
    own placement). Two all-reduces, where torch issues three (max, sum of exps and the
    target logit: fsdp2d sends the last two as one stacked tensor)."""
    _check_options(size_average, reduce, label_smoothing)
    mesh, cdim = input.device_mesh, 1 if input.ndim >= 2 else 0
    p = input.placements[0] if mesh.ndim == 1 else None
    if p is None or not p.is_shard() or p.dim % input.ndim != cdim:
        raise ValueError(f"loss_parallel: DTensor logits must be sharded on the class dim (dim {cdim}) of a "
                         f"1-D TP mesh, got placements {input.placements} on {mesh}")
    if isinstance(target, DTensor):
        if target.device_mesh != mesh or not all(q.is_replicate() for q in target.placements):
            raise ValueError(f"loss_parallel: a DTensor target must be Replicate on the logits' mesh, got "
                             f"{target.placements} on {target.device_mesh}")
        target = target.to_local()
    local = input.to_local()  # (N, C/k, d1, ...)
    classes = local.shape[cdim]
    flat = local.movedim(cdim, -1).reshape(-1, classes)  # (N * d1 * ..., C/k)
    loss = vocab_parallel_cross_entropy(flat, target.reshape(-1), group=mesh.get_group(),
                                        vocab_size=input.shape[cdim], ignore_index=ignore_index,
                                        reduction=reduction, weight=weight)
    if reduction == "none":
        loss = loss.reshape(target.shape)
    return DTensor.from_local(loss, mesh, [Replicate()], run_check=False)


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Compute ``F.cross_entropy`` on vocab-sharded logits (``ColwiseParallel`` with
    ``output_layouts=Shard(-1)``) without gathering them; run backward inside too.

    Example::

        with loss_parallel():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
    """
    with _LossParallelMode():
        yield
