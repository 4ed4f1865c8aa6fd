"""``fully_shard``: FSDP on the data axis, per parameter along dim 0, composed with TP.

Apply bottom-up (each transformer block, then the root) after ``parallelize_module``:
each call groups the parameters of its module that no inner ``fully_shard`` already
manages, chunks every (TP-local) parameter along dim 0 over the mesh's shard axis, and
turns the module into an :class:`FSDPModule` (its class is swapped for a subclass, as
in torch). Parameters at rest are plain ``nn.Parameter`` shards; their 2D layouts
(TP-major) are available from :func:`fsdp_params`.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from .._dtensor import local_of
from ..tensor_parallel._params import tp_params
from ..mesh import DeviceMesh
from ._group import FSDPParamGroup
from ._policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._param import FSDPParam
from ._state import FSDPState

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "fsdp_params", "summon_full_params"]


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the
    all-gather and registers the unsharded parameters on the module."""

    def __init__(self, state: FSDPState) -> None:
        self._state = state

    def wait(self) -> None:
        group = self._state.group
        if group is not None:
            group.wait_unshard()
            group.register_unsharded()


class FSDPModule:
    """Methods added to every module passed to :func:`fully_shard`."""

    _fsdp2d_fsdp: FSDPState

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        mods = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        return [m._fsdp2d_fsdp for m in mods if isinstance(m, FSDPModule)]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (e.g. to prefetch by hand)."""
        state = self._fsdp2d_fsdp
        if state.group is not None:
            state.group.sync_params()
            state.group.unshard(async_op=True)
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters and register the shards again."""
        if self._fsdp2d_fsdp.group is not None:
            self._fsdp2d_fsdp.group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps unsharded gradients (accumulating microbatches) and does
        not reduce-scatter; set True before the last microbatch to sync once."""
        for s in self._fsdp_states(recurse):
            if s.group is not None:
                s.group.requires_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        for s in self._fsdp_states(recurse):
            if s.group is not None:
                s.group.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for s in self._fsdp_states(recurse):
            if s.group is not None:
                s.group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """All-gather these modules' parameters when this module's forward starts."""
        self._fsdp2d_fsdp.forward_prefetch = [_state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """All-gather these modules' parameters when this module's backward starts."""
        self._fsdp2d_fsdp.backward_prefetch = [_state_of(m) for m in modules]

    def summon_full_params(self, writeback: bool = True) -> contextlib.AbstractContextManager:
        return summon_full_params(self, writeback=writeback)  # type: ignore[arg-type]


def _state_of(module: nn.Module) -> FSDPState:
    if not isinstance(module, FSDPModule):
        raise TypeError(f"{type(module).__name__} is not an FSDPModule: call fully_shard on it first")
    return module._fsdp2d_fsdp


_FSDP_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _FSDP_CLASSES[cls]


def _world_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("fully_shard without mesh= needs torch.distributed initialised; pass mesh=mesh['dp']")
    world_group = dist.group.WORLD
    if _WORLD_MESH and _WORLD_MESH[0] is world_group:
        return _WORLD_MESH[1]  # one mesh per default group: every parameter of a model shares it
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    world = dist.get_world_size()
    mesh = DeviceMesh(device, torch.arange(world, dtype=torch.int), ("dp",), [world_group], (dist.get_rank(),))
    _WORLD_MESH[:] = [world_group, mesh]
    return mesh


_WORLD_MESH: list = []  # [default group, its mesh] for fully_shard without mesh=


def _managed(module: nn.Module, prefix: str = "", ignored: frozenset[int] = frozenset()
             ) -> Iterator[tuple[str, nn.Module, str]]:
    """(fqn, owner module, name) of parameters not managed by an inner fully_shard (nor
    ignored: ids in ``ignored``)."""
    for name, p in module._parameters.items():
        if p is not None and id(p) not in ignored:
            yield (f"{prefix}{name}", module, name)
    for cname, child in module.named_children():
        if not isinstance(child, FSDPModule):
            yield from _managed(child, f"{prefix}{cname}.", ignored)


def fully_shard(module: nn.Module, *, mesh: DeviceMesh | None = None, reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(),
                ignored_params: set[nn.Parameter] | None = None) -> nn.Module:
    """Shard ``module``'s parameters along dim 0 over the data axis of ``mesh``.

    Args:
        module: apply to each block first, then to the root. Tensor parallelism, if
            any, must already be applied (``parallelize_module``).
        mesh: 1-D (``mesh["dp"]``: FSDP) or 2-D (``mesh["replicate", "shard"]``: HSDP,
            sharded within a replica group, gradients all-reduced across replicas).
            Default: the whole world as one data axis.
        reshard_after_forward: free the unsharded parameters after forward and
            all-gather again in backward (less memory, one more all-gather per group).
            The root keeps them (they are needed first in backward).
        mp_policy: parameter / reduce / output dtypes (:class:`MixedPrecisionPolicy`).
        offload_policy: :class:`CPUOffloadPolicy` keeps shards on the CPU (CUDA runs).
        ignored_params: parameters to leave alone (as torch): not sharded, not moved,
            their gradients not reduced across ranks.

    Returns ``module``, now also an :class:`FSDPModule`.

    Example::

        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        optim = torch.optim.AdamW(model.parameters())  # after fully_shard

    Raises: ValueError for a module already fully sharded, a mesh that includes the
    TP axis or has more than 2 axes, and mixed parameter dtypes without ``param_dtype``.
    """
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}; apply it once per module")
    mesh = mesh if mesh is not None else _world_mesh()
    if not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard needs a 1-D (shard) or 2-D (replicate, shard) fsdp2d mesh, got {mesh!r}")
    if isinstance(offload_policy, CPUOffloadPolicy) and mesh.device_type == "cpu":
        warnings.warn("CPUOffloadPolicy on a CPU mesh: shards already live on the CPU; nothing to offload",
                      stacklevel=2)
    ignored = frozenset(id(p) for p in ignored_params or ())
    params = _fsdp_params_of(module, mesh, ignored)
    replicate = mesh.get_group(0) if mesh.ndim == 2 else None
    group = FSDPParamGroup(params, mesh.get_group(mesh.ndim - 1), replicate, mp_policy, offload_policy,
                           type(module).__name__) if params else None
    if group is not None:
        group.reshard_after_forward = reshard_after_forward
    state = FSDPState(module, group, mp_policy)
    module.__dict__["_fsdp2d_fsdp"] = state
    for p in params:
        p.module.__dict__.setdefault("_fsdp2d_fsdp_owner", state)
    module.register_forward_pre_hook(state.pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(state.post_forward)
    module.__class__ = _fsdp_class(type(module))
    return module


def _fsdp_params_of(module: nn.Module, mesh: DeviceMesh, ignored: frozenset[int] = frozenset()) -> list[FSDPParam]:
    """FSDP state for each parameter of ``module`` not managed by an inner fully_shard,
    with the process group of every axis of its 2D layout. A tensor held by several
    modules (tied weights) is one FSDPParam that registers on all of them."""
    params: list[FSDPParam] = []
    by_id: dict[int, FSDPParam] = {}
    for fqn, info in tp_params(module):
        clash = sorted(set(info.mesh.mesh_dim_names) & set(mesh.mesh_dim_names))
        if clash:
            raise ValueError(
                f"fully_shard: mesh axis {clash[0]!r} is the tensor-parallel axis of parameter {fqn!r}; "
                f"shard over the data axis only, e.g. fully_shard(module, mesh=mesh['dp'])"
            )
    used = {info.mesh.mesh_dim_names[0] for _, info in tp_params(module)}
    tp_axes = tuple(a for a in mesh.root.mesh_dim_names if a in used)  # root order
    for fqn, owner, name in _managed(module, "", ignored):
        current = owner._parameters[name]
        if id(current) in by_id:  # tied: the same tensor again
            by_id[id(current)].aliases.append((owner, name))
            continue
        tp = getattr(owner, "_fsdp2d_tp", {}).get(name)
        param = FSDPParam(owner, name, fqn, tp, mesh, tp_axes)
        param.axis_groups = {n: mesh.root.get_group(n) for n in param.layout.axis_names}
        by_id[id(current)] = param
        params.append(param)
    _check_ties_outside(module, by_id)
    return params


def _check_ties_outside(module: nn.Module, by_id: dict[int, FSDPParam]) -> None:
    """A tensor this group shards must not also be held by a module an inner
    ``fully_shard`` manages: two groups would shard one tensor (torch unties it)."""
    for name, child in module.named_modules():
        state = getattr(child, "_fsdp2d_fsdp", None)
        if child is module or state is None or state.group is None:
            continue
        for p in state.group.params:
            original = p.original()
            mine = by_id.get(id(original)) if original is not None else None
            if mine is not None:
                raise ValueError(
                    f"fully_shard: parameter {mine.fqn!r} is the same tensor as {name}.{p.fqn} (tied weights), "
                    f"which an inner fully_shard already manages; do not fully_shard a module that holds only "
                    f"one of them, shard their common parent, so one group owns both")


def fsdp_params(model: nn.Module) -> Iterator[tuple[str, FSDPParam]]:
    """``(fqn, FSDPParam)`` for every FSDP-managed parameter of ``model``, fqn relative
    to ``model`` (``FSDPParam`` has ``layout``, ``sharded``, ``unsharded``). Parameters
    replaced since ``fully_shard`` (``to_empty()``) are adopted first, so ``sharded`` is
    the object the module and an optimizer built from ``model.parameters()`` hold."""
    for prefix, m in model.named_modules():
        state = getattr(m, "_fsdp2d_fsdp", None)
        if state is not None and state.module is m and state.group is not None:
            state.group.sync_params()
            for p in state.group.params:
                yield (f"{prefix}.{p.fqn}" if prefix else p.fqn), p


@contextlib.contextmanager
def summon_full_params(module: nn.Module, writeback: bool = True) -> Iterator[None]:
    """Register unsharded (over the data axis) parameters, in their own dtype, on every
    FSDP module under ``module`` for inspection or edits; on exit, what the modules then
    hold is written back to the shards (``writeback=True``) and the shards registered
    again. TP-sharded parameters stay TP-local (``fsdp2d.gather_full`` gives the global
    tensor). Do not run forward or backward inside. Collective over the data axis.
    """
    groups = [m._fsdp2d_fsdp.group for m in module.modules()
              if isinstance(m, FSDPModule) and m._fsdp2d_fsdp.group is not None]
    for g in groups:
        g.sync_params()
        g.reshard()
        for p, full in zip(g.params, g.gather_exact()):
            full = nn.Parameter(full, requires_grad=p.requires_grad)
            for owner, name in [(p.module, p.name), *p.aliases]:
                owner._parameters[name] = full
    try:
        yield
    finally:
        with torch.no_grad():
            for g in groups:
                for p in g.params:
                    if writeback:
                        local_of(p.sharded).copy_(p.shard_of(p.module._parameters[p.name]))
                    p.register("sharded")
