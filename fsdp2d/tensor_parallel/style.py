"""Parallel styles: what a module's parameters and boundary activations look like on TP.

A style knows layouts, not models. ``validate`` checks that it can apply to a module
(it runs for every module in a plan before any is changed, so a bad plan changes
nothing); ``apply`` replaces parameters by this rank's local shard (recording each
one's :class:`~fsdp2d.placement.Layout`) and installs forward hooks that move the
activations between layouts with the collectives of ``_functions``.

Keywords follow ``torch.distributed.tensor.parallel``. One documented difference:
activations are always plain local tensors, so ``use_local_output`` is accepted for
compatibility and has no effect.
"""

from __future__ import annotations

import types
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import _collectives as C
from ..mesh import DeviceMesh
from ..placement import Partial, Placement, Replicate, Shard
from . import _functions as T
from ._params import shard_parameter, mark_partial_grads

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
           "PrepareModuleInput", "PrepareModuleOutput"]


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

    def _shard_params(self, module: nn.Module, mesh: DeviceMesh) -> None:
        for name, placement in self.param_placements(module).items():
            if module._parameters.get(name) is not None:
                shard_parameter(module, name, placement, mesh, self.src_data_rank)

    def _require(self, module: nn.Module, fqn: str, types_: tuple[type, ...]) -> None:
        if not isinstance(module, types_):
            names = " or ".join(t.__name__ for t in types_)
            raise TypeError(
                f"{type(self).__name__} cannot apply to module {fqn or '<root>'!r} of type "
                f"{type(module).__name__}: it supports nn.{names}. Use another style or "
                f"change the plan's pattern so it does not match this module"
            )


def redistribute(x: Any, src: Placement | None, dst: Placement | None, group: C.Group) -> Any:
    """Move activation ``x`` from layout ``src`` to ``dst`` on the TP group.

    ``None`` on either side (or a non-tensor ``x``) leaves ``x`` alone. Supported moves:
    Shard->Replicate (all-gather), Replicate->Shard (split), Partial->Replicate
    (all-reduce), Partial->Shard (reduce-scatter), Shard(a)->Shard(a), and no-op moves.
    """
    if src is None or dst is None or not isinstance(x, torch.Tensor) or src == dst:
        return x
    dim = lambda p: p.dim % x.ndim  # noqa: E731
    k = C.group_size(group)
    # A sequence-style shard (any dim but the last, the feature dim) is gathered again
    # later without size information, so it must split evenly; feature dims may not.
    if isinstance(dst, Shard) and not isinstance(src, Shard) and dim(dst) != x.ndim - 1 and x.shape[dim(dst)] % k:
        raise ValueError(
            f"cannot shard an activation of shape {tuple(x.shape)} along dim {dim(dst)} over {k} TP ranks: "
            f"{x.shape[dim(dst)]} is not divisible by {k}. Sequence parallel needs a sequence length "
            f"divisible by the TP degree (pad the batch or change tp)"
        )
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return T.gather_cached(x, dim(src), group=group)
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return T.scatter_to_tp(x, dim(dst), group=group)
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        return T.reduce_from_tp(x, group=group)
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return T.reduce_scatter_to_tp(x, dim(dst), group=group)
    if isinstance(src, Shard) and isinstance(dst, Shard) and dim(src) == dim(dst):
        return x
    raise NotImplementedError(f"redistributing an activation from {src} to {dst} is not supported")


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
    all-gathered once per tensor and shared by every layer that reads it). Output
    ``Shard(-1)`` (default) or ``Replicate()`` (all-gathered). Layers reading the same
    replicated input share one backward reduction (see ``_functions.tp_input``).
    """

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        self.input_layout = _one(input_layouts, Replicate())
        self.output_layout = _one(output_layouts, Shard(-1))
        if not (isinstance(self.output_layout, Replicate) or
                (isinstance(self.output_layout, Shard) and self.output_layout.dim == -1)):
            raise ValueError(f"ColwiseParallel output_layouts must be Shard(-1) or Replicate(), got {self.output_layout}")
        self.use_local_output = use_local_output

    def validate(self, module: nn.Module, fqn: str) -> None:
        self._require(module, fqn, (nn.Linear, nn.Embedding))

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        if isinstance(module, nn.Linear):
            return {"weight": Shard(0), "bias": Shard(0)}
        return {"weight": Shard(1)}

    def apply(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:
        is_linear = isinstance(module, nn.Linear)
        self._shard_params(module, mesh)
        group, in_layout, out_layout = mesh.get_group(), self.input_layout, self.output_layout
        global_out = module.out_features if is_linear else module.embedding_dim

        def pre(mod: nn.Module, args: tuple) -> tuple:
            x = redistribute(args[0], in_layout, Replicate(), group)
            if is_linear:
                x = T.tp_input(x, group=group)
            return (x, *args[1:])

        def post(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            if isinstance(out_layout, Replicate):
                return T.gather_from_tp(out, -1, group=group, global_size=global_out)
            out._fsdp2d_vocab = (group, global_out)  # read by loss_parallel()
            return out

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


class RowwiseParallel(ParallelStyle):
    """Row-wise: ``nn.Linear`` weight ``Shard(1)`` (in features), bias ``Replicate()``
    (added once, after the reduction); ``nn.Embedding`` weight ``Shard(0)`` (vocab
    parallel: each rank looks up the ids in its vocab range, others give zeros).

    Input ``input_layouts`` (Linear default ``Shard(-1)``; ``Replicate()`` is split
    locally; Embedding ids are always replicated). Output ``Replicate()`` (default,
    all-reduce) or ``Shard(d)`` (reduce-scatter, e.g. ``Shard(1)`` for sequence parallel).
    """

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        self.input_layout = _one(input_layouts, Shard(-1))
        self.output_layout = _one(output_layouts, Replicate())
        if not isinstance(self.output_layout, (Replicate, Shard)):
            raise ValueError(f"RowwiseParallel output_layouts must be Replicate() or Shard(d), got {self.output_layout}")
        self.use_local_output = use_local_output

    def validate(self, module: nn.Module, fqn: str) -> None:
        self._require(module, fqn, (nn.Linear, nn.Embedding))
        if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.sparse):
            raise TypeError(f"RowwiseParallel on {fqn!r}: nn.Embedding with max_norm or sparse=True is not supported")

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        if isinstance(module, nn.Linear):
            return {"weight": Shard(1), "bias": Replicate()}
        return {"weight": Shard(0)}

    def apply(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:
        group, out_layout = mesh.get_group(), self.output_layout
        self._shard_params(module, mesh)
        if isinstance(module, nn.Linear):
            if module.bias is not None and isinstance(out_layout, Shard):  # bias meets sequence shards
                mark_partial_grads(module, ("bias",), group)  # partial grads
            in_layout = self.input_layout
            module.register_forward_pre_hook(
                lambda mod, args: (redistribute(args[0], in_layout, Shard(-1), group), *args[1:]))
            module.forward = types.MethodType(_rowwise_linear_forward, module)
        else:
            module.forward = types.MethodType(_vocab_parallel_embedding_forward, module)
        module._fsdp2d_reduce = lambda y: redistribute(y, Partial(), out_layout, group)


def _rowwise_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    y = self._fsdp2d_reduce(F.linear(x, self.weight))  # partial sums -> output layout
    return y if self.bias is None else y + self.bias


def _vocab_parallel_embedding_forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    start = self._fsdp2d_tp["weight"].layout.global_offset[0]
    padding = self.padding_idx
    if padding is not None:
        padding = padding - start if start <= padding < start + self.weight.shape[0] else None
    return self._fsdp2d_reduce(_VocabShardEmbedding.apply(ids, self.weight, start, padding))  # partial


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


class SequenceParallel(ParallelStyle):
    """For norms (and other replicated-parameter modules) on sequence-sharded activations.

    Parameters stay replicated; because each rank sees only its sequence shard, their
    gradients are partial and are summed over TP in backward. Input and output stay
    sharded along ``sequence_dim``.
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def validate(self, module: nn.Module, fqn: str) -> None:
        if next(module.parameters(recurse=False), None) is None:
            raise TypeError(f"SequenceParallel on {fqn or '<root>'!r}: the module has no parameters of its own "
                            f"(it applies to leaf modules such as norms); match the norm modules instead")

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        return {n: Replicate() for n, _ in module.named_parameters(recurse=False)}

    def apply(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:
        self._shard_params(module, mesh)
        mark_partial_grads(module, tuple(self.param_placements(module)), mesh.get_group())


def _as_tuple(layouts: Any) -> tuple:
    if layouts is None:
        return ()
    return tuple(layouts) if isinstance(layouts, (tuple, list)) else (layouts,)


class PrepareModuleInput(ParallelStyle):
    """Move a module's inputs from ``input_layouts`` to ``desired_input_layouts`` (one
    entry per positional input, ``None`` for non-tensors or inputs left alone); the
    same for keyword inputs with ``input_kwarg_layouts``/``desired_input_kwarg_layouts``.
    """

    def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                 input_kwarg_layouts: dict[str, Placement] | None = None,
                 desired_input_kwarg_layouts: dict[str, Placement] | None = None,
                 use_local_output: bool = False) -> None:
        self.input_layouts = _as_tuple(input_layouts)
        self.desired_input_layouts = _as_tuple(desired_input_layouts)
        if len(self.input_layouts) != len(self.desired_input_layouts):
            raise ValueError("PrepareModuleInput: input_layouts and desired_input_layouts need the same length")
        self.kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        if set(self.kwarg_layouts) != set(self.desired_kwarg_layouts):
            raise ValueError("PrepareModuleInput: input_kwarg_layouts and desired_input_kwarg_layouts need the same keys")
        self.use_local_output = use_local_output

    def validate(self, module: nn.Module, fqn: str) -> None:
        pass

    def apply(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:
        group = mesh.get_group()
        pairs = list(zip(self.input_layouts, self.desired_input_layouts))
        kw = {k: (self.kwarg_layouts[k], self.desired_kwarg_layouts[k]) for k in self.kwarg_layouts}

        def pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple:
            if len(args) < len(pairs):
                raise ValueError(f"PrepareModuleInput on {fqn!r}: expected {len(pairs)} positional inputs, got {len(args)}")
            args = tuple(redistribute(a, *pairs[i], group) if i < len(pairs) else a for i, a in enumerate(args))
            kwargs = {k: redistribute(v, *kw[k], group) if k in kw else v for k, v in kwargs.items()}
            return args, kwargs

        module.register_forward_pre_hook(pre, with_kwargs=True)


class PrepareModuleOutput(ParallelStyle):
    """Move a module's outputs from ``output_layouts`` to ``desired_output_layouts``
    (one entry per output when the module returns a tuple)."""

    def __init__(self, *, output_layouts: Any, desired_output_layouts: Any, use_local_output: bool = True) -> None:
        self.output_layouts = _as_tuple(output_layouts)
        self.desired_output_layouts = _as_tuple(desired_output_layouts)
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError("PrepareModuleOutput: output_layouts and desired_output_layouts need the same length")
        self.use_local_output = use_local_output

    def validate(self, module: nn.Module, fqn: str) -> None:
        pass

    def apply(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:
        group, pairs = mesh.get_group(), list(zip(self.output_layouts, self.desired_output_layouts))

        def post(mod: nn.Module, args: tuple, out: Any) -> Any:
            outs = out if isinstance(out, tuple) else (out,)
            if len(outs) != len(pairs):
                raise ValueError(f"PrepareModuleOutput on {fqn!r}: expected {len(pairs)} outputs, got {len(outs)}")
            moved = tuple(redistribute(o, *p, group) for o, p in zip(outs, pairs))
            return moved if isinstance(out, tuple) else moved[0]

        module.register_forward_hook(post)
