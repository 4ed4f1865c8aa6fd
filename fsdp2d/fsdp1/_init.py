"""Construction helpers of :class:`~fsdp2d.fsdp1.FullyShardedDataParallel` units: which
modules are ignored, meta-device materialisation, ``sync_module_states``,
``MixedPrecision.buffer_dtype`` and the flat parameter of ``use_orig_params=False``."""

from __future__ import annotations

import collections
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.tensor import Replicate as TReplicate, Shard as TShard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .._dtensor import as_dtensor, local_of
from ..fsdp.api import FSDPModule

KWARGS = ("process_group", "sharding_strategy", "cpu_offload", "auto_wrap_policy", "backward_prefetch",
          "mixed_precision", "ignored_modules", "param_init_fn", "device_id", "sync_module_states",
          "forward_prefetch", "limit_all_gathers", "use_orig_params", "ignored_states", "device_mesh")


def _is_unit(m: nn.Module) -> bool:
    return "_fsdp1_group" in m.__dict__ or isinstance(m, FSDPModule)


def unit_kwargs(kw: dict) -> dict:
    unknown = sorted(set(kw) - set(KWARGS))
    if unknown:
        raise TypeError(f"FullyShardedDataParallel: unexpected arguments {unknown} from the auto-wrap policy")
    return {k: kw.get(k) for k in KWARGS}


def ignored(module: nn.Module, ignored_modules: Any, ignored_states: Any) -> tuple[set, set]:
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("FullyShardedDataParallel: pass ignored_modules or ignored_states, not both")
    mods: set = set()
    params: set = set()
    for item in list(ignored_modules or ()) + list(ignored_states or ()):
        if "_fsdp1_group" in item.__dict__:
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


def parents(module: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    out: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, child in m._modules.items():
            if child is not None:
                out.setdefault(id(child), []).append((m, name))
    return out


def own_modules(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` and its submodules not inside an inner FSDP1 unit."""
    yield module
    for child in module.children():
        if not _is_unit(child):
            yield from own_modules(child)


def device_of(device_id: Any, mesh) -> torch.device:
    if device_id is None:
        return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    return torch.device(device_id)


def materialize(module: nn.Module, param_init_fn: Any, device: torch.device, ignored_modules: set) -> None:
    """A unit with meta-device states is materialised as torch's FSDP1 does: its modules
    (breadth first, not inside inner units or ignored) each get ``param_init_fn(m)``, or
    without one, those holding parameters or buffers get ``to_empty(device)`` and
    ``reset_parameters()``, which must exist."""
    own, queue = [], collections.deque([module])
    while queue:
        m = queue.popleft()
        own.append(m)
        queue.extend(c for c in m.children() if not _is_unit(c) and c not in ignored_modules and c not in own)

    def states(m: nn.Module) -> list[torch.Tensor]:
        return [*m.parameters(recurse=False), *m.buffers(recurse=False)]

    if not any(t.is_meta for m in own for t in states(m)):
        return
    for m in own:
        if param_init_fn is not None:
            param_init_fn(m)
        elif states(m):
            reset = getattr(m, "reset_parameters", None)
            if reset is None:
                raise ValueError(f"FullyShardedDataParallel: a {type(m).__name__} of this meta-device module has no "
                                 f"reset_parameters() to initialise it after to_empty(); pass param_init_fn= (as "
                                 f"torch requires) or build the model on a real device")
            m.to_empty(device=device, recurse=False)
            with torch.no_grad():
                reset()


def broadcast_states(module: nn.Module, mesh, ignored_params: set) -> None:
    """``sync_module_states``: every data-parallel rank takes rank 0's parameters and
    buffers (over the shard axis, then the replicate axis)."""
    tensors = [local_of(p) for m in own_modules(module) for p in m.parameters(recurse=False)
               if p not in ignored_params] + \
              [b for m in own_modules(module) for b in m.buffers(recurse=False)]
    with torch.no_grad():
        for axis in reversed(range(mesh.ndim)):
            group = mesh.get_group(axis)
            if group.size() > 1:
                for t in tensors:
                    dist.broadcast(t, group_src=0, group=group)


def cast_buffers(module: nn.Module, dtype: torch.dtype | None) -> dict[tuple[int, str], torch.dtype]:
    """MixedPrecision.buffer_dtype: this unit's floating buffers in that dtype (state
    dicts give them back in their own dtype)."""
    out: dict[tuple[int, str], torch.dtype] = {}
    if dtype is None:
        return out
    for m in own_modules(module):
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                out[(id(m), name)] = b.dtype
                m._buffers[name] = b.to(dtype)
    return out


def check_mp_modules(module: nn.Module, mp: MixedPrecision) -> None:
    classes = tuple(getattr(mp, "_module_classes_to_ignore", ()) or ())
    for name, m in module.named_modules():
        if classes and isinstance(m, classes):
            raise NotImplementedError(
                f"FullyShardedDataParallel: module {name or '<root>'} ({type(m).__name__}) is in "
                f"MixedPrecision._module_classes_to_ignore, which torch wraps separately in full precision; fsdp2d "
                f"does not. Wrap it yourself without mixed precision, or pass MixedPrecision(..., "
                f"_module_classes_to_ignore=()) to run it in param_dtype")


def flat_param(group, mesh, what: str) -> nn.Parameter:
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
    tmesh = mesh
    placements = (TReplicate(), TShard(0)) if mesh.ndim == 2 else (TShard(0),)
    shape = torch.Size([group.k * group.total])
    spec = DTensorSpec(tmesh, placements, TensorMeta(shape, (1,), flat.dtype))
    return nn.Parameter(as_dtensor(flat, spec), requires_grad=grads.pop())
