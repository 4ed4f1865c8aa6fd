"""Parallel styles: what a module's parameters and boundary activations look like on TP.

A style knows layouts, not models. ``validate`` checks that it can apply to a module
(it runs for every module in a plan before any is changed, so a bad plan changes
nothing); ``apply`` replaces parameters by DTensors holding this rank's shard (recording
each one's :class:`~fsdp2d.placement.Layout`) and installs forward hooks that move the
activations between layouts with the collectives of ``_functions``.

Keywords and defaults follow ``torch.distributed.tensor.parallel`` with torch's
semantics: ``input_layouts`` describe plain inputs (a DTensor input brings its own
placement), ``output_layouts`` any layout torch accepts for the style, and
``use_local_output=False`` returns DTensor activations with global shapes (see
``_activations``). ``SequenceParallel`` and the ``PrepareModule*`` styles are in
``prepare.py``.
"""

from __future__ import annotations

import types
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import _collectives as C
from ..mesh import DeviceMesh
from ..placement import Partial, Placement, Replicate, Shard
from . import _functions as T
from ._activations import as_output, local_input, redistribute
from ._own_forward import dtensor_call, has_own_forward, own_forward
from ._params import shard_parameter

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel"]


class ParallelStyle:
    """Base class. Subclasses implement ``validate(module, fqn)`` and ``apply``."""

    src_data_rank: int | None = 0

    def validate(self, module: nn.Module, fqn: str) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def apply(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:  # pragma: no cover
        raise NotImplementedError

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        """``{parameter name: placement on the TP axis}`` this style gives ``module``'s own
        parameters (checked for ties before anything changes, then applied)."""
        return {}

    def _shard_params(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
        for name, placement in self.param_placements(module).items():
            if module._parameters.get(name) is not None:
                shard_parameter(module, name, placement, mesh, self.src_data_rank,
                                fqn=f"{fqn}.{name}" if fqn else name)

    def _require(self, module: nn.Module, fqn: str, types_: tuple[type, ...]) -> None:
        if not isinstance(module, types_):
            names = " or ".join(t.__name__ for t in types_)
            raise TypeError(
                f"{type(self).__name__} cannot apply to module {fqn or '<root>'!r} of type "
                f"{type(module).__name__}: it supports nn.{names}. Use another style or "
                f"change the plan's pattern so it does not match this module"
            )


def _one(layouts: Placement | Sequence[Placement] | None, default: Placement) -> Placement:
    if layouts is None:
        return default
    if isinstance(layouts, Placement):
        return layouts
    if len(layouts) != 1:
        raise ValueError(f"expected one layout, got {layouts}")
    return layouts[0]


class ColwiseParallel(ParallelStyle):
    """Column-wise: ``nn.Linear`` weight ``Shard(0)`` (out features) and bias ``Shard(0)``;
    ``nn.Embedding`` weight ``Shard(1)`` (embedding dim).

    Input ``input_layouts`` (default ``Replicate()``; ``Shard(1)`` = sequence parallel,
    all-gathered once per tensor and shared by every layer that reads it; embedding ids
    are gathered likewise). Output ``output_layouts``: ``Shard(-1)`` (default, the local
    columns), ``Replicate()`` (all-gathered) or ``Shard(d)`` (gathered, then split along
    ``d``). Layers reading the same replicated input share one backward reduction (see
    ``_functions.tp_input``). ``use_local_output=False``: the output is a DTensor.
    """

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        self.input_layout = _one(input_layouts, Replicate())
        self.output_layout = _one(output_layouts, Shard(-1))
        if isinstance(self.output_layout, Partial):
            raise ValueError(f"ColwiseParallel output_layouts must be Shard(d) or Replicate(), got "
                             f"{self.output_layout!r}: column-wise outputs are complete, never partial sums")
        self.use_local_output = use_local_output

    def validate(self, module: nn.Module, fqn: str) -> None:
        self._require(module, fqn, (nn.Linear, nn.Embedding))

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        if isinstance(module, nn.Linear):
            return {"weight": Shard(0), "bias": Shard(0)}
        return {"weight": Shard(1)}

    def apply(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:
        is_linear = isinstance(module, nn.Linear)
        self._shard_params(module, mesh, fqn)
        if is_linear and has_own_forward(module):  # run it as torch's TP does (see _own_forward)
            module._fsdp2d_own_forward = dtensor_call(mesh, {"weight": Shard(0), "bias": Shard(0)}, Replicate(),
                                                      Partial(), Shard(-1))
            module.forward = types.MethodType(own_forward, module)
        group, in_layout, out_layout = mesh.get_group(), self.input_layout, self.output_layout
        global_out, use_local = (module.out_features if is_linear else module.embedding_dim), self.use_local_output

        def pre(mod: nn.Module, args: tuple) -> tuple:
            x, src, size = local_input(args[0], in_layout, fqn)
            x = redistribute(x, src, Replicate(), group, size)
            if is_linear:
                x = T.tp_input(x, group=group)
            return (x, *args[1:])

        def post(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            last = isinstance(out_layout, Shard) and out_layout.dim % out.ndim == out.ndim - 1
            if last:
                out._fsdp2d_vocab = (group, global_out)  # read by loss_parallel()
            else:
                out = T.gather_from_tp(out, -1, group=group, global_size=global_out)
                out = redistribute(out, Replicate(), out_layout, group)
            return as_output(out, out_layout, mesh, use_local, global_out)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


class RowwiseParallel(ParallelStyle):
    """Row-wise: ``nn.Linear`` weight ``Shard(1)`` (in features), bias ``Replicate()``
    (added once, to the reduced output); ``nn.Embedding`` weight ``Shard(0)`` (vocab
    parallel: each rank looks up the ids in its vocab range, others give zeros).

    Input ``input_layouts`` (default ``Shard(-1)``, torch's, also for embedding ids:
    pass ``Replicate()`` for ids every rank holds; sharded ids are all-gathered first).
    Output ``output_layouts``: ``Replicate()`` (default, all-reduce), ``Shard(d)``
    (reduce-scatter, e.g. ``Shard(1)`` for sequence parallel) or ``Partial()`` (no
    reduction: the summands, with the bias on TP rank 0 only). ``use_local_output=False``:
    the output is a DTensor.
    """

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        self.input_layout = _one(input_layouts, Shard(-1))
        self.output_layout = _one(output_layouts, Replicate())
        self.use_local_output = use_local_output

    def validate(self, module: nn.Module, fqn: str) -> None:
        self._require(module, fqn, (nn.Linear, nn.Embedding))
        if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.sparse):
            raise TypeError(f"RowwiseParallel on {fqn!r}: nn.Embedding with max_norm or sparse=True is not supported")
        if isinstance(module, nn.Embedding) and has_own_forward(module):
            raise TypeError(f"RowwiseParallel on {fqn!r}: {type(module).__name__} overrides nn.Embedding.forward, "
                            f"which fsdp2d's vocab-parallel lookup would replace; use ColwiseParallel for it")

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        if isinstance(module, nn.Linear):
            return {"weight": Shard(1), "bias": Replicate()}
        return {"weight": Shard(0)}

    def apply(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:
        group, in_layout, out_layout = mesh.get_group(), self.input_layout, self.output_layout
        self._shard_params(module, mesh, fqn)
        is_linear = isinstance(module, nn.Linear)
        needed = Shard(-1) if is_linear else Replicate()

        def pre(mod: nn.Module, args: tuple) -> tuple:
            x, src, size = local_input(args[0], in_layout, fqn)
            return (redistribute(x, src, needed, group, size), *args[1:])

        def reduce(y: torch.Tensor) -> torch.Tensor:  # partial sums -> output layout
            return y if isinstance(out_layout, Partial) else redistribute(y, Partial(), out_layout, group)

        module._fsdp2d_reduce = reduce
        module._fsdp2d_bias = lambda b, ndim: _bias_for(b, out_layout, group, ndim)
        module._fsdp2d_output = lambda y: as_output(y, out_layout, mesh, self.use_local_output,
                                                    module.out_features if is_linear else module.embedding_dim)
        module.register_forward_pre_hook(pre)
        if is_linear and has_own_forward(module):  # run it as torch's TP does (see _own_forward)
            module._fsdp2d_own_forward = dtensor_call(mesh, {"weight": Shard(1), "bias": None}, Shard(-1), Shard(-1),
                                                      Replicate())
        module.forward = types.MethodType(_rowwise_linear_forward if is_linear else
                                          _vocab_parallel_embedding_forward, module)


def _bias_for(bias: torch.Tensor, out_layout: Placement, group, ndim: int) -> torch.Tensor | None:
    """The part of a replicated bias this rank adds to an ``ndim`` output laid out as
    ``out_layout``, with the backward that makes its gradient complete on every rank:
    all of it (Replicate); its feature shard (output sharded on the last dim: gradients
    all-gathered); all of it on a sequence shard (partial gradients, all-reduced); for a
    ``Partial()`` output, all of it on TP rank 0 and zeros elsewhere (summed once)."""
    if isinstance(out_layout, Replicate):
        return bias
    if isinstance(out_layout, Shard) and out_layout.dim % ndim == ndim - 1:
        return T.scatter_to_tp(bias, 0, group=group)
    bias = T.copy_to_tp(bias, group=group)
    return bias if not isinstance(out_layout, Partial) or C.group_rank(group) == 0 else bias.mul(0.0)


def _rowwise_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    own = self.__dict__.get("_fsdp2d_own_forward")
    if own is None:
        partial = F.linear(x, self.weight)
    else:  # a Linear subclass's own forward (torchao Float8Linear), on DTensors; the bias is added below
        partial = own(self, x)
    y = self._fsdp2d_reduce(partial)  # partial sums -> output layout
    bias = None if self.bias is None else self._fsdp2d_bias(self.bias, y.ndim)
    return self._fsdp2d_output(y if bias is None else y + bias)


def _vocab_parallel_embedding_forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    start = self._fsdp2d_tp["weight"].layout.global_offset[0]
    padding = self.padding_idx
    if padding is not None:
        padding = padding - start if start <= padding < start + self.weight.shape[0] else None
    partial = _VocabShardEmbedding.apply(ids, self.weight, start, padding)
    return self._fsdp2d_output(self._fsdp2d_reduce(partial))


def _local_ids(ids: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids owned by another rank, ids relative to this rank's rows with those set to 0)."""
    outside = (ids < start) | (ids >= start + rows)
    return outside, (ids - start).masked_fill(outside, 0)


class _VocabShardEmbedding(torch.autograd.Function):
    """Lookup in this rank's vocab rows ``[start, start + rows)``; other ids give zeros.
    Exactly ``F.embedding`` on the local ids, then zeroing the outside rows, but it saves
    only the caller's ``ids`` and recomputes the mask in backward, so no per-token
    tensor stays alive from forward to backward (it would be in every step's peak)."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, start: int, padding: int | None) -> torch.Tensor:
        outside, local = _local_ids(ids, start, weight.shape[0])
        ctx.save_for_backward(ids)
        ctx.start, ctx.rows, ctx.padding = start, weight.shape[0], padding
        return F.embedding(local, weight, padding).masked_fill_(outside.unsqueeze(-1), 0.0)  # (..., C)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.needs_input_grad[1]:
            return None, None, None, None
        (ids,) = ctx.saved_tensors
        outside, local = _local_ids(ids, ctx.start, ctx.rows)
        grad = grad.masked_fill(outside.unsqueeze(-1), 0.0)
        padding = -1 if ctx.padding is None else ctx.padding
        return None, torch.ops.aten.embedding_backward(grad, local, ctx.rows, padding, False, False), None, None
