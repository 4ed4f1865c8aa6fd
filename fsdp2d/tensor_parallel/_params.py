"""Replacing a module's parameters by local shards, and remembering their layouts.

The layout of each sharded parameter is recorded on the module that owns it
(``module._fsdp2d_tp[name] = TPParam(layout, mesh)``), not on the tensor: ``to_empty()``
and ``_apply()`` create new Parameter objects, but the owning module stays, so the
record survives meta-device initialisation. :func:`tp_params` lists them by fully
qualified name.

Parameters replicated over TP whose gradients are partial (norms on sequence shards,
a row-wise bias added after a reduce-scatter) get a gradient hook that sums the
gradient over TP. Hooks belong to tensors, so they are (re)attached lazily in a forward
pre-hook: whatever Parameter object the module holds when it runs gets one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from .. import _collectives as C
from ..mesh import DeviceMesh
from ..placement import Layout, Placement


@dataclass(frozen=True)
class TPParam:
    """How a tensor-parallel parameter is sharded: its layout and the TP mesh."""

    layout: Layout
    mesh: DeviceMesh


def shard_parameter(module: nn.Module, name: str, placement: Placement, mesh: DeviceMesh,
                    src_data_rank: int | None) -> None:
    """Replace ``module.<name>`` by this rank's piece under ``placement`` on ``mesh``.

    With ``src_data_rank`` (default 0, as torch), the full value is first broadcast from
    that TP rank so that ranks initialised differently still agree; ``None`` slices the
    local value as is (every rank must hold the same full tensor). Meta tensors stay meta.
    """
    param = module._parameters[name]
    assert param is not None
    layout = Layout(tuple(param.shape), (mesh.size(),), mesh.mesh_dim_names, (placement,),
                    mesh.get_coordinate())
    full = param.detach()
    if src_data_rank is not None:
        full = C.broadcast(full, mesh.get_group(), src_data_rank)
    local = layout.shard(full).clone(memory_format=torch.contiguous_format)
    new = nn.Parameter(local, requires_grad=param.requires_grad)
    new._fsdp2d_layout = layout  # read by clip_grad_norm_; refreshed by _refresh_layouts
    module._parameters[name] = new
    if "_fsdp2d_tp" not in module.__dict__:
        module._fsdp2d_tp = {}
        module.register_forward_pre_hook(_refresh_layouts)
    module._fsdp2d_tp[name] = TPParam(layout, mesh)


def _refresh_layouts(module: nn.Module, args: tuple) -> None:
    """Re-tag parameters that ``to_empty()``/``_apply`` replaced (FSDP-managed ones are
    tagged with their 2D layout by FSDP and left alone)."""
    for name, info in module._fsdp2d_tp.items():
        p = module._parameters.get(name)
        if p is not None and getattr(p, "_fsdp2d_layout", None) is None:
            p._fsdp2d_layout = info.layout


def mark_partial_grads(module: nn.Module, names: tuple[str, ...], group: C.Group) -> None:
    """Sum the gradients of ``module.<name>`` over ``group`` in backward, for each name."""
    if C.group_size(group) == 1 or not names:
        return
    module.__dict__.setdefault("_fsdp2d_partial_grads", {}).update({n: group for n in names})
    if getattr(module, "_fsdp2d_partial_hooked", False):
        return
    module._fsdp2d_partial_hooked = True

    def attach_grad_hooks(mod: nn.Module, args: tuple) -> None:
        for pname, grp in mod._fsdp2d_partial_grads.items():
            p = mod._parameters.get(pname)
            if p is not None and p.requires_grad and not getattr(p, "_fsdp2d_grad_hooked", False):
                p.register_hook(lambda g, grp=grp: C.all_reduce(g, grp, inplace=False))
                p._fsdp2d_grad_hooked = True

    module.register_forward_pre_hook(attach_grad_hooks)


def tp_params(model: nn.Module) -> Iterator[tuple[str, TPParam]]:
    """``(fqn, TPParam)`` for every tensor-parallel parameter of ``model``."""
    for mod_name, mod in model.named_modules():
        for pname, info in getattr(mod, "_fsdp2d_tp", {}).items():
            yield (f"{mod_name}.{pname}" if mod_name else pname), info
