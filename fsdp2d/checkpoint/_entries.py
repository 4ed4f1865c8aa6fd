"""What a rank holds of a model and optimizer: named local tensors with their layouts.

One enumeration serves save and load, so both agree on names: model parameters and
persistent buffers are ``model/<fqn>``; optimizer state is ``optim/<fqn>/<key>``
(``exp_avg``, ``exp_avg_sq`` for AdamW; tensors shaped like the parameter share its
layout, scalars such as ``step`` are replicated). A layout of None means "the full
tensor, replicated on every rank" (an unparallelized model).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from torch.distributed.tensor import DTensor

from .._dtensor import layout_of, local_of
from ..fsdp import fsdp_params
from ..mesh import DeviceMesh, axis_names, root_of
from ..placement import Box, Layout


@dataclass
class Entry:
    name: str
    tensor: torch.Tensor          # this rank's local piece (filled in place on load)
    layout: Layout | None
    global_shape: tuple[int, ...]
    groups: dict = field(default_factory=dict)  # layout axis name -> process group
    mesh: DeviceMesh | None = None  # the root mesh the layout's axes belong to

    def get_group(self, axis: str):  # lets an Entry stand in for a mesh in gather_full
        return self.groups[axis]

    @property
    def box(self) -> Box:
        if self.layout is None:
            return Box((0,) * len(self.global_shape), self.global_shape)
        return self.layout.box


def _layouts(model: nn.Module) -> dict[str, tuple[Layout, dict, DeviceMesh]]:
    """fqn -> (layout, {axis name: group}, the user's root mesh) for every sharded
    parameter: every DTensor parameter, whoever sharded it (fsdp2d's TP or FSDP, torch's
    TP), read from its placements, so no sharded parameter is ever saved as if whole.
    The root mesh (``init_device_mesh``'s, whose axis order the index records) of an FSDP
    parameter is its FSDP mesh's; its own DTensor mesh is fsdp2d's TP-first one."""
    out = {}
    for fqn, p in _named_params(model).items():
        if isinstance(p, DTensor):
            tmesh = p.device_mesh
            groups = {n: tmesh.get_group(i) for i, n in enumerate(axis_names(tmesh))}
            out[fqn] = (layout_of(p), groups, root_of(tmesh))
    out.update({fqn: (p.layout, p.axis_groups, root_of(p.mesh)) for fqn, p in fsdp_params(model)})
    return out


def _named_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters by fqn, as the optimizer sees them (FSDP shards, not unsharded)."""
    out = dict(model.named_parameters())
    for fqn, p in fsdp_params(model):
        out[fqn] = p.sharded
    return out


def model_entries(model: nn.Module) -> list[Entry]:
    layouts = _layouts(model)
    entries = []
    for fqn, p in _named_params(model).items():
        lay, groups, mesh = layouts.get(fqn, (None, {}, None))
        shape = lay.global_shape if lay is not None else tuple(p.shape)
        entries.append(Entry(f"model/{fqn}", local_of(p).detach(), lay, shape, groups, mesh))
    for fqn, buf in model.named_buffers():
        mod_name, _, bname = fqn.rpartition(".")
        owner = model.get_submodule(mod_name) if mod_name else model
        if bname not in owner._non_persistent_buffers_set:
            entries.append(Entry(f"model/{fqn}", buf, None, tuple(buf.shape)))
    return entries


def param_fqns(model: nn.Module) -> dict[int, str]:
    """id(parameter as the optimizer sees it) -> fqn."""
    return {id(p): fqn for fqn, p in _named_params(model).items()}


def materialize_state(optimizer: torch.optim.Optimizer, only: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Create the state torch optimizers make lazily, for parameters (of ``only``, if
    given) that have none, so a load has tensors to fill: one step on zero gradients at
    lr=0 (parameters unchanged, since every update and weight decay is scaled by lr).
    Returns those parameters, so a failed load can drop their state again."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    pool = params if only is None else only
    created = [p for p in pool if p.requires_grad and not optimizer.state.get(p)]
    if not created:
        return []
    grads = {p: p.grad for p in params}
    lrs = [g.get("lr") for g in optimizer.param_groups]
    new = {id(p) for p in created}  # identity: `in` on tensors would compare values
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if id(p) in new else None
        for g in optimizer.param_groups:
            if "lr" in g:
                g["lr"] = 0.0
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p, grad in grads.items():
            p.grad = grad
    return created


def optimizer_entries(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Entry]:
    """Optimizer state entries (parameters without state are skipped: see
    :func:`materialize_state`)."""
    layouts = _layouts(model)
    fqn_of = param_fqns(model)
    entries = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            fqn = fqn_of.get(id(p))
            if fqn is None:
                raise ValueError("optimizer holds a parameter that is not in the model; build the "
                                 "optimizer from model.parameters() after parallelize_module/fully_shard")
            state = optimizer.state.get(p)
            if not state:
                continue
            lay, groups, mesh = layouts.get(fqn, (None, {}, None))
            for key, value in sorted(state.items()):
                if not isinstance(value, torch.Tensor):
                    continue
                if isinstance(value, DTensor) and lay is not None and not layout_of(value).splits_like(lay):
                    raise ValueError(f"optimizer state {key!r} of {fqn!r} is laid out as {value.placements}, its "
                                     f"parameter as {p.placements}; save cannot tell which box it holds")
                if value.shape == p.shape and value.ndim > 0:  # DTensor state of a DTensor parameter
                    shape = lay.global_shape if lay is not None else tuple(p.shape)
                    entries.append(Entry(f"optim/{fqn}/{key}", local_of(value), lay, shape, groups, mesh))
                else:
                    entries.append(Entry(f"optim/{fqn}/{key}", local_of(value), None, tuple(value.shape)))
    return entries


def optimizer_hparams(optimizer: torch.optim.Optimizer) -> list[dict]:
    """JSON-able hyperparameters of each param group (lr, betas, ...), without params."""
    out = []
    for group in optimizer.param_groups:
        out.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
                    if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None)))})
    return out
