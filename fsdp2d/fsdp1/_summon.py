"""``summon_full_params`` of FSDP1 units and torch's default communication hooks."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from .._dtensor import local_of
from ._state_dict import _tp_local, gather_data_axes, units

_LOCAL = threading.local()


def summon_depth() -> int:
    return getattr(_LOCAL, "summon", 0)


@contextlib.contextmanager
def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                       offload_to_cpu: bool = False, with_grads: bool = False) -> Iterator[None]:
    """The full (data-axis-unsharded) parameters of every FSDP1 unit under ``module``
    (``recurse=False``: of ``module`` alone) registered for reading or editing; a TP
    parameter is, as with torch, a DTensor on the tp mesh whose local tensor is its
    TP-local piece. On exit edits are written back to the shards (``writeback``).
    ``rank0_only``: only rank 0 gets them (no writeback). ``offload_to_cpu``: the full
    copies live on the CPU. ``with_grads``: their ``.grad`` is the full gradient too.

    A unit already being summoned cannot be summoned again (torch's rule): the nested call
    raises torch's AssertionError on every rank alike, before any collective. A child
    inside its parent's ``recurse=False`` summon is a different unit, and is allowed."""
    if rank0_only and writeback:
        raise NotImplementedError("summon_full_params: writeback=True with rank0_only=True is not supported "
                                  "(as with torch); pass writeback=False")
    found = units(module) if recurse else ([module] if "_fsdp1_group" in module.__dict__ else [])
    if not recurse and not found:
        raise ValueError("summon_full_params(recurse=False) needs a FullyShardedDataParallel unit")
    if any(u.__dict__.get("_fsdp1_summoning") for u in found):
        # the flags are the same on every rank, so every rank raises here, none gathers
        raise AssertionError("Cannot manually unshard parameters when already unsharding parameters")
    groups = [u._fsdp1_group for u in found if u._fsdp1_group is not None]
    keep = not rank0_only or dist.get_rank() == 0
    for g in groups:
        g.sync_params()
        g.reshard()
        grads = _full_grads(g) if with_grads else [None] * len(g.params)
        for p, full, grad in zip(g.params, g.gather_exact(), grads):
            if not keep:
                continue
            full, grad = [None if t is None else (t.cpu() if offload_to_cpu else t) for t in (full, grad)]
            if p.tp is not None:
                full, grad = [None if t is None else _tp_local(p, t) for t in (full, grad)]
            full = nn.Parameter(full, requires_grad=p.requires_grad)
            if grad is not None:
                full.grad = grad
            for owner, name in [(p.module, p.name), *p.aliases]:
                owner._parameters[name] = full
    _LOCAL.summon = summon_depth() + 1
    for u in found:
        u.__dict__["_fsdp1_summoning"] = True
    try:
        yield
    finally:
        _LOCAL.summon = summon_depth() - 1
        for u in found:
            u.__dict__["_fsdp1_summoning"] = False
        with torch.no_grad():
            for g in groups:
                for p in g.params:
                    if writeback and keep:
                        current = local_of(p.module._parameters[p.name])
                        local_of(p.sharded).copy_(p.shard_of(current.to(p.sharded.device)))
                    p.register("sharded")


def _full_grads(g) -> list[torch.Tensor | None]:
    """Each parameter's gradient unsharded over the data axis (None where it has none:
    the same on every rank, as the reduce decides it collectively)."""
    out = []
    flat_grad = g.flat_param.grad if g.flat_param is not None else None
    for p in g.params:
        if flat_grad is not None:
            local = p.shard_in(local_of(flat_grad))
        elif p.sharded.grad is not None:
            local = local_of(p.sharded.grad)
        else:
            out.append(None)
            continue
        out.append(gather_data_axes(p, local.contiguous()))
    return out


# -- communication hooks --------------------------------------------------------------------
def register_comm_hook(root: nn.Module, state: object, hook: Any) -> None:
    """torch's default FSDP1 hooks: ``allreduce_hook`` / ``reduce_scatter_hook`` are what
    fsdp2d does anyway; ``fp16_compress_hook`` / ``bf16_compress_hook`` reduce gradients
    in that dtype and give them back in the parameters' dtype. Other hooks raise."""
    from torch.distributed.algorithms._comm_hooks import default_hooks as D

    dtypes = {D.allreduce_hook: None, D.reduce_scatter_hook: None,
              D.fp16_compress_hook: torch.float16, D.bf16_compress_hook: torch.bfloat16}
    if hook not in dtypes:
        raise NotImplementedError(
            f"register_comm_hook: fsdp2d runs torch's default hooks (allreduce_hook, reduce_scatter_hook, "
            f"fp16_compress_hook, bf16_compress_hook) but not {getattr(hook, '__name__', hook)!r}; for low-"
            f"precision reduction use MixedPrecision(reduce_dtype=...)")
    if not root.check_is_root():
        raise AssertionError("register_comm_hook must be called on the root FSDP instance")
    for u in units(root):
        if u._fsdp1_mp is not None and dtypes[hook] is not None:
            raise NotImplementedError("register_comm_hook: a compression hook with MixedPrecision is not "
                                      "supported (as with torch); set MixedPrecision(reduce_dtype=...) instead")
        g = u._fsdp1_group
        if g is not None and dtypes[hook] is not None:
            g.reduce_dtype = dtypes[hook]
