"""``FullyShardedDataParallel``: torch's FSDP1 API on fsdp2d's ``fully_shard`` engine.

Each FSDP1 unit (the root, and every module the auto-wrap policy picks, children first)
is one ``fully_shard`` group on the mesh its arguments name (see :mod:`._mesh`), held by
a thin ``nn.Module`` wrapper as torch's: ``.module`` / ``_fsdp_wrapped_module``, attribute
and ``__getitem__`` forwarding, parameter names with the ``_fsdp_wrapped_module.``
segments, state-dict keys without them. The strategies map onto fsdp2d's:

==========================  ==========================================================
FULL_SHARD                  ``fully_shard(reshard_after_forward=True)``
SHARD_GRAD_OP               ``reshard_after_forward=False``
NO_SHARD                    HSDP over (replicate = all ranks, shard = one rank)
HYBRID_SHARD                HSDP over (replicate, shard), reshard after forward
_HYBRID_SHARD_ZERO2         HSDP, no reshard after forward
==========================  ==========================================================

``use_orig_params=True``: the optimizer sees the original parameters (DTensors, one
per parameter, as fsdp2d's ``fully_shard``). ``use_orig_params=False`` (torch's default):
it sees one flat parameter per unit, ``_flat_param``: a DTensor over the unit's flat
storage (this rank's shards back to back, ``Shard(0)`` over the data axis), which the
original parameters are views of, and which receives one flat gradient.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy,
                                    StateDictType)
from torch.distributed.tensor import Replicate as TReplicate, Shard as TShard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._pytree import tree_map

from .. import wrap as _wrap
from .._dtensor import as_dtensor
from ..clip import clip_grad_norm_ as _clip
from ..fsdp._policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ..fsdp.api import FSDPModule, fully_shard
from ..tensor_parallel._params import tp_params
from . import _mesh, _state_dict

_RESHARD_AFTER_FORWARD = {
    ShardingStrategy.FULL_SHARD: True, ShardingStrategy.HYBRID_SHARD: True,
    ShardingStrategy.SHARD_GRAD_OP: False, ShardingStrategy._HYBRID_SHARD_ZERO2: False,
    ShardingStrategy.NO_SHARD: False,
}
_LOCAL = threading.local()  # .depth: FSDP1 forwards in progress (the outermost is the root's)
_KWARGS = ("process_group", "sharding_strategy", "cpu_offload", "auto_wrap_policy", "backward_prefetch",
           "mixed_precision", "ignored_modules", "param_init_fn", "device_id", "sync_module_states",
           "forward_prefetch", "limit_all_gathers", "use_orig_params", "ignored_states", "device_mesh")


class FullyShardedDataParallel(nn.Module):
    """torch 2.13's ``torch.distributed.fsdp.FullyShardedDataParallel``, same arguments
    and methods, on fsdp2d's per-parameter engine (see the module docstring)."""

    def __init__(self, module: nn.Module, process_group: Any = None, sharding_strategy: ShardingStrategy | None = None,
                 cpu_offload: CPUOffload | None = None, auto_wrap_policy: Any = None,
                 backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision: MixedPrecision | None = None, ignored_modules: Any = None,
                 param_init_fn: Any = None, device_id: int | torch.device | None = None,
                 sync_module_states: bool = False, forward_prefetch: bool = False, limit_all_gathers: bool = True,
                 use_orig_params: bool = False, ignored_states: Any = None, device_mesh: Any = None) -> None:
        super().__init__()
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError("FullyShardedDataParallel: this module is already wrapped; wrap it once")
        kwargs = dict(process_group=process_group, sharding_strategy=sharding_strategy, cpu_offload=cpu_offload,
                      backward_prefetch=backward_prefetch, mixed_precision=mixed_precision,
                      param_init_fn=param_init_fn, device_id=device_id, sync_module_states=sync_module_states,
                      forward_prefetch=forward_prefetch, limit_all_gathers=limit_all_gathers,
                      use_orig_params=use_orig_params, device_mesh=device_mesh)
        ignored_mods, ignored_params = _ignored(module, ignored_modules, ignored_states)
        parents = _parents(module)
        for child, child_kwargs in _wrap.targets(module, auto_wrap_policy, ignored_mods, ignored_params,
                                                 {**kwargs, "auto_wrap_policy": auto_wrap_policy}):
            unit = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
            nn.Module.__init__(unit)
            unit._setup(child, _unit_kwargs(child_kwargs), ignored_params)
            for parent, name in parents.get(id(child), []):
                parent._modules[name] = unit
        self._setup(module, kwargs, ignored_params)
        for m in self.modules():
            if isinstance(m, FullyShardedDataParallel) and m is not self:
                m.__dict__["_fsdp1_nested"] = True

    # -- construction ------------------------------------------------------------------
    def _setup(self, module: nn.Module, kw: dict, ignored_params: set) -> None:
        strategy = kw["sharding_strategy"] or ShardingStrategy.FULL_SHARD
        if not isinstance(strategy, ShardingStrategy):
            raise TypeError(f"FullyShardedDataParallel: sharding_strategy must be a ShardingStrategy, got {strategy!r}")
        mp: MixedPrecision | None = kw["mixed_precision"]
        offload: CPUOffload | None = kw["cpu_offload"]
        has_tp = any(True for _ in tp_params(module))
        mesh = _mesh.mesh_for(strategy, kw["process_group"], kw["device_mesh"], has_tp)
        device = _device_of(kw["device_id"], mesh)
        _materialize(module, kw["param_init_fn"], device, ignored_params)
        if device.type != "cpu" and any(p.device.type == "cpu" for p in module.parameters()):
            module.to(device)  # torch moves a CPU module to device_id
        if kw["sync_module_states"]:
            _broadcast_states(module, mesh, ignored_params)
        buffer_dtypes = _cast_buffers(module, mp.buffer_dtype if mp is not None else None)
        if mp is not None:
            _check_mp_modules(module, mp)
        policy = MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                                      cast_forward_inputs=False) if mp is not None else MixedPrecisionPolicy()
        offload_policy = CPUOffloadPolicy() if offload is not None and offload.offload_params else OffloadPolicy()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CPUOffload on a CPU run is a no-op, as with torch
            fully_shard(module, mesh=mesh, reshard_after_forward=_RESHARD_AFTER_FORWARD[strategy],
                        mp_policy=policy, offload_policy=offload_policy, ignored_params=ignored_params)
        group = module._fsdp2d_fsdp.group
        if kw["backward_prefetch"] is None:
            module.set_modules_to_backward_prefetch([])
        if group is not None and mp is not None and mp.keep_low_precision_grads:
            group.grad_dtype = mp.param_dtype
        self._fsdp_wrapped_module = module
        self.__dict__.update(
            _fsdp1_strategy=strategy, _fsdp1_mp=mp, _fsdp1_mesh=mesh, _fsdp1_nested=False,
            _fsdp1_use_orig_params=bool(kw["use_orig_params"]), _fsdp1_buffer_dtypes=buffer_dtypes,
            _fsdp1_group=group, _fsdp1_settings=_state_dict.default_settings(),
            _fsdp1_given_mesh=kw["device_mesh"] is not None)
        if not kw["use_orig_params"] and group is not None:
            group.flat_param = _flat_param(group, mesh, type(module).__name__)
        _state_dict.install_hooks(self)

    # -- nn.Module surface -----------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_fsdp_wrapped_module":
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_LOCAL, "depth", 0)
        mp = self._fsdp1_mp
        if mp is not None and mp.param_dtype is not None and \
                (mp.cast_forward_inputs or (depth == 0 and mp.cast_root_forward_inputs)):
            args, kwargs = tree_map(lambda t: t.to(mp.param_dtype) if isinstance(t, torch.Tensor)
                                    and t.is_floating_point() else t, (args, kwargs))
        _LOCAL.depth = depth + 1
        try:
            return self._fsdp_wrapped_module(*args, **kwargs)
        finally:
            _LOCAL.depth = depth

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """As torch: ``use_orig_params=False`` units show one ``_flat_param`` instead of
        their parameters; inside ``summon_full_params`` the names have no
        ``_fsdp_wrapped_module.`` segments."""
        flat_of: dict[int, tuple[str, nn.Parameter]] = {}
        if recurse:
            for path, m in self.named_modules(prefix=prefix):
                group = m.__dict__.get("_fsdp1_group")
                if isinstance(m, FullyShardedDataParallel) and group is not None and group.flat_param is not None:
                    name = f"{path}._fsdp_wrapped_module._flat_param" if path else "_fsdp_wrapped_module._flat_param"
                    for p in group.params:
                        for t in (p.sharded, p.unsharded):
                            flat_of[id(t)] = (name, group.flat_param)
        seen: set[int] = set()
        summoned = _state_dict.summon_depth() > 0
        for name, p in super().named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate):
            if id(p) in flat_of:
                name, p = flat_of[id(p)]
                if id(p) in seen:
                    continue
                seen.add(id(p))
            elif summoned:
                name = name.replace("_fsdp_wrapped_module.", "")
            yield name, p

    # -- FSDP1 methods -------------------------------------------------------------------
    def check_is_root(self) -> bool:
        """Whether this instance is the outermost FSDP1 unit."""
        return not self._fsdp1_nested

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        return [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)
                and (not root_only or m.check_is_root())]

    def apply(self, fn: Any) -> "FullyShardedDataParallel":
        """``fn`` on every submodule with the full parameters in place (edits are kept)."""
        with _state_dict.summon_full_params(self, recurse=True, writeback=True):
            super().apply(fn)
        return self

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside keeps unsharded gradients and does not communicate; the first
        backward after it reduces their sum. Call on the root."""
        if not self.check_is_root():
            raise RuntimeError("no_sync() on an inner FSDP instance is not supported; call it on the root")
        units = [m.module for m in self.fsdp_modules(self)]
        for u in units:
            u.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for u in units:
                u.set_requires_gradient_sync(True, recurse=False)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every gradient of this model to a global ``norm_type``-norm of
        ``max_norm``; returns the norm before clipping (the same on every rank)."""
        if not self.check_is_root():
            raise RuntimeError("clip_grad_norm_ must be called on the root FSDP instance")
        return _clip(self.parameters(), max_norm, norm_type)

    def register_comm_hook(self, state: object, hook: Any) -> None:
        _state_dict.register_comm_hook(self, state, hook)

    summon_full_params = staticmethod(_state_dict.summon_full_params)
    state_dict_type = staticmethod(_state_dict.state_dict_type)
    set_state_dict_type = staticmethod(_state_dict.set_state_dict_type)
    get_state_dict_type = staticmethod(_state_dict.get_state_dict_type)

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict | None = None,
                         group: Any = None) -> dict:
        from ._optim import optim_state_dict
        return optim_state_dict(model, optim, optim_state_dict)

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict,
                                 is_named_optimizer: bool = False, load_directly: bool = False,
                                 group: Any = None) -> dict:
        from ._optim import optim_state_dict_to_load
        out = optim_state_dict_to_load(model, optim, optim_state_dict)
        if load_directly:
            optim.load_state_dict(out)
        return out


# -- construction helpers --------------------------------------------------------------
def _unit_kwargs(kw: dict) -> dict:
    unknown = sorted(set(kw) - set(_KWARGS))
    if unknown:
        raise TypeError(f"FullyShardedDataParallel: unexpected arguments {unknown} from the auto-wrap policy")
    return {k: kw.get(k) for k in _KWARGS}


def _ignored(module: nn.Module, ignored_modules: Any, ignored_states: Any) -> tuple[set, set]:
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("FullyShardedDataParallel: pass ignored_modules or ignored_states, not both")
    mods: set = set()
    params: set = set()
    for item in list(ignored_modules or ()) + list(ignored_states or ()):
        if isinstance(item, FullyShardedDataParallel):
            raise ValueError("FullyShardedDataParallel: ignored_modules must not contain FSDP instances")
        if isinstance(item, nn.Module):
            mods.update(item.modules())
            params.update(item.parameters())
        elif isinstance(item, nn.Parameter):
            params.add(item)
        else:
            raise TypeError(f"FullyShardedDataParallel: ignored_states holds {type(item).__name__}; "
                            f"give modules or parameters")
    return mods, params


def _parents(module: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    out: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, child in m._modules.items():
            if child is not None:
                out.setdefault(id(child), []).append((m, name))
    return out


def _own_modules(module: nn.Module, ignored_params: set) -> Iterator[nn.Module]:
    """``module`` and its submodules not inside an inner FSDP1 unit."""
    yield module
    for child in module.children():
        if not isinstance(child, (FullyShardedDataParallel, FSDPModule)):
            yield from _own_modules(child, ignored_params)


def _device_of(device_id: Any, mesh) -> torch.device:
    if device_id is None:
        return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    return torch.device(device_id)


def _materialize(module: nn.Module, param_init_fn: Any, device: torch.device, ignored_params: set) -> None:
    """Meta-device modules of this unit: ``param_init_fn(m)`` on each of them (torch's
    rule), else ``to_empty`` on ``device`` and ``reset_parameters()``."""
    own = list(_own_modules(module, ignored_params))

    def is_meta(m: nn.Module) -> bool:
        return any(t.is_meta for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))

    if not any(is_meta(m) for m in own):
        return
    for m in own:
        if param_init_fn is not None:
            param_init_fn(m)
        elif is_meta(m):
            m.to_empty(device=device, recurse=False)
            if hasattr(m, "reset_parameters"):
                with torch.no_grad():
                    m.reset_parameters()


def _broadcast_states(module: nn.Module, mesh, ignored_params: set) -> None:
    """``sync_module_states``: every data-parallel rank takes rank 0's parameters and
    buffers (over the shard axis, then the replicate axis)."""
    from .._dtensor import local_of

    tensors = [local_of(p) for m in _own_modules(module, ignored_params) for p in m.parameters(recurse=False)
               if p not in ignored_params] + \
              [b for m in _own_modules(module, ignored_params) for b in m.buffers(recurse=False)]
    with torch.no_grad():
        for axis in reversed(range(mesh.ndim)):
            group = mesh.get_group(axis)
            if group.size() > 1:
                for t in tensors:
                    dist.broadcast(t, group_src=0, group=group)


def _cast_buffers(module: nn.Module, dtype: torch.dtype | None) -> dict[tuple[int, str], torch.dtype]:
    """MixedPrecision.buffer_dtype: this unit's floating buffers in that dtype (state
    dicts give them back in their own dtype)."""
    out: dict[tuple[int, str], torch.dtype] = {}
    if dtype is None:
        return out
    for m in _own_modules(module, set()):
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                out[(id(m), name)] = b.dtype
                m._buffers[name] = b.to(dtype)
    return out


def _check_mp_modules(module: nn.Module, mp: MixedPrecision) -> None:
    classes = tuple(getattr(mp, "_module_classes_to_ignore", ()) or ())
    for name, m in module.named_modules():
        if classes and isinstance(m, classes):
            raise NotImplementedError(
                f"FullyShardedDataParallel: module {name or '<root>'} ({type(m).__name__}) is in "
                f"MixedPrecision._module_classes_to_ignore, which torch wraps separately in full precision; fsdp2d "
                f"does not. Wrap it yourself without mixed precision, or pass MixedPrecision(..., "
                f"_module_classes_to_ignore=()) to run it in param_dtype")


def _flat_param(group, mesh, what: str) -> nn.Parameter:
    """``use_orig_params=False``: the unit's flat storage as one DTensor Parameter,
    ``Shard(0)`` over the data axis (replicated over the replicate axis of HSDP)."""
    if any(p.tp is not None for p in group.params):
        raise NotImplementedError(
            f"FullyShardedDataParallel({what}): use_orig_params=False with tensor-parallel parameters is not "
            f"supported; pass use_orig_params=True, as torch's FSDP1 + TP recipe does")
    if len(group.flats) != 1:
        raise ValueError(f"FullyShardedDataParallel({what}): parameters of mixed dtypes cannot share one flat "
                         f"parameter; cast the module or pass use_orig_params=True")
    grads = {p.requires_grad for p in group.params}
    if len(grads) > 1:
        frozen = [p.fqn for p in group.params if not p.requires_grad][:4]
        raise ValueError(f"FullyShardedDataParallel({what}): some parameters require gradients and some "
                         f"({frozen}) do not; one flat parameter cannot mix them (as with torch). Pass "
                         f"use_orig_params=True or wrap the frozen ones in their own unit")
    flat = next(iter(group.flats.values()))
    tmesh = mesh.torch_mesh(mesh.mesh_dim_names)
    placements = (TReplicate(), TShard(0)) if mesh.ndim == 2 else (TShard(0),)
    shape = torch.Size([group.k * group.total])
    spec = DTensorSpec(tmesh, placements, TensorMeta(shape, (1,), flat.dtype))
    return nn.Parameter(as_dtensor(flat, spec), requires_grad=grads.pop())
