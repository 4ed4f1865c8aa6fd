"""Replacing a module's parameters by TP shards: DTensors at rest, plain in compute.

``shard_parameter`` replaces ``module.<name>`` by an ``nn.Parameter`` wrapping a torch
``DTensor`` on the TP mesh whose local tensor is this rank's piece (as torch's
``parallelize_module`` does), and records the piece's :class:`Layout` on the module
(``module._fsdp2d_tp[name] = TPParam(layout, mesh)``): ``to_empty()`` and ``_apply()``
create new Parameter objects, but the owning module stays.

Compute is plain: a forward pre-hook registers the local tensor in place of each DTensor
parameter (``to_local()`` when it needs a gradient, so the gradient arrives at the
DTensor parameter as a DTensor, exactly as with torch), and a forward hook puts the
DTensor parameters back, also when forward raises. Parameters that ``fully_shard``
manages are left alone: FSDP registers its own plain unsharded parameter first.

Parameters replicated over TP whose gradients are partial (norms on sequence shards,
a row-wise bias added after a reduce-scatter) get a gradient hook that sums the
gradient over TP, attached to whatever plain tensor the module computes with.

Tied parameters (one tensor held by two modules, e.g. an embedding and the LM head):
``parallelize_module`` shards them once and registers the same DTensor parameter on
both (see :data:`TIES`), so the tie holds; styles that disagree on its placement, or a
tied module left out of the plan, are rejected before anything changes.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .. import _collectives as C
from .._dtensor import as_dtensor, install_load_hook, spec_of
from .._stale import mark_replaced
from ..mesh import DeviceMesh, axis_names, coordinate
from ..placement import Layout, Placement


@dataclass(frozen=True)
class TPParam:
    """How a tensor-parallel parameter is sharded: its layout and the TP mesh."""

    layout: Layout
    mesh: DeviceMesh


# id(original parameter) -> the DTensor parameter that replaced it, during one
# parallelize_module call, so a tied parameter is sharded once (set by parallelize_module).
TIES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fsdp2d_tp_ties", default=None)


def shard_parameter(module: nn.Module, name: str, placement: Placement, mesh: DeviceMesh,
                    src_data_rank: int | None, *, fqn: str | None = None) -> None:
    """Replace ``module.<name>`` by this rank's piece under ``placement`` on ``mesh``.

    With ``src_data_rank`` (default 0, as torch), the full value is first broadcast from
    that TP rank so that ranks initialised differently still agree; ``None`` slices the
    local value as is (every rank must hold the same full tensor). Meta tensors stay meta.
    """
    param = module._parameters[name]
    assert param is not None
    if isinstance(param, DTensor):
        raise ValueError(f"parameter {name!r} of {type(module).__name__} is already a DTensor; "
                         f"apply parallelize_module once, to plain parameters")
    layout = Layout(tuple(param.shape), (mesh.size(),), axis_names(mesh), (placement,), coordinate(mesh))
    ties = TIES.get()
    new = ties.get(id(param)) if ties is not None else None
    if new is None:
        full = param.detach()
        if src_data_rank is not None:
            full = C.broadcast(full, mesh.get_group(), src_data_rank)
        local = layout.shard(full).clone(memory_format=torch.contiguous_format)
        new = nn.Parameter(as_dtensor(local, spec_of(layout, mesh, local.dtype)),
                           requires_grad=param.requires_grad)
        if ties is not None:
            ties[id(param)] = new
    module._parameters[name] = new
    mark_replaced(param, fqn or name, "parallelize_module")
    install_load_hook(module)
    if "_fsdp2d_tp" not in module.__dict__:
        module._fsdp2d_tp = {}
        module.register_forward_pre_hook(_to_compute)
        module.register_forward_hook(_to_rest, always_call=True)
    module._fsdp2d_tp[name] = TPParam(layout, mesh)


def _to_compute(module: nn.Module, args: tuple) -> None:
    """Register plain local tensors in place of the module's DTensor parameters."""
    at_rest = {}
    for name in module._fsdp2d_tp:
        p = module._parameters.get(name)
        if isinstance(p, DTensor):  # FSDP-managed parameters are plain (unsharded) here
            at_rest[name] = p
            grad = p.requires_grad and torch.is_grad_enabled()
            module._parameters[name] = p.to_local() if grad else p._local_tensor
    module.__dict__["_fsdp2d_at_rest"] = at_rest


def _to_rest(module: nn.Module, args: tuple, output: object) -> None:
    """Put the DTensor parameters back after forward (also when it raised)."""
    for name, p in module.__dict__.pop("_fsdp2d_at_rest", {}).items():
        module._parameters[name] = p


def mark_partial_grads(module: nn.Module, names: tuple[str, ...], group: C.Group) -> None:
    """Sum the gradients of ``module.<name>`` over ``group`` in backward, for each name."""
    if C.group_size(group) == 1 or not names:
        return
    module.__dict__.setdefault("_fsdp2d_partial_grads", {}).update({n: group for n in names})
    if getattr(module, "_fsdp2d_partial_hooked", False):
        return
    module._fsdp2d_partial_hooked = True

    def attach_grad_hooks(mod: nn.Module, args: tuple) -> None:
        # Runs after _to_compute (registered later): hooks the plain tensor the module
        # computes with, FSDP's persistent unsharded parameter (once) or this forward's
        # local view of a DTensor parameter (every forward: it is a new tensor).
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
