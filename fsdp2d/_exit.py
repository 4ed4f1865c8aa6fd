"""Leave the process quietly at exit: no gloo worker may need Python after it is gone.

**The abort.** A script whose last call is a gloo collective (``all_gather_object``,
``all_reduce`` of a loss, a barrier with tensors) now and then dies *after* its work is
done: "terminate called without an active exception", SIGABRT, torchrun exit 1. A core
dump of one (module-level script, ``all_gather_object`` last, 1 run in 12-30 on the 2-core
dev machine, with or without ``dist.destroy_process_group()``) shows the main thread in
``Py_FinalizeEx`` and a ``ProcessGroupGloo::runLoop`` worker destroying the finished
work (``~AsyncAllgatherWork``): its tensors have Python objects, so dropping them takes
the GIL, and a thread that asks for the GIL while the interpreter finalizes is made to
exit (``PyThread_exit_thread``); the unwind crosses a ``noexcept`` C++ frame and
``std::terminate`` aborts the process. The main thread's ``wait()`` returned when the
work *completed*; the worker drops its reference a moment later, and nothing waits for
that. ``destroy_process_group()`` does not: it unregisters the groups, whose worker
threads live on while anything (a mesh, a model) holds them.

**What runs at exit** (``atexit``, while the interpreter is still whole, so other
threads can still take the GIL):

1. one garbage collection: a model under ``fully_shard`` is a cycle (module -> hook ->
   FSDP state -> module) that would otherwise outlive ``main()`` into the teardown with
   its process groups and their last tensors (the first suspect; not the cause above);
2. the main thread lets go of the GIL, in pauses of 2 ms, until no other thread of the
   process has run in two pauses in a row (``/proc/self/task/*/stat`` and
   ``schedstat``: asleep at the look, and under 0.5 ms of CPU in the pause, which must
   not have overrun; at most 1 s, so a busy thread of the user's own costs at most
   that). A worker that is still finishing, or that waits for the GIL to drop a work's
   tensors (asleep at a look, as a thread waiting for the GIL is), gets the GIL in the
   pauses; an idle gloo worker sleeps on its queue. ~5-10 ms at exit when all is
   quiet; off Linux (no ``/proc``) only step 1.

This is a heuristic that narrows the window, not a proof: a worker woken for the GIL
that gets no core in two pauses that did not overrun, or a collective left running (an
``async_op`` work never waited for), can still abort the exit. Measured with the
repro above on 4 gloo ranks: 7 aborts in 124 runs with step 1 only, none in 136 with
both steps (issue 20). ``tests/unit/test_exit.py`` tests the mechanism (the race
itself is too rare for a test).
"""

from __future__ import annotations

import atexit
import gc
import os
import threading
import time

_SETTLE_S = 1.0  # the most exit waits for other threads
_PAUSE_S = 0.002  # the GIL is free this long between two looks
_BUSY_NS = 500_000  # a thread that ran this long in a pause is still working (gloo's
# transport loops wake every 10 ms for a few microseconds: idle)
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _threads() -> dict[int, tuple[str, int]] | None:
    """Every other thread of this process: (state, CPU ns so far); None where ``/proc``
    cannot tell."""
    me = threading.get_native_id()
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return None
    out = {}
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the fields after "(comm)"
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    cpu_ns = int(f.read().split()[0])
            except OSError:  # no schedstat: user + system clock ticks, coarser
                cpu_ns = (int(fields[11]) + int(fields[12])) * 1_000_000_000 // _TICKS_PER_S
        except (OSError, IndexError, ValueError):
            continue  # it exited meanwhile
        out[tid] = (fields[0], cpu_ns)
    return out


def _quiet(before: dict[int, tuple[str, int]], now: dict[int, tuple[str, int]]) -> bool:
    """No thread runs, is runnable or works in the kernel (``D``, e.g. unmapping a freed
    tensor) now, and none ran ``_BUSY_NS`` or more since ``before`` (one that waits for
    the GIL is asleep at a look, but it runs in the pause)."""
    for tid, (state, cpu) in now.items():
        if state in "RD" or tid not in before or cpu - before[tid][1] >= _BUSY_NS:
            return False
    return True


def settle_threads(timeout_s: float = _SETTLE_S) -> bool:
    """Release the GIL until no other thread has run in two pauses in a row (True), or
    ``timeout_s`` passed (False). True at once with no other thread, or where ``/proc``
    cannot tell. A pause that overran (the machine is loaded: a thread woken for the
    GIL may not have had a core yet) does not count as quiet."""
    deadline = time.monotonic() + timeout_s
    before, quiet = _threads(), 0
    if not before:
        return True
    while quiet < 2:
        t0 = time.monotonic()
        time.sleep(_PAUSE_S)  # the GIL is free: a thread waiting for it runs now
        overran = time.monotonic() - t0 > 2 * _PAUSE_S
        now = _threads()
        if now is None:
            return True
        quiet = quiet + 1 if _quiet(before, now) and not overran else 0
        before = now
        if quiet < 2 and time.monotonic() > deadline:
            return False
    return True


def _at_exit() -> None:
    gc.collect()
    settle_threads()


atexit.register(_at_exit)
