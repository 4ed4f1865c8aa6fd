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
from torch.utils._pytree import tree_map

from .. import wrap as _wrap
from ..clip import clip_grad_norm_ as _clip
from ..fsdp._policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ..fsdp.api import fully_shard
from ..tensor_parallel._params import tp_params
from . import _init, _mesh, _state_dict, _summon
from ._unit import Unit

# None: after forward every unit but the root reshards (FSDP1 keeps the root's parameters,
# which backward needs first; FSDP2's default does the same).
_RESHARD_AFTER_FORWARD = {
    ShardingStrategy.FULL_SHARD: None, ShardingStrategy.HYBRID_SHARD: None,
    ShardingStrategy.SHARD_GRAD_OP: False, ShardingStrategy._HYBRID_SHARD_ZERO2: False,
    ShardingStrategy.NO_SHARD: False,
}
_LOCAL = threading.local()  # .depth: FSDP1 forwards in progress (the outermost is the root's)


def _unsupported(name: str) -> Any:
    def method(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"FullyShardedDataParallel.{name} (deprecated in torch) is not supported by fsdp2d; save with "
            f"FSDP.optim_state_dict(model, optim) and load with optim.load_state_dict("
            f"FSDP.optim_state_dict_to_load(model, optim, osd))")
    return staticmethod(method)


class FullyShardedDataParallel(Unit):
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
        ignored_mods, ignored_params = _init.ignored(module, ignored_modules, ignored_states)
        parents = _init.parents(module)
        for child, child_kwargs in _wrap.targets(module, auto_wrap_policy, ignored_mods, ignored_params,
                                                 {**kwargs, "auto_wrap_policy": auto_wrap_policy}):
            unit = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
            nn.Module.__init__(unit)
            unit._setup(child, _init.unit_kwargs(child_kwargs), ignored_params, ignored_mods)
            for parent, name in parents.get(id(child), []):
                parent._modules[name] = unit
        self._setup(module, kwargs, ignored_params, ignored_mods)
        for m in self.modules():
            if isinstance(m, FullyShardedDataParallel) and m is not self:
                m.__dict__["_fsdp1_nested"] = True

    # -- construction ------------------------------------------------------------------
    def _setup(self, module: nn.Module, kw: dict, ignored_params: set, ignored_mods: set) -> None:
        strategy = kw["sharding_strategy"] or ShardingStrategy.FULL_SHARD
        if not isinstance(strategy, ShardingStrategy):
            raise TypeError(f"FullyShardedDataParallel: sharding_strategy must be a ShardingStrategy, got {strategy!r}")
        mp: MixedPrecision | None = kw["mixed_precision"]
        offload: CPUOffload | None = kw["cpu_offload"]
        has_tp = any(True for _ in tp_params(module))
        mesh = _mesh.mesh_for(strategy, kw["process_group"], kw["device_mesh"], has_tp)
        device = _init.device_of(kw["device_id"], mesh)
        _init.materialize(module, kw["param_init_fn"], device, ignored_mods)
        if device.type != "cpu" and any(p.device.type == "cpu" for p in module.parameters()):
            module.to(device)  # torch moves a CPU module to device_id
        if kw["sync_module_states"]:
            _init.broadcast_states(module, mesh, ignored_params)
        buffer_dtypes = _init.cast_buffers(module, mp.buffer_dtype if mp is not None else None)
        if mp is not None:
            _init.check_mp_modules(module, mp)
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
        if group is not None:  # torch FSDP1's no_sync sums unsharded gradients in param_dtype
            group.accumulate_in_compute_dtype = True
        if group is not None and mp is not None and mp.keep_low_precision_grads:
            group.grad_dtype = mp.param_dtype
        self._fsdp_wrapped_module = module
        self.__dict__.update(
            _fsdp1_strategy=strategy, _fsdp1_mp=mp, _fsdp1_offload=offload, _fsdp1_device=device, _fsdp1_mesh=mesh, _fsdp1_nested=False,
            _fsdp1_use_orig_params=bool(kw["use_orig_params"]), _fsdp1_buffer_dtypes=buffer_dtypes,
            _fsdp1_group=group, _fsdp1_settings=_state_dict.default_settings(),
            _fsdp1_given_mesh=kw["device_mesh"] is not None)
        if not kw["use_orig_params"] and group is not None:
            group.flat_param = _init.flat_param(group, mesh, type(module).__name__)
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
        summoned = _summon.summon_depth() > 0
        for name, p in super().named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate):
            if id(p) in flat_of:
                name, p = flat_of[id(p)]
                if id(p) in seen:
                    continue
                seen.add(id(p))
            if summoned:  # flat parameters too (rank0_only leaves them on the other ranks)
                name = name.replace("_fsdp_wrapped_module.", "")
            yield name, p

    # -- FSDP1 attributes ----------------------------------------------------------------
    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._fsdp1_strategy

    @property
    def mixed_precision(self) -> MixedPrecision:
        return self._fsdp1_mp if self._fsdp1_mp is not None else MixedPrecision()

    @property
    def cpu_offload(self) -> CPUOffload:
        return self._fsdp1_offload if self._fsdp1_offload is not None else CPUOffload()

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The group parameters are sharded over (the shard axis; the replicate axis of
        the hybrid strategies is ``_inter_node_pg``, as in torch)."""
        return self._fsdp1_mesh.get_group(self._fsdp1_mesh.ndim - 1)

    @property
    def _inter_node_pg(self) -> dist.ProcessGroup | None:
        return self._fsdp1_mesh.get_group(0) if self._fsdp1_mesh.ndim == 2 else None

    @property
    def rank(self) -> int:
        return self.process_group.rank()

    @property
    def world_size(self) -> int:
        return self.process_group.size()

    @property
    def compute_device(self) -> torch.device:
        return self._fsdp1_device

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
        if _summon.summon_depth():  # an outer unit's apply has summoned us already
            return super().apply(fn)
        with _summon.summon_full_params(self, recurse=True, writeback=True):
            super().apply(fn)
        return self

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside keeps unsharded gradients, summed in ``param_dtype`` (the
        compute dtype, whatever ``reduce_dtype``: torch FSDP1's semantics), and does not
        communicate; the first backward after it casts their sum to ``reduce_dtype`` and
        reduces it. Call on the root. docs/accumulation.md compares the dtypes."""
        if not self.check_is_root():
            raise RuntimeError("no_sync() on an inner FSDP instance is not supported; call it on the root")
        fsdp = self.fsdp_modules(self)
        units = [m.module for m in fsdp]
        # As torch: SHARD_GRAD_OP / _HYBRID_SHARD_ZERO2 units keep their parameters
        # unsharded through no_sync backwards (the next forward gathers nothing).
        keep = [m.module for m in fsdp if _RESHARD_AFTER_FORWARD[m._fsdp1_strategy] is False]
        for u in units:
            u.set_requires_gradient_sync(False, recurse=False)
        for u in keep:
            u.set_reshard_after_backward(False, recurse=False)
        try:
            yield
        finally:
            for u in units:
                u.set_requires_gradient_sync(True, recurse=False)
            for u in keep:
                u.set_reshard_after_backward(True, recurse=False)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every gradient of this model to a global ``norm_type``-norm of
        ``max_norm``; returns the norm before clipping (the same on every rank)."""
        if not self.check_is_root():
            raise RuntimeError("clip_grad_norm_ must be called on the root FSDP instance")
        return _clip(self.parameters(), max_norm, norm_type)

    def register_comm_hook(self, state: object, hook: Any) -> None:
        _summon.register_comm_hook(self, state, hook)

    summon_full_params = staticmethod(_summon.summon_full_params)
    state_dict_type = staticmethod(_state_dict.state_dict_type)
    set_state_dict_type = staticmethod(_state_dict.set_state_dict_type)
    get_state_dict_type = staticmethod(_state_dict.get_state_dict_type)

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict | None = None,
                         group: Any = None) -> dict:
        from . import _optim  # not `from ._optim import optim_state_dict`: that would shadow the argument
        return _optim.optim_state_dict(model, optim, optim_state_dict)

    @staticmethod
    def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_input: Any = None,
                              rank0_only: bool = True, group: Any = None) -> dict:
        """torch's older API: ``optim_state_dict`` under FULL_STATE_DICT (CPU tensors;
        ``rank0_only``: the other ranks get an empty dict)."""
        from torch.distributed.fsdp import FullOptimStateDictConfig, StateDictType

        from ._optim import optim_state_dict
        _no_optim_input(optim_input, "full_optim_state_dict")
        with _state_dict.state_dict_type(model, StateDictType.FULL_STATE_DICT, None,
                                         FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only)):
            return optim_state_dict(model, optim)

    @staticmethod
    def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, group: Any = None) -> dict:
        """torch's older API: ``optim_state_dict`` under SHARDED_STATE_DICT."""
        from ._optim import optim_state_dict
        with _state_dict.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            return optim_state_dict(model, optim)

    @staticmethod
    def shard_full_optim_state_dict(full_optim_state_dict: dict, model: nn.Module, optim_input: Any = None,
                                    optim: torch.optim.Optimizer | None = None) -> dict:
        _no_optim_input(optim_input, "shard_full_optim_state_dict")
        if optim is None:
            raise NotImplementedError("shard_full_optim_state_dict without optim= is not supported; pass optim=, "
                                      "or use FSDP.optim_state_dict_to_load(model, optim, osd)")
        from ._optim import optim_state_dict_to_load
        return optim_state_dict_to_load(model, optim, full_optim_state_dict)

    scatter_full_optim_state_dict = _unsupported("scatter_full_optim_state_dict")
    flatten_sharded_optim_state_dict = _unsupported("flatten_sharded_optim_state_dict")
    rekey_optim_state_dict = _unsupported("rekey_optim_state_dict")

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
def _no_optim_input(optim_input: Any, what: str) -> None:
    if optim_input is not None:
        raise NotImplementedError(f"{what}: optim_input (deprecated in torch) is not supported; pass the optimizer")
