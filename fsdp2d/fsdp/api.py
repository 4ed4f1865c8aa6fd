"""``fully_shard``: FSDP on the data axis, per parameter along dim 0, composed with TP.

Apply bottom-up (each transformer block, then the root) after ``parallelize_module``:
each call groups the parameters of its module that no inner ``fully_shard`` already
manages, chunks every (TP-local) parameter along dim 0 over the mesh's shard axis, and
turns the module into an :class:`FSDPModule` (its class is swapped for a subclass, as
in torch; fsdp2d's ``FSDPModule`` is a subclass of torch's, see :mod:`._module`).
Parameters at rest are DTensor shards; their 2D layouts (TP-major) are available from
:func:`fsdp_params`.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ..bridge.extensions import layout_of_spec
from ..mesh import DeviceMesh, axis_names, joined
from ..tensor_parallel._params import TPParam, tp_params
from ._group import FSDPParamGroup
from ._policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._module import FSDPModule, UnshardHandle, fsdp_class
from ._param import FSDPParam
from ._state import FSDPState
from ._summon import summon_full_params
from ._torch_state import plant, state_view

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "fsdp_params", "summon_full_params"]


def _world_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("fully_shard without mesh= needs torch.distributed initialised; pass mesh=mesh['dp']")
    world_group = dist.group.WORLD
    if _WORLD_MESH and _WORLD_MESH[0] is world_group:
        return _WORLD_MESH[1]  # one mesh per default group: every parameter of a model shares it
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = DeviceMesh.from_group(world_group, device, mesh_dim_names=("dp",))
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


def fully_shard(module: nn.Module | list[nn.Module], *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | None = None, shard_placement_fn: Callable | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(),
                ignored_params: set[nn.Parameter] | None = None, dp_mesh_dims: Any = None) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters along dim 0 over the data axis of ``mesh``.

    Args:
        module: apply to each block first, then to the root. A list of modules is one
            group (one all-gather), as in torch: e.g. ``fully_shard([model.norm,
            model.output])``. Tensor parallelism, if any, must already be applied, by
            fsdp2d's ``parallelize_module`` or by anyone's (torch's ``parallelize_module``,
            ``distribute_tensor``, torchtitan, transformers): a parameter that is a DTensor
            on a TP mesh is re-chunked along the data axis from its placements (TP-major,
            uneven sizes included), and its module's forward still sees a DTensor on the
            TP mesh, as its TP hooks expect.
        mesh: a torch ``DeviceMesh``, 1-D (``mesh["dp"]``: FSDP) or 2-D
            (``mesh["replicate", "shard"]``: HSDP, sharded within a replica group,
            gradients all-reduced across replicas), a slice of the same mesh as the TP
            mesh. Default: the whole world as one data axis.
        reshard_after_forward: free the unsharded parameters after forward and
            all-gather again in backward (less memory, one more all-gather per group).
            The root keeps them (they are needed first in backward). ``None`` (torch's
            default) is ``True``; an ``int`` (torch: reshard to a smaller group) raises
            NotImplementedError.
        shard_placement_fn: as torch's, called on each parameter; fsdp2d shards dim 0
            only, so it may return None or ``Shard(0)``; another dim raises
            NotImplementedError naming the parameter (an invalid one, torch's AssertionError).
        dp_mesh_dims: torch's SPMD-mesh mode; only None is supported (NotImplementedError).
        mp_policy: parameter / reduce / output dtypes (:class:`MixedPrecisionPolicy`).
        offload_policy: :class:`CPUOffloadPolicy` keeps shards on the CPU (CUDA runs).
        ignored_params: parameters to leave alone (as torch): not sharded, not moved,
            their gradients not reduced across ranks.

    Returns ``module``, now also an :class:`FSDPModule` (each module of a list).

    Example::

        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        optim = torch.optim.AdamW(model.parameters())  # after fully_shard

    Raises: ValueError for a module already fully sharded, a ``ModuleList``/``ModuleDict``
    (no forward to hook, as torch), a mesh that includes the TP axis or has more than 2
    axes, parameters on two different TP meshes, a TP placement fsdp2d cannot re-chunk
    (``Partial``, a ``_StridedShard`` that is not TP-major), and mixed parameter dtypes
    without ``param_dtype``; TypeError for a mesh that is not a torch ``DeviceMesh``.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    for m in modules:
        _check_shardable(m)
    chosen = reshard_after_forward is not None  # (None: the root keeps its parameters, see FSDPState)
    reshard_after_forward = _check_options(reshard_after_forward, dp_mesh_dims)
    mesh = mesh if mesh is not None else _world_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard got a {type(mesh).__module__}.{type(mesh).__name__} as mesh; pass a torch "
                        f"DeviceMesh (fsdp2d.init_device_mesh or torch's), e.g. mesh['dp']")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh!r}: a 1-D (shard) or 2-D "
                         f"(replicate, shard) mesh")
    if isinstance(offload_policy, CPUOffloadPolicy) and mesh.device_type == "cpu":
        warnings.warn("CPUOffloadPolicy on a CPU mesh: shards already live on the CPU; nothing to offload",
                      stacklevel=2)
    ignored = frozenset(id(p) for p in ignored_params or ())
    if shard_placement_fn is not None:
        _check_placements(modules, ignored, shard_placement_fn)
    params = _fsdp_params_of(modules, mesh, ignored)
    replicate = mesh.get_group(0) if mesh.ndim == 2 else None
    name = "+".join(type(m).__name__ for m in modules)
    group = FSDPParamGroup(params, mesh.get_group(mesh.ndim - 1), replicate, mp_policy, offload_policy,
                           name, _mesh_device(mesh)) if params else None
    if group is not None:
        group.reshard_after_forward, group.reshard_after_forward_chosen = reshard_after_forward, chosen
    state = FSDPState(modules, group, mp_policy)
    for p in params:
        p.module.__dict__.setdefault("_fsdp2d_fsdp_owner", state)
    for managed in _managed_modules(modules):  # as torch's, for torch.compile (and HF generate's synced_gpus)
        managed._is_fsdp_managed_module = True
        managed._fsdp_use_orig_params = True
    for m in modules:
        m.__dict__["_fsdp2d_fsdp"] = state
        plant(m, state)  # what fully_shard.state(m) and m._get_fsdp_state() return
        m.register_forward_pre_hook(state.pre_forward, prepend=True, with_kwargs=True)
        m.register_forward_hook(state.post_forward)
        m.__class__ = fsdp_class(type(m))
    return module


fully_shard.state = state_view  # torch's fully_shard.state(module) (the view of _torch_state), or None


class AlreadySharded(ValueError, AssertionError):
    """``fully_shard`` applied twice to one module: a ValueError (fsdp2d's refusals) that is
    also torch's type for it (an AssertionError from its composable-API contract)."""


def _managed_modules(modules: list[nn.Module]) -> Iterator[nn.Module]:
    """The modules of ``modules``' trees that no inner ``fully_shard`` manages (the ones
    torch marks ``_is_fsdp_managed_module``)."""
    stack = list(modules)
    while stack:
        m = stack.pop()
        yield m
        stack.extend(c for c in m.children() if not isinstance(c, FSDPModule))


def _check_options(reshard_after_forward: Any, dp_mesh_dims: Any) -> bool:
    """torch's keywords fsdp2d does not implement: refused, never ignored."""
    if dp_mesh_dims is not None:
        raise NotImplementedError("fully_shard(dp_mesh_dims=...) (torch's SPMD-mesh mode) is not supported by fsdp2d: "
                                  "apply TP on mesh['tp'] and pass mesh=mesh['dp']")
    if reshard_after_forward is None:
        return True
    if not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(f"fully_shard(reshard_after_forward={reshard_after_forward!r}): resharding to a "
                                  f"smaller group after forward is not supported by fsdp2d; pass True or False")
    return reshard_after_forward


def _check_placements(modules: list[nn.Module], ignored: frozenset[int], fn: Callable) -> None:
    """``shard_placement_fn``: fsdp2d shards dim 0, so None or ``Shard(0)`` only. Every
    placement's dim is checked first (torch's AssertionError for an invalid one)."""
    from torch.distributed.tensor import Shard

    dims = []
    for unit in modules:
        for fqn, owner, name in _managed(unit, "", ignored):
            param = owner._parameters[name]
            placement = fn(param)
            if placement is None:
                continue
            if not isinstance(placement, Shard):
                raise NotImplementedError(f"fully_shard: shard_placement_fn gave parameter {fqn!r} {placement!r}; "
                                          f"fsdp2d shards every parameter on one mesh, along dim 0")
            dim = placement.dim + param.ndim if placement.dim < 0 else placement.dim
            if not 0 <= dim < param.ndim:
                raise AssertionError(f"Shard dim {placement.dim} is invalid for {param.ndim}D tensor ({fqn!r})")
            dims.append((fqn, dim))
    for fqn, dim in dims:
        if dim != 0:
            raise NotImplementedError(f"fully_shard: shard_placement_fn gave parameter {fqn!r} Shard({dim}); "
                                      f"fsdp2d shards dim 0 only (return None or Shard(0))")


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's collectives on ``mesh`` run on (its current accelerator)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device()) if module.is_available() else \
        torch.device(mesh.device_type)  # a fake mesh of a machine without one (fsdp2d plan, tests)


def _check_shardable(module: nn.Module) -> None:
    if isinstance(module, FSDPModule):
        raise AlreadySharded(f"Each distinct composable distributed API can only be applied to a module once: "
                             f"fully_shard was already applied to this {type(module).__name__}")
    if isinstance(module, _TorchFSDPModule):
        raise ValueError(f"torch's fully_shard (or replicate) was already applied to this {type(module).__name__}; "
                         f"shard a model with one of them, fsdp2d's or torch's")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(f"fully_shard does not support containers that do not implement forward: "
                         f"{type(module).__name__}; shard each of its modules (e.g. every block), or pass them "
                         f"as one list, fully_shard(list(container))")


def _tp_of(owner: nn.Module, name: str, fqn: str) -> tuple[TPParam | None, DTensorSpec | None]:
    """A parameter's tensor-parallel layout and, for TP fsdp2d did not apply, the DTensor
    spec its module computes with: fsdp2d's own record, or the placements of a DTensor
    (torch's ``parallelize_module``, ``distribute_tensor``, torchtitan, transformers)."""
    record = getattr(owner, "_fsdp2d_tp", {}).get(name)
    if record is not None:
        return record, None
    param = owner._parameters[name]
    if not isinstance(param, DTensor):
        return None, None
    where = f"fully_shard: parameter {fqn!r}"
    if param.device_mesh.ndim != 1:
        raise NotImplementedError(f"{where} is a DTensor on the {param.device_mesh.ndim}-D mesh {param.device_mesh}; "
                                  f"fsdp2d re-chunks parameters tensor-parallel over one axis (a 1-D TP mesh)")
    layout = layout_of_spec(param.device_mesh, param.placements, tuple(param.shape), where)
    if any(p.is_partial() for p in layout.placements):
        raise ValueError(f"{where} is a DTensor with placements {param.placements}: a Partial parameter holds "
                         f"summands, not a shard FSDP can re-chunk; redistribute it to Replicate() first")
    return TPParam(layout, param.device_mesh), param._spec


def _fsdp_params_of(modules: list[nn.Module], mesh: DeviceMesh, ignored: frozenset[int] = frozenset()
                    ) -> list[FSDPParam]:
    """FSDP state for each parameter of ``modules`` not managed by an inner fully_shard,
    on one TP-first mesh. A tensor held by several modules (tied weights) is one FSDPParam
    that registers on all of them."""
    found = [(unit, fqn, owner, name) for unit in modules for fqn, owner, name in _managed(unit, "", ignored)]
    tps = [_tp_of(owner, name, fqn) for unit, fqn, owner, name in found]
    tp_mesh = _tp_mesh(modules, mesh, [(f[1], tp) for f, (tp, _) in zip(found, tps) if tp is not None])
    params: list[FSDPParam] = []
    by_id: dict[int, FSDPParam] = {}
    for (unit, fqn, owner, name), (tp, tp_spec) in zip(found, tps):
        current = owner._parameters[name]
        if id(current) in by_id:  # tied: the same tensor again
            by_id[id(current)].aliases.append((owner, name))
            continue
        param = FSDPParam(owner, name, fqn, tp, mesh, tp_mesh, tp_spec)
        param.unit = unit
        by_id[id(current)] = param
        params.append(param)
    for unit in modules:
        _check_ties_outside(unit, by_id)
    return params


def _tp_mesh(modules: list[nn.Module], mesh: DeviceMesh, tps: list[tuple[str, TPParam]]) -> DeviceMesh | None:
    """The one TP mesh of the tensor-parallel parameters under ``modules`` (those this
    group shards, fsdp2d's records, and inner groups'), checked against the FSDP mesh."""
    found: dict[DeviceMesh, str] = {}
    for fqn, tp in tps:
        found.setdefault(tp.mesh, fqn)
    for unit in modules:
        for fqn, info in tp_params(unit):
            found.setdefault(info.mesh, fqn)
        for inner in unit.modules():
            state = getattr(inner, "_fsdp2d_fsdp", None)
            for p in (state.group.params if state is not None and state.group is not None else ()):
                if p.tp is not None:
                    found.setdefault(p.tp.mesh, p.fqn)
    if len(found) > 1:
        (m1, f1), (m2, f2) = list(found.items())[:2]
        raise ValueError(f"fully_shard: parameters {f1!r} and {f2!r} are tensor-parallel on two meshes ({m1} and "
                         f"{m2}); fsdp2d shards one model over one TP mesh")
    if not found:
        return None
    tp_mesh, fqn = next(iter(found.items()))
    clash = sorted(set(axis_names(tp_mesh)) & set(axis_names(mesh)))
    if clash or tp_mesh == mesh:
        raise ValueError(
            f"fully_shard: mesh axis {(clash or axis_names(mesh))[0]!r} is the tensor-parallel axis of parameter "
            f"{fqn!r}; shard over the data axis only, e.g. fully_shard(module, mesh=mesh['dp'])")
    joined([tp_mesh, mesh])  # raises, naming both, unless they are slices of one mesh
    return tp_mesh


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
        if state is not None and state.group is not None and any(u is m for u in state.modules):
            state.group.sync_params()
            for p in state.group.params:
                if p.unit is m:  # fqns are relative to the module of a fully_shard list they came from
                    yield (f"{prefix}.{p.fqn}" if prefix else p.fqn), p
