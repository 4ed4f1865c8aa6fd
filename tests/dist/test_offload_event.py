"""CPU offload: the copies between the host shards and the compute device run on the side
stream, never on the compute stream, in the order ``fsdp2d._streams`` states (issue 30
item 1); gradient copies are waited for once, at the end of backward, before an
optimizer can read them, and what they read is held until then.

This machine has no GPU, so the offload path is forced on CPU groups (``_offloading``)
and the streams are recorders: ``_streams.side_stream`` and ``current_stream`` return
fake streams that log their waits and events, and a dispatch mode notes which stream was
entered when each op ran. The offload copies are the ops that read a group's host shard
buffer (the flat storage) or write a host gradient buffer once it is made: every one
must run on the side stream, one per all-gather and one per group's reduction. The numbers must equal the
plain path's."""

import copy
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fsdp2d
from fsdp2d import _streams
from fsdp2d._dtensor import local_of

from . import _parity as P


class _Streams:
    """Fake streams ``side`` and ``current``: ``log`` gets (stream, what, other)."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.entered: list[str] = []
        self.groups: list = []
        streams = self

        class Stream:
            def __init__(self, name: str) -> None:
                self.name = name

            def __enter__(self):
                streams.entered.append(self.name)
                return self

            def __exit__(self, *exc):
                streams.entered.pop()

            def wait_stream(self, other) -> None:
                streams.log.append((self.name, "wait_stream", other.name))

            def wait_event(self, event) -> None:
                streams.log.append((self.name, "wait_event", event.stream))

            def record_event(self):
                return Event(self.name)

        class Event:
            def __init__(self, stream: str) -> None:
                self.stream = stream
                streams.log.append((stream, "record", None))

            def synchronize(self) -> None:
                # what the copies read (the reduced shards on the device) is still held
                held = [g.offload_event[1] for g in streams.groups
                        if g.offload_event is not None and g.offload_event[0] is self]
                alive = len(held) == 1 and isinstance(held[0], torch.Tensor) and held[0].numel() > 0
                streams.log.append((self.stream, "synchronize", "held" if alive else "released"))

        self.side, self.current = Stream("side"), Stream("current")


_NO_DATA = ("aten.set_", "aten.new_empty", "aten.empty", "aten.detach")  # views and allocations: no bytes move


class _Ops(TorchDispatchMode):
    """(op, stream entered, data pointers of its tensor arguments and results) per op."""

    def __init__(self, streams: _Streams) -> None:
        super().__init__()
        self.streams, self.ops = streams, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        moves_data = not (func.is_view or str(func.overloadpacket) in _NO_DATA)
        ptrs = [t.data_ptr() for t in tree_flatten((args, kwargs, out))[0]
                if moves_data and isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel()]
        made = out.data_ptr() if func.overloadpacket is torch.ops.aten.empty else None  # a fresh buffer
        self.ops.append((str(func.overloadpacket), (self.streams.entered or ["current"])[-1], ptrs, made))
        return out


def _ranges(tensors) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]


def _touches(ptrs: list[int], ranges: list[tuple[int, int]]) -> bool:
    return any(a <= p < b for p in ptrs for a, b in ranges)


def _offload_with_recorders(model) -> tuple[list, _Streams, tuple]:
    """Force the offload path on ``model``'s groups and put recorders in place of the
    streams; returns (groups, recorders, the real stream functions to put back)."""
    groups = list({id(m._fsdp2d_fsdp.group): m._fsdp2d_fsdp.group for m in model.modules()
                   if isinstance(m, fsdp2d.FSDPModule)}.values())
    for g in groups:
        g._offloading = lambda device: True
    streams = _Streams()
    streams.groups = groups
    real = _streams.side_stream, _streams.current_stream
    _streams.side_stream, _streams.current_stream = (lambda d: streams.side), (lambda d: streams.current)
    return groups, streams, real


def job_offload_streams() -> dict:
    torch.set_num_threads(1)
    s = P.Setup(model="llama", mesh=(4,), names=("dp",))
    plain = P.build("llama")
    offloaded = copy.deepcopy(plain)
    for model in (plain, offloaded):
        P.parallelize(model, s)
    groups, streams, real = _offload_with_recorders(offloaded)
    out = {"groups": len(groups)}
    try:
        x, y = P.batch_for(0, s)
        F.cross_entropy(plain(x[:2]).flatten(0, 1), y[:2].flatten()).backward()
        gathers = sum(g.counts["all_gather"] for g in groups)
        with _Ops(streams) as ops:
            F.cross_entropy(offloaded(x[:2]).flatten(0, 1), y[:2].flatten()).backward()
        out["gathers"] = sum(g.counts["all_gather"] for g in groups) - gathers
        out["log"] = streams.log[:]
        flats = _ranges(f for g in groups for f in g.flats.values())  # (made before: no other tensor there)
        out["h2d"] = [(op, where) for op, where, ptrs, _ in ops.ops if _touches(ptrs, flats)]
        out["d2h"] = []
        for g in groups:  # each group's host gradients: ops on its buffer once it was made
            [(start, end)] = _ranges([local_of(g.params[0].sharded.grad)])  # (the buffer's start)
            end = max(b for _, b in _ranges(local_of(p.sharded.grad) for p in g.params))
            made = max(i for i, op in enumerate(ops.ops) if op[3] == start)
            out["d2h"] += [(op, where) for op, where, ptrs, _ in ops.ops[made + 1:] if _touches(ptrs, [(start, end)])]
        out["pending"] = [g.fqn for g in groups if g.offload_event is not None]
        held = [weakref.ref(local_of(p.grad)) for p in offloaded.parameters()]
        # a second backward adds to the host gradients: each copy is waited for at once
        streams.log.clear()
        for model in (plain, offloaded):
            F.cross_entropy(model(x[:2]).flatten(0, 1), y[:2].flatten()).backward()
        log = streams.log
        out["accumulate_syncs"] = [(log[i - 1], e) for i, e in enumerate(log) if e[1] == "synchronize"]
        out["grads_kept"] = all(r() is not None for r in held)
    finally:
        _streams.side_stream, _streams.current_stream = real
    out["grad_err"] = max((a.grad - b.grad).abs().max().item()
                          for a, b in zip(plain.parameters(), offloaded.parameters()))
    return out


def test_offload_copies_run_on_the_side_stream(pool):
    for r in pool.run(job_offload_streams):
        n, gathers = r["groups"], r["gathers"]
        assert gathers > n  # forward and backward all-gathers (the blocks reshard after forward)
        # every op reading a host shard buffer is its one copy to the device, on the side stream
        assert r["h2d"] == [("aten.copy_", "side")] * gathers, r["h2d"]
        # every op writing a host gradient is its group's one copy to the host, on the side stream
        assert r["d2h"] == [("aten.copy_", "side")] * n, r["d2h"]
        log = r["log"]
        # each copy first waits for the compute stream (its buffer was allocated there)
        assert log.count(("side", "wait_stream", "current")) == gathers + n
        # the compute stream waits for each copy to the device before its copy-out
        assert log.count(("current", "wait_event", "side")) == gathers
        # gradient copies: all waited for once, at the end of backward, their sources held till then
        syncs = [e for e in log if e[1] == "synchronize"]
        assert syncs == [("side", "synchronize", "held")] * n, log
        assert log.index(syncs[0]) > max(i for i, e in enumerate(log) if e == ("side", "record", None))
        assert r["pending"] == []
        # accumulation: the CPU add reads the copy at once, so each is waited for right away
        assert r["accumulate_syncs"] == [(("side", "record", None), ("side", "synchronize", "held"))] * n
        assert r["grads_kept"]
        assert r["grad_err"] == 0.0


def job_offload_host_writes() -> dict:
    """What orders the host's writes to the host shards after the copies out of them:
    a gather dropped unused, and a forward that no backward follows."""
    from fsdp2d.fsdp import _unshard

    torch.set_num_threads(1)
    s = P.Setup(model="llama", mesh=(4,), names=("dp",))
    model = P.build("llama")
    P.parallelize(model, s)
    groups, streams, real = _offload_with_recorders(model)
    out = {"groups": len(groups)}
    try:
        x, y = P.batch_for(0, s)
        # a prefetch nobody waits for, dropped: its send buffer returns to the compute
        # stream's pool, so the compute stream must wait for the copy into it first
        model.layers[1].unshard(async_op=True)
        mark = len(streams.log)
        model.layers[1].reshard()
        out["drop"] = streams.log[mark - 1:]
        # a forward with no backward, then the host writes the shards: an optimizer step
        with torch.no_grad():
            model(x[:2])
        out["pending"] = len(getattr(_unshard, "_HOST_READS", "?"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        F.cross_entropy(model(x[:2]).flatten(0, 1), y[:2].flatten()).backward()
        out["pending_after_backward"] = len(getattr(_unshard, "_HOST_READS", "?"))  # backward's end waited for them
        with torch.no_grad():
            model(x[:2])
        mark = len(streams.log)
        opt.step()
        out["step"] = streams.log[mark:]
        with torch.no_grad():
            model(x[:2])
        mark = len(streams.log)
        model.load_state_dict(model.state_dict())
        out["load"] = streams.log[mark:]
        out["pending_end"] = len(getattr(_unshard, "_HOST_READS", "?"))
    finally:
        _streams.side_stream, _streams.current_stream = real
    return out


def test_host_writes_wait_for_the_copies_out_of_the_shards(pool):
    """Before the fix: a dropped gather left no wait (drop ended at its record), and after
    a forward with no backward nothing waited for its copies before an optimizer step or
    load_state_dict wrote the pinned shards."""
    for r in pool.run(job_offload_host_writes):
        n = r["groups"]
        assert r["drop"] == [("side", "record", None), ("current", "wait_event", "side")], r["drop"]
        assert r["pending"] == n and r["pending_after_backward"] == 0, r
        # each group's last copy out of its shards, waited for by the host before the step writes
        assert [e[:2] for e in r["step"]] == [("side", "synchronize")] * n, r["step"]
        assert [e[:2] for e in r["load"] if e[1] == "synchronize"] == [("side", "synchronize")] * n, r["load"]
        assert r["pending_end"] == 0
