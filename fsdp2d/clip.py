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

import math
from typing import Iterable

import torch
import torch.distributed as dist

from torch.distributed.tensor import DTensor

from ._dtensor import layout_of, local_of
from .placement import Layout

__all__ = ["clip_grad_norm_"]


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _share(g: torch.Tensor, world: int) -> float:
    """This rank's weight for gradient ``g`` in the world-wide sum (0 if not owner)."""
    layout: Layout | None = layout_of(g) if isinstance(g, DTensor) else None
    if layout is None:
        return 1.0 / world
    if not layout.is_replica_owner():
        return 0.0
    return math.prod(layout.mesh_shape) / world


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale gradients in place so their global ``norm_type``-norm is at most ``max_norm``.

    Returns the total norm (before clipping), identical on every rank, as a device
    tensor: nothing is read on the host (no sync) unless ``error_if_nonfinite``. The ops
    it dispatches do not grow with the number of parameters: one ``_foreach_norm`` and a
    few reductions per kind of layout (gradients grouped by their weight in the
    world-wide sum, device and dtype: one or two groups in a model), one all-reduce, and
    one ``_foreach_mul_`` per device and dtype, as torch's foreach path. Collective:
    every rank must call it with the matching parameters.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [(g, local_of(g)) for g in (p.grad for p in params) if g is not None]
    norm_type = float(norm_type)
    world = _world()
    # A rank without gradients still joins the all-reduce, on the parameters' device.
    device = grads[0][1].device if grads else (params[0].device if params else torch.device("cpu"))
    if norm_type == math.inf:  # duplicates do not change a maximum: every nonempty gradient counts
        maxima = [torch.stack(torch._foreach_norm(gs, math.inf)).max().float()
                  for gs in _buckets((None, g) for _, g in grads).values()]
        total = torch.stack(maxima).max().reshape(1) if maxima else torch.zeros(1, device=device)
        if world > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
        total = total[0]
    else:
        acc = torch.zeros(1, dtype=torch.float64, device=device)
        for (share, _, _), gs in _buckets((_share(dg, world), g) for dg, g in grads).items():
            norms = torch.stack(torch._foreach_norm(gs, norm_type, dtype=torch.float32)).double()
            acc += norms.pow_(norm_type).sum() * share  # |g|_p^p, summed in float64 as before
        if world > 1:
            dist.all_reduce(acc)
        total = (acc[0] ** (1.0 / norm_type)).float()
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total gradient norm is {total.item()}")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for (_, dev, dtype), gs in _buckets((None, g) for _, g in grads).items():
        torch._foreach_mul_(gs, coef.to(dev, dtype))
    return total


def _buckets(weighted: Iterable[tuple[float | None, torch.Tensor]]) -> dict[tuple, list[torch.Tensor]]:
    """Nonempty local gradients grouped by (weight, device, dtype), in first-seen order:
    one foreach op per group (weight 0, a copy another rank owns, is left out; ``None``
    groups by device and dtype only)."""
    out: dict[tuple, list[torch.Tensor]] = {}
    for share, g in weighted:
        if share != 0 and g.numel():
            out.setdefault((share, g.device, g.dtype), []).append(g)
    return out
