"""Activations at style boundaries: moving between layouts, and DTensor in and out.

Compute is plain: a style turns its inputs into local tensors of the layout its module
needs (:func:`redistribute`, fsdp2d's own collectives) and hands back a local output.
Where the user asks for DTensors (``use_local_output=False``, torch's default for
``SequenceParallel`` and ``PrepareModuleInput``), the output is wrapped as a torch
``DTensor`` on the TP mesh with its global shape, so code between styles can use
global-shape views (``q.view(B, T, n_heads, head_dim)``) as it would with torch; a style
that receives a DTensor takes its local tensor and its *actual* placement (as torch
redistributes from what it gets). Both conversions are differentiable.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import _collectives as C
from ..mesh import DeviceMesh
from ..placement import Partial, Placement, Replicate, Shard, check_placement
from . import _functions as T

__all__ = ["redistribute", "local_input", "as_output"]


def redistribute(x: Any, src: Placement | None, dst: Placement | None, group: C.Group,
                 global_size: int | None = None) -> Any:
    """Move local activation ``x`` from layout ``src`` to ``dst`` on the TP group.

    ``None`` on either side (or a non-tensor ``x``) leaves ``x`` alone. Supported moves:
    Shard->Replicate (all-gather), Replicate->Shard (split), Partial->Replicate
    (all-reduce), Partial->Shard (reduce-scatter), Shard(a)->Shard(b) (all-gather a,
    split b), and no-op moves; anything else raises. ``global_size``: the whole size of
    a ``Shard`` source's dim when known (uneven pieces); otherwise pieces are even.
    """
    if src is None or dst is None or not isinstance(x, torch.Tensor) or src == dst:
        return x
    dim = lambda p: p.dim % x.ndim  # noqa: E731
    k = C.group_size(group)
    # A sequence-style shard (any dim but the last, the feature dim) is gathered again
    # later without size information, so it must split evenly; feature dims may not.
    if isinstance(dst, Shard) and dim(dst) != x.ndim - 1 and x.shape[dim(dst)] % k and \
            not (isinstance(src, Shard) and dim(src) == dim(dst)):
        raise ValueError(
            f"cannot shard an activation of shape {tuple(x.shape)} along dim {dim(dst)} over {k} TP ranks: "
            f"{x.shape[dim(dst)]} is not divisible by {k}. Sequence parallel needs a sequence length "
            f"divisible by the TP degree (pad the batch or change tp)"
        )
    if isinstance(src, Shard) and isinstance(dst, Shard):
        if dim(src) == dim(dst):
            return x
        gathered = T.gather_cached(x, dim(src), group=group, global_size=global_size)
        return T.scatter_to_tp(gathered, dim(dst), group=group)
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return T.gather_cached(x, dim(src), group=group, global_size=global_size)
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return T.scatter_to_tp(x, dim(dst), group=group)
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        return T.reduce_from_tp(x, group=group)
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return T.reduce_scatter_to_tp(x, dim(dst), group=group)
    raise NotImplementedError(f"redistributing an activation from {src!r} to {dst!r} is not supported")


def _placement_of(dt: DTensor, where: str) -> Placement:
    if dt.device_mesh.ndim != 1:
        raise ValueError(f"{where}: got a DTensor on the {dt.device_mesh.ndim}-D mesh {dt.device_mesh}; "
                         f"activations between TP styles live on the 1-D TP mesh")
    return check_placement(dt.placements[0], f"{where}: input DTensor placement")


def _version(x: torch.Tensor) -> int:
    return -1 if x.is_inference() else x._version


def local_input(x: Any, declared: Placement | None, where: str) -> tuple[Any, Placement | None, int | None]:
    """(local tensor, its placement, the global size of its sharded dim or None) of a
    style's input: a plain tensor has the declared layout (even pieces); a DTensor brings
    its own placement and global shape (its local view is cached on it, so layers that
    read one DTensor share one local tensor, and one backward reduction, see ``tp_input``)."""
    if not isinstance(x, DTensor):
        return x, declared, None
    key = (torch.is_grad_enabled(), x.requires_grad, _version(x))
    entry = getattr(x, "_fsdp2d_local", None)
    if entry is None or entry[0] != key:
        local = x.to_local() if key[0] and key[1] else x._local_tensor
        entry = (key, local)
        x._fsdp2d_local = entry
    placement = _placement_of(x, where)
    size = x.shape[placement.dim % x.ndim] if isinstance(placement, Shard) else None
    return entry[1], placement, size


def as_output(y: Any, placement: Placement, mesh: DeviceMesh, use_local_output: bool,
              features: int | None = None) -> Any:
    """``y`` (local, laid out as ``placement``) as the style's output: itself, or a
    DTensor on the TP mesh with the global shape (``features``: the global size of the
    last dim, for feature shards that may be uneven; other shards split evenly, which
    sequence sharding guarantees)."""
    if use_local_output or not isinstance(y, torch.Tensor):
        return y
    shape = list(y.shape)
    if isinstance(placement, Shard):
        d = placement.dim % y.ndim
        shape[d] = features if d == y.ndim - 1 and features is not None else shape[d] * mesh.size()
    shape = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(y, mesh, (placement,), run_check=False,
                              shape=shape, stride=stride)
