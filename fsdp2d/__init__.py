"""fsdp2d: 2D parallelism for PyTorch (tensor parallel x fully sharded data parallel).

Build a mesh, ``parallelize_module`` on its TP axis, ``fully_shard`` on its data axis,
train; parameters at rest are torch DTensors (so torch's own tools read them), compute
is plain.
"""

from . import _exit  # noqa: F401  (frees fsdp2d's cycles, and their process groups, before exit teardown)
from .mesh import DeviceMesh, init_device_mesh
from .placement import Layout, Partial, Placement, Replicate, Shard
from .bridge import DTensorExtensions, LocalShard, from_dtensor, gather_full, to_dtensor
from .clip import clip_grad_norm_
from .fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, UnshardHandle,
                   fsdp_params, fully_shard, summon_full_params)
from .tensor_parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput,
                              PrepareModuleOutput, RowwiseParallel, SequenceParallel, loss_parallel,
                              parallelize_module, tp_params)

__all__ = [
    "init_device_mesh", "DeviceMesh", "Shard", "Replicate", "Partial", "Placement", "Layout",
    "parallelize_module", "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "loss_parallel", "tp_params",
    "fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "UnshardHandle",
    "fsdp_params", "summon_full_params", "DTensorExtensions", "LocalShard", "gather_full", "to_dtensor",
    "from_dtensor", "clip_grad_norm_",
]


def __getattr__(name: str):
    # The FSDP1 front end imports torch.distributed.fsdp (for its config objects): loaded
    # on first use, not with every `import fsdp2d`.
    if name == "FullyShardedDataParallel":
        from .fsdp1 import FullyShardedDataParallel
        return FullyShardedDataParallel
    if name in ("fsdp1", "wrap"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'fsdp2d' has no attribute {name!r}")
