"""Deprecated: Hugging Face TP plans moved to :mod:`fsdp2d.hf` (``fsdp2d.plans.from_hf(m)`` is
``fsdp2d.hf.tp_plan(m)``). Kept one release so scripts written against the old name keep
working, with a FutureWarning naming the new one."""

import warnings

from .hf.tp import tp_plan

__all__ = ["from_hf"]


def from_hf(hf_model):
    warnings.warn("fsdp2d.plans.from_hf is deprecated: use fsdp2d.hf.tp_plan(hf_model)", FutureWarning,
                  stacklevel=2)
    return tp_plan(hf_model)
