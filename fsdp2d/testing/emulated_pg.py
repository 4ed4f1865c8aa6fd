"""An emulated NCCL process group: one simulated rank whose collectives take network time.

torch's fake process group (``backend="fake"``) lets one process run as one rank of a
huge job, but its collectives return at once and move nothing: a step under it is the
step *without* communication. This backend (``"emulated"``, a Python
``dist.ProcessGroup`` registered with ``dist.Backend.register_backend``) keeps NCCL's
*stream contract* and *cost*, so the step on a real GPU shows how much communication each
stack hides behind compute:

* **streams** (as ``ProcessGroupNCCL``): each group has a side stream (high priority,
  one per group and device, so one group's collectives run in order, as on one NCCL
  communicator). A collective makes the side stream wait for the caller's current
  stream, runs there, and records an event; ``work.wait()`` makes the *current* stream
  wait for that event. The host never waits (no ``synchronize``, no ``.item()``), so it
  is safe under ``torch.cuda.set_sync_debug_mode("error")``.
* **time**: on the side stream, ``torch.cuda._sleep`` spins for the collective's ring
  time, the model of ``fsdp2d plan`` (:mod:`fsdp2d.plan.estimate`): ``wire_factor`` x
  logical bytes / link bandwidth, with ``wire_factor`` = (k-1)/k for all-gather (of the
  gathered output) and reduce-scatter (of the unreduced input), 2(k-1)/k for all-reduce,
  1 for broadcast and all-to-all; the link is NVLink when all of the group's ranks share
  one node (``gpus_per_node`` consecutive ranks) and the network otherwise. Sleep cycles
  = seconds x the calibrated cycles per second (:func:`calibrate_sleep`). The sleep
  occupies one thread block: the emulation shows dependencies and stream overlap, not
  the SMs and HBM bandwidth that real NCCL kernels take from compute.
* **values**, after the sleep, on the side stream: this rank's result in an ``N``-rank
  job where *every rank holds this rank's input*. all-gather: the input tiled ``N``
  times; reduce-scatter and all-reduce: SUM = ``N`` x (this rank's chunk / the tensor),
  AVG = it unchanged, PREMUL_SUM(f) = ``N f`` x it, MAX/MIN/BAND/BOR = it, PRODUCT = it
  to the power ``N``, BXOR = it (``N`` odd) or 0; broadcast: unchanged; all-to-all: this
  rank's chunk from every rank; reduce: the all-reduce on the root. These are exactly what
  real collectives give when all ranks pass equal inputs
  (``tests/dist/test_emulated_pg.py`` checks them against gloo), so training under this
  group is deterministic, finite and comparable between configurations (e.g. CPU offload
  against none), which the fake group's uninitialised outputs are not.

On CPU tensors there are no streams: the values are filled at once and nothing sleeps.
Use::

    from fsdp2d.testing import emulated_pg as E
    E.register(E.LinkModel(), cycles_per_s=E.calibrate_sleep())  # once per process
    dist.init_process_group("emulated", store=FakeStore(), rank=0, world_size=256)
    E.STATE.comm_time = False   # same streams and values, zero time (the baseline)
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..plan.estimate import wire_factor

__all__ = ["BACKEND", "LinkModel", "STATE", "EmulatedProcessGroup", "EmulatedWork", "register", "calibrate_sleep"]

BACKEND = "emulated"
_Op = dist.ReduceOp.RedOpType


@dataclass(frozen=True)
class LinkModel:
    """Bandwidths (bytes/s per GPU per direction, the figures of ``fsdp2d plan``'s
    :data:`~fsdp2d.plan.estimate.GPUS`: H100/H200 NVLink 4 450e9, one 400 Gb/s NIC per
    GPU 50e9) and an optional fixed latency per collective (the plan has none)."""

    nvlink_bytes_per_s: float = 450e9
    network_bytes_per_s: float = 50e9
    gpus_per_node: int = 8
    latency_s: float = 0.0

    def link(self, ranks: Sequence[int]) -> str:
        """``nvlink`` when every rank of the group is on one node, else ``network``."""
        return "nvlink" if len({r // self.gpus_per_node for r in ranks}) <= 1 else "network"

    def seconds(self, kind: str, nbytes: int, ranks: Sequence[int]) -> float:
        k = len(ranks)
        if k <= 1:
            return 0.0
        bw = self.nvlink_bytes_per_s if self.link(ranks) == "nvlink" else self.network_bytes_per_s
        return self.latency_s + wire_factor(kind, k) * nbytes / bw


@dataclass
class _State:
    """Process-wide settings and counters of the emulated groups."""

    link: LinkModel = field(default_factory=LinkModel)
    cycles_per_s: float | None = None
    """``torch.cuda._sleep`` cycles per second (:func:`calibrate_sleep`); needed on CUDA."""
    comm_time: bool = True
    """False: the same streams, events and values, no sleep (the zero-time baseline)."""
    stats: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    """(group name, kind) -> [count, logical bytes, modelled seconds] since the last reset."""

    def reset(self) -> None:
        self.stats = {}


STATE = _State()


class _CudaStreams:
    """NCCL's stream contract for one group: side stream per device, events to join."""

    def __init__(self) -> None:
        self.side: dict[torch.device, torch.cuda.Stream] = {}

    def launch(self, device: torch.device, cycles: int, fill: Callable[[], None],
               tensors: list[torch.Tensor]) -> Any:
        current = torch.cuda.current_stream(device)
        side = self.side.get(device)
        if side is None:
            side = self.side[device] = torch.cuda.Stream(device=device, priority=-1)
        side.wait_stream(current)  # the inputs are ready on the caller's stream
        with torch.cuda.stream(side):
            if cycles > 0:
                torch.cuda._sleep(cycles)
            fill()
            event = torch.cuda.Event()
            event.record(side)
        for t in tensors:  # the caller may free them before the side stream is done
            try:
                t.record_stream(side)
            except RuntimeError:  # memory the caching allocator does not own: the work holds it
                pass
        return event

    def wait(self, device: torch.device, event: Any) -> None:
        torch.cuda.current_stream(device).wait_event(event)

    def done(self, event: Any) -> bool:
        return event.query()


class EmulatedWork(dist._Work):
    """NCCL's work semantics: ``wait()`` makes the current stream wait for the collective
    (the host returns at once); tensors are kept alive until then."""

    def __init__(self, streams: Any, device: torch.device, event: Any, tensors: list[torch.Tensor],
                 result: list[torch.Tensor]) -> None:
        super().__init__()
        self._streams, self._device, self._event = streams, device, event
        self._tensors, self._result = tensors, result

    def wait(self, timeout: Any = None) -> bool:
        if self._event is not None:
            self._streams.wait(self._device, self._event)
        self._tensors = []
        return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return self._event is None or self._streams.done(self._event)

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A completed future; on CUDA the current stream first waits (as NCCL's
        future's callbacks run after the collective on the stream)."""
        self.wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut


def _factor(op: dist.ReduceOp) -> float:
    factor = getattr(op, "factor", None)
    if factor is None:
        try:
            factor = op.__getstate__()[1]
        except (AttributeError, IndexError, TypeError, RuntimeError):
            factor = None
    if not isinstance(factor, (int, float)):
        raise NotImplementedError(f"emulated process group: cannot read the factor of PREMUL_SUM {op!r} on torch "
                                  f"{torch.__version__} (a tensor factor?): use ReduceOp.AVG or SUM")
    return float(factor)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def reduce_into(out: torch.Tensor, src: torch.Tensor, k: int, op: Any) -> None:
    """``out`` = ``op`` over ``k`` copies of ``src`` (same number of elements)."""
    kind = op.op if isinstance(op, dist.ReduceOp) else op
    src = src.reshape(out.shape)
    same = src.data_ptr() == out.data_ptr() and src.stride() == out.stride()
    if not same and _overlap(src, out):
        src = src.clone()
    if kind == _Op.SUM:
        torch.mul(src, k, out=out)
    elif kind == _Op.PREMUL_SUM:
        torch.mul(src, k * _factor(op), out=out)
    elif kind == _Op.PRODUCT:
        torch.pow(src, k, out=out)
    elif kind == _Op.BXOR and k % 2 == 0:
        out.zero_()
    elif kind in (_Op.AVG, _Op.MAX, _Op.MIN, _Op.BAND, _Op.BOR, _Op.BXOR):
        if not same:
            out.copy_(src)
    else:
        raise NotImplementedError(f"emulated process group: reduce op {kind} is not supported")


def tile_into(out: torch.Tensor, src: torch.Tensor, k: int) -> None:
    """``out`` (k x src.numel() elements, contiguous) = ``src`` repeated ``k`` times."""
    n = src.numel()
    if out.numel() != k * n:
        raise ValueError(f"emulated all-gather: output has {out.numel()} elements, expected {k} x {n}")
    if _overlap(src, out):  # FSDP's in-place all-gather: the input is a chunk of the output
        src = src.clone()
    out.view(k, n).copy_(src.reshape(1, n).expand(k, n))


class EmulatedProcessGroup(dist.ProcessGroup):
    """One rank of a group of ``len(ranks)`` (global ``ranks``); see the module doc."""

    stream_devices = ("cuda",)

    def __init__(self, rank: int, size: int, ranks: Sequence[int]) -> None:
        super().__init__(rank, size)
        self._me, self._k, self.ranks = rank, size, list(ranks)
        self.streams: Any = _CudaStreams()
        self._name, self._desc = "", ""

    # torch's C++ names (pybind overrides): a Python group has no backend to keep them
    def getBackendName(self) -> str:  # noqa: N802
        return BACKEND

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    # -- the one path every collective takes ----------------------------------------
    def _run(self, kind: str, nbytes: int, tensors: list[torch.Tensor], fill: Callable[[], None],
             result: list[torch.Tensor]) -> EmulatedWork:
        seconds = STATE.link.seconds(kind, nbytes, self.ranks)
        row = STATE.stats.setdefault((self._name, kind), [0, 0, 0.0])
        row[0] += 1
        row[1] += nbytes
        row[2] += seconds
        device = tensors[0].device if tensors else torch.device("cpu")
        if device.type not in self.stream_devices:
            fill()
            return EmulatedWork(None, device, None, [], result)
        cycles = 0
        if STATE.comm_time and seconds > 0:
            if STATE.cycles_per_s is None:
                raise RuntimeError("emulated process group: call register(..., cycles_per_s=calibrate_sleep()) "
                                   "before collectives on CUDA")
            cycles = int(seconds * STATE.cycles_per_s)
        event = self.streams.launch(device, cycles, fill, tensors)
        return EmulatedWork(self.streams, device, event, tensors, result)

    # -- all-reduce ------------------------------------------------------------------
    def allreduce(self, tensors, opts):
        op, k = opts.reduceOp, self._k
        return self._run("all_reduce", _nbytes(tensors), list(tensors),
                         lambda: [reduce_into(t, t, k, op) for t in tensors], list(tensors))

    allreduce_coalesced = allreduce

    def reduce(self, tensors, opts):
        op, k, root = opts.reduceOp, self._k, opts.rootRank == self._me
        return self._run("reduce", _nbytes(tensors), list(tensors),
                         lambda: [reduce_into(t, t, k, op) for t in tensors] if root else None, list(tensors))

    def broadcast(self, tensors, opts):  # every rank holds the root's value already
        return self._run("broadcast", _nbytes(tensors), list(tensors), lambda: None, list(tensors))

    def barrier(self, opts=None):
        return EmulatedWork(None, torch.device("cpu"), None, [], [])

    # -- all-gather ------------------------------------------------------------------
    def all_gather_single(self, output, input, opts):
        k = self._k
        return self._run("all_gather", _nbytes([output]), [output, input], lambda: tile_into(output, input, k),
                         [output])

    _allgather_base = all_gather_single  # torch < 2.13's name

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        k = self._k
        return self._run("all_gather", _nbytes(outputs), [*outputs, *inputs],
                         lambda: [tile_into(o, i, k) for o, i in zip(outputs, inputs)], list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, output_lists, inputs, opts):
        outs = [o for lst in output_lists for o in lst]

        def fill():
            for lst, inp in zip(output_lists, inputs):
                for o in lst:
                    o.copy_(inp)
        return self._run("all_gather", _nbytes(outs), [*outs, *inputs], fill, outs)

    allgather_coalesced = allgather

    # -- reduce-scatter --------------------------------------------------------------
    def reduce_scatter_single(self, output, input, opts):
        op, k, me = opts.reduceOp, self._k, self._me
        return self._run("reduce_scatter", _nbytes([input]), [output, input],
                         lambda: reduce_into(output, input.reshape(k, -1)[me], k, op), [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        op, k, me = opts.reduceOp, self._k, self._me
        return self._run("reduce_scatter", _nbytes(inputs), [*outputs, *inputs],
                         lambda: [reduce_into(o, i.reshape(k, -1)[me], k, op) for o, i in zip(outputs, inputs)],
                         list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts):
        op, k, me = opts.reduceOp, self._k, self._me
        ins = [i for lst in input_lists for i in lst]
        return self._run("reduce_scatter", _nbytes(ins), [*outputs, *ins],
                         lambda: [reduce_into(o, lst[me], k, op) for o, lst in zip(outputs, input_lists)],
                         list(outputs))

    # -- all-to-all ------------------------------------------------------------------
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        k, me = self._k, self._me
        rows = input.shape[0] if input.dim() else 1
        in_splits = list(input_split_sizes) or [rows // k] * k
        out_splits = list(output_split_sizes) or [in_splits[me]] * k
        if any(s != in_splits[me] for s in out_splits):
            raise NotImplementedError(f"emulated all-to-all: every rank sends this rank {in_splits[me]} rows (all "
                                      f"ranks hold this rank's input); output splits {out_splits} differ")
        start = sum(in_splits[:me])
        chunk = input.narrow(0, start, in_splits[me]) if input.dim() else input
        return self._run("all_to_all", _nbytes([input]), [output, input],
                         lambda: tile_into(output.reshape(-1), chunk.reshape(-1), k), [output])

    alltoall_base = all_to_all_single


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _create(dist_opts: Any, backend_opts: Any = None) -> EmulatedProcessGroup:
    ranks = list(dist_opts.global_ranks_in_group) or list(range(dist_opts.group_size))
    return EmulatedProcessGroup(dist_opts.group_rank, dist_opts.group_size, ranks)


def register(link: LinkModel | None = None, cycles_per_s: float | None = None) -> None:
    """Register backend ``"emulated"`` (once per process) and set the link model and the
    sleep calibration that the groups created from now on (and existing ones) use."""
    if link is not None:
        STATE.link = link
    if cycles_per_s is not None:
        STATE.cycles_per_s = cycles_per_s
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def calibrate_sleep(device: torch.device | None = None, repeats: int = 3) -> float:
    """``torch.cuda._sleep`` cycles per second on ``device``: the slope between spins of
    1e6 and 1e7 cycles timed with CUDA events (the intercept is the launch's own cost).
    Synchronises: call it before, never inside, a step."""
    device = device or torch.device("cuda", torch.cuda.current_device())

    def timed(cycles: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    with torch.cuda.device(device):
        timed(1000)  # load the kernel
        lo = statistics.median(timed(1_000_000) for _ in range(repeats))
        hi = statistics.median(timed(10_000_000) for _ in range(repeats))
    if not hi > lo > 0:
        raise RuntimeError(f"torch.cuda._sleep calibration failed: 1e6 cycles took {lo * 1e3:.3f} ms, 1e7 took "
                           f"{hi * 1e3:.3f} ms")
    return 9_000_000 / (hi - lo)
