"""Tensor parallelism: declarative plans of styles applied with ``parallelize_module``."""

from ._functions import copy_to_tp, gather_from_tp, reduce_from_tp, reduce_scatter_to_tp, scatter_to_tp
from ._params import TPParam, tp_params
from .api import parallelize_module
from .loss import loss_parallel, vocab_parallel_cross_entropy
from .prepare import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput, SequenceParallel
from .style import ColwiseParallel, ParallelStyle, RowwiseParallel

__all__ = [
    "parallelize_module", "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "loss_parallel", "vocab_parallel_cross_entropy",
    "TPParam", "tp_params", "copy_to_tp", "reduce_from_tp", "gather_from_tp", "scatter_to_tp",
    "reduce_scatter_to_tp",
]
