"""FSDP: ``fully_shard`` on the data axis of a mesh, composed with tensor parallelism."""

from ._policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .api import FSDPModule, UnshardHandle, fsdp_params, fully_shard, summon_full_params

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy",
           "CPUOffloadPolicy", "fsdp_params", "summon_full_params"]
