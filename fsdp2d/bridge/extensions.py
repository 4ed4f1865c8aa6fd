"""``DTensorExtensions``: the 2D bridge between TP shards and FSDP's dim-0 chunks.

An fsdp2d sharded tensor is a plain local tensor plus its :class:`Layout`, bundled here
as :class:`LocalShard`. The bridge's operations mirror the seed
(``torch/distributed/tensor/parallel/fsdp.py``) and accept either an fsdp2d
``LocalShard`` or a torch ``DTensor`` on a 1-D TP mesh:

- ``pre_flatten_transform(t)`` -> ``(local tensor, extension)``: strip the TP metadata
  so FSDP handles a plain tensor; the extension remembers it.
- ``post_unflatten_transform(local, extension)``: put it back (same kind as the input).
- ``chunk_tensor(t, rank, world_size)``: the ``rank``-th dim-0 chunk of a tensor that TP
  does not shard, with its FSDP-only layout.
- ``chunk_dtensor(t, rank, mesh)``: chunk a TP-sharded tensor again along dim 0 over the
  FSDP axes of a 2D/3D ``mesh`` (TP-major): the ShardedTensor-style result knows every
  rank's box.
- ``pre_load_state_dict_transform(t)`` -> ``(local tensor, [Box])``: what this rank holds,
  as boxes in global coordinates (what a checkpoint loader needs).
- ``all_gather_dtensor(t, mesh)``: undo the FSDP chunking (all-gather over the FSDP axes),
  giving back the TP-local shard.
- ``all_gather(t, mesh)``: the full global tensor on every rank.

All index math comes from :mod:`fsdp2d.placement`; communication is per mesh axis, in the
reverse of the split order, so every step gathers one contiguous piece.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import _collectives as C
from ..mesh import DeviceMesh, axis_names, axis_size, coordinate
from ..placement import Box, Layout, Partial, Replicate, Shard, chunk_range
from .._dtensor import _strided_shard_is_exact, layout_of, layout_of_spec
from ._layout import fsdp_layout

__all__ = ["LocalShard", "DTensorExtensions", "gather_full", "gather_axes", "to_dtensor", "from_dtensor"]


@dataclass(frozen=True)
class LocalShard:
    """This rank's piece of a sharded tensor and where it sits (``layout``)."""

    tensor: torch.Tensor
    layout: Layout

    def __post_init__(self) -> None:
        if tuple(self.tensor.shape) != self.layout.local_shape:
            raise ValueError(f"local tensor shape {tuple(self.tensor.shape)} != layout local shape "
                             f"{self.layout.local_shape}")


def gather_axes(local: torch.Tensor, layout: Layout, mesh: DeviceMesh, axes: list[str]) -> tuple[torch.Tensor, Layout]:
    """Undo the splits of the named ``axes`` (which must come last in the split order):
    all-gather Shard axes, all-reduce Partial ones. Returns the bigger piece and its layout."""
    idx = [layout.axis(a) for a in axes]
    tail = list(layout.split_order[len(layout.split_order) - len(idx):])
    if sorted(tail) != sorted(idx):
        raise ValueError(f"axes {axes} are not the last to split in {layout} (split_order {layout.split_order})")
    x = local
    placements = list(layout.placements)
    for axis in reversed(layout.split_order):
        if axis not in idx:
            continue
        p, group = layout.placements[axis], mesh.get_group(layout.axis_names[axis])
        if isinstance(p, Shard):
            x = C.all_gather(x, p.dim, group, global_size=layout.piece_before(axis)[p.dim])
        elif isinstance(p, Partial):
            x = C.all_reduce(x, group, inplace=False)
        placements[axis] = Replicate()
    return x, Layout(layout.global_shape, layout.mesh_shape, layout.axis_names, tuple(placements),
                     layout.coordinate, layout.split_order)


def gather_full(local: torch.Tensor, layout: Layout | None = None, mesh: Any = None) -> torch.Tensor:
    """The whole global tensor on every rank of ``mesh`` (anything with
    ``get_group(axis name)``). A DTensor (an fsdp2d parameter or gradient) needs neither:
    its spec gives the layout and its mesh the groups."""
    from torch.distributed.tensor import DTensor

    if isinstance(local, DTensor):
        layout = layout if layout is not None else layout_of(local)
        mesh = mesh if mesh is not None else local.device_mesh
        local = local._local_tensor
    if layout is None or mesh is None:
        raise TypeError("gather_full(local, layout, mesh): a plain tensor needs its Layout and mesh")
    return gather_axes(local, layout, mesh, list(layout.axis_names))[0]


def _tp_of(t: Any) -> tuple[torch.Tensor, Any]:
    """(local tensor, extension) of an fsdp2d LocalShard or a torch DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        if t.device_mesh.ndim != 1:
            raise ValueError(f"expected a DTensor on a 1-D TP mesh, got mesh {t.device_mesh}")
        return t.to_local(), ("dtensor", t.device_mesh, t.placements, tuple(t.shape), t.stride())
    if isinstance(t, LocalShard):
        return t.tensor, ("fsdp2d", t.layout)
    return t, None


class DTensorExtensions:
    """The 2D extension used by FSDP over TP (see the module docstring for each method)."""

    def pre_flatten_transform(self, tensor: Any) -> tuple[torch.Tensor, Any]:
        return _tp_of(tensor)

    def post_unflatten_transform(self, tensor: torch.Tensor, param_extension: Any) -> Any:
        if param_extension is None:
            return tensor
        if param_extension[0] == "fsdp2d":
            return LocalShard(tensor, param_extension[1])
        from torch.distributed.tensor import DTensor

        _, mesh, placements, shape, stride = param_extension
        return DTensor.from_local(tensor, mesh, placements, run_check=False, shape=shape, stride=stride)

    def chunk_tensor(self, tensor: torch.Tensor, rank: int, world_size: int, *_: Any) -> LocalShard:
        layout = fsdp_layout(tuple(tensor.shape), None, (world_size,), ("dp",), (rank,))
        return LocalShard(layout.shard(tensor.detach()).clone(), layout)

    def chunk_dtensor(self, tensor: Any, rank: int, device_mesh: DeviceMesh) -> LocalShard:
        """``device_mesh``: the full mesh, FSDP axes first and the TP axis last."""
        local, ext = _tp_of(tensor)
        tp_layout = self._tp_layout(local, ext, device_mesh)
        fsdp_axes = axis_names(device_mesh)[:-1]
        coord = coordinate(device_mesh)[:-1]
        if tp_layout is None:  # not TP-sharded: replicated over TP, chunked over FSDP
            layout = fsdp_layout(tuple(local.shape), None, device_mesh.shape[:-1], fsdp_axes, coord)
            return LocalShard(layout.shard(local.detach()).clone(), layout)
        layout = fsdp_layout(tp_layout.global_shape, tp_layout, device_mesh.shape[:-1], fsdp_axes, coord)
        start, n = chunk_range(local.shape[0], device_mesh.shape[-2], coord[-1])
        return LocalShard(local.detach()[start:start + n].clone(), layout)

    @staticmethod
    def _tp_layout(local: torch.Tensor, ext: Any, mesh: DeviceMesh) -> Layout | None:
        if ext is None:
            return None
        if ext[0] == "fsdp2d":
            return ext[1]
        _, tmesh, placements, shape, _ = ext
        lay = layout_of_spec(tmesh, placements, shape)
        return Layout(lay.global_shape, lay.mesh_shape, (axis_names(mesh)[-1],), lay.placements, lay.coordinate)

    def pre_load_state_dict_transform(self, tensor: Any) -> tuple[torch.Tensor, list[Box]]:
        if isinstance(tensor, LocalShard):
            return tensor.tensor, [tensor.layout.box] if tensor.tensor.numel() else []
        local, ext = _tp_of(tensor)
        if ext is None:
            return local, [Box((0,) * local.ndim, tuple(local.shape))]
        _, tmesh, placements, shape, _ = ext
        return local, [layout_of_spec(tmesh, placements, shape).box] if local.numel() else []

    def all_gather_dtensor(self, tensor: LocalShard, parent_mesh: DeviceMesh) -> LocalShard:
        """All-gather over the FSDP axes; the TP-local shard with its TP-only layout."""
        lay = tensor.layout
        names = axis_names(parent_mesh)
        fsdp_axes = [n for n in lay.axis_names if n in names[:-1]]
        x, _ = gather_axes(tensor.tensor, lay, parent_mesh, fsdp_axes)
        tp = names[-1]
        if tp not in lay.axis_names:  # chunk_dtensor of a tensor TP does not shard: replicated over TP
            tp_layout = Layout(lay.global_shape, (axis_size(parent_mesh, tp),), (tp,), (Replicate(),),
                               (parent_mesh.get_local_rank(tp),))
            return LocalShard(x, tp_layout)
        i = lay.axis(tp)
        tp_layout = Layout(lay.global_shape, (lay.mesh_shape[i],), (tp,), (lay.placements[i],), (lay.coordinate[i],))
        return LocalShard(x, tp_layout)

    def all_gather(self, tensor: LocalShard, mesh: DeviceMesh) -> torch.Tensor:
        return gather_full(tensor.tensor, tensor.layout, mesh)


def _torch_placements(layout: Layout) -> list:
    """The torch placements with the same data layout as ``layout`` (see :func:`to_dtensor`)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = list(layout.placements)
    by_dim: dict[int, list[int]] = {}
    for axis, p in enumerate(layout.placements):
        if isinstance(p, Shard):
            by_dim.setdefault(p.dim, []).append(axis)
    for dim, axes in by_dim.items():
        order = [a for a in layout.split_order if a in axes]
        if order == sorted(order):
            continue
        if len(axes) != 2:
            raise NotImplementedError(f"to_dtensor: {len(axes)} axes split dim {dim} out of mesh order")
        inner, outer = order  # inner splits first but sits later in the mesh
        sf = layout.mesh_shape[inner]
        if not _strided_shard_is_exact(layout.global_shape[dim], sf, layout.mesh_shape[outer]):
            names = layout.axis_names
            raise NotImplementedError(
                f"to_dtensor: torch's _StridedShard cannot express this uneven TP-major split of dim {dim} "
                f"(size {layout.global_shape[dim]}, {names[inner]!r}={sf} then {names[outer]!r}="
                f"{layout.mesh_shape[outer]}): it would put some rows on other ranks")
        placements[outer] = _StridedShard(dim, split_factor=sf)
    return placements


def to_dtensor(tensor: torch.Tensor, layout: Layout, mesh: DeviceMesh):
    """A torch DTensor with the same data layout as (``tensor``, ``layout``) on the torch
    ``mesh`` (whose axes are the layout's, in order).

    Axes that shard distinct dims map to torch ``Shard``; a TP-major 2D split of one dim
    (FSDP over TP) maps to torch's ``_StridedShard`` on the FSDP axis. Layouts torch
    cannot express raise NotImplementedError: more than two axes splitting one dim out
    of mesh order, and uneven TP-major splits whose rows ``_StridedShard`` would put on
    other ranks (see ``_strided_shard_is_exact``: only when the FSDP shard axis has 3+ ranks).
    """
    from torch.distributed.tensor import DTensor

    if axis_names(mesh) != tuple(layout.axis_names):
        raise ValueError(f"layout axes {layout.axis_names} != mesh axes {axis_names(mesh)}")
    if tuple(layout.mesh_shape) != tuple(mesh.shape):
        raise ValueError(f"layout mesh shape {layout.mesh_shape} != mesh shape {tuple(mesh.shape)}")
    if tuple(layout.coordinate) != coordinate(mesh):
        raise ValueError(f"layout coordinate {layout.coordinate} != this rank's mesh coordinate {coordinate(mesh)}")
    placements = _torch_placements(layout)
    shape = layout.global_shape
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(tensor, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def from_dtensor(dt: Any) -> tuple[torch.Tensor, Layout]:
    """(local tensor, Layout) of a torch DTensor; inverse of :func:`to_dtensor`."""
    return dt.to_local(), layout_of_spec(dt.device_mesh, dt.placements, tuple(dt.shape))
