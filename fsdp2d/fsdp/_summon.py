"""``summon_full_params``: the unsharded parameters registered for inspection or edits."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from .._dtensor import local_of

__all__ = ["summon_full_params"]


@contextlib.contextmanager
def summon_full_params(module: nn.Module, writeback: bool = True) -> Iterator[None]:
    """Register unsharded (over the data axis) parameters, in their own dtype, on every
    FSDP module under ``module`` for inspection or edits; on exit, what the modules then
    hold is written back to the shards (``writeback=True``) and the shards registered
    again. TP-sharded parameters stay TP-local (``fsdp2d.gather_full`` gives the global
    tensor). Do not run forward or backward inside. Collective over the data axis.
    """
    states = [m.__dict__["_fsdp2d_fsdp"] for m in module.modules() if "_fsdp2d_fsdp" in m.__dict__]
    groups = list({id(s.group): s.group for s in states if s.group is not None}.values())  # one group may serve a list
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
