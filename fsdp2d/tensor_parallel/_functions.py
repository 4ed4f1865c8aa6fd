"""Tensor-parallel collectives as tiny autograd functions.

Each function is a forward/backward pair over one process group (the TP axis); all are
identities at group size 1. Activations stay plain tensors.

==========================  ===========================  ===========================
function                    forward                      backward
==========================  ===========================  ===========================
``copy_to_tp``              identity                     all-reduce (sum)
``reduce_from_tp``          all-reduce (sum)             identity
``gather_from_tp(dim)``     all-gather along dim         split (grad is complete)
``scatter_to_tp(dim)``      split along dim              all-gather
``reduce_scatter_to_tp``    reduce-scatter along dim     all-gather
==========================  ===========================  ===========================

**Sharing one backward reduction.** A column-wise layer sees its input replicated but
produces only a *partial* gradient for it (its slice of the output features), so the
gradient must be summed over TP. Layers that read the same tensor (q/k/v, gate/up)
would each all-reduce their own partial gradient; instead :func:`tp_input` wraps a
tensor once and caches the wrapper on it, so autograd sums the layers' partial
gradients first and one collective reduces them. When the input itself came from a
sequence-parallel all-gather, the partial gradients are reduce-scattered straight back
to the sequence shard (one reduce-scatter instead of an all-reduce plus a split), and
any other, complete, gradient of the gathered tensor is split as usual: both paths
add up in the shard's gradient, so mixing TP and replicated consumers stays exact.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from .. import _collectives as C

Group = C.Group


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.detach()  # an alias, not an autograd view: see tp_input

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad, ctx.group, inplace=False), None  # autograd may share grad with other nodes


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return C.all_reduce(x, group, inplace=False)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, global_size):
        ctx.dim, ctx.group = dim, group
        ctx.set_materialize_grads(False)
        return C.all_gather(x, dim, group, global_size)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:  # only partial-gradient consumers (see _PartialGradToShard)
            return None, None, None, None
        return C.split(grad, ctx.dim, ctx.group), None, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.global_size = dim, group, x.shape[dim]
        return C.split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather(grad, ctx.dim, ctx.group, ctx.global_size), None, None


class _ReduceScatterToTP(_ScatterToTP):
    """Same backward as ``_ScatterToTP`` (all-gather to the pre-split size)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.global_size = dim, group, x.shape[dim]
        return C.reduce_scatter(x, dim, group)


class _PartialGradToShard(torch.autograd.Function):
    """Forward: ``full`` unchanged. Backward: the (partial) gradient of ``full`` is
    reduce-scattered along ``dim`` and delivered to ``shard``, the tensor that was
    all-gathered into ``full``; nothing flows to ``full`` itself."""

    @staticmethod
    def forward(ctx, full, shard, dim, group):
        ctx.dim, ctx.group = dim, group
        return full.detach()  # an alias, not an autograd view: see tp_input

    @staticmethod
    def backward(ctx, grad):
        return None, C.reduce_scatter(grad, ctx.dim, ctx.group), None, None


def _identity_at_size_1(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def wrapper(x: torch.Tensor, *args: Any, group: Group, **kwargs: Any) -> torch.Tensor:
        if C.group_size(group) == 1:
            return x
        return fn(x, *args, group=group, **kwargs)

    wrapper.__name__, wrapper.__doc__ = fn.__name__, fn.__doc__
    return wrapper


@_identity_at_size_1
def copy_to_tp(x: torch.Tensor, *, group: Group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient in backward. Shape unchanged."""
    return _CopyToTP.apply(x, group)


@_identity_at_size_1
def reduce_from_tp(x: torch.Tensor, *, group: Group) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward. Partial -> Replicate."""
    return _ReduceFromTP.apply(x, group)


@_identity_at_size_1
def gather_from_tp(x: torch.Tensor, dim: int, *, group: Group, global_size: int | None = None) -> torch.Tensor:
    """All-gather along ``dim`` ((.., n/k, ..) -> (.., n, ..)); backward splits the
    (complete) gradient. Shard(dim) -> Replicate."""
    return _GatherFromTP.apply(x, dim, group, global_size)


@_identity_at_size_1
def scatter_to_tp(x: torch.Tensor, dim: int, *, group: Group) -> torch.Tensor:
    """Split along ``dim`` ((.., n, ..) -> (.., n/k, ..)); backward all-gathers.
    Replicate -> Shard(dim)."""
    return _ScatterToTP.apply(x, dim, group)


@_identity_at_size_1
def reduce_scatter_to_tp(x: torch.Tensor, dim: int, *, group: Group) -> torch.Tensor:
    """Reduce-scatter along ``dim`` ((.., n, ..) -> (.., n/k, ..)); backward all-gathers.
    Partial -> Shard(dim)."""
    return _ReduceScatterToTP.apply(x, dim, group)


def _version(x: torch.Tensor) -> int:
    """The version counter, or -1 for inference tensors (they have none)."""
    return -1 if x.is_inference() else x._version


def tp_input(x: torch.Tensor, *, group: Group) -> torch.Tensor:
    """The tensor a column-wise layer should consume for replicated input ``x``.

    Wraps ``x`` so that the partial gradients of all TP consumers are summed by one
    collective (see the module docstring), and caches the wrapper on ``x`` so that
    every layer reading ``x`` in this graph shares it. The cache is keyed on the group,
    grad mode and ``x``'s version counter, so an in-place edit or a no-grad pass never
    reuses a stale wrapper. ``x`` holds the wrapper strongly; the wrapper aliases ``x``'s
    storage without being an autograd view of it (no ``_base``), so nothing points back
    and no reference cycle forms: both go when the caller drops ``x``. (With a view,
    the cycle would run through C++ where Python's GC cannot see it, leaking the whole
    graph every step.) Consumers only read the wrapper; never modify it in place.
    """
    if C.group_size(group) == 1 or not torch.is_floating_point(x):
        return x
    key = (id(group), torch.is_grad_enabled(), x.requires_grad, _version(x))
    out = _cached(x, "_fsdp2d_tp_input", key)
    if out is not None:
        return out
    gathered = getattr(x, "_fsdp2d_gathered", None)
    shard = gathered[2]() if gathered is not None and gathered[0] is group else None
    if shard is not None:
        out = _PartialGradToShard.apply(x, shard, gathered[1], group)
    else:
        out = _CopyToTP.apply(x, group)
    x._fsdp2d_tp_input = (key, out)
    return out


def gather_cached(x: torch.Tensor, dim: int, *, group: Group, global_size: int | None = None) -> torch.Tensor:
    """``gather_from_tp`` shared by every consumer of ``x`` (one all-gather for q/k/v
    reading the same sequence shard); ``global_size`` for uneven pieces."""
    if C.group_size(group) == 1:
        return x
    key = (id(group), dim, global_size, torch.is_grad_enabled(), x.requires_grad, _version(x))
    out = _cached(x, "_fsdp2d_gather", key)
    if out is not None:
        return out
    out = gather_from_tp(x, dim, group=group, global_size=global_size)
    out._fsdp2d_gathered = (group, dim, weakref.ref(x))  # weak: x -> out is the strong link
    x._fsdp2d_gather = (key, out)
    return out


def _cached(x: torch.Tensor, attr: str, key: tuple) -> torch.Tensor | None:
    entry = getattr(x, attr, None)
    return entry[1] if entry is not None and entry[0] == key else None
