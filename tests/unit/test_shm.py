"""The shared-memory link (``fsdp2d._shm._Link``) between two ends in one process.

A ``socketpair`` stands in for the two ranks' socket: end ``a`` plays the sender, end
``b`` the receiver (every link sends and receives; one direction is enough to test the
ring). Multi-rank behaviour (setup, agreement, collectives on top) is tested in
tests/dist/test_collectives.py.
"""

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
    """a sends t; b reads it (returned as a copy) and frees it; a collects the ack."""
    a.send(tag, t)
    got = b.recv(tag, t.dtype, t.numel()).clone()
    b.release(tag)
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
    a._pump(block=False)
    assert a.retired == {} and a.live == {}
    assert list(b.rings) == [a.gen]  # the receiver unmapped every ring but the newest
    live_rings = [r for r in _shm._RINGS.values() if r.mine]
    assert a.ring in live_rings and _shm.ring_bytes() >= a.ring.size


def test_zero_size_message(ends):
    a, b = ends
    assert _exchange(a, b, 3, torch.empty(0)).numel() == 0
    assert a.ring is None  # nothing was ever allocated


def test_size_mismatch_names_the_peer_and_keeps_the_link_in_step(ends):
    a, b = ends
    a.send(1, torch.ones(4))
    with pytest.raises(ValueError, match="end a sent 16 bytes .* expects 20"):
        b.recv(1, torch.float32, 5)
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


def test_missing_message_times_out(ends, monkeypatch):
    monkeypatch.setattr(_shm, "_TIMEOUT_MS", 50)
    _a, b = ends
    with pytest.raises(TimeoutError, match="no message from end a"):
        b.recv(4, torch.float32, 1)
