"""Tensor-parallel styles for Hugging Face's ``Conv1D`` (GPT-2 and its relatives).

HF's ``Conv1D`` is a linear layer whose weight is stored transposed, ``(in, out)``
(``nx``, ``nf``), computing ``x @ W + b``. So column-wise means ``Shard(1)`` of the
weight (and ``Shard(0)`` of the bias), row-wise ``Shard(0)`` of the weight.

Fused projections: GPT-2's ``c_attn`` ``(C, 3C)`` holds q, k and v side by side. A plain
column split would give rank 0 all of q. ``ColwiseConv1D(fused=3)`` first views the
weight as ``(C, 3, C)`` (bias ``(3, C)``) and shards the last dim, so every rank holds
the same whole heads of q, k and v and its local output is ``[q_r | k_r | v_r]``
``(B, T, 3C/tp)``. That view is the parameter's shape from then on (state dicts and
fsdp2d checkpoints see ``(C, 3, C)``; HF export goes through fsdp2d's own models).
The attention module splits its fused output with ``split(self.split_size)``, a global
width: :class:`DivideAttributes` on the attention module makes it the local one.

Built on the same pieces as :mod:`.style` (``shard_parameter``, ``redistribute``, the
collectives of ``_functions``), so layouts, checkpoints and ``fully_shard`` treat these
parameters like any other tensor-parallel parameter.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ..mesh import DeviceMesh
from ..placement import Partial, Placement, Replicate, Shard
from ..tensor_parallel import _functions as T
from ..tensor_parallel._params import mark_partial_grads, shard_parameter
from ..tensor_parallel.style import ParallelStyle, RowwiseParallel, _one, redistribute

__all__ = ["ColwiseConv1D", "RowwiseConv1D", "DivideAttributes", "is_conv1d"]


def is_conv1d(module: nn.Module) -> bool:
    """HF's ``transformers.pytorch_utils.Conv1D``, recognised without importing transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def _require_conv1d(style: ParallelStyle, module: nn.Module, fqn: str) -> None:
    if not is_conv1d(module):
        raise TypeError(f"{type(style).__name__} cannot apply to module {fqn or '<root>'!r} of type "
                        f"{type(module).__name__}: it supports Hugging Face's Conv1D (use ColwiseParallel / "
                        f"RowwiseParallel for nn.Linear)")


def _view_param(module: nn.Module, name: str, shape: tuple[int, ...]) -> None:
    """Reshape ``module.<name>`` in place: the Parameter object (its identity, which
    ``shard_parameter`` may key ties on) stays, only its view changes."""
    p = module._parameters[name]
    p.data = p.data.view(shape)


def _conv1d_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x @ W + b`` on the local (possibly fused-view) shard: (..., in) -> (..., out_local)."""
    w = self.weight.flatten(1)  # (in_local, out_local)
    y = (x.reshape(-1, x.shape[-1]) @ w).view(*x.shape[:-1], -1)  # (..., out_local)
    if getattr(self, "_fsdp2d_reduce", None) is not None:
        y = self._fsdp2d_reduce(y)  # row-wise: partial sums -> output layout
    return y if self.bias is None else y + self.bias.flatten()


class ColwiseConv1D(ParallelStyle):
    """Column-wise ``Conv1D``: weight ``Shard(1)``, bias ``Shard(0)``; with ``fused=k``
    the output columns are ``k`` equal blocks (q, k, v) and each is split on its own.

    Input ``input_layouts`` (default ``Replicate()``; ``Shard(1)`` = sequence parallel).
    Output ``Shard(-1)`` (default) or, unfused only, ``Replicate()`` (all-gathered).
    """

    def __init__(self, *, fused: int = 1, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True) -> None:
        self.fused = fused
        self.input_layout = _one(input_layouts, Replicate())
        self.output_layout = _one(output_layouts, Shard(-1))
        if not (isinstance(self.output_layout, Replicate) or self.output_layout == Shard(-1)):
            raise ValueError(f"ColwiseConv1D output_layouts must be Shard(-1) or Replicate(), got {self.output_layout!r}")
        if fused > 1 and isinstance(self.output_layout, Replicate):
            raise ValueError("ColwiseConv1D(fused>1) keeps the output sharded: gathering would interleave the "
                             "blocks (q_0, k_0, v_0, q_1, ...); use output_layouts=Shard(-1)")
        self.use_local_output = use_local_output

    def validate(self, module: nn.Module, fqn: str) -> None:
        _require_conv1d(self, module, fqn)
        if module.nf % self.fused:
            raise ValueError(f"ColwiseConv1D(fused={self.fused}) on {fqn!r}: {module.nf} output features do not "
                             f"split into {self.fused} equal blocks")

    def apply(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:
        nx, nf, k = module.weight.shape[0], module.nf, self.fused
        if k > 1:
            _view_param(module, "weight", (nx, k, nf // k))
            if module.bias is not None:
                _view_param(module, "bias", (k, nf // k))
        shard_parameter(module, "weight", Shard(module.weight.ndim - 1), mesh, self.src_data_rank)
        if module.bias is not None:
            shard_parameter(module, "bias", Shard(module.bias.ndim - 1), mesh, self.src_data_rank)
        module.forward = types.MethodType(_conv1d_forward, module)
        group, in_layout, out_layout = mesh.get_group(), self.input_layout, self.output_layout
        module.register_forward_pre_hook(
            lambda mod, args: (T.tp_input(redistribute(args[0], in_layout, Replicate(), group), group=group),
                               *args[1:]))
        if isinstance(out_layout, Replicate):
            module.register_forward_hook(
                lambda mod, args, out: T.gather_from_tp(out, -1, group=group, global_size=nf))


class RowwiseConv1D(RowwiseParallel):
    """Row-wise ``Conv1D``: weight ``Shard(0)`` (in features), bias ``Replicate()`` added
    once after the reduction. Keywords as :class:`RowwiseParallel`: input ``Shard(-1)``
    (default) or ``Replicate()`` (split locally); output ``Replicate()`` (all-reduce,
    default) or ``Shard(d)`` (reduce-scatter)."""

    def validate(self, module: nn.Module, fqn: str) -> None:
        _require_conv1d(self, module, fqn)

    def apply(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:
        group, in_layout, out_layout = mesh.get_group(), self.input_layout, self.output_layout
        shard_parameter(module, "weight", Shard(0), mesh, self.src_data_rank)
        if module.bias is not None:
            shard_parameter(module, "bias", Replicate(), mesh, self.src_data_rank)
            if isinstance(out_layout, Shard):  # the bias meets sequence shards: partial gradients
                mark_partial_grads(module, ("bias",), group)
        module._fsdp2d_reduce = lambda y: redistribute(y, Partial(), out_layout, group)
        module.register_forward_pre_hook(
            lambda mod, args: (redistribute(args[0], in_layout, Shard(-1), group), *args[1:]))
        module.forward = types.MethodType(_conv1d_forward, module)


class DivideAttributes(ParallelStyle):
    """Divide integer attributes of a module by the TP size, so a forward written with
    global counts (GPT-2 attention's ``split_size``) works on local shards.

    Example: ``{"h.*.attn": DivideAttributes("split_size")}``. Raises ``ValueError``
    naming the attribute when it is missing, not an int, or not divisible.
    """

    def __init__(self, *names: str) -> None:
        if not names:
            raise ValueError("DivideAttributes needs at least one attribute name")
        self.names = names

    def validate(self, module: nn.Module, fqn: str) -> None:
        for name in self.names:
            if not isinstance(getattr(module, name, None), int):
                raise ValueError(f"DivideAttributes on {fqn!r}: {type(module).__name__}.{name} is not an int "
                                 f"attribute")

    def apply(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:
        for name in self.names:
            value, k = getattr(module, name), mesh.size()
            if value % k:
                raise ValueError(f"DivideAttributes on {fqn!r}: {name}={value} is not divisible by the TP size {k}")
            setattr(module, name, value // k)
