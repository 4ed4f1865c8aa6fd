"""FSDP1's ``optim_state_dict`` / ``optim_state_dict_to_load`` on fsdp2d units.

The saved form is torch's: ``{"state": {fqn: {name: value}}, "param_groups": [{...,
"params": [fqn, ...]}]}`` keyed by the original parameters' clean names, whatever
``use_orig_params`` (a flat parameter's state is split into its parameters'), with
values as the model's state dict has them under the current ``state_dict_type``: full
tensors (FULL_STATE_DICT), ShardedTensor / DTensor pieces (SHARDED_STATE_DICT). Scalars
(``step``) are kept as they are. Loading accepts any of these forms.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.fsdp import StateDictType
from torch.distributed.tensor import DTensor

from .._dtensor import as_dtensor, layout_of, local_of
from ..bridge import gather_full
from ._state_dict import PREFIX, _local_of_sharded, _sharded_value, get_state_dict_type, units


def _entries(model: nn.Module) -> dict[int, list[tuple[str, Any, Any]]]:
    """id(optimizer parameter) -> [(fqn, FSDPParam or None, unit)] (a flat parameter
    maps to all of its unit's parameters)."""
    out: dict[int, list] = {}
    paths = {id(m): n for n, m in model.named_modules()}
    for unit in units(model):
        g = unit._fsdp1_group
        if g is None:
            continue
        base = paths[id(unit)]
        for p in g.params:
            fqn = f"{base}.{PREFIX}{p.fqn}" if base else f"{PREFIX}{p.fqn}"
            entry = (fqn.replace(PREFIX, ""), p, unit)
            out.setdefault(id(g.flat_param if g.flat_param is not None else p.sharded), []).append(entry)
    for name, param in model.named_parameters():
        if id(param) not in out:
            out[id(param)] = [(name.replace(PREFIX, ""), None, None)]
    return out


def _check_owned(entries: dict, optim: torch.optim.Optimizer, api: str) -> None:
    """Every optimizer parameter must be one of the model's (as the optimizer sees it: a
    flat parameter or a sharded one); else the state would be dropped without a word."""
    for i, p in enumerate(q for g in optim.param_groups for q in g["params"]):
        if id(p) not in entries:
            raise ValueError(f"{api}: the optimizer's parameter {i} (shape {tuple(p.shape)}) is not a parameter of "
                             f"the model given: was the optimizer built over another model, or before wrapping?")


def _order(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optim.param_groups for p in group["params"]]


def _piece(p, unit, value: torch.Tensor) -> torch.Tensor:
    """This rank's local state tensor of parameter ``p`` from the optimizer's value (the
    parameter's own DTensor shape, or the unit's flat one)."""
    local = local_of(value)
    g = unit._fsdp1_group
    if g.flat_param is not None:
        return p.shard_in(local)
    return local


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict | None = None) -> dict:
    osd = optim_state_dict if optim_state_dict is not None else optim.state_dict()
    settings = get_state_dict_type(model)
    kind, cfg = settings.state_dict_type, settings.optim_state_dict_config
    if kind == StateDictType.LOCAL_STATE_DICT:
        raise NotImplementedError("optim_state_dict with LOCAL_STATE_DICT is not supported (as with torch); use "
                                  "FULL_STATE_DICT or SHARDED_STATE_DICT")
    entries = _entries(model)
    _check_owned(entries, optim, "optim_state_dict")
    state: dict[str, dict] = {}
    groups = []
    index = 0
    for group in optim.param_groups:
        fqns = []
        for param in group["params"]:
            param_state = osd["state"].get(index, {})
            index += 1
            for fqn, p, unit in entries.get(id(param), []):
                fqns.append(fqn)
                if not param_state:
                    continue
                out = {}
                for name, value in param_state.items():
                    if not isinstance(value, torch.Tensor) or value.dim() == 0 or p is None:
                        # A copy, as torch's: the live ``step`` tensor would keep counting after
                        # the snapshot (and an optimizer loading it would share the counter).
                        out[name] = value.detach().clone() if isinstance(value, torch.Tensor) else value
                        continue
                    dt = as_dtensor(_piece(p, unit, value), p.sharded._spec)
                    if kind == StateDictType.FULL_STATE_DICT:
                        v = gather_full(dt)
                    else:
                        v = _sharded_value(unit, p, dt)
                    out[name] = v.cpu() if cfg.offload_to_cpu and not isinstance(v, ShardedTensor) else v
                state[fqn] = out
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
    if kind == StateDictType.FULL_STATE_DICT and getattr(cfg, "rank0_only", False) and dist.get_rank() != 0:
        return {}
    return {"state": state, "param_groups": groups}


def _local_value(p, key: str, value: Any, unit) -> torch.Tensor:
    """This rank's shard of parameter ``p`` from a saved state value of any form."""
    if isinstance(value, (ShardedTensor, DTensor)):
        return _local_of_sharded(unit, p, key, value)
    if tuple(value.shape) != tuple(p.sharded.shape):
        raise ValueError(f"optim_state_dict_to_load: {key!r} has shape {tuple(value.shape)}, the parameter "
                         f"{tuple(p.sharded.shape)}")
    return layout_of(p.sharded).shard(value)


def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict) -> dict:
    """A saved ``optim_state_dict`` (of any state-dict type, any mesh) in the form
    ``optim.load_state_dict`` takes for this model's optimizer."""
    saved_state, saved_groups = optim_state_dict["state"], optim_state_dict["param_groups"]
    entries = _entries(model)
    _check_owned(entries, optim, "optim_state_dict_to_load")
    state: dict[int, dict] = {}
    groups = []
    index = 0
    for gi, group in enumerate(optim.param_groups):
        ids = []
        for param in group["params"]:
            ids.append(index)
            mine = entries.get(id(param), [])
            present = [e for e in mine if e[0] in saved_state]
            if present:
                state[index] = _load_param(param, mine, saved_state)
            index += 1
        saved = saved_groups[gi] if gi < len(saved_groups) else {}
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def _load_param(param: torch.Tensor, mine: list, saved_state: dict) -> dict:
    first = saved_state[mine[0][0]]
    out: dict[str, Any] = {}
    for name, value in first.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or mine[0][1] is None:
            out[name] = value.clone() if isinstance(value, torch.Tensor) else value
            continue
        if len(mine) == 1 and (mine[0][2]._fsdp1_group.flat_param is None):
            fqn, p, unit = mine[0]
            local = _local_value(p, f"{fqn}.{name}", value, unit)
            out[name] = as_dtensor(local.to(p.sharded.device).clone(), p.sharded._spec)
            continue
        flat = torch.zeros_like(local_of(param), dtype=value.dtype)
        for fqn, p, unit in mine:
            v = saved_state[fqn][name]
            piece = _local_value(p, f"{fqn}.{name}", v, unit)
            p.shard_in(flat).copy_(piece.reshape(p.shard_shape))
        out[name] = as_dtensor(flat, param._spec)
    return out
