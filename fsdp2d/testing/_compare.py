"""Helpers ``check_parallel`` and its checks of the test share: calling the model on a
batch, recording each module's outputs, and the relative error it compares with."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["call_model", "gathered", "capture", "rel_error"]


def call_model(model: torch.nn.Module, batch: Any, forward: Callable | None) -> Any:
    if forward is not None:
        return forward(model, batch)
    if isinstance(batch, dict):
        return model(**{k: v for k, v in batch.items() if k != "labels"})
    return model(batch)


def gathered(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).float()


def capture(model: torch.nn.Module, into: dict, gather: bool) -> list:
    """Forward hooks recording each module's first output of a step, in finishing order."""
    from torch.utils._pytree import tree_flatten

    def hook(name):
        def record(module, args, output):
            if name in into:  # a recompute (activation checkpointing) runs forward again
                return
            leaves = [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor) and x.is_floating_point()]
            into[name] = [gathered(x) if gather else x.detach().float() for x in leaves]
        return record

    return [m.register_forward_hook(hook(name)) for name, m in model.named_modules()]


def rel_error(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    scale = max(want.abs().max().item() if want.numel() else 0.0, floor, 1e-30)
    return (got - want).abs().max().item() / scale if want.numel() else 0.0
