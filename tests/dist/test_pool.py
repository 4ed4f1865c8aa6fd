"""Tests of the worker pool itself: results, exceptions, timeouts, dying workers."""

import os
import time

import pytest

from .pool import get_mesh


def _all_reduce(offset):
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return rank, dist.get_world_size(), t.item(), torch.get_num_threads()


def _raise_on_rank_2():
    import torch.distributed as dist

    if dist.get_rank() == 2:
        raise ValueError("boom from rank two")
    dist.barrier()  # the other ranks block here: the pool must not wait for them
    return dist.get_rank()


def _sleep(seconds):
    time.sleep(seconds)


def _count_mesh_uses():
    mesh = get_mesh((2, 2), ("dp", "tp"))
    mesh.pool_test_uses = getattr(mesh, "pool_test_uses", 0) + 1
    return mesh.pool_test_uses


def _unpicklable():
    return lambda: None


def _segfault_on_rank_3():
    import signal
    import torch.distributed as dist

    if dist.get_rank() == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


def _exit_on_rank_1(code):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(code)
    dist.barrier()


def test_all_reduce_results_in_rank_order(pool):
    assert pool.run(_all_reduce, 10) == [(r, 4, 46.0, 1) for r in range(4)]


def test_exception_names_rank_and_traceback_then_recovers(pool):
    with pytest.raises(AssertionError) as info:
        pool.run(_raise_on_rank_2, timeout=30)
    msg = str(info.value)
    assert "failed on ranks [2]" in msg
    assert "rank 2 raised" in msg and "ValueError: boom from rank two" in msg
    assert 'raise ValueError("boom from rank two")' in msg  # the traceback's source line
    assert pool.run(_all_reduce, 0) == [(r, 4, 6.0, 1) for r in range(4)]


def test_timeout_fails_clearly_then_recovers(pool):
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 3 s on ranks \[0, 1, 2, 3\]") as info:
        pool.run(_sleep, 60, timeout=3)
    assert time.monotonic() - start < 15
    assert "in _sleep" in str(info.value)  # the hung ranks' stacks are dumped
    assert pool.run(_all_reduce, 1)[0][2] == 10.0


def test_dying_worker_is_reported_then_recovers(pool):
    with pytest.raises(AssertionError) as info:
        pool.run(_exit_on_rank_1, 3, timeout=30)
    assert "rank 1 died with exit code 3" in str(info.value)
    assert pool.run(_all_reduce, 0)[3][2] == 6.0


def test_mesh_cache_persists_across_jobs(pool):
    first = pool.run(_count_mesh_uses)
    assert pool.run(_count_mesh_uses) == [n + 1 for n in first]  # the same mesh object


def test_unpicklable_result_is_reported(pool):
    with pytest.raises(AssertionError, match="(?s)failed on ranks \\[0, 1, 2, 3\\].*pickle"):
        pool.run(_unpicklable)


def test_rejects_local_functions(pool):
    def local():
        pass

    with pytest.raises(TypeError, match="module-level"):
        pool.run(local)


def test_segfault_is_reported_with_python_stack(pool):
    with pytest.raises(AssertionError) as info:
        pool.run(_segfault_on_rank_3, timeout=30)
    msg = str(info.value)
    assert "rank 3 died with exit code -11 (SIGSEGV)" in msg and "_segfault_on_rank_3" in msg
    assert pool.run(_all_reduce, 0)[0][2] == 6.0
