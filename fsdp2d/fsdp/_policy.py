"""FSDP's policies: dtypes of collectives and compute, and where shards live."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for FSDP's collectives and compute (torch's ``MixedPrecisionPolicy``).

    param_dtype: dtype of the unsharded parameters (all-gather and compute); None keeps
        the sharded dtype. reduce_dtype: dtype of the gradient reduce-scatter; None uses
        param_dtype. output_dtype: cast forward outputs to it (None: leave).
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (the default)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and the optimizer step on the CPU while the
    module computes on CUDA. On CPU-only runs everything is on the CPU already, so this
    is a no-op. ``pin_memory`` pins the CPU shards for faster copies."""

    pin_memory: bool = True
