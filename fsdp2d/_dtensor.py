"""Parameters at rest as torch DTensors (DESIGN item 3): specs from fsdp2d layouts.

Between steps every parameter fsdp2d manages is an ``nn.Parameter`` wrapping a torch
``DTensor``: its local tensor is fsdp2d's shard (for FSDP a view into the group's flat
storage, no copy) and its spec describes exactly the box of the parameter's
:class:`~fsdp2d.placement.Layout`. So ``state_dict``, DCP, ``clip_grad_norm_``,
``full_tensor()`` and torch optimizers read the parameters correctly. Compute never
sees a DTensor: forward swaps in plain tensors (FSDP's unsharded parameters, or the
local tensor for TP-only ones) and the hot path has no DTensor dispatch.

**Mesh order.** torch applies ``Shard`` placements left to right: the first mesh axis
splits the global tensor (``torch.chunk``), the next splits that piece, and so on.
fsdp2d's 2D layouts are TP-major (TP splits the global tensor, FSDP the TP shard), so a
parameter lives on the torch mesh ``joined([tp_mesh, dp_mesh])``: the user's own TP and
FSDP slices concatenated TP first (``fsdp2d.mesh.joined``, the same process groups). Every layout, even or uneven, is then one plain torch placement per
axis: no ``_StridedShard`` (whose uneven boxes differ from ``torch.chunk``'s TP-major
ones), nothing a torch tool could misread. All parameters of one model share that one
mesh (a parameter TP does not shard is ``Replicate()`` on the tp axis).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .mesh import DeviceMesh, axis_names, coordinate
from .placement import Layout, Shard, check_placement, chunk_range

__all__ = ["spec_of", "as_dtensor", "local_of", "layout_of", "layout_of_spec", "install_load_hook", "install_rest_hooks"]


def _check_left_to_right(layout: Layout) -> None:
    """torch splits in mesh order; the layout must too (for axes sharding one dim)."""
    last: dict[int, int] = {}
    for axis in layout.split_order:
        p = layout.placements[axis]
        if isinstance(p, Shard):
            if last.get(p.dim, -1) > axis:
                raise ValueError(f"layout {layout} splits dim {p.dim} out of mesh order; put the axis that "
                                 f"splits first earlier in the mesh")
            last[p.dim] = axis


def spec_of(layout: Layout, mesh: DeviceMesh, dtype: torch.dtype) -> DTensorSpec:
    """The DTensor spec of a tensor of ``dtype`` laid out as ``layout`` on the torch
    ``mesh``, whose axes are the layout's, in its order."""
    _check_left_to_right(layout)
    if axis_names(mesh) != layout.axis_names or coordinate(mesh) != layout.coordinate:
        raise ValueError(f"layout over axes {layout.axis_names} at {layout.coordinate} does not sit on {mesh} "
                         f"(this rank at {coordinate(mesh)})")
    shape = torch.Size(layout.global_shape)
    stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(mesh, layout.placements, TensorMeta(shape, stride, dtype))
    spec._fsdp2d_layout = layout  # layout_of() gives this one back (with its split order)
    return spec


def as_dtensor(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool = False) -> DTensor:
    """Wrap ``local`` (this rank's box, no copy) as a DTensor with ``spec``, without
    dispatch or communication (``DTensor.from_local`` checks and may copy)."""
    if spec.tensor_meta is not None and spec.tensor_meta.dtype != local.dtype:
        meta = spec.tensor_meta
        layout = getattr(spec, "_fsdp2d_layout", None)
        spec = DTensorSpec(spec.mesh, spec.placements, TensorMeta(meta.shape, meta.stride, local.dtype))
        if layout is not None:
            spec._fsdp2d_layout = layout
    return DTensor(local, spec, requires_grad=requires_grad)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (no autograd, no dispatch); ``t`` itself otherwise."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _strided_shard_is_exact(size: int, inner: int, outer: int) -> bool:
    """Whether ``[_StridedShard(d, split_factor=inner) on the outer axis, Shard(d) on the
    inner axis]`` holds the TP-major boxes of a dim of ``size`` (inner axis splits first).

    torch's ``_StridedShard`` gives outer rank ``a`` the concatenation over ``b`` of
    ``chunk(chunk(size, inner)[b], outer)[a]``, and the inner ``Shard`` then ``torch.chunk``s
    that concatenation: exact iff those chunks are exactly the concatenated pieces (always
    when even; not e.g. for 7 rows, inner=2, outer=3)."""
    for a in range(outer):
        lens = [chunk_range(chunk_range(size, inner, b)[1], outer, a)[1] for b in range(inner)]
        total = sum(lens)
        for b in range(inner):
            start, n = chunk_range(total, inner, b)
            if n != lens[b] or (n and start != sum(lens[:b])):
                return False
    return True


def layout_of_spec(mesh: DeviceMesh, placements: Any, global_shape: Any, where: str = "DTensor") -> Layout:
    """The :class:`Layout` of this rank's piece of a tensor of ``global_shape`` with torch
    ``placements`` on ``mesh``: read from the placements, never from a local shape.

    ``_StridedShard(d, split_factor=f)`` is torch's encoding of a split of dim ``d`` that
    happens after the split of a later axis of ``f`` ranks (FSDP over TP on a (dp, tp)
    mesh): it becomes a ``Shard(d)`` whose axis comes after that one in ``split_order``,
    if torch's interleaved chunks are exactly those TP-major boxes (always when even;
    ``_strided_shard_is_exact``). Anything a Layout cannot state exactly raises naming
    ``where``: another split factor, uneven chunks that interleave, ``Partial`` other than
    a sum, vocab-parallel ``_MaskPartial``."""
    from torch.distributed.tensor.placement_types import _StridedShard

    names, shape = axis_names(mesh), tuple(mesh.shape)
    plain, strided = [], []
    for axis, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            plain.append(Shard(p.dim))
            strided.append((axis, p))
        else:
            plain.append(check_placement(p, f"{where}: placement on mesh axis {names[axis]!r},"))
    order = list(range(len(shape)))
    for axis, p in strided:  # the strided axis splits after the axis that shards the same dim
        later = [a for a in range(axis + 1, len(shape)) if plain[a] == Shard(p.dim)]
        dim = p.dim % len(global_shape)
        if len(later) != 1 or p.split_factor != shape[later[0]] or \
                not _strided_shard_is_exact(global_shape[dim], shape[later[0]], shape[axis]):
            raise NotImplementedError(
                f"{where}: placement {p} on mesh axis {names[axis]!r} of {tuple(placements)} is not a TP-major "
                f"split fsdp2d can state exactly (global shape {tuple(global_shape)}, mesh {dict(zip(names, shape))}); "
                f"redistribute it to Shard/Replicate placements first")
        order.remove(axis)
        order.insert(order.index(later[0]) + 1, axis)
    return Layout(tuple(global_shape), shape, names, tuple(plain), coordinate(mesh), tuple(order))


def layout_of(dt: DTensor) -> Layout:
    """The fsdp2d :class:`Layout` of a DTensor (cached on its spec, which fsdp2d's
    parameters and their gradients share)."""
    spec = dt._spec
    layout = getattr(spec, "_fsdp2d_layout", None)
    if layout is None:
        layout = layout_of_spec(dt.device_mesh, dt.placements, tuple(dt.shape))
        spec._fsdp2d_layout = layout
    return layout


def install_load_hook(module: torch.nn.Module) -> None:
    """Let ``module.load_state_dict`` take full plain tensors for its DTensor parameters
    (each rank slices its own box, no communication); DTensors load as torch loads them."""
    if not module.__dict__.get("_fsdp2d_load_hook", False):
        module.register_load_state_dict_pre_hook(_full_to_dtensor)
        module.__dict__["_fsdp2d_load_hook"] = True


def install_rest_hooks(module: torch.nn.Module, to_rest) -> None:
    """Make ``module.state_dict()`` and ``load_state_dict()`` call ``to_rest()`` first:
    FSDP modules hold plain unsharded parameters between a forward and its backward, and
    both must see (and fill) the DTensor shards, never those transient copies."""
    module.__dict__["_fsdp2d_to_rest"] = to_rest
    if not module.__dict__.get("_fsdp2d_rest_hook", False):
        module.register_state_dict_pre_hook(lambda mod, prefix, keep_vars: mod._fsdp2d_to_rest())
        module.__dict__["_fsdp2d_rest_hook"] = True
    install_load_hook(module)


def _full_to_dtensor(module: torch.nn.Module, state_dict: dict, prefix: str, *args) -> None:
    # load_state_dict hands each module a shallow copy of the caller's dict: replacing a
    # value here leaves the caller's dict alone.
    to_rest = module.__dict__.get("_fsdp2d_to_rest")
    if to_rest is not None:
        to_rest()
    for name, p in module._parameters.items():
        value = state_dict.get(prefix + name)
        if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                and tuple(value.shape) == tuple(p.shape):  # other shapes: torch's size-mismatch error
            local = layout_of(p).shard(value.detach()).to(p.device)
            state_dict[prefix + name] = as_dtensor(local, p._spec)
