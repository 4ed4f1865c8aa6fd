"""Optimizers holding parameters that fsdp2d replaced: a loud error at their first step.

``parallelize_module`` and ``fully_shard`` replace a module's parameters by new DTensor
parameters (as torch's do). An optimizer built before them holds the old tensors, which
the model no longer uses: its steps would silently train nothing. The same goes for an
optimizer built from ``model.parameters()`` between a forward and its backward, when FSDP
modules hold their unsharded copies. Each replaced tensor
is marked, and a global optimizer step pre-hook checks every optimizer's parameters
once (again only when param groups are added): O(parameters) once, nothing per step.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["mark_replaced", "mark_transient"]

_CHECKED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()


def mark_replaced(old: torch.Tensor, fqn: str, by: str) -> None:
    """Record that the model no longer uses ``old`` (parameter ``fqn``), replaced by ``by``."""
    old._fsdp2d_replaced = f"{fqn!r} (replaced by {by})"


def mark_transient(t: torch.Tensor, fqn: str) -> None:
    """Record that ``t`` is FSDP's unsharded copy of parameter ``fqn``: the model shows it
    only between a forward and its backward, and an optimizer stepping it trains nothing."""
    t._fsdp2d_replaced = (f"{fqn!r} (FSDP's unsharded copy, which the model holds only between a forward and "
                          f"its backward: model.parameters() was called there)")


def _check(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    groups = len(optimizer.param_groups)
    if _CHECKED.get(optimizer) == groups:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            what = getattr(p, "_fsdp2d_replaced", None)
            if what is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step(): the optimizer holds parameter {what}, a tensor the "
                    f"model no longer uses, so this step would train nothing. Build the optimizer from "
                    f"model.parameters() after parallelize_module and fully_shard (and after to_empty() "
                    f"for a meta-device model)")
    _CHECKED[optimizer] = groups


register_optimizer_step_pre_hook(_check)
