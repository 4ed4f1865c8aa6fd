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
from .placement import Layout, Shard

__all__ = ["spec_of", "as_dtensor", "local_of", "layout_of", "install_load_hook", "install_rest_hooks"]


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


def layout_of(dt: DTensor) -> Layout:
    """The fsdp2d :class:`Layout` of a DTensor (cached on its spec, which fsdp2d's
    parameters and their gradients share)."""
    spec = dt._spec
    layout = getattr(spec, "_fsdp2d_layout", None)
    if layout is None:
        from .bridge.extensions import from_dtensor

        layout = from_dtensor(dt)[1]
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
