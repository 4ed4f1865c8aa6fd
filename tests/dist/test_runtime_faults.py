"""Runtime faults (issue 12, items 17 and 18): sub-groups inherit the default group's
timeout; TP ranks fed different sizes get the same clear ValueError on both exchange
transports (shared memory and gloo point-to-point), never a gloo abort."""

from __future__ import annotations

from datetime import timedelta

from .pool import capture_error


def job_subgroup_timeouts() -> dict:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    import torch

    import fsdp2d

    def group_timeout(group=None):  # read independently of fsdp2d.mesh's own reader
        return (group or c10d._get_default_group())._get_backend(torch.device("cpu")).options._timeout

    before = group_timeout()
    c10d._set_pg_timeout(timedelta(seconds=17))  # as init_process_group(timeout=17 s) would
    try:
        mesh = fsdp2d.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        got = {axis: group_timeout(mesh.get_group(axis)).total_seconds() for axis in ("dp", "tp")}
    finally:
        c10d._set_pg_timeout(before)
    return {"sub": got, "default_restored": group_timeout() == before, "rank": dist.get_rank()}


def test_subgroups_inherit_the_default_timeout(pool):
    for r in pool.run(job_subgroup_timeouts, timeout=60):
        assert r["sub"] == {"dp": 17.0, "tp": 17.0} and r["default_restored"], r


def job_mismatched_sizes(use_shm: bool) -> list:
    import torch
    import torch.distributed as dist

    from fsdp2d import _collectives as C

    C.USE_SHM = use_shm  # read when a group makes its first exchange: use a new group
    try:
        group = dist.new_group([0, 1, 2, 3])
        out = []
        for n in (3, 5) if dist.get_rank() == 0 else (3, 3):  # rank 0's second batch is larger
            inp = torch.ones(n)
            out.append(capture_error(lambda: C.all_gather_into(torch.empty(4 * n), inp, group)))
            out.append(capture_error(lambda: C.reduce_scatter_into(torch.empty(n), torch.ones(4 * n), group)))
        ok = torch.ones(2)  # and the group is still usable afterwards
        full = torch.empty(8)
        C.all_gather_into(full, ok, group)
        out.append(bool(full.eq(1).all()))
        return out
    finally:
        C.USE_SHM = True


def test_mismatched_sizes_raise_the_same_error_on_both_transports(pool):
    for use_shm in (True, False):
        for rank, r in enumerate(pool.run(job_mismatched_sizes, use_shm, timeout=60)):
            assert r[0] is None and r[1] is None and r[-1] is True, (use_shm, rank, r)
            for err in r[2:4]:
                assert err is not None and err[0] == "ValueError", (use_shm, rank, r)
                assert "the ranks called the collective with different sizes" in err[1], (use_shm, rank, err)
