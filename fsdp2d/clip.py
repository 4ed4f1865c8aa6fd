"""``clip_grad_norm_`` over every way a parameter can be spread: TP, FSDP, HSDP, plain.

The true global norm counts each element of each logical parameter once. Every fsdp2d
gradient is a DTensor whose spec gives its :class:`Layout`, so each rank adds
``|g|^p`` only for boxes it owns (coordinate 0 on the axes that replicate: a TP-
replicated norm weight, the HSDP replicate axis) and one all-reduce over the world sums
the rest. A layout's mesh may cover only part of the world (a TP-only parameter is
copied on every data-parallel rank): its contribution is divided by the number of such
copies, so the sum stays exact up to rounding. Parameters without a layout are
replicated everywhere. Unlike torch's, this works when only some layers are
TP-sharded (no cross-mesh error).
"""

from __future__ import annotations

import functools
import math
from typing import Iterable

import torch
import torch.distributed as dist

from torch.distributed.tensor import DTensor

from ._dtensor import layout_of, local_of
from .placement import Layout

__all__ = ["clip_grad_norm_", "clip_grad_norm_across_stages_"]


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _share(g: torch.Tensor, holders: int) -> float:
    """This rank's weight for gradient ``g`` in the world-wide sum (0 if not owner), when
    ``holders`` ranks hold one copy of every parameter (copies: ``holders / mesh size``)."""
    layout: Layout | None = layout_of(g) if isinstance(g, DTensor) else None
    if layout is None:
        return 1.0 / holders
    if not layout.is_replica_owner():
        return 0.0
    return math.prod(layout.mesh_shape) / holders


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale gradients in place so their global ``norm_type``-norm is at most ``max_norm``.

    Returns the total norm (before clipping), identical on every rank, as a device
    tensor in torch's dtype (the gradients' promoted dtype: float32 for bf16 and fp32
    gradients, float64 when any is float64): nothing is read on the host (no sync) unless
    ``error_if_nonfinite``. A NaN gradient on any rank makes the total NaN, as torch's on
    one process. The ops it dispatches do not grow with the number of parameters: one
    ``_foreach_norm`` and a few reductions per kind of layout (gradients grouped by their
    weight in the world-wide sum, device and dtype: one or two groups in a model), one
    all-reduce, and one ``_foreach_mul_`` per device and dtype, as torch's foreach path.
    Collective: every rank must call it with the matching parameters.

    Not for pipeline stages: it takes the ranks outside the parameters' mesh to hold copies
    of them, so on a stage it would return the whole model's norm over ``sqrt(pp)``. It
    raises ValueError on the parameters of ``fully_shard`` groups that torch's pipelining
    has reduced (marked then); a stage with TP only (no ``fully_shard``) or not yet stepped
    is not recognised (torch hands back equal mesh slices of another root mesh over the
    same ranks, so the mesh's root does not say whether a ``pp`` axis is in play). Use
    :func:`clip_grad_norm_across_stages_` there (the trainer does).
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    staged = next((p for p in params if getattr(p, "_fsdp2d_pipeline_stage", False)), None)
    if staged is not None:  # (marked when torch's pipelining reduced its group: fsdp2d/fsdp/_torch_state.py)
        raise ValueError("fsdp2d.clip_grad_norm_: these parameters are a pipeline stage's (torch's pipelining "
                         "reduced their fully_shard groups), and a norm over the world would count the other "
                         "stages as copies of this one: use fsdp2d.clip.clip_grad_norm_across_stages_(params, "
                         "max_norm, pp=<pipeline degree>) for the whole model's norm (torchtitan's), or "
                         "torch.nn.utils.clip_grad_norm_ for this stage's own")
    return _clip(params, max_norm, norm_type, error_if_nonfinite, holders=_world())


@torch.no_grad()
def clip_grad_norm_across_stages_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, *, pp: int,
                                  norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """:func:`clip_grad_norm_` for a model split into pipeline stages over a mesh axis of
    size ``pp``: each rank passes the parameters of its own stages (sharded over the other
    axes), and the norm is over every stage's, the whole model's (torchtitan all-reduces
    the squared norm over ``pp``; here it is the same one all-reduce over the world).
    :func:`clip_grad_norm_` would count each stage's parameters as copies held by all
    ``pp`` slices of the world, and return the norm over ``sqrt(pp)``. ``pp=1``: the same
    as :func:`clip_grad_norm_`."""
    world = _world()
    if pp < 1 or world % pp:
        raise ValueError(f"clip_grad_norm_across_stages_: pp={pp} must divide the world size {world}")
    return _clip(parameters, max_norm, norm_type, error_if_nonfinite, holders=world // pp)


def _clip(parameters, max_norm: float, norm_type: float, error_if_nonfinite: bool, holders: int) -> torch.Tensor:
    """The clipping both entry points share; ``holders``: the ranks holding one copy of
    every parameter (the world, or one pipeline slice of it)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [(g, local_of(g)) for g in (p.grad for p in params) if g is not None]
    norm_type = float(norm_type)
    world = _world()
    # A rank without gradients still joins the all-reduce, on the parameters' device.
    device = grads[0][1].device if grads else (params[0].device if params else torch.device("cpu"))
    # torch stacks the per-gradient norms, each in its gradient's dtype: the promoted dtype
    out_dtype = functools.reduce(torch.promote_types, {g.dtype for _, g in grads}) if grads else torch.float32
    if norm_type == math.inf:
        total = _global_max(_buckets((None, g) for _, g in grads), device, world)
    else:
        total = _global_sum(_buckets((_share(dg, holders), g) for dg, g in grads), norm_type, device, world)
    total = total.to(out_dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total gradient norm is {total.item()}")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # in the total's dtype, as torch's
    for (_, dev, _), gs in _buckets((None, g) for _, g in grads).items():
        torch._foreach_mul_(gs, coef.to(dev))  # the gradients' dtype, multiplied at the coefficient's precision
    return total


def _global_max(buckets: dict[tuple, list[torch.Tensor]], device: torch.device, world: int) -> torch.Tensor:
    """The largest absolute value over every rank's gradients, in float64 (exact for any
    float dtype). Duplicates do not change a maximum: every nonempty gradient counts. A
    NaN travels as a flag beside the maximum in the same all-reduce: MAX over NaN and a
    number may return either (gloo's std::max depends on the order of its arguments)."""
    maxima = [torch.stack(torch._foreach_norm(gs, math.inf)).max().to(device, torch.float64)
              for gs in buckets.values()]
    local = torch.stack(maxima).max() if maxima else torch.zeros((), dtype=torch.float64, device=device)
    both = torch.stack([local, local.isnan().to(torch.float64)])  # (2,): max, has NaN
    if world > 1:
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return torch.where(both[1] > 0, math.nan, both[0])


def _global_sum(buckets: dict[tuple, list[torch.Tensor]], norm_type: float, device: torch.device,
                world: int) -> torch.Tensor:
    """``(sum over ranks and buckets of share * |g|_p^p) ** (1/p)`` in float64. Norms are
    taken in each gradient's dtype, at least float32 (float64 cannot be narrowed)."""
    acc = torch.zeros(1, dtype=torch.float64, device=device)
    for (share, _, dtype), gs in buckets.items():
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        norms = torch.stack(torch._foreach_norm(gs, norm_type, dtype=wide)).to(device, torch.float64)
        acc += norms.pow_(norm_type).sum() * share  # |g|_p^p, summed in float64
    if world > 1:
        dist.all_reduce(acc)
    return acc[0] ** (1.0 / norm_type)


def _buckets(weighted: Iterable[tuple[float | None, torch.Tensor]]) -> dict[tuple, list[torch.Tensor]]:
    """Nonempty local gradients grouped by (weight, device, dtype), in first-seen order:
    one foreach op per group (weight 0, a copy another rank owns, is left out; ``None``
    groups by device and dtype only)."""
    out: dict[tuple, list[torch.Tensor]] = {}
    for share, g in weighted:
        if share != 0 and g.numel():
            out.setdefault((share, g.device, g.dtype), []).append(g)
    return out
