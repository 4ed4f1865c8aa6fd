"""The shared-memory link (``fsdp2d._shm._Link``) between two ends in one process.

A ``socketpair`` stands in for the two ranks' socket: end ``a`` plays the sender, end
``b`` the receiver (every link sends and receives; one direction is enough to test the
ring). Multi-rank behaviour (setup, agreement, collectives on top) is tested in
tests/dist/test_collectives.py.
"""

import os
import socket
import sys

import pytest
import torch

from fsdp2d import _shm

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd and SCM_RIGHTS: Linux")


@pytest.fixture
def ends():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield _shm._Link(a, "end b"), _shm._Link(b, "end a")
    a.close()
    b.close()


def _exchange(a, b, tag, t):
    """a sends t; b reads it (returned as a copy) and frees it; a collects the ack (which
    b sends with its next token or wait: flushed here, as b's next wait would)."""
    a.send(tag, t)
    got = b.recv(tag, t.dtype, t.numel()).clone()
    b.release(tag)
    b._flush_acks()
    a._pump(block=False)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool,
                                   torch.complex64])
def test_round_trip_is_exact(ends, dtype):
    a, b = ends
    t = (torch.randn(1000) * 100).to(dtype)
    assert torch.equal(_exchange(a, b, 7, t), t.reshape(-1))
    assert a.live == {}  # acked: the bytes are free again


def test_steady_state_reuses_the_first_ring(ends):
    a, b = ends
    for tag in range(1, 50):  # same-size messages, each read before the next is sent
        t = torch.full((100_000,), float(tag))
        assert torch.equal(_exchange(a, b, tag, t), t)
    assert a.gen == 0 and len(b.rings) == 1


def test_messages_read_out_of_order(ends):
    a, b = ends
    sent = {tag: torch.randn(10_000 * tag) for tag in (1, 2, 3)}
    for tag, t in sent.items():
        a.send(tag, t)
    for tag in (3, 1, 2):
        assert torch.equal(b.recv(tag, torch.float32, sent[tag].numel()), sent[tag])
        b.release(tag)
    b._flush_acks()
    a._pump(block=False)
    assert a.live == {}


def test_ring_grows_while_messages_are_in_flight_and_old_rings_are_freed(ends):
    a, b = ends
    big = 300_000  # floats: 1.2 MB, more than the first ring
    sent = {tag: torch.full((big,), float(tag)) for tag in range(1, 6)}
    for tag, t in sent.items():  # nothing is read yet: the sender must grow, never wait
        a.send(tag, t)
    assert a.gen >= 1 and a.retired  # older rings still hold unread messages
    for tag in (5, 1, 4, 2, 3):
        assert torch.equal(b.recv(tag, torch.float32, big), sent[tag])
        b.release(tag)
    b._flush_acks()
    a._pump(block=False)
    assert a.retired == {} and a.live == {}
    assert list(b.rings) == [a.gen]  # the receiver unmapped every ring but the newest
    live_rings = [r for r in _shm._RINGS.values() if r.mine]
    assert a.ring in live_rings and _shm.ring_bytes() >= a.ring.size


def test_ack_goes_with_the_next_token_not_alone(ends):
    """A token of its own per ACK would wake a peer waiting for data once per exchange."""
    a, b = ends
    a.send(1, torch.ones(1000))
    b.recv(1, torch.float32, 1000)
    b.release(1)
    assert not a.poll_in.poll(0) and 1 in a.live  # nothing sent yet: the ACK waits ...
    b.send(2, torch.zeros(3))  # ... for b's next token, which carries it
    assert torch.equal(a.recv(2, torch.float32, 3), torch.zeros(3))
    assert a.live == {}


def test_zero_size_message(ends):
    a, b = ends
    assert _exchange(a, b, 3, torch.empty(0)).numel() == 0
    assert a.ring is None  # nothing was ever allocated


def test_size_mismatch_names_the_peer_and_keeps_the_link_in_step(ends):
    a, b = ends
    a.send(1, torch.ones(4))
    with pytest.raises(ValueError, match="end a sent 16 bytes .* expects 20"):
        b.recv(1, torch.float32, 5)
    b._flush_acks()
    a._pump(block=False)
    assert a.live == {}  # the mismatched message was dropped and acked
    assert torch.equal(_exchange(a, b, 2, torch.arange(3.0)), torch.arange(3.0))


def test_closed_peer_fails_at_once(ends):
    a, b = ends
    a.sock.close()
    with pytest.raises(RuntimeError, match="end a closed its link"):
        b.recv(9, torch.float32, 1)
    with pytest.raises(RuntimeError, match="end a (closed its link|is gone)"):
        b.send(9, torch.ones(1))


def test_missing_message_times_out(ends):
    _a, b = ends
    b.timeout_ms = 50
    with pytest.raises(TimeoutError, match="no message from end a"):
        b.recv(4, torch.float32, 1)


def test_receiver_unmaps_rings_it_finished_with(ends):
    a, b = ends
    for tag, n in enumerate([10_000, 100_000, 300_000, 1_000_000], 1):  # each outgrows the ring
        _exchange(a, b, tag, torch.ones(n))
    assert a.gen == 3 and list(b.rings) == [3]


def test_idle_oversized_ring_is_replaced_without_thrashing(ends, monkeypatch):
    monkeypatch.setattr(_shm, "_SHRINK_ABOVE", 1 << 20)
    a, b = ends
    tag = iter(range(1, 1000))
    _exchange(a, b, next(tag), torch.ones(1_000_000))  # a one-off 4 MB message
    big_gen = a.gen
    for _ in range(5):  # big and small alternating: the big ring stays
        _exchange(a, b, next(tag), torch.ones(1000))
        _exchange(a, b, next(tag), torch.ones(1_000_000))
    assert a.gen == big_gen and a.ring.size >= 4_000_000
    for _ in range(_shm._SHRINK_AFTER):  # only small ones from now on: replaced, once
        _exchange(a, b, next(tag), torch.ones(1000))
    assert a.gen == big_gen + 1 and a.ring.size == _shm._MIN_RING and list(b.rings) == [a.gen]


def test_two_ends_flooding_each_other_do_not_jam(ends):
    """Each end issues more messages than a socket buffers, waits for them in reverse,
    then meets the other at a barrier (a collective on another group): tokens that do
    not fit must neither block the sender forever nor be lost."""
    import threading

    for end in ends:
        end.timeout_ms = 20_000
    n, rounds = 600, 2
    barrier, errors = threading.Barrier(2, timeout=30), []

    def rank(end, me):
        try:
            for r in range(rounds):
                tags = range(r * n, (r + 1) * n)
                for tag in tags:
                    end.send(tag, torch.full((16,), float(me)))
                for tag in reversed(tags):
                    assert end.recv(tag, torch.float32, 16)[0].item() == 1 - me
                    end.release(tag)
                barrier.wait()
        except BaseException as e:  # noqa: B036 - reported to the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(end, me), daemon=True) for me, end in enumerate(ends)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors, errors


def test_peer_credentials_name_this_process(ends):
    a, _b = ends
    assert _shm._peer_pid(a.sock) == os.getpid()


def test_three_ranks_waiting_in_a_cycle_do_not_jam():
    """Ranks 0, 1, 2 each issue more exchanges to both peers than a socket buffers before
    waiting: a rank blocked writing to one peer must keep reading the other."""
    import threading

    pairs = {}
    for i, j in ((0, 1), (0, 2), (1, 2)):
        pairs[i, j], pairs[j, i] = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    links = {r: _shm.siblings({p: _shm._Link(pairs[r, p], f"rank {p}", 20_000) for p in range(3) if p != r})
             for r in range(3)}
    n, errors = 1500, []

    def rank(me):
        try:
            for tag in range(n):
                for p in sorted(links[me]):
                    links[me][p].send(tag, torch.empty(0))  # tokens only: what can jam is the socket
            for tag in range(n):
                for p in sorted(links[me]):
                    assert links[me][p].recv(tag, torch.float32, 0).numel() == 0
                    links[me][p].release(tag)
        except BaseException as e:  # noqa: B036 - reported to the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not any(t.is_alive() for t in threads) and not errors, errors
    finally:
        for sock in pairs.values():
            sock.close()
