"""How a gradient sum over ranks is divided (torch FSDP2's ``_get_gradient_divide_factors``):
inside the collective where the backend can (NCCL ``AVG`` / ``PREMUL_SUM``, in float32
and bfloat16), around it otherwise (float16: a power of two near sqrt(N) before, the
rest after), or after it (``force_sum``, backends that cannot divide). Used by the
collectives of :mod:`fsdp2d._collectives` and the gradient reduction of ``fully_shard``
(``fsdp2d.fsdp._grads``)."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist

Group = dist.ProcessGroup


_BACKENDS: "weakref.WeakKeyDictionary[Group, str]" = weakref.WeakKeyDictionary()
DIVIDING_BACKENDS = ("nccl", "fake", "emulated")  # NCCL and what stands in for it: the fake group (`fsdp2d plan`,
# the scale probes) and fsdp2d.testing.emulated_pg (the GPU probe's P3), which divides as NCCL does


def _backend(group: Group) -> str:
    name = _BACKENDS.get(group)
    if name is None:
        try:
            name = str(dist.get_backend(group))
        except (ValueError, RuntimeError):  # not a registered group
            name = ""
        _BACKENDS[group] = name
    return name


@functools.lru_cache(maxsize=64)
def _premul_sum(factor: float) -> Any:
    return dist._make_nccl_premul_sum(factor)


@dataclasses.dataclass(frozen=True)
class Division:
    """How a sum of gradients over ranks is divided, as torch FSDP2's
    ``_get_gradient_divide_factors``: the input by ``pre`` before the (first) collective,
    the sum by ``within`` inside it where the backend can (:func:`reduce_op`; elsewhere
    right after it), then by ``post`` after the (last) collective. At most one of
    ``within`` and ``post`` is not 1. Split over a reduce-scatter and an all-reduce (HSDP),
    the first takes ``pre`` and ``within``, the second ``post``."""

    pre: float = 1.0
    within: float = 1.0
    post: float = 1.0

    @property
    def first(self) -> "Division":
        return Division(self.pre, self.within)

    @property
    def last(self) -> "Division":
        return Division(post=self.post)


def division(factor: float, dtype: torch.dtype, force_sum: bool = False) -> Division:
    """The :class:`Division` of a sum by ``factor`` in ``dtype`` (torch FSDP2's rule).
    float32 and bfloat16 have float32's range: divided inside the collective
    (``force_sum``: after it). Any other dtype (float16's range is 65504; float64, as
    torch) risks overflow in the sum and underflow in a division before it: divided by
    a power of two near ``sqrt(factor)`` before and the rest after (torch's loop, so the
    same numbers)."""
    if factor == 1.0:
        return Division()
    if dtype not in (torch.float32, torch.bfloat16):
        pre = 1
        while factor % pre == 0 and factor / pre > pre:
            pre *= 2
        return Division(pre=float(pre), post=factor / pre)
    return Division(post=factor) if force_sum else Division(within=factor)


def start_division(d: Division | None, group: Group, x: torch.Tensor) -> tuple[Any, float]:
    """Divide ``x`` by ``d.pre`` (in place); (the collective's op, the division after it)."""
    if d is None:
        return dist.ReduceOp.SUM, 1.0
    if d.pre != 1.0:
        x.div_(d.pre)
    op, after = reduce_op(group, d.within, x)
    return op, after * d.post  # (one of the two is 1: exact)


def after_sum(d: Division | None) -> float:
    """The division left after a plain sum (a transport that cannot divide)."""
    return 1.0 if d is None else d.within * d.post  # (one of the two is 1: exact)


def reduce_op(group: Group, divide: float, x: torch.Tensor) -> tuple[Any, float]:
    """(the reduce op, the division left after it) for a sum over ``group`` divided by
    ``divide``: NCCL divides inside the collective, as torch FSDP2 has it do, with
    ``AVG`` when ``divide`` is the group's size and ``PREMUL_SUM(1/divide)`` otherwise,
    in float32 and bfloat16 (other dtypes are divided around the collective, see
    :func:`division`). Elsewhere SUM and then a division (none at ``divide=1``)."""
    if divide == 1.0:
        return dist.ReduceOp.SUM, 1.0
    name = _backend(group)
    native = name in DIVIDING_BACKENDS or (x.is_cuda and "cuda:nccl" in name.split(","))
    if not native or x.dtype not in (torch.float32, torch.bfloat16):
        return dist.ReduceOp.SUM, divide
    if divide == group.size():
        return dist.ReduceOp.AVG, 1.0
    return _premul_sum(1.0 / divide), 1.0
