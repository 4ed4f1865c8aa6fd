"""fsdp2d's exit handler (``fsdp2d/_exit.py``): before the interpreter finalizes, the main
thread lets other threads finish what needs the GIL (a gloo worker dropping the last
tensors of a finished work), else such a thread is made to exit mid-C++ and the process
aborts after the job is done. The race itself (1 run in 12-30 of a 4-rank gloo script)
is too rare for a test; these pin the mechanism."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from fsdp2d import _exit

linux_proc = pytest.mark.skipif(_exit._threads() is None, reason="needs /proc/self/task")


@linux_proc
def test_a_thread_woken_to_need_the_gil_finishes_before_settle_returns():
    # as a gloo worker: it sleeps outside Python (a lock, GIL released), is woken as the
    # main thread heads for the exit, then needs the GIL for a while
    go, done = threading.Lock(), []
    go.acquire()

    def worker():
        with go:
            pass
        total = 0
        for i in range(3_000_000):  # Python work: holds and hands back the GIL
            total += i
        done.append(total)

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    time.sleep(0.05)  # asleep on the lock
    go.release()
    assert _exit.settle_threads(timeout_s=10) is True
    assert done == [sum(range(3_000_000))]
    t.join()


@linux_proc
def test_a_busy_thread_costs_at_most_the_timeout():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        t0 = time.monotonic()
        assert _exit.settle_threads(timeout_s=0.2) is False
        assert time.monotonic() - t0 < 2.0
    finally:
        stop.set()
        t.join()


@linux_proc
def test_quiet_process_settles_at_once():
    t0 = time.monotonic()
    assert _exit.settle_threads() is True
    assert time.monotonic() - t0 < 0.5


def test_exit_handler_runs_at_interpreter_exit():
    # a daemon thread woken by the last line of the script still finishes its Python work
    # (without the handler the interpreter would not wait for it: it is a daemon)
    script = textwrap.dedent("""
        import threading, time
        import fsdp2d
        go = threading.Lock(); go.acquire()
        def worker():
            with go:
                pass
            s = 0
            for i in range(3_000_000):
                s += i
            print("worker done", flush=True)
        threading.Thread(target=worker, daemon=True).start()
        time.sleep(0.05)
        go.release()
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    if _exit._threads() is not None:
        assert "worker done" in run.stdout, run.stdout
