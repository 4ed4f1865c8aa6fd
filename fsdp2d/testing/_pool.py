"""A persistent pool of CPU gloo worker processes for multi-rank tests (``check_parallel``
and fsdp2d's own test suite share it: :func:`worker_pool`).

Why persistent: starting ``world_size`` fresh Python processes that import torch and join
a process group costs 10-30 s on a 2-core machine, far more than a typical test. The pool
starts its workers once (FileStore rendezvous in a temp dir, loopback interface, one
torch thread each) and every test ships jobs to them. Workers come from a ``forkserver``
that has preloaded torch (never forked from the pytest process itself, which has
threads), so a restart after a failure costs ~1.5 s instead of ~12 s with ``spawn``
(``spawn`` is the fallback where there is no forkserver).

A job is a module-level function, sent by module + qualified name (plus the directory
that makes the module importable), run on every rank; ``run`` returns the per-rank
results in rank order. Inside a job, :func:`get_mesh` caches device meshes per worker
process, since gloo groups are expensive and leak sockets when created per test.

Failures: a rank that raises sends its traceback back; a rank that dies is noticed
through its process sentinel. Peers of a rank that raised are usually stuck in a
collective that will never complete (gloo waits out its 30 min timeout; only when a peer
*dies* do they fail at once, with "Connection reset by peer"), so after the first failure
the driver waits only ``GRACE_S`` for the other ranks, then raises an ``AssertionError``
naming the failed ranks with their tracebacks / exit codes. A job that overruns its
timeout gets the Python stacks of its unfinished ranks (faulthandler on SIGUSR1) in the
error. After any failure or timeout all workers are killed and the pool restarts lazily
on the next ``run``, so one broken test never poisons later ones.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path

GRACE_S = 1.0  # how long to wait for the other ranks once one rank failed
_MESHES: dict = {}


def get_mesh(shape, names):
    """The torch DeviceMesh of ``shape``/``names``, created once per worker process.

    Call it inside a job function (all ranks must call it together the first time)."""
    key = (tuple(shape), tuple(names))
    if key not in _MESHES:
        import fsdp2d

        _MESHES[key] = fsdp2d.init_device_mesh("cpu", key[0], mesh_dim_names=key[1])
    return _MESHES[key]


def capture_error(fn):
    """Run ``fn`` inside a job; ``(exception type name, message)`` if it raised, else None.

    Expected errors must be caught in the worker: a raising job restarts the pool."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - callers inspect the type and message
        return type(e).__name__, str(e)
    return None


def _worker_main(rank: int, world_size: int, store_path: str, stack_path: str, conn) -> None:
    """Worker loop: join the gloo group, then run jobs until told to stop."""
    stack_file = open(stack_path, "w")
    faulthandler.enable(stack_file)  # segfaults leave a Python stack for the driver
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
        if "lo" in {name for _, name in socket.if_nameindex()}:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # 127.0.0.1 only
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store_path}",
                                rank=rank, world_size=world_size)
        conn.send((0, "ok", "ready"))
    except BaseException:
        conn.send((0, "err", traceback.format_exc()))
        return
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the driver went away
            return
        if job is None:
            break
        job_id, root, module, qualname, args, kwargs = job
        try:
            if root not in sys.path:
                sys.path.insert(0, root)
            fn = __import__(module, fromlist=["_"])
            for part in qualname.split("."):
                fn = getattr(fn, part)
            conn.send((job_id, "ok", fn(*args, **kwargs)))  # pickles here: errors are caught
        except BaseException:
            conn.send((job_id, "err", traceback.format_exc()))
    dist.destroy_process_group()


def module_root(fn, who: str) -> str:
    """The ``sys.path`` entry a worker needs to import the module-level function (or
    class) ``fn`` by name: workers never see the driver's ``__main__`` or closures."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn))
    if module is None or "<locals>" in qualname or "<lambda>" in qualname or module == "__main__":
        raise TypeError(f"{who} needs a module-level function, not {module}.{qualname}: define it at the "
                        f"top level of an importable module (a test file is one), not in __main__ or a closure")
    path = Path(sys.modules[module].__file__).resolve()
    if path.stem == "__init__":
        path = path.parent
    return str(path.parents[module.count(".")])


def _describe_exit(code: int | None) -> str:
    if code is not None and -code in set(signal.valid_signals()):
        return f"exit code {code} ({signal.Signals(-code).name})"
    return f"exit code {code}"


class WorkerPool:
    """``world_size`` gloo ranks that run module-level functions: ``pool.run(fn, ...)``."""

    def __init__(self, world_size: int = 4, startup_timeout: float = 180.0) -> None:
        self.world_size = world_size
        self.startup_timeout = startup_timeout
        self._procs: list = []
        self._conns: list = []
        self._tmp: str | None = None
        self._job_id = 0
        atexit.register(self.close)
        self._start()

    # -- lifecycle -------------------------------------------------------------------
    def _start(self) -> None:
        if "forkserver" in mp.get_all_start_methods():
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["torch", "torch.distributed"])
        else:
            ctx = mp.get_context("spawn")
        self._tmp = tempfile.mkdtemp(prefix="fsdp2d-pool-")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, daemon=True, name=f"pool-rank{rank}",
                            args=(rank, self.world_size, os.path.join(self._tmp, "store"),
                                  self._stack_path(rank), child))
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self._collect(0, self.startup_timeout, "pool startup")

    def _stack_path(self, rank: int) -> str:
        return os.path.join(self._tmp, f"stack-rank{rank}.txt")

    def _kill(self) -> None:
        for p in self._procs:
            p.kill()
        for p, c in zip(self._procs, self._conns):
            p.join(5)
            c.close()
        self._procs, self._conns = [], []
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def close(self) -> None:
        """Stop the workers politely (kill the ones that do not stop)."""
        for c in self._conns:
            try:
                c.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    # -- jobs ------------------------------------------------------------------------
    def run(self, fn, *args, timeout: float = 120, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        module, qualname = fn.__module__, fn.__qualname__
        root = module_root(fn, "pool.run")
        if any(p.exitcode is not None for p in self._procs):
            self._kill()  # a worker died between jobs
        if not self._procs:
            self._start()
        self._job_id += 1
        job = pickle.dumps((self._job_id, root, module, qualname, args, kwargs))
        try:
            for c in self._conns:
                c.send_bytes(job)
            return self._collect(self._job_id, timeout, f"pool job {module}.{qualname}")
        except BaseException:  # failed job, Ctrl-C, broken pipe: never reuse the workers
            self._kill()
            raise

    def _collect(self, job_id, timeout: float, what: str) -> list:
        """Wait for one reply per rank; on any failure kill the pool and raise."""
        results: dict = {}
        errors: dict = {}  # rank -> traceback text or exit description
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        failed_at = None
        while pending:
            limit = deadline if failed_at is None else min(deadline, failed_at + GRACE_S)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            waitables = {self._conns[r]: r for r in pending}
            waitables.update({self._procs[r].sentinel: r for r in pending})
            for ready in wait(list(waitables), remaining):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                conn, reply = self._conns[rank], None
                try:
                    if ready is conn or conn.poll():
                        reply = conn.recv()
                except (EOFError, OSError):
                    pass  # the worker died: handled below
                except Exception:
                    reply = (job_id, "err", "(the driver could not unpickle the result)\n"
                             + traceback.format_exc())
                pending.discard(rank)
                if reply is not None:
                    reply_id, status, payload = reply
                    assert reply_id == job_id, f"stale reply {reply_id} for job {job_id}"
                    if status == "ok":
                        results[rank] = payload
                    else:
                        errors[rank] = f"rank {rank} raised:\n{payload}"
                    continue
                proc = self._procs[rank]
                proc.join(1)
                stack = self._read_stack(rank)
                errors[rank] = f"rank {rank} died with {_describe_exit(proc.exitcode)}" + (
                    f"; its last Python stack:\n{stack}" if stack else "")
            if errors and failed_at is None:
                failed_at = time.monotonic()
        if not errors and not pending:
            return [results[r] for r in range(self.world_size)]
        if errors:
            # Peers of a dead rank fail with "Connection reset/closed by peer": list those last.
            order = sorted(errors, key=lambda r: ("by peer" in errors[r], r))
            msg = f"{what} failed on ranks {sorted(errors)}\n" + "\n".join(
                f"--- {errors[r]}" for r in order)
            if pending:
                msg += (f"\n--- ranks {sorted(pending)} had not finished {GRACE_S} s after the "
                        f"failure (blocked in a collective with the failed rank?)")
        else:
            msg = f"{what} timed out after {timeout} s on ranks {sorted(pending)}"
            msg += "".join(f"\n--- rank {r} stack:\n{s}" for r, s in self._dump_stacks(pending))
        self._kill()  # the next run() starts a fresh pool
        raise AssertionError(msg + "\n(the worker pool was killed and restarts on the next run)")

    def _read_stack(self, rank: int) -> str:
        try:
            return Path(self._stack_path(rank)).read_text().strip()
        except OSError:
            return ""

    def _dump_stacks(self, ranks) -> list:
        if not hasattr(signal, "SIGUSR1"):
            return []
        for r in ranks:
            os.kill(self._procs[r].pid, signal.SIGUSR1)
        time.sleep(0.5)
        return [(r, self._read_stack(r)) for r in sorted(ranks)]


_POOLS: dict[int, WorkerPool] = {}


def worker_pool(world_size: int) -> WorkerPool:
    """The pool of ``world_size`` ranks of this process, started on first use and reused
    by every later call (a failed job restarts its workers lazily; they stop at exit)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"worker_pool needs a positive number of ranks, got {world_size!r}")
    if world_size not in _POOLS:
        _POOLS[world_size] = WorkerPool(world_size)
    return _POOLS[world_size]
