"""FSDP1 state dicts (``summon_full_params`` and the comm hooks: :mod:`._summon`).

Keys never show the ``_fsdp_wrapped_module.`` segments (each unit's hooks strip its
own and put it back on load). Values by ``state_dict_type``:

- ``FULL_STATE_DICT``: full tensors (gathered over the data axis); a TP parameter, as
  with torch's FSDP1 + TP, stays a DTensor on the tp mesh (gathered over the data axis
  only: ``full_tensor()`` gives the whole); ``rank0_only`` leaves the other ranks' dicts
  empty; buffers in their own dtype whatever ``MixedPrecision.buffer_dtype``. Loading
  takes full tensors or DTensors on any mesh.
- ``SHARDED_STATE_DICT``: each rank's ``torch.chunk`` piece along dim 0, as torch's FSDP1
  gives it: a ``ShardedTensor`` (same metadata as torch: one shard per non-empty chunk,
  placed on the data-parallel group's global ranks), or a ``DTensor`` when the unit
  was given a ``device_mesh`` or has TP parameters (the parameter's own spec: TP-major
  on the (tp, dp) mesh, no communication; torch's FSDP1 + TP redistributes to
  ``(Shard(0), tp_placement)`` on its (dp, tp) mesh, the same boxes except where TP and
  FSDP both split dim 0). Either writes with DCP and reads back on any mesh; loading in
  memory also takes another model's DTensors (e.g. torch's), gathered whole per tensor.
- ``LOCAL_STATE_DICT``: ``<unit>._flat_param``, this rank's flat storage as a
  ``ShardedTensor``; loads only into the same wrapping on the same number of ranks.
  fsdp2d's flat storage is each parameter's own dim-0 chunk, back to back; torch's is a
  chunk of all parameters flattened end to end: the same sizes whenever every dim 0
  divides by the ranks, different contents. So the state dict's metadata records the
  layout (ranks, parameters, shapes) and loading checks it: torch's local state dicts
  and other wrappings fail loudly instead of loading permuted values.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as STShard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig, LocalStateDictConfig,
                                    OptimStateDictConfig, ShardedOptimStateDictConfig, ShardedStateDictConfig,
                                    StateDictConfig, StateDictSettings, StateDictType)
from torch.distributed.tensor import DTensor

from .._dtensor import as_dtensor, layout_of, local_of
from .._dtensor import spec_of
from ..bridge import gather_full
from ..bridge.extensions import gather_axes
from ..mesh import axis_names
from ..placement import Shard, chunk_range
from ._unit import Unit

PREFIX = "_fsdp_wrapped_module."


def units(module: nn.Module) -> list:
    return [m for m in module.modules() if isinstance(m, Unit)]


# -- state_dict_type ------------------------------------------------------------------------
_CONFIGS = {StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
            StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
            StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, OptimStateDictConfig)}


def default_settings() -> StateDictSettings:
    return StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())


def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                        state_dict_config: StateDictConfig | None = None,
                        optim_state_dict_config: OptimStateDictConfig | None = None) -> StateDictSettings:
    """Set the state-dict type of every FSDP1 unit under ``module``; returns the previous
    settings (those of the units, which must agree)."""
    found = units(module)
    if not found:
        raise ValueError(f"set_state_dict_type: {type(module).__name__} holds no FullyShardedDataParallel unit")
    sd_cls, optim_cls = _CONFIGS[state_dict_type]
    state_dict_config = state_dict_config if state_dict_config is not None else sd_cls()
    optim_state_dict_config = optim_state_dict_config if optim_state_dict_config is not None else optim_cls()
    if not isinstance(state_dict_config, sd_cls):
        raise ValueError(f"set_state_dict_type: {state_dict_type.name} takes a {sd_cls.__name__}, got "
                         f"{type(state_dict_config).__name__}")
    previous = found[0]._fsdp1_settings
    for u in found:
        if u._fsdp1_settings.state_dict_type != previous.state_dict_type:
            raise RuntimeError("set_state_dict_type: the FSDP units hold different state-dict types; "
                               "set them all through the root")
        u.__dict__["_fsdp1_settings"] = StateDictSettings(state_dict_type, copy.copy(state_dict_config),
                                                          copy.copy(optim_state_dict_config))
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    found = units(module)
    if not found:
        raise ValueError(f"get_state_dict_type: {type(module).__name__} holds no FullyShardedDataParallel unit")
    return found[0]._fsdp1_settings


@contextlib.contextmanager
def state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                    state_dict_config: StateDictConfig | None = None,
                    optim_state_dict_config: OptimStateDictConfig | None = None) -> Iterator[None]:
    previous = set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
    try:
        yield
    finally:
        set_state_dict_type(module, previous.state_dict_type, previous.state_dict_config,
                            previous.optim_state_dict_config)


# -- values ---------------------------------------------------------------------------------
def uses_dtensor(unit: nn.Module) -> bool:
    """Sharded values are DTensors (not ShardedTensors) for units given a device_mesh
    or holding TP parameters, as in torch."""
    group = unit._fsdp1_group
    return unit._fsdp1_given_mesh or (group is not None and any(p.tp is not None for p in group.params))


def chunk_sharded(local: torch.Tensor, global_shape: tuple[int, ...], group: dist.ProcessGroup) -> ShardedTensor:
    """``local`` (this rank's ``torch.chunk`` piece along dim 0 over ``group``) as the
    ShardedTensor torch's FSDP1 builds: one shard per non-empty chunk, no communication."""
    k, rank = group.size(), group.rank()
    rows = global_shape[0] if global_shape else 0
    device = "cuda" if local.device.type == "cuda" else "cpu"
    shards = []
    for r in range(k):
        start, n = chunk_range(rows, k, r)
        if n == 0 and r > 0:
            break
        g = dist.get_global_rank(group, r)
        placement = f"rank:{g}/cuda:{local.device.index or 0}" if device == "cuda" and g == dist.get_rank() \
            else (f"rank:{g}/cuda:{g % max(torch.cuda.device_count(), 1)}" if device == "cuda" else f"rank:{g}/cpu")
        shards.append(ShardMetadata([start] + [0] * (len(global_shape) - 1), [n, *global_shape[1:]], placement))
    meta = ShardedTensorMetadata(shards, torch.Size(global_shape), TensorProperties(
        dtype=local.dtype, layout=local.layout, requires_grad=False, memory_format=torch.contiguous_format,
        pin_memory=False))
    mine = [STShard.from_tensor_and_offsets(local, shards[rank].shard_offsets, dist.get_rank())] \
        if rank < len(shards) else []
    return ShardedTensor._init_from_local_shards_and_global_metadata(mine, meta, process_group=group)


def _sharded_value(unit: nn.Module, p, value: DTensor) -> torch.Tensor:
    local = local_of(value).detach().clone()
    if uses_dtensor(unit):
        return as_dtensor(local, value._spec)
    return chunk_sharded(local, tuple(value.shape), p.mesh.get_group(p.mesh.ndim - 1))


def _local_of_sharded(unit: nn.Module, p, key: str, value: Any) -> torch.Tensor:
    """This rank's shard of parameter ``p`` from a loaded SHARDED value (ShardedTensor,
    DTensor, or a full plain tensor), checked against the box this rank owns in global
    coordinates (for TP parameters that is the FSDP chunk of the TP shard)."""
    box = layout_of(p.sharded)
    if isinstance(value, DTensor):
        if value.device_mesh != p.sharded.device_mesh:
            # Another model's mesh (torch's FSDP1 + TP puts its values on its own (dp, tp)
            # mesh): DTensor cannot redistribute across meshes, so gather this one tensor
            # whole and slice this rank's box.
            return box.shard(value.full_tensor())
        if value._spec.placements != p.sharded._spec.placements or tuple(value.shape) != tuple(p.sharded.shape):
            value = value.redistribute(p.sharded.device_mesh, p.sharded.placements)
        return local_of(value)
    if isinstance(value, ShardedTensor):
        shards = value.local_shards()
        if tuple(value.size()) != tuple(p.sharded.shape):
            raise ValueError(f"load_state_dict: {key!r} has shape {tuple(value.size())}, the model's parameter "
                             f"{tuple(p.sharded.shape)}")
        offset, shape = list(box.global_offset), list(box.local_shape)
        if not shards:
            if math.prod(shape):
                raise ValueError(f"load_state_dict: {key!r} has no shard on this rank, which owns the box at "
                                 f"{offset} of shape {shape}; load it with torch.distributed.checkpoint into "
                                 f"this model's own state_dict()")
            return torch.empty(p.shard_shape, dtype=value.dtype, device=p.sharded.device)
        md = shards[0].metadata
        if len(shards) != 1 or list(md.shard_offsets) != offset or list(md.shard_sizes) != shape:
            raise ValueError(f"load_state_dict: {key!r} holds the box at {list(md.shard_offsets)} of shape "
                             f"{list(md.shard_sizes)} on this rank, which owns the one at {offset} of shape "
                             f"{shape}; load it with torch.distributed.checkpoint into this model's own "
                             f"state_dict()")
        return shards[0].tensor
    if tuple(value.shape) == tuple(p.sharded.shape):
        return box.shard(value)  # a full tensor
    raise ValueError(f"load_state_dict: {key!r} is a plain tensor of shape {tuple(value.shape)}; SHARDED_STATE_DICT "
                     f"takes ShardedTensors, DTensors or the full {tuple(p.sharded.shape)} tensor")


def gather_data_axes(p, local: torch.Tensor) -> torch.Tensor:
    """Parameter ``p``'s shard gathered over the data axes: its TP-local piece (the
    bridge's ``gather_axes``, which ``DTensorExtensions.all_gather_dtensor`` uses too)."""
    layout = p.layout
    axes = [n for n in axis_names(p.mesh) if isinstance(layout.placements[layout.axis(n)], Shard)]
    return gather_axes(local, layout, p.spec_mesh, axes)[0] if axes else local


def _tp_local(p, local: torch.Tensor) -> DTensor:
    """A TP-local piece of ``p`` as the DTensor torch's FSDP1 + TP shows: on the tp mesh,
    with the TP placement (global shape)."""
    return as_dtensor(local, spec_of(p.tp.layout, p.tp.mesh, local.dtype))


def _own_params(unit: nn.Module) -> list[tuple[str, Any]]:
    """(key under the unit's prefix, FSDPParam) for the unit's parameters and ties."""
    group = unit._fsdp1_group
    if group is None:
        return []
    inner = unit._fsdp_wrapped_module
    paths = {id(m): n for n, m in inner.named_modules(remove_duplicate=False)}
    out = []
    for p in group.params:
        for owner, name in [(p.module, p.name), *p.aliases]:
            path = paths.get(id(owner))
            if path is not None:
                out.append((PREFIX + (f"{path}.{name}" if path else name), p))
    return out


def _own_buffers(unit: nn.Module) -> list[tuple[str, torch.dtype]]:
    dtypes = unit._fsdp1_buffer_dtypes
    if not dtypes:
        return []
    inner = unit._fsdp_wrapped_module
    return [(PREFIX + (f"{path}.{name}" if path else name), dtypes[(id(m), name)])
            for path, m in inner.named_modules() for name in m._buffers if (id(m), name) in dtypes]


_LAYOUT_KEY = "fsdp2d_flat_layout"


def _flat_layout(group) -> list:
    """What a unit's flat storage holds on each rank: the shard-axis size, each rank's
    element count, and the parameters (name, shape) in storage order."""
    return [group.k, group.total, [[p.fqn, list(p.unsharded_shape)] for p in group.params]]


def _check_flat_layout(unit: nn.Module, prefix: str, local_metadata: dict) -> None:
    """LOCAL_STATE_DICT load: the saved layout (in the state dict's ``_metadata``) must be
    this unit's. A state dict without ``_metadata`` (e.g. rebuilt as a plain dict) has
    only the element-count check after this."""
    if not local_metadata:
        return
    saved, mine = local_metadata.get(_LAYOUT_KEY), _flat_layout(unit._fsdp1_group)
    where = f"load_state_dict (LOCAL_STATE_DICT): {prefix}_flat_param"
    if saved is None:
        raise ValueError(f"{where} was not written by fsdp2d's FullyShardedDataParallel (torch's FSDP1 lays out "
                         f"its flat parameter differently); move state between implementations with "
                         f"SHARDED_STATE_DICT or FULL_STATE_DICT")
    if saved != mine:
        def what(layout: list) -> str:
            names = [n for n, _ in layout[2]]
            return f"{layout[0]} ranks, parameters {names[:4]}" + (f" and {len(names) - 4} more" if names[4:] else "")
        raise ValueError(f"{where} was written for {what(saved)}; this unit has {what(mine)}: a local state dict "
                         f"loads only into the same wrapping on the same ranks; use SHARDED_STATE_DICT to reshard")


def _post_state_dict(unit: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    settings = unit._fsdp1_settings
    kind, cfg = settings.state_dict_type, settings.state_dict_config
    for key, p in _own_params(unit):
        key = prefix + key
        value = state_dict.get(key)
        if not isinstance(value, DTensor):
            continue
        if kind == StateDictType.FULL_STATE_DICT:
            full = _tp_local(p, gather_data_axes(p, local_of(value).detach())) if p.tp is not None \
                else gather_full(value.detach())
            state_dict[key] = full.cpu() if cfg.offload_to_cpu else full
        elif kind == StateDictType.SHARDED_STATE_DICT:
            v = _sharded_value(unit, p, value)
            state_dict[key] = v.cpu() if cfg.offload_to_cpu and not isinstance(v, ShardedTensor) else v
        else:
            del state_dict[key]
    for key, dtype in _own_buffers(unit):
        if prefix + key in state_dict and kind != StateDictType.LOCAL_STATE_DICT:
            state_dict[prefix + key] = state_dict[prefix + key].to(dtype)
    group = unit._fsdp1_group
    if kind == StateDictType.LOCAL_STATE_DICT and group is not None:
        flat = next(iter(group.flats.values())).detach()
        k = group.k
        state_dict[prefix + "_flat_param"] = chunk_sharded(flat, (k * group.total,),
                                                           unit._fsdp1_mesh.get_group(unit._fsdp1_mesh.ndim - 1))
        local_metadata[_LAYOUT_KEY] = _flat_layout(group)
    for key in [k for k in state_dict if k.startswith(prefix + PREFIX)]:
        state_dict[prefix + key[len(prefix + PREFIX):]] = state_dict.pop(key)
    if kind == StateDictType.FULL_STATE_DICT and cfg.rank0_only and dist.get_rank() != 0:
        for key in [k for k in state_dict if k.startswith(prefix)]:
            del state_dict[key]


def _pre_load_state_dict(unit: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + PREFIX)]:
        state_dict[prefix + PREFIX + key[len(prefix):]] = state_dict.pop(key)
    kind = unit._fsdp1_settings.state_dict_type
    group = unit._fsdp1_group
    if group is None:
        return
    group.to_rest()
    if kind == StateDictType.LOCAL_STATE_DICT:
        value = state_dict.pop(prefix + PREFIX + "_flat_param", None)
        if value is None:
            raise KeyError(f"load_state_dict (LOCAL_STATE_DICT): no {prefix}_flat_param")
        _check_flat_layout(unit, prefix, args[0] if args else {})
        local = value.local_shards()[0].tensor if isinstance(value, ShardedTensor) else local_of(value)
        flat = next(iter(group.flats.values()))
        if local.numel() != flat.numel():
            raise ValueError(f"load_state_dict (LOCAL_STATE_DICT): {prefix}_flat_param holds {local.numel()} "
                             f"elements on this rank, this unit {flat.numel()}: a local state dict loads only "
                             f"into the same wrapping on the same ranks; use SHARDED_STATE_DICT to reshard")
        with torch.no_grad():
            flat.copy_(local.view(-1))
        for key, p in _own_params(unit):
            state_dict[prefix + key] = p.sharded
        return
    if kind == StateDictType.SHARDED_STATE_DICT:
        for key, p in _own_params(unit):
            value = state_dict.get(prefix + key)
            if value is not None and not (isinstance(value, DTensor) and value._spec == p.sharded._spec):
                local = _local_of_sharded(unit, p, prefix + key, value)
                state_dict[prefix + key] = as_dtensor(local.to(p.sharded.device, p.sharded.dtype), p.sharded._spec)
        return
    for key, p in _own_params(unit):  # FULL_STATE_DICT: full tensors, sliced by the engine's load hook
        value = state_dict.get(prefix + key)
        if isinstance(value, DTensor) and value.device_mesh != p.sharded.device_mesh:
            # torch's FSDP1 + TP gives TP parameters as DTensors on its own tp mesh; the
            # engine's load hook takes full tensors (DTensor cannot copy across meshes).
            state_dict[prefix + key] = value.full_tensor()


def install_hooks(unit: nn.Module) -> None:
    unit._register_state_dict_hook(_post_state_dict)
    # with_module=True: the hook's first argument is the unit (torch's default passes
    # the state dict first).
    unit._register_load_state_dict_pre_hook(_pre_load_state_dict, with_module=True)
