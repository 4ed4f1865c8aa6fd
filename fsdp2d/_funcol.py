"""torch's functional collectives, for the calls torch's ``CommDebugMode`` watches.

torch's TP tests (and users) count collectives with ``CommDebugMode``, a dispatch mode
that sees ``torch.ops._c10d_functional`` ops (and ``c10d`` ops) but not fsdp2d's pairwise
exchanges, which issue no op. So while one is active, ``fsdp2d._collectives`` runs each
collective as the functional op on the same group instead (then ``wait_tensor``): the
mode counts it under torch's name (``c10d_functional.all_reduce`` ...), the result is the
same. :func:`watched` is the hot path's only cost: one C call when no dispatch mode is
active (measured in ``benchmarks/collective_watch.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_ops = torch.ops._c10d_functional
_REDUCE_NAME = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min",
                dist.ReduceOp.PRODUCT: "product", dist.ReduceOp.AVG: "avg"}
_dispatch_modes = torch._C._len_torch_dispatch_stack


def watched() -> bool:
    """Whether torch's ``CommDebugMode`` (or a subclass) is active on this thread."""
    if not _dispatch_modes():
        return False
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(m, CommDebugMode) for m in _get_current_dispatch_mode_stack())


class Done:
    """The handle of a collective that already completed."""

    def wait(self) -> bool:
        return True


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> Done:
    """``out`` (flat, k * inp.numel()) = every rank's ``inp`` in group-rank order."""
    got = _ops.wait_tensor(_ops.all_gather_into_tensor(inp.reshape(-1), group.size(), group.group_name))
    out.view(-1).copy_(got)
    return Done()


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> Done:
    """``out`` (flat) = the sum over ranks of chunk ``rank`` of ``inp`` (k * out.numel())."""
    got = _ops.wait_tensor(_ops.reduce_scatter_tensor(inp.reshape(-1), "sum", group.size(), group.group_name))
    out.view(-1).copy_(got)
    return Done()


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp) -> torch.Tensor:
    """A new tensor: ``op`` of ``x`` over the group."""
    if op not in _REDUCE_NAME:
        raise ValueError(f"all_reduce: {op} has no functional-collective form")
    return _ops.wait_tensor(_ops.all_reduce(x, _REDUCE_NAME[op], group.group_name))
