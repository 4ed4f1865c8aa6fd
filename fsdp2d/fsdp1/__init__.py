"""torch's FSDP1 API (``FullyShardedDataParallel``) on the fsdp2d engine.

An FSDP1 script runs by switching its imports::

    from fsdp2d.fsdp1 import FullyShardedDataParallel as FSDP, ShardingStrategy, MixedPrecision
    from fsdp2d.wrap import transformer_auto_wrap_policy

The configuration objects (``ShardingStrategy``, ``MixedPrecision``, ``CPUOffload``,
``BackwardPrefetch``, ``StateDictType`` and the state-dict configs) are torch's own, so
torch's and fsdp2d's are interchangeable. See :mod:`fsdp2d.fsdp1._wrapper` for how each
strategy maps onto ``fully_shard``, and the README's migration table for what is
supported.
"""

from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload, FullOptimStateDictConfig, FullStateDictConfig,
                                    LocalOptimStateDictConfig, LocalStateDictConfig, MixedPrecision,
                                    OptimStateDictConfig, ShardedOptimStateDictConfig, ShardedStateDictConfig,
                                    ShardingStrategy, StateDictConfig, StateDictSettings, StateDictType)

from ._wrapper import FullyShardedDataParallel

FSDP = FullyShardedDataParallel

__all__ = ["FullyShardedDataParallel", "FSDP", "ShardingStrategy", "MixedPrecision", "CPUOffload",
           "BackwardPrefetch", "StateDictType", "StateDictConfig", "FullStateDictConfig", "ShardedStateDictConfig",
           "LocalStateDictConfig", "OptimStateDictConfig", "FullOptimStateDictConfig", "ShardedOptimStateDictConfig",
           "LocalOptimStateDictConfig", "StateDictSettings"]
