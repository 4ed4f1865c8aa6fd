"""Count the collectives a piece of code issues, per process group and kind.

:class:`CollectiveCounter` is a ``TorchDispatchMode``: every ``torch.distributed``
entry point dispatches to a ``c10d::*`` op, so it sees what reaches the backend,
whichever library issued it (fsdp2d, torch's FSDP2, ``dist.*`` calls). It sees the
calls of the thread that enters it (gloo and NCCL do their transfers on their own
threads, but the ops are issued here).

Bytes are the *logical buffer* of a collective on one rank: all-reduce: the tensor;
all-gather: the gathered output; reduce-scatter: the unreduced input; broadcast, send,
recv: the tensor. fsdp2d's pairwise exchanges on gloo (see ``fsdp2d._collectives``)
move their data through shared memory or as ``send``/``recv`` ops tagged with their
kind: either way they report themselves when issued and are counted as the one
collective they implement, with the same logical bytes as the native op, so counts
and bytes do not depend on the transport or the backend's algorithm (their tagged
``send``/``recv`` ops are not counted again; nor are the few gloo collectives that set
up a group's shared-memory links, once per group). A user's own ``send`` with a tag in
fsdp2d's range, ``[1 << 24, 4 << 24)``, is not counted.

    from fsdp2d.debug import CollectiveCounter
    with CollectiveCounter() as counter:
        loss.backward()
    counter.count(mesh.get_group("dp"), "reduce_scatter")   # -> int
    counter.counts   # {(group name, kind): [count, bytes]}
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import _collectives, _shm
from ._collectives import EXCHANGE_KINDS

__all__ = ["CollectiveCounter", "OpCounter", "C10D_KINDS", "describe_c10d_op", "watch_exchanges",
           "watch_storage_resizes", "init_fake_world"]

# c10d op name -> (kind, index of the argument holding the logical buffer or None)
C10D_KINDS: dict[str, tuple[str, int | None]] = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0), "allgather_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0), "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1),
    "barrier": ("barrier", None), "send": ("send", 0), "recv_": ("recv", 0), "reduce_": ("reduce", 0),
    "gather_": ("gather", 1), "scatter_": ("scatter", 0),
}


def nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


def process_group(args: tuple) -> dist.ProcessGroup | None:
    """The ProcessGroup among a c10d op's arguments (boxed as a ScriptObject)."""
    for a in args:
        if isinstance(a, torch.ScriptObject) and a._type().qualified_name().endswith("c10d.ProcessGroup"):
            return dist.ProcessGroup.unbox(a)
    return None


def describe_c10d_op(func, args: tuple) -> tuple[dist.ProcessGroup | None, str, int] | None:
    """(group, kind, logical bytes) of one c10d op; None if it is not a collective, is a
    message of a pairwise exchange (exchanges report themselves: :func:`watch_exchanges`)
    or sets up shared-memory links."""
    if func.namespace != "c10d" or _shm.internal_ops_active():
        return None
    name = func._schema.name.split("::")[-1]
    if name in ("send", "recv_") and args[-1] >> 24 in EXCHANGE_KINDS:
        return None
    kind, arg = C10D_KINDS.get(name, (name, 0))
    return process_group(args), kind, 0 if arg is None else nbytes(args[arg])


class watch_exchanges:
    """Context manager: calls ``fn(group, kind, logical bytes)`` for every pairwise
    exchange the entering thread issues while active."""

    def __init__(self, fn) -> None:
        thread = threading.get_ident()

        def observe(group: dist.ProcessGroup, kind: str, size: int) -> None:
            if threading.get_ident() == thread:
                fn(group, kind, size)

        self._observe = observe

    def __enter__(self) -> "watch_exchanges":
        _collectives._OBSERVERS.append(self._observe)
        return self

    def __exit__(self, *exc) -> None:
        _collectives._OBSERVERS.remove(self._observe)


class CollectiveCounter(TorchDispatchMode):
    """Counts c10d collectives while active: ``counts[(group name, kind)] = [count, bytes]``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[tuple[str, str], list[int]] = {}

    def count(self, group: dist.ProcessGroup, kind: str) -> int:
        return self.counts.get((group.group_name, kind), [0, 0])[0]

    def _add(self, group: dist.ProcessGroup | None, kind: str, size: int) -> None:
        entry = self.counts.setdefault((group.group_name if group is not None else "", kind), [0, 0])
        entry[0] += 1
        entry[1] += size

    def __enter__(self) -> "CollectiveCounter":
        self._watch = watch_exchanges(self._add)
        self._watch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._watch.__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        described = describe_c10d_op(func, args)
        if described is not None:
            self._add(*described)
        return func(*args, **(kwargs or {}))


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched while active, by op name (``aten.mm``, ``c10d.allreduce_``):
    on a GPU each is a kernel launch or a collective. ``counter.ops`` is a Counter."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class watch_storage_resizes:
    """Calls ``on_resize(storage)`` after every ``UntypedStorage.resize_`` while active:
    both fsdp2d's and torch's FSDP free and refill unsharded parameters this way, which a
    dispatch mode does not see. Used by the benchmark's and ``fsdp2d plan``'s memory
    trackers."""

    def __init__(self, on_resize) -> None:
        self.on_resize = on_resize

    def __enter__(self) -> "watch_storage_resizes":
        self._orig = orig = torch.UntypedStorage.resize_
        on_resize = self.on_resize

        def resize_(st, size):
            out = orig(st, size)
            on_resize(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        return self

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_ = self._orig


def init_fake_world(rank: int, world_size: int) -> None:
    """Initialise torch's fake process group as ``rank`` of ``world_size`` (one simulated
    rank of a big job: ``fsdp2d plan``, the scale probes). Several ranks simulated one
    after another in one process must not share torch's DTensor sharding-propagation
    cache: torch's meshes compare equal by value (every tp line of a mesh slices the
    same rank map), so a cached output spec from an earlier rank would carry that rank's
    mesh and process groups into this one. Destroy with ``dist.destroy_process_group()``."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _clear_sharding_prop_cache()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
