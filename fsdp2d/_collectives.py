"""Raw collectives along a tensor dim, shared by tensor parallelism and FSDP.

Every function takes an explicit process group and is a no-op (returns its input, or
the obvious local result) when the group has one rank, so world size 1 runs the same
code path. Sizes along the split dim follow ``torch.chunk`` semantics; when the global
size is given, uneven chunks are padded to equal size for the collective and trimmed
after, so callers never see the padding.

**Pairwise exchanges on gloo.** On CPU tensors over a gloo group of 2 to
``EXCHANGE_MAX_RANKS`` ranks, all-gather, reduce-scatter and the two-rank all-reduce
run as direct point-to-point exchanges (each rank sends its chunk to every peer)
instead of gloo's collective algorithms. Each rank sends the same bytes as a ring
would ((k-1)/k of the buffer; the whole tensor for a two-rank all-reduce), and a
reduction is one local sum per chunk, in group-rank order (so every rank computes
bit-identical results, equal to gloo's). Two transports carry the messages:

* **shared memory** (``fsdp2d._shm``), when every rank of the group is on this host
  (decided collectively at the group's first exchange; ``FSDP2D_SHM=0`` turns it off):
  the sender copies its chunk into a ring that the receiver maps and reads from
  directly, with 32-byte tokens on a Unix socket. Measured on the 2-core benchmark
  machine (4 ranks): a llama-medium training step's CPU per rank went from 219-226 ms
  to 181-197 ms, the step from 0.54-0.59x torch's time to 0.43-0.47x.
* **gloo point-to-point** (``isend``/``irecv``) otherwise: still cheaper than gloo's
  collectives (a 5.7 MB reduce-scatter 5-6 ms instead of 14-15 ms).

**Seen by torch's ``CommDebugMode``.** While a ``CommDebugMode`` is active (torch's TP
tests count collectives with it), every collective here runs as torch's functional
collective op instead (``_c10d_functional.all_reduce`` / ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` on the same group, then ``wait_tensor``), which the mode counts
under torch's names: same result, no pairwise exchange (``fsdp2d._funcol``). The hot path pays one C call
(is any dispatch mode active?): 0.1-0.36 us per collective, against 43-730 us for the
smallest one, a 2-rank all-reduce of one float: 0.05-0.22% of it, the spread being the
load on the shared 2-core machine (``benchmarks/collective_watch.py``, 7 runs).

NCCL and other backends use their native collectives. Messages carry the tag
``kind << 24 | sequence number`` (one counter per group, advanced by every exchange;
all ranks issue collectives in the same order), so concurrent exchanges on one group
never mix (see :data:`EXCHANGE_KINDS`). Exchanges report themselves to
``fsdp2d.debug`` (no c10d op is issued on the shared-memory path).

(Longer than the package's ~400-line aim on purpose: each collective's paths, shared
memory, pairwise gloo and the backend's own, sit side by side so that they stay
bit-identical and tagged alike; the transport itself is :mod:`fsdp2d._shm`.)
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import _funcol, _shm
from ._division import Division, after_sum, start_division
from .placement import chunk_range

Group = dist.ProcessGroup


def group_size(group: Group | None) -> int:
    return 1 if group is None else group.size()  # (cheaper than dist.get_world_size)


def group_rank(group: Group | None) -> int:
    return 0 if group is None else group.rank()


def chunk_sizes(global_size: int, num_chunks: int) -> list[int]:
    return [chunk_range(global_size, num_chunks, i)[1] for i in range(num_chunks)]


# -- pairwise exchanges (gloo, CPU) ----------------------------------------------------
EXCHANGE_MAX_RANKS = 8  # k-1 messages per rank per exchange: beyond this, gloo's ring wins
EXCHANGE_KINDS = {1: "all_gather", 2: "reduce_scatter", 3: "all_reduce", 4: "sizes"}  # tag >> 24
_SIZES = 4 << 24  # gloo point-to-point: each exchange's sizes go first (see _GlooPending)
_KIND_CODE = {v: k for k, v in EXCHANGE_KINDS.items()}
USE_SHM = True  # read when a group makes its first exchange (tests flip it; FSDP2D_SHM=0 also disables)

# Called as fn(group, kind, logical bytes) for every exchange issued (see fsdp2d.debug).
_OBSERVERS: list[Callable[[Group, str, int], None]] = []


class _Peers:
    """Per group: whether exchanges apply, this rank, the other ranks, the tag counter,
    and the shared-memory links when every rank is on this host."""

    def __init__(self, group: Group) -> None:
        try:  # "gloo", or "cpu:gloo,cuda:nccl" for a group with a backend per device
            backend = dist.get_backend(group)
        except (ValueError, RuntimeError):  # not a registered group (a fake or custom one)
            backend = ""
        gloo = backend == "gloo" or "cpu:gloo" in backend.split(",")
        self.k, self.me = group_size(group), group_rank(group)
        self.exchange = gloo and 2 <= self.k <= EXCHANGE_MAX_RANKS
        self.others = [j for j in range(self.k) if j != self.me]  # group ranks
        self.seq = 0
        # collective, and agreed: USE_SHM or FSDP2D_SHM off on any rank turns it off for all
        self.links = _shm.connect(group, enabled=USE_SHM) if self.exchange else None
        # (no reference to the group: this object is the group's value in a weak dict)

    def start(self, group: Group, kind: str, logical_bytes: int, sends: dict[int, torch.Tensor],
              into: dict[int, torch.Tensor | None], like: torch.Tensor) -> "_ShmPending | _GlooPending":
        """Send ``sends[j]`` to every peer j and receive one message of ``like``'s size and
        dtype from each (into ``into[j]``, or a buffer of the transport's shaped like
        ``like`` when None). Bytes are what counts: shapes need not match across ranks."""
        self.seq += 1
        tag = _KIND_CODE[kind] << 24 | self.seq % (1 << 24)
        for observe in _OBSERVERS:
            observe(group, kind, logical_bytes)
        if self.links is not None:
            for j, t in sends.items():
                self.links[j].send(tag, t)
            return _ShmPending(self.links, tag, into, like)
        return _GlooPending(group, tag, sends, into, like)


class _ShmPending:
    """Messages of one exchange over shared memory: sent already; received at wait()."""

    def __init__(self, links: "dict[int, _shm._Link]", tag: int, into: dict, like: torch.Tensor) -> None:
        self.links, self.tag, self.into, self.like = links, tag, into, like
        self.held: list[int] = []

    def wait(self) -> dict[int, torch.Tensor]:
        """Every peer's message: ``into[j]``, or a view into the peer's ring (read it
        before :meth:`release`). If one peer's message is bad, the others are still
        received and freed (the group stays in step), then the first error is raised."""
        got, error = {}, None
        try:
            for j, dest in self.into.items():
                try:
                    view = self.links[j].recv(self.tag, self.like.dtype, self.like.numel())
                except ValueError as e:  # size mismatch: that message is already dropped
                    error = error or e
                    continue
                if dest is None:
                    got[j] = view.view(self.like.shape)
                    self.held.append(j)
                else:
                    got[j] = dest.copy_(view.view(dest.shape))
                    self.links[j].release(self.tag)
        except BaseException:
            self.release()
            raise
        if error is not None:
            self.release()
            raise error
        return got

    def release(self) -> None:
        for j in self.held:
            self.links[j].release(self.tag)
        self.held = []


class _GlooPending:
    """Messages of one exchange as gloo ``isend``/``irecv`` pairs, all posted at once.

    gloo aborts the process (``EnforceNotMet``) when a message's size differs from the
    receive buffer's, so each pair first swaps (bytes I send you, bytes I expect from
    you): both ranks of a pair then see all four numbers and agree to skip that pair's
    data, and :meth:`wait` raises the shared-memory transport's ValueError once the good
    pairs are done (the group stays in step). One 16-byte message per peer, on this
    fallback transport only."""

    def __init__(self, group: Group, tag: int, sends: dict, into: dict, like: torch.Tensor) -> None:
        self.works, self.bufs, self.error = [], {}, None
        expect = like.numel() * like.element_size()
        bad = self._check_sizes(group, tag, {j: t.numel() * t.element_size() for j, t in sends.items()}, expect)
        for j, t in sends.items():
            if j not in bad:
                self.works.append(dist.isend(t, group=group, tag=tag, group_dst=j))
        for j, dest in into.items():
            buf = self.bufs[j] = torch.empty_like(like) if dest is None else dest
            if j not in bad:
                self.works.append(dist.irecv(buf, group=group, tag=tag, group_src=j))
        if bad:
            j, got = next(iter(bad.items()))
            where = f"group rank {j} of process group {getattr(group, 'group_name', '?')!r}"
            self.error = ValueError(f"fsdp2d: {where} sent {got} bytes for an exchange where this rank expects "
                                    f"{expect} ({like.numel()} x {like.dtype}): the ranks called the collective "
                                    "with different sizes")

    @staticmethod
    def _check_sizes(group: Group, tag: int, sending: dict[int, int], expect: int) -> dict[int, int]:
        """Peers whose pair disagrees on a size -> the bytes that peer sends here."""
        mine = {j: torch.tensor([n, expect], dtype=torch.int64) for j, n in sending.items()}
        theirs = {j: torch.empty(2, dtype=torch.int64) for j in sending}
        tag = _SIZES | tag & 0xFFFFFF  # the exchange's sequence number, kind "sizes"
        works = [dist.isend(t, group=group, tag=tag, group_dst=j) for j, t in mine.items()]
        works += [dist.irecv(t, group=group, tag=tag, group_src=j) for j, t in theirs.items()]
        for w in works:
            w.wait()
        return {j: int(theirs[j][0]) for j in sending
                if int(theirs[j][0]) != expect or sending[j] != int(theirs[j][1])}

    def wait(self) -> dict[int, torch.Tensor]:
        for w in self.works:
            w.wait()
        self.works = []
        if self.error is not None:
            raise self.error
        return self.bufs

    def release(self) -> None:
        pass


_PEERS: "weakref.WeakKeyDictionary[Group, _Peers]" = weakref.WeakKeyDictionary()


def _exchange_peers(group: Group, t: torch.Tensor) -> _Peers | None:
    """The group's exchange state when ``t`` goes by pairwise exchange, else None.
    A group's first call is collective (it may set up shared-memory links)."""
    if t.device.type != "cpu" or group_size(group) == 1:
        return None
    info = _PEERS.get(group)
    if info is None:
        info = _PEERS[group] = _Peers(group)
    return info if info.exchange else None


class Exchange:
    """Handle of a pending pairwise exchange, like the ``Work`` of an async collective:
    ``wait()`` receives the messages, then runs the local reduction (if any)."""

    def __init__(self, pending: "_ShmPending | _GlooPending",
                 finish: Callable[[dict[int, torch.Tensor]], None] | None = None) -> None:
        self._pending, self._finish = pending, finish

    def wait(self, consume: Callable[[dict[int, torch.Tensor]], None] | None = None) -> bool:
        """``consume``: called with the messages after the reduction (see
        :func:`all_gather_rows`); they are freed when it returns."""
        pending, self._pending = self._pending, None
        if pending is not None:
            parts = pending.wait()
            try:
                if self._finish is not None:
                    self._finish(parts)
                if consume is not None:
                    consume(parts)
            finally:
                pending.release()
        return True


def _check(full: torch.Tensor, piece: torch.Tensor, k: int, what: str) -> None:
    """``full`` must hold ``k`` pieces: same dtype, both contiguous."""
    if full.dtype != piece.dtype or full.numel() != k * piece.numel() or not (
            full.is_contiguous() and piece.is_contiguous()):
        raise ValueError(f"{what}: the tensors need the same dtype, be contiguous, and the larger hold "
                         f"{k} x the smaller; got {full.dtype} x {full.numel()} and {piece.dtype} x "
                         f"{piece.numel()}")


def _exchange_all_gather(out: torch.Tensor, inp: torch.Tensor, group: Group, info: _Peers) -> Exchange:
    n, me = inp.numel(), info.me
    _check(out, inp, info.k, "all_gather_into")
    out, inp = out.view(-1), inp.view(-1)  # only the bytes matter (as with gloo's collective)
    pending = info.start(group, "all_gather", out.numel() * out.element_size(), {j: inp for j in info.others},
                         {j: out[j * n:(j + 1) * n] for j in info.others}, inp)
    out[me * n:(me + 1) * n].copy_(inp)
    return Exchange(pending)


def all_gather_rows(inp: torch.Tensor, group: Group) -> Exchange | None:
    """An all-gather of ``inp`` over shared memory that gathers into nothing: the handle's
    ``wait(consume)`` calls ``consume({group rank: piece})`` with every rank's flat piece
    where it lies (this rank's ``inp``, the peers' in their rings; valid during the call
    only), so the caller copies each straight to its destination: one copy of the
    gathered bytes less than :func:`all_gather_into`, and no gathered buffer. ``wait()``
    alone drops the pieces. None where the exchange would not go over shared memory
    (another transport or backend, one rank, a ``CommDebugMode``): use
    :func:`all_gather_into` there. Counted and observed as an all-gather of
    ``k * inp`` bytes, as :func:`all_gather_into`."""
    if _funcol.watched():
        return None
    info = _exchange_peers(group, inp)
    if info is None or info.links is None:
        return None
    if not inp.is_contiguous():
        raise ValueError("all_gather_rows: the input must be contiguous")
    me, inp = info.me, inp.view(-1)
    pending = info.start(group, "all_gather", info.k * inp.numel() * inp.element_size(),
                         {j: inp for j in info.others}, dict.fromkeys(info.others), inp)
    return Exchange(pending, lambda parts: parts.__setitem__(me, inp))


def _exchange_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Group, info: _Peers,
                             after: float = 1.0) -> Exchange:
    n, me = out.numel(), info.me
    _check(inp, out, info.k, "reduce_scatter_into")
    out, inp = out.view(-1), inp.view(-1)
    pending = info.start(group, "reduce_scatter", inp.numel() * inp.element_size(),
                         {j: inp[j * n:(j + 1) * n] for j in info.others}, dict.fromkeys(info.others), out)

    def finish(parts: dict[int, torch.Tensor]) -> None:  # sum in group-rank order
        parts[me] = inp[me * n:(me + 1) * n]
        torch.add(parts[0], parts[1], out=out)
        for j in range(2, info.k):
            out.add_(parts[j])
        if after != 1.0:
            out.div_(after)

    return Exchange(pending, finish)


def _exchange_all_reduce(x: torch.Tensor, group: Group, info: _Peers, inplace: bool) -> torch.Tensor:
    """Two ranks: swap the whole tensor, then ``rank0's + rank1's`` on both (into ``x``
    when ``inplace``): the same operands in the same order, so the same bits."""
    [peer] = info.others
    pending = info.start(group, "all_reduce", x.numel() * x.element_size(), {peer: x}, {peer: None}, x)
    other = pending.wait()[peer]  # x is no longer needed by the transport: sent or copied
    try:
        if not inplace:  # (out= would not be differentiable)
            return torch.add(x, other) if info.me == 0 else torch.add(other, x)
        return torch.add(x, other, out=x) if info.me == 0 else torch.add(other, x, out=x)
    finally:
        pending.release()


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False) -> Any:
    """``out`` (k * inp.numel(), flat) = every rank's ``inp`` in group-rank order.
    With ``async_op`` returns a handle whose ``wait()`` completes it."""
    if _funcol.watched():  # torch's CommDebugMode counts functional collectives only
        _check(out, inp, group_size(group), "all_gather_into")
        work = _funcol.all_gather(out, inp, group)
    else:
        info = _exchange_peers(group, inp)
        work = _exchange_all_gather(out, inp, group, info) if info is not None else \
            dist.all_gather_single(out, inp, group=group, async_op=True)
    return _finish(work, async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False,
                        division: "Division | None" = None) -> Any:
    """``out`` (flat) = the sum over ranks of chunk ``rank`` of ``inp`` (k * out.numel()),
    divided as ``division`` says (see :class:`Division`: its ``pre`` divides ``inp`` in
    place first)."""
    op, after = start_division(division, group, inp)
    if _funcol.watched():
        _check(inp, out, group_size(group), "reduce_scatter_into")
        work = _funcol.reduce_scatter(out, inp, group)  # (completed: a sum)
        after = after_sum(division)
        return _finish(_Then(work, out, after) if after != 1.0 else work, async_op)
    info = _exchange_peers(group, inp)
    if info is not None:  # divides as it finishes
        return _finish(_exchange_reduce_scatter(out, inp, group, info, after_sum(division)), async_op)
    work = dist.reduce_scatter_single(out, inp, op=op, group=group, async_op=True)
    return _finish(_Then(work, out, after) if after != 1.0 else work, async_op)


def _finish(work: Any, async_op: bool) -> Any:
    if async_op:
        return work
    work.wait()
    return None


class _Then:
    """The handle of a sum whose division comes after it (``x /= divide`` once waited)."""

    def __init__(self, work: Any, x: torch.Tensor, divide: float) -> None:
        self.work, self.x, self.divide = work, x, divide

    def wait(self) -> bool:
        work, self.work = self.work, None
        if work is not None:
            work.wait()
            self.x.div_(self.divide)
        return True


def all_reduce(x: torch.Tensor, group: Group, op: dist.ReduceOp = dist.ReduceOp.SUM, *,
               inplace: bool = True) -> torch.Tensor:
    """Sum (or ``op``) of ``x`` over the group. Use the returned tensor: with ``inplace``
    it may be ``x`` itself (overwritten) or a new tensor; without, ``x`` is untouched."""
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    if _funcol.watched():
        return _funcol.all_reduce(x, group, op)
    info = _exchange_peers(group, x) if op == dist.ReduceOp.SUM and group_size(group) == 2 else None
    if info is not None:
        return _exchange_all_reduce(x, group, info, inplace)
    if not inplace:
        x = x.clone()
    dist.all_reduce(x, op=op, group=group)
    return x


def all_reduce_start(x: torch.Tensor, group: Group, division: Division | None = None) -> Any:
    """Start an in-place sum of contiguous ``x`` over the group, divided as ``division``
    says (see :class:`Division`), and return a handle whose ``wait()`` completes it (on
    NCCL the wait makes the current stream wait, the host does not), or None when the
    result is already in ``x``: one rank, and the transports that run at once (the
    two-rank pairwise exchange, ``CommDebugMode``'s functional collective)."""
    op, after = start_division(division, group, x)
    if group_size(group) == 1 or _funcol.watched() or (group_size(group) == 2 and _exchange_peers(group, x) is not None):
        y = all_reduce(x, group)
        if y is not x:
            x.copy_(y)
        after = after_sum(division)
        if after != 1.0:
            x.div_(after)
        return None
    work = dist.all_reduce(x, op=op, group=group, async_op=True)
    return work if after == 1.0 else _Then(work, x, after)


def split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's ``torch.chunk`` piece of ``x`` along ``dim`` (no communication)."""
    k = group_size(group)
    if k == 1:
        return x
    start, length = chunk_range(x.shape[dim], k, group_rank(group))
    return x.narrow(dim, start, length).contiguous()


def all_gather(x: torch.Tensor, dim: int, group: Group, global_size: int | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``.

    Without ``global_size`` all pieces must have the same size (checked by gloo/NCCL).
    With it, pieces are the ``torch.chunk`` sizes of ``global_size`` (trailing ones may
    be smaller or empty). Gathers into a stacked (k, *x.shape) buffer: along dim 0 the
    result is a free view, along any other dim one concatenating copy.
    """
    k = group_size(group)
    if k == 1:
        return x
    dim = dim % x.ndim
    local = x.shape[dim]
    sizes = [local] * k if global_size is None else chunk_sizes(global_size, k)
    step = max(sizes)
    if local < step:  # pad uneven pieces to the common size
        pad = list(x.shape)
        pad[dim] = step - local
        x = torch.cat([x, x.new_zeros(pad)], dim)
    x = x.contiguous()
    out = x.new_empty((k, *x.shape))
    all_gather_into(out.view(-1), x.view(-1), group)
    if all(s == step for s in sizes):  # even: (k, ..., step, ...) -> (..., k * step, ...), one copy at
        # most, none when the dims before ``dim`` have size 1 (a micro-batch of one sequence)
        merged = (*x.shape[:dim], k * step, *x.shape[dim + 1:])
        return out.movedim(0, dim).contiguous().view(merged)
    return torch.cat([out[i].narrow(dim, 0, s) for i, s in enumerate(sizes)], dim)


def reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum over the group, then keep this rank's ``torch.chunk`` piece along ``dim``."""
    k = group_size(group)
    if k == 1:
        return x
    dim = dim % x.ndim
    size = x.shape[dim]
    sizes = chunk_sizes(size, k)
    step = max(sizes) if sizes else 0
    if dim == 0 and step * k == size:
        inp = x.contiguous()
    elif step * k == size:  # even: the chunks stacked (k, ..., step, ...) by one copy at most (see all_gather)
        inp = x.unflatten(dim, (k, step)).movedim(dim, 0).contiguous()
    else:  # stack the (padded) chunks: one copy, whatever the dim
        pieces = []
        for i, s in enumerate(sizes):
            piece = x.narrow(dim, i * step, s) if s else x.narrow(dim, 0, 0)
            if s < step:
                pad = list(x.shape)
                pad[dim] = step - s
                piece = torch.cat([piece, x.new_zeros(pad)], dim)
            pieces.append(piece)
        inp = torch.stack(pieces)
    out_shape = list(x.shape)
    out_shape[dim] = step
    out = x.new_empty(out_shape)
    reduce_scatter_into(out.view(-1), inp.reshape(-1), group)
    mine = sizes[group_rank(group)]
    return out if mine == step else out.narrow(dim, 0, mine).contiguous()


def broadcast(x: torch.Tensor, group: Group, src_group_rank: int = 0) -> torch.Tensor:
    """Overwrite ``x`` on every rank with the value held by group rank ``src_group_rank``."""
    if group_size(group) == 1 or x.device.type == "meta":
        return x
    src = dist.get_global_rank(group, src_group_rank)
    buf = x.detach().contiguous()
    dist.broadcast(buf, src=src, group=group)
    return buf
