"""Shared-memory links between the ranks of one process group on one host.

fsdp2d's pairwise exchanges (see ``fsdp2d._collectives``) move CPU tensors between the
ranks of a gloo group. Over gloo's TCP transport each message costs two kernel copies,
several wake-ups of gloo's transport thread and of the waiting thread, and epoll work;
on a 2-core machine running 4 ranks that was a quarter of a rank's CPU per training
step. When every rank of the group is on this host, a :class:`Links` moves the bytes
through shared memory instead, as NCCL's SHM transport does for GPUs:

* **data**: each ordered pair (sender -> receiver) has a ring buffer in an anonymous
  shared-memory file (``memfd``) that the sender writes and the receiver maps. The
  sender copies its chunk in when the exchange is issued; the receiver reads (copies or
  sums) it straight out of the ring when it waits, then frees it.
* **control**: one Unix stream socket per pair carries 32-byte tokens: ``DATA`` (where
  in the ring a tagged message lies) and ``ACK`` (the receiver is done with it, the
  sender may reuse the bytes). A ring that is too small for the messages in flight is
  replaced by a bigger one; its file descriptor travels with the first token that uses
  it (``SCM_RIGHTS``), so nothing is ever named in the filesystem and nothing is left
  behind when a process dies.

The sender never blocks (it grows the ring instead of waiting for acks), so as long as
all ranks issue the same exchanges in the same order (the contract of every collective)
no rank can deadlock; the receiver blocks in ``poll`` on the socket until the data
token arrives, for at most the process group timeout. A peer that exits closes its
sockets, and a waiting rank fails at once with an error naming the peer.

Setup (:func:`connect`) is collective over the group, runs at the group's first
exchange, and agrees on the outcome: if any rank is on another host, cannot create
sockets or ``FSDP2D_SHM=0`` is set anywhere, every rank falls back to gloo's
point-to-point messages. Links are not thread-safe: issue a group's exchanges from one
thread at a time (the order contract needs that anyway).
"""

from __future__ import annotations

import mmap
import os
import secrets
import select
import socket
import struct
import sys
import threading
import weakref
import zlib

import torch
import torch.distributed as dist

_TOKEN = struct.Struct("<iiqqq")  # type, ring generation, tag, byte offset, byte count
_DATA, _ACK = 0, 1
_ALIGN = 4096  # message offsets and sizes: pages (aligned for any dtype; similar sizes reuse places)
_MIN_RING = 1 << 18
_GROW_STEP = 1 << 16
_ACCEPT_TIMEOUT_S = 20.0
_TIMEOUT_MS = int(dist.default_pg_timeout.total_seconds() * 1000)

# This process's mapped rings, for tools that account memory (see benchmarks/).
_RINGS: "weakref.WeakValueDictionary[int, _Ring]" = weakref.WeakValueDictionary()
_INTERNAL = threading.local()  # set while setup issues its own gloo collectives


def internal_ops_active() -> bool:
    """True while :func:`connect` runs its own setup collectives (counting tools skip them)."""
    return getattr(_INTERNAL, "depth", 0) > 0


def ring_bytes() -> int:
    """Bytes of shared memory this process holds in send rings (receive rings are the
    peers' send rings: on one host, the sum over ranks of this is the total)."""
    return sum(r.size for r in list(_RINGS.values()) if r.mine)


def is_ring(data_ptr: int) -> bool:
    """Whether a storage with this data pointer is one of this process's mapped rings."""
    return data_ptr in _RINGS


def _host_id() -> int:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return zlib.crc32(f"{socket.gethostname()}|{boot}".encode()) & 0x7FFFFFFF


def _enabled() -> bool:
    return (os.environ.get("FSDP2D_SHM", "1") != "0" and sys.platform.startswith("linux")
            and hasattr(os, "memfd_create") and hasattr(socket, "send_fds"))


class _Ring:
    """One shared-memory file, mapped as a flat uint8 tensor."""

    def __init__(self, fd: int, size: int, mine: bool) -> None:
        try:
            size = size or os.fstat(fd).st_size  # 0: a peer's ring, as big as its file
            self.buf = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)  # keeps the map alive
        finally:
            os.close(fd)
        self.size, self.mine = size, mine  # mine: our send ring (else a peer's, mapped here)
        _RINGS[self.buf.data_ptr()] = self


def _new_ring(size: int, where: str) -> tuple[int, _Ring]:
    fd = os.memfd_create("fsdp2d-ring", os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, size)  # ENOSPC/ENOMEM now, not SIGBUS on a later write
        dup = os.dup(fd)
    except OSError as e:
        os.close(fd)
        raise RuntimeError(f"fsdp2d: cannot allocate a {size}-byte shared-memory ring for {where}: {e}. "
                           "Free memory, or set FSDP2D_SHM=0 to send over gloo's TCP transport") from None
    return fd, _Ring(dup, size, mine=True)


class _Link:
    """This rank <-> one peer: our send ring and its bookkeeping, the peer's rings as
    mapped here, and the socket carrying both directions' tokens."""

    def __init__(self, sock: socket.socket, where: str) -> None:
        self.sock, self.where = sock, where
        self.poll = select.poll()
        self.poll.register(sock, select.POLLIN)
        self.rx = bytearray()
        self.fds: list[int] = []  # received ring fds, in generation order
        # send side: current ring and its generation, its unacked messages, older rings
        self.gen, self.ring = -1, None
        self.live: dict[int, tuple[int, int]] = {}  # tag -> (start, end) in the ring
        self.retired: dict[int, tuple[_Ring, set[int]]] = {}  # gen -> (ring, unacked tags)
        # receive side
        self.arrived: dict[int, tuple[int, int, int]] = {}  # tag -> (gen, offset, nbytes)
        self.rings: dict[int, _Ring] = {}  # peer's rings, by generation
        self.closed = False

    # -- sending -------------------------------------------------------------------
    def send(self, tag: int, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        fd = None
        if nbytes == 0:
            off, gen = 0, max(self.gen, 0)
        else:
            off = self._fit(nbytes)
            if off is None:
                self._pump(block=False)  # acks may be waiting: collect them and retry
                off = self._fit(nbytes)
            if off is None:
                fd = self._grow(nbytes)
                off = 0
            self.live[tag] = (off, off + _round(nbytes))
            self.ring.buf[off:off + nbytes].view(t.dtype).copy_(t.reshape(-1))
            gen = self.gen
        token = _TOKEN.pack(_DATA, gen, tag, off, nbytes)
        try:
            if fd is None:
                self.sock.sendall(token)
            else:
                try:
                    socket.send_fds(self.sock, [token], [fd])
                finally:
                    os.close(fd)
        except OSError as e:
            raise RuntimeError(f"fsdp2d: {self.where} is gone ({e}): the peer process exited or failed") from None

    def _fit(self, nbytes: int) -> int | None:
        """Lowest offset with ``nbytes`` free in the current ring (first fit between the
        unacked messages; sizes are rounded to pages, so a message of about the size of
        a freed one reuses its place)."""
        if self.ring is None:
            return None
        need, pos = _round(nbytes), 0
        for start, end in sorted(self.live.values()):
            if start - pos >= need:
                return pos
            pos = max(pos, end)
        return pos if self.ring.size - pos >= need else None

    def _grow(self, nbytes: int) -> int:
        """Start a new, bigger ring, large enough for everything in flight now; the old
        one lives on (retired) until its messages are acked. Returns the new ring's fd."""
        old = self.ring.size if self.ring is not None else 0
        if self.live:
            self.retired[self.gen] = (self.ring, set(self.live))
        need = _round(nbytes) + sum(end - start for start, end in self.live.values())
        size = max(_MIN_RING, _round(max(need, old + 1) * 5 // 4, _GROW_STEP))  # 25% slack
        fd, self.ring = _new_ring(size, self.where)
        self.gen += 1
        self.live = {}
        return fd

    def _acked(self, gen: int, tag: int) -> None:
        if gen == self.gen:
            self.live.pop(tag, None)
            return
        retired = self.retired.get(gen)
        if retired is not None:
            retired[1].discard(tag)
            if not retired[1]:
                del self.retired[gen]  # its last message was read: unmap it

    # -- receiving -----------------------------------------------------------------
    def recv(self, tag: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The peer's message ``tag`` as a read-only view into its ring: valid until
        :meth:`release`."""
        while tag not in self.arrived:
            self._pump(block=True, waiting_for=tag)
        gen, off, nbytes = self.arrived[tag]
        expect = numel * dtype.itemsize
        if nbytes != expect:
            self.release(tag)  # drop it, so later exchanges stay in step
            raise ValueError(f"fsdp2d: {self.where} sent {nbytes} bytes for an exchange where this rank "
                             f"expects {expect} ({numel} x {dtype}): the ranks called the collective "
                             "with different sizes")
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        return self.rings[gen].buf[off:off + nbytes].view(dtype)

    def release(self, tag: int) -> None:
        gen, _off, nbytes = self.arrived.pop(tag)
        if nbytes:
            try:
                self.sock.sendall(_TOKEN.pack(_ACK, gen, tag, 0, 0))
            except OSError:
                pass  # the peer is gone; whoever waits on it next reports that
            if gen != max(self.rings) and not any(g == gen for g, _, _ in self.arrived.values()):
                del self.rings[gen]  # an older ring with nothing left to read

    def _pump(self, block: bool, waiting_for: int | None = None) -> None:
        """Read what the peer sent (tokens, ring fds) and file it: with ``block``, until
        message ``waiting_for`` is in (at most the process group timeout), else until
        nothing more is waiting."""
        while True:
            if not self.poll.poll(_TIMEOUT_MS if block else 0):
                if block:
                    raise TimeoutError(f"fsdp2d: no message from {self.where} in "
                                       f"{_TIMEOUT_MS / 1000:.0f} s (exchange tag {waiting_for:#x})")
                return
            try:
                data, fds, flags, _ = socket.recv_fds(self.sock, 1 << 16, 8)
            except OSError as e:
                data, fds, flags = b"", [], 0
                if not isinstance(e, ConnectionResetError):
                    raise
            self.fds.extend(fds)
            if flags & socket.MSG_CTRUNC:
                raise RuntimeError(f"fsdp2d: ring descriptors from {self.where} were truncated")
            if not data:
                raise RuntimeError(f"fsdp2d: {self.where} closed its link: the peer process exited "
                                   f"or failed while this rank waited for exchange tag {waiting_for:#x}"
                                   if waiting_for is not None else f"fsdp2d: {self.where} closed its link")
            self.rx += data
            usable = len(self.rx) - len(self.rx) % _TOKEN.size
            for kind, gen, tag, off, nbytes in _TOKEN.iter_unpack(memoryview(self.rx)[:usable]):
                if kind == _DATA:
                    self.arrived[tag] = (gen, off, nbytes)
                    if nbytes and gen not in self.rings:  # a new ring: its fd came with this token
                        self.rings[gen] = _Ring(self.fds.pop(0), 0, mine=False)
                else:
                    self._acked(gen, tag)
            del self.rx[:usable]
            if block and waiting_for in self.arrived:
                return


def _round(n: int, step: int = _ALIGN) -> int:
    return -(-n // step) * step


class Links:
    """This rank's links to the other ranks of one group (by group rank)."""

    def __init__(self, links: dict[int, _Link]) -> None:
        self.links = links

    def send(self, peer: int, tag: int, t: torch.Tensor) -> None:
        self.links[peer].send(tag, t)

    def recv(self, peer: int, tag: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.links[peer].recv(tag, dtype, numel)

    def release(self, peer: int, tag: int) -> None:
        self.links[peer].release(tag)


def _agree(ok: bool, group: dist.ProcessGroup) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def connect(group: dist.ProcessGroup) -> Links | None:
    """Collective over ``group`` (all ranks, same point in their programs): links to every
    other rank if all are on this host and can make them, else None on every rank."""
    _INTERNAL.depth = getattr(_INTERNAL, "depth", 0) + 1
    try:
        return _connect(group)
    finally:
        _INTERNAL.depth -= 1


def _connect(group: dist.ProcessGroup) -> Links | None:
    k, me = group.size(), group.rank()
    mine = torch.tensor([_host_id(), int(_enabled()), secrets.randbits(62)], dtype=torch.int64)
    rows = torch.empty(k * 3, dtype=torch.int64)
    dist.all_gather_single(rows, mine, group=group)
    rows = rows.view(k, 3)
    if not (bool(rows[:, 1].all()) and bool((rows[:, 0] == rows[0, 0]).all())):
        return None
    name = f"\0fsdp2d-{int(rows[0, 2]):x}-"  # Linux abstract socket names: no file to clean up
    listener, socks, ok = None, {}, True
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(f"{name}{me}")
        listener.listen(k)
    except OSError:
        ok = False
    try:
        if _agree(ok, group):
            try:  # connect to higher ranks (completes from the backlog), accept lower ones
                for j in range(me + 1, k):
                    s = socks[j] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.connect(f"{name}{j}")
                    s.sendall(struct.pack("<q", me))
                listener.settimeout(_ACCEPT_TIMEOUT_S)
                for _ in range(me):
                    s, _addr = listener.accept()
                    s.settimeout(_ACCEPT_TIMEOUT_S)
                    j = struct.unpack("<q", _recv_exactly(s, 8))[0]
                    s.settimeout(None)
                    socks[j] = s
                ok = sorted(socks) == [j for j in range(k) if j != me]
            except (OSError, struct.error):
                ok = False
            if _agree(ok, group):
                where = f"group rank {{}} of process group {getattr(group, 'group_name', '?')!r}"
                return Links({j: _Link(s, where.format(j)) for j, s in socks.items()})
        for s in socks.values():
            s.close()
        return None
    finally:
        if listener is not None:
            listener.close()


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise OSError("connection closed during setup")
        data += chunk
    return data
