"""Shared-memory links between the ranks of one process group on one host.

fsdp2d's pairwise exchanges (see ``fsdp2d._collectives``) move CPU tensors between the
ranks of a gloo group. Over gloo's TCP transport each message costs two kernel copies,
several wake-ups of gloo's transport thread and of the waiting thread, and epoll work;
on a 2-core machine running 4 ranks that was a quarter of a rank's CPU per training
step. When every rank of the group is on this host, :func:`connect`'s links move the bytes
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

The sender never waits for acks (it grows the ring instead), acks wait in a queue
and go out with the link's next token (or when the link next waits), and a data token
that finds the socket full reads the peer's tokens while it waits for room, so as long
as all ranks issue the same exchanges in the same order (the contract of every
collective) two ranks cannot block each other;
the receiver blocks in ``poll`` until the data token arrives, for at most the process
group's timeout. (A socket holds ~270 unread tokens: a rank that issues more than ~270
exchanges to one peer while that peer is blocked in a collective on another group
would wait for it.) A peer that exits closes its
sockets, and a waiting rank fails at once with an error naming the peer. A ring far
larger than the messages of the moment (after a one-off big message, e.g. a checkpoint
gather) is replaced by a small one once it is idle.

Setup (:func:`connect`) is collective over the group, runs at the group's first
exchange, and agrees on the outcome: if any rank is on another host, cannot create
sockets or ``FSDP2D_SHM=0`` is set anywhere, every rank falls back to gloo's
point-to-point messages. Each connection is checked against the peer's process id
(``SO_PEERCRED``), so another local process cannot pose as a rank (ranks in different
pid namespaces, e.g. containers sharing a network namespace, therefore fall back to
gloo, after a 20 s wait for connections that never pass the check). Links are not
thread-safe: issue a group's exchanges from one thread at a time (the order contract
needs that anyway).

(Longer than the package's ~400-line aim on purpose: the ring, its tokens, the deferred
ACKs and a link's lifetime form one invariant, which is checked by reading them together.)
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
import time
import weakref
import zlib

import torch
import torch.distributed as dist

_TOKEN = struct.Struct("<iiqqq")  # type, ring generation, tag, byte offset, byte count
_DATA, _ACK = 0, 1
_ALIGN = 4096  # message offsets and sizes: pages (aligned for any dtype; similar sizes reuse places)
_MIN_RING = 1 << 18
_GROW_STEP = 1 << 16
_SHRINK_ABOVE = 32 << 20  # an idle ring this big and > 4x the messages is replaced ...
_SHRINK_AFTER = 16  # ... after this many such sends in a row (no thrash between big and small)
_ACCEPT_TIMEOUT_S = 20.0
_SEND_FLAGS = socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)
_RECV_FLAGS = getattr(socket, "MSG_CMSG_CLOEXEC", 0)

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


def _available() -> bool:
    return (os.environ.get("FSDP2D_SHM", "1") != "0" and sys.platform.startswith("linux")
            and hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and hasattr(socket, "SO_PEERCRED"))


def _timeout_ms(group: dist.ProcessGroup) -> int:
    """The group's own timeout (what gloo would wait), else torch's default."""
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        timeout = dist.default_pg_timeout
    return min(int(timeout.total_seconds() * 1000), 2**31 - 1)  # poll() takes a C int


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
    """A new send ring and an fd of it to pass to the peer."""
    fd = os.memfd_create("fsdp2d-ring", os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, size)  # ENOSPC/ENOMEM now, not SIGBUS on a later write
        ring = _Ring(os.dup(fd), size, mine=True)
    except OSError as e:
        os.close(fd)
        raise RuntimeError(f"fsdp2d: cannot allocate a {size}-byte shared-memory ring for {where}: {e}. "
                           "Free memory, or set FSDP2D_SHM=0 to send over gloo's TCP transport") from None
    return fd, ring


class _Link:
    """This rank <-> one peer: our send ring and its bookkeeping, the peer's rings as
    mapped here, and the socket carrying both directions' tokens."""

    def __init__(self, sock: socket.socket, where: str, timeout_ms: int = 30 * 60 * 1000) -> None:
        sock.setblocking(True)
        self.sock, self.where, self.timeout_ms = sock, where, timeout_ms
        self.poll_in = select.poll()
        self.poll_in.register(sock, select.POLLIN)
        self.set_siblings([self])
        self.rx = bytearray()
        self.fds: list[int] = []  # received ring fds, in generation order
        self.acks = bytearray()  # ACK bytes not written yet (the socket was full)
        # send side: current ring and its generation, its unacked messages, older rings
        self.gen, self.ring = -1, None
        self.live: dict[int, tuple[int, int]] = {}  # tag -> (start, end) in the ring
        self.retired: dict[int, tuple[_Ring, set[int]]] = {}  # gen -> (ring, unacked tags)
        # receive side
        self.arrived: dict[int, tuple[int, int, int]] = {}  # tag -> (gen, offset, nbytes)
        self.rings: dict[int, _Ring] = {}  # peer's rings, by generation
        self.broken: str | None = None  # why the link can no longer be used
        self.oversized = 0  # sends in a row that found the idle ring far too big

    def set_siblings(self, links: list["_Link"]) -> None:
        """This rank's links in the same group (self included). Whenever this link has
        to wait (for the peer's data, or for room to write), it reads every sibling's
        tokens too: with 3+ ranks, A waiting on B waiting on C waiting on A must not
        jam because each reads only the link it waits on."""
        self.by_fd = {link.sock.fileno(): link for link in links}
        self.poll_any = select.poll()  # readable siblings, or room on our own socket
        for fd in self.by_fd:
            self.poll_any.register(fd, select.POLLIN)

    def _wait_any(self, writing: bool, timeout_ms: int | None = None) -> bool:
        """Block until a sibling is readable (read it) or, ``writing``, our socket has
        room. False on timeout."""
        me = self.sock.fileno()
        if writing:
            self.poll_any.modify(me, select.POLLIN | select.POLLOUT)
        try:
            events = self.poll_any.poll(self.timeout_ms if timeout_ms is None else timeout_ms)
        finally:
            if writing:
                self.poll_any.modify(me, select.POLLIN)
        for fd, ev in events:
            if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                self.by_fd[fd]._pump(block=False)
        return bool(events)

    def _fail(self, why: str) -> RuntimeError:
        self.broken = self.broken or why
        return RuntimeError(f"fsdp2d: {self.where} {self.broken}")

    # -- sending -------------------------------------------------------------------
    def send(self, tag: int, t: torch.Tensor) -> None:
        if self.broken:
            raise self._fail(self.broken)
        nbytes = t.numel() * t.element_size()
        fd, off = None, 0
        if nbytes:
            off = self._fit(nbytes)
            if off is None:
                self._pump(block=False)  # acks may be waiting: collect them and retry
                off = self._fit(nbytes)
            if off is None:
                idle_fits = self.ring is not None and not self.live and self.ring.size >= _round(nbytes)
                try:
                    fd = self._grow(nbytes)
                except RuntimeError:
                    if not idle_fits:  # (only a shrink may fail softly: keep the big ring)
                        raise
                off = 0
            self.live[tag] = (off, off + _round(nbytes))
            try:
                self.ring.buf[off:off + nbytes].view(t.dtype).copy_(t.reshape(-1))
            except BaseException:
                self.live.pop(tag, None)
                if fd is not None:  # the peer will never see this ring: the link is out of step
                    os.close(fd)
                    self.broken = "is out of step: a send to it failed halfway"
                raise
        self._write(_TOKEN.pack(_DATA, max(self.gen, 0), tag, off, nbytes), fd)

    def _fit(self, nbytes: int) -> int | None:
        """Lowest offset with ``nbytes`` free in the current ring (first fit between the
        unacked messages; sizes are rounded to pages, so a message of about the size of
        a freed one reuses its place). None also when an idle ring is far too big."""
        ring, need = self.ring, _round(nbytes)
        if ring is None:
            return None
        if not self.live and ring.size > max(_SHRINK_ABOVE, 4 * need):
            self.oversized += 1
            if self.oversized >= _SHRINK_AFTER:
                return None
        elif ring.size <= 4 * need:
            self.oversized = 0
        pos = 0
        for start, end in sorted(self.live.values()):
            if start - pos >= need:
                return pos
            pos = max(pos, end)
        return pos if ring.size - pos >= need else None

    def _grow(self, nbytes: int) -> int:
        """Start a new ring, large enough for everything in flight now plus 25%; the
        old one lives on (retired) until its messages are acked. Returns the new
        ring's fd, which the caller passes to the peer with this message's token."""
        need = _round(nbytes) + sum(end - start for start, end in self.live.values())
        fd, ring = _new_ring(max(_MIN_RING, _round(need * 5 // 4, _GROW_STEP)), self.where)
        if self.live:
            self.retired[self.gen] = (self.ring, set(self.live))
        self.ring, self.gen, self.live, self.oversized = ring, self.gen + 1, {}, 0
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

    def _write(self, token: bytes, fd: int | None = None) -> None:
        """Send queued ACKs, then one data token (with ``fd`` attached). Waits for room
        in the socket only while reading the peers' tokens, so ranks writing to each
        other cannot jam."""
        data = bytes(self.acks) + token
        self.acks.clear()
        view = memoryview(data)
        try:
            while view:
                try:
                    if fd is not None:
                        sent = socket.send_fds(self.sock, [view], [fd], _SEND_FLAGS)
                        os.close(fd)
                        fd = None
                    else:
                        sent = self.sock.send(view, _SEND_FLAGS)
                    view = view[sent:]
                except BlockingIOError:  # the socket is full: read while waiting for room
                    if not self._wait_any(writing=True):
                        raise self._fail(f"made no room to send in {self.timeout_ms / 1000:.0f} s") from None
        except BaseException as e:  # the token did not (all) go out: the peer waits for it in vain
            if isinstance(e, OSError):
                raise self._fail(f"is gone ({e}): the peer process exited or failed") from None
            self.broken = self.broken or f"is out of step: a token to it was cut short ({type(e).__name__})"
            raise
        finally:
            if fd is not None:
                os.close(fd)

    # -- receiving -----------------------------------------------------------------
    def recv(self, tag: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The peer's message ``tag``, flat, as a view into the peer's ring: read it
        before :meth:`release`."""
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
        """Done with message ``tag``: queue its ACK, sent with this link's next token (or
        when it next waits). Never blocks: an ACK only lets the peer reuse ring space (it
        grows the ring rather than wait), and a token of its own would cost a send and
        wake a peer that waits for data, once per exchange (measured: ~47 per llama-medium
        step per rank); the peer's exchanges come in the same order, so the next one
        carries it."""
        gen, _off, nbytes = self.arrived.pop(tag)
        if nbytes:
            self._drop_old_rings()
            self.acks += _TOKEN.pack(_ACK, gen, tag, 0, 0)

    def _flush_acks(self) -> None:
        while self.acks and not self.broken:
            try:
                sent = self.sock.send(self.acks, _SEND_FLAGS)
            except BlockingIOError:
                return
            except OSError:  # the peer is gone: whoever waits on it next reports that
                self.acks.clear()
                return
            del self.acks[:sent]

    def _drop_old_rings(self) -> None:
        """Unmap the peer's rings older than its newest that hold nothing unread."""
        newest = max(self.rings, default=-1)
        pending = {g for g, _, n in self.arrived.values() if n}
        for gen in [g for g in self.rings if g != newest and g not in pending]:
            del self.rings[gen]

    def _pump(self, block: bool, waiting_for: int | None = None) -> None:
        """Read what the peer sent (tokens, ring fds) and file it: with ``block``, until
        message ``waiting_for`` is in (reading every sibling meanwhile; at most the
        process group timeout), else until nothing more is waiting."""
        if self.broken:
            raise self._fail(self.broken)
        self._flush_acks()
        if not block:
            while self.poll_in.poll(0):
                self._read(waiting_for)
            return
        deadline = time.monotonic() + self.timeout_ms / 1000
        while waiting_for not in self.arrived:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._wait_any(writing=False, timeout_ms=left_ms):
                raise TimeoutError(f"fsdp2d: no message from {self.where} in "
                                   f"{self.timeout_ms / 1000:.0f} s (exchange tag {waiting_for:#x})")
            if self.broken:
                raise self._fail(self.broken)

    def _read(self, waiting_for: int | None) -> None:
        """One read from the socket, every whole token in it filed."""
        try:
            data, fds, flags, _ = socket.recv_fds(self.sock, 1 << 16, 8, _RECV_FLAGS)
        except ConnectionResetError:
            data, fds, flags = b"", [], 0
        except OSError as e:
            raise self._fail(f"cannot be read ({e})") from None
        self.fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            raise self._fail("sent ring descriptors that were truncated (too many open files?)")
        if not data:
            raise self._fail("closed its link: the peer process exited or failed"
                             + (f" while this rank waited for exchange tag {waiting_for:#x}"
                                if waiting_for is not None else ""))
        self.rx += data
        usable = len(self.rx) - len(self.rx) % _TOKEN.size
        try:
            new_ring = False
            for kind, gen, tag, off, nbytes in _TOKEN.iter_unpack(memoryview(self.rx)[:usable]):
                if kind == _DATA:
                    self.arrived[tag] = (gen, off, nbytes)
                    if nbytes and gen not in self.rings:  # a new ring: its fd came with this token
                        self.rings[gen] = _Ring(self.fds.pop(0), 0, mine=False)
                        new_ring = True
                else:
                    self._acked(gen, tag)
        except Exception as e:  # (mapping a ring failed): tokens half filed, the link is unusable
            raise self._fail(f"sent a ring this rank cannot map ({type(e).__name__}: {e})") from None
        del self.rx[:usable]
        if new_ring:
            self._drop_old_rings()


def _round(n: int, step: int = _ALIGN) -> int:
    return -(-n // step) * step


def siblings(links: dict[int, _Link]) -> dict[int, _Link]:
    """Tell each of one rank's links in a group about the others (see
    :meth:`_Link.set_siblings`); returns ``links``, by peer group rank."""
    for link in links.values():
        link.set_siblings(list(links.values()))
    return links


def _agree(ok: bool, group: dist.ProcessGroup) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def connect(group: dist.ProcessGroup, enabled: bool = True) -> dict[int, _Link] | None:
    """Collective over ``group`` (all ranks, same point in their programs): a link to every
    other rank, by group rank, if all are on this host, enabled, and can make them; else
    None on every rank."""
    _INTERNAL.depth = getattr(_INTERNAL, "depth", 0) + 1
    try:
        return _connect(group, enabled and _available())
    finally:
        _INTERNAL.depth -= 1


def _connect(group: dist.ProcessGroup, enabled: bool) -> dict[int, _Link] | None:
    k, me = group.size(), group.rank()
    mine = torch.tensor([_host_id(), int(enabled), secrets.randbits(62), os.getpid()], dtype=torch.int64)
    rows = torch.empty(k * 4, dtype=torch.int64)
    dist.all_gather_single(rows, mine, group=group)
    rows = rows.view(k, 4)
    if not (bool(rows[:, 1].all()) and bool((rows[:, 0] == rows[0, 0]).all())):
        return None
    pids = rows[:, 3].tolist()
    name = f"\0fsdp2d-{int(rows[0, 2]):x}-"  # Linux abstract socket names: no file to clean up
    listener, socks = None, {}
    try:
        try:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(f"{name}{me}")
            listener.listen(k)
            ok = True
        except OSError:
            ok = False
        if not _agree(ok, group):
            return None
        try:  # connect to higher ranks (completes from the backlog), accept lower ones
            for j in range(me + 1, k):
                s = socks[j] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(_ACCEPT_TIMEOUT_S)
                s.connect(f"{name}{j}")
                ok = ok and _peer_pid(s) == pids[j]
                s.sendall(struct.pack("<q", me))
            if ok:
                _accept_lower_ranks(listener, me, pids, socks)
        except OSError:
            ok = False
        if _agree(ok, group):
            timeout_ms = _timeout_ms(group)
            gname = getattr(group, "group_name", "?")
            links = siblings({j: _Link(s, f"group rank {j} of process group {gname!r}", timeout_ms)
                              for j, s in socks.items()})
            socks = {}
            return links
        return None
    finally:
        for s in socks.values():
            s.close()
        if listener is not None:
            listener.close()


def _accept_lower_ranks(listener: socket.socket, me: int, pids: list[int], socks: dict) -> None:
    """Accept the connections of group ranks ``0 .. me-1`` into ``socks`` (by rank),
    dropping any whose process is not the rank it claims; OSError past the deadline."""
    deadline = time.monotonic() + _ACCEPT_TIMEOUT_S
    while len(socks) < len(pids) - 1:
        listener.settimeout(max(deadline - time.monotonic(), 0.001))
        s, _addr = listener.accept()
        try:
            if _peer_pid(s) not in pids[:me]:
                s.close()  # not one of the ranks that connect here: another local process
                continue
            s.settimeout(max(deadline - time.monotonic(), 0.001))
            j = struct.unpack("<q", _recv_exactly(s, 8))[0]
        except BaseException:
            s.close()
            raise
        if not (0 <= j < me) or j in socks or _peer_pid(s) != pids[j]:
            s.close()
            continue
        socks[j] = s


def _peer_pid(s: socket.socket) -> int:
    pid, _uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise OSError("connection closed during setup")
        data += chunk
    return data
