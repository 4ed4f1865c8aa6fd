"""Random initialisation of parameters that may be DTensors.

torch draws a DTensor's random values shard by shard with its RNG tracker only on
CUDA-like meshes. On a CPU mesh every rank draws its local shard from the same
generator state, so every shard of a TP- or FSDP-sharded weight comes out identical
(duplicated heads and rows; torch only warns, "DTensor random operators may not have
complete support on cpu device mesh"). There, :func:`init_` fills the whole tensor on
every rank (all ranks make the same draws) and keeps this rank's box: each shard is
different, and the weights equal a single process's initialisation with the same seed.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch.distributed.tensor import DTensor

from .._dtensor import layout_of, local_of


def _draws_per_shard(dt: DTensor) -> bool:
    """Whether torch's DTensor RNG gives each shard its own draws on ``dt``'s mesh."""
    handle = getattr(torch, dt.device_mesh.device_type, None)
    return dt.device_mesh.device_type != "cpu" and hasattr(handle, "set_rng_state")


def init_(param: torch.Tensor, fill: Callable[[torch.Tensor], object]) -> None:
    """Apply the in-place random init ``fill`` (e.g. ``nn.init.normal_``) to ``param``:
    directly, or on a CPU-mesh DTensor through its global tensor (see the module)."""
    if isinstance(param, DTensor) and not _draws_per_shard(param):
        full = torch.empty(param.shape, dtype=param.dtype, device=local_of(param).device)
        with torch.no_grad():
            fill(full)
            local_of(param).copy_(layout_of(param).shard(full))
        return
    fill(param)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Random draws inside come from ``torch.manual_seed(seed)`` (CPU and the current CUDA
    device, where torch's DTensor random ops draw too); the generators' states are restored
    after, so what follows does not depend on how much was drawn inside. Only the current
    device's state is saved: reading every visible device's would make each rank of an
    8-GPU node create a CUDA context on all 8 (torch's fork_rng warns of it)."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
