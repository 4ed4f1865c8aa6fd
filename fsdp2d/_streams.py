"""Streams for copies beside compute: one code path on CUDA and on CPU.

CPU offload moves every shard to the GPU before its all-gather (H2D, then a cast to
``param_dtype``) and every reduced gradient back (D2H). On the compute stream those
copies would queue behind the block's kernels and hold the next block's kernels behind
them; torch FSDP2 runs them on side streams. fsdp2d does too, through this module, which
the engine calls the same way on every device:

- :func:`current_stream` / :func:`side_stream`: the stream compute runs on, and the one
  offload copies run on (one per device, made once);
- ``with stream:`` issues the enclosed ops on ``stream``;
- ``stream.wait_stream(other)``, ``stream.record_event()``, ``stream.wait_event(event)``
  and ``event.synchronize()``: the orderings between them.

On CPU there are no streams: every op runs in program order on the calling thread, so
:data:`HOST` is a stream whose context, waits and events do nothing (an event is
complete when recorded). Tests replace :func:`side_stream` and :func:`current_stream`
with recorders (``tests/dist/test_offload_event.py``), which is why the engine looks
them up here at each call.

The rules the engine follows with a side stream (both devices, checked on CPU):

- before the side stream writes into memory allocated on the compute stream, it waits
  for the compute stream: the caching allocator may have handed out memory that a
  kernel still queued there last used;
- a tensor the side stream reads or writes is held (a Python reference) until an event
  recorded on the side stream after its last use is waited for: not ``record_stream``,
  which does not see views that alias a slice of a storage (fsdp2d's shards and
  gradients, see ``fsdp.alias``);
- the compute stream (or the host) waits for that event before it reads what the side
  stream wrote.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HOST", "current_stream", "side_stream"]


class _DoneEvent:
    """An event on a device without streams: complete as soon as it is recorded."""

    __slots__ = ()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_DONE = _DoneEvent()


class _HostStream:
    """The only "stream" of a device without streams (CPU): nothing to order."""

    def __enter__(self) -> "_HostStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self) -> _DoneEvent:
        return _DONE


HOST = _HostStream()


class _CudaStream:
    """A CUDA stream with the interface above (``with`` makes it current)."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self._ctx: list = []

    def __enter__(self) -> "_CudaStream":
        ctx = torch.cuda.stream(self.stream)
        ctx.__enter__()
        self._ctx.append(ctx)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.pop().__exit__(*exc)

    def wait_stream(self, other: "_CudaStream") -> None:
        self.stream.wait_stream(other.stream)

    def wait_event(self, event: torch.cuda.Event) -> None:
        self.stream.wait_event(event)

    def record_event(self) -> torch.cuda.Event:
        return self.stream.record_event()


_SIDE: dict[torch.device, _CudaStream] = {}


def current_stream(device: torch.device) -> Any:
    """The stream ops on ``device`` are issued to now (compute)."""
    if device.type != "cuda":
        return HOST
    return _CudaStream(torch.cuda.current_stream(device))


def side_stream(device: torch.device) -> Any:
    """``device``'s stream for offload copies, made at first use. Its priority is the
    default: copies beside compute must not push the compute kernels back."""
    if device.type != "cuda":
        return HOST
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _SIDE:
        _SIDE[device] = _CudaStream(torch.cuda.Stream(device=device))
    return _SIDE[device]
