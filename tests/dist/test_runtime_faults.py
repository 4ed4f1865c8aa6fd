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


def job_failed_unshard_wait(use_shm: bool, via: str) -> dict:
    """A gather whose wait raises (a peer timed out, sizes differed) must not leave its
    spent handle behind: the next forward would take it as done and compute with
    parameters that were never filled. Injected: the real gather completes (the group
    stays in step), then its wait raises; a later wait of the spent handle returns at
    once, as a real one does, and (gloo's transport, where the gather fills a buffer)
    the buffer is poisoned, as one never filled would be. ``via``: the wait that
    raises is ``wait_unshard``'s, or ``reshard``'s (a prefetch dropped unused)."""
    import copy

    import torch
    import torch.distributed as dist

    import fsdp2d
    from fsdp2d import _collectives as C

    C.USE_SHM = use_shm  # read at a group's first exchange: new_group below gives a fresh one
    try:
        torch.manual_seed(0)
        mesh = fsdp2d.DeviceMesh.from_group(dist.new_group([0, 1, 2, 3]), "cpu", mesh_dim_names=("dp",))
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
        ref = copy.deepcopy(model)
        for m in (model[0], model[2]):
            fsdp2d.fully_shard(m, mesh=mesh)
        fsdp2d.fully_shard(model, mesh=mesh)
        x = torch.randn(4, 8)  # the same batch on every rank: the averaged gradient is ref's
        for net in (model, ref):  # one SGD step on both, so stale memory would hold old weights
            opt = torch.optim.SGD(net.parameters(), lr=0.5)
            net(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        group = model[2]._fsdp2d_fsdp.group

        class FailsOnce:
            def __init__(self, work, out):
                self.work, self.out, self.spent = work, out, False

            def wait(self, *consume):
                if self.spent:  # a spent handle returns at once, bringing nothing
                    return True
                self.spent = True
                self.work.wait()  # the gather itself completes on every rank (unread)
                if self.out is not None:
                    self.out.fill_(float("nan"))
                raise RuntimeError("injected: the gather's wait failed")

        group.unshard(async_op=True)
        gather = group._gather
        out = gather.out
        gather.work = FailsOnce(gather.work, out)
        err = capture_error(group.wait_unshard if via == "wait_unshard" else group.reshard)
        state = {"gathering": group.gathering, "unsharded": group.unsharded}
        with torch.no_grad():
            got, want = model(x), ref(x)
        return {"err": err, "state": state, "shm": out is None, "max_diff": float((got - want).abs().max()),
                "scale": float(want.abs().max())}
    finally:
        C.USE_SHM = True


def test_a_failed_unshard_wait_leaves_no_spent_handle(pool):
    for use_shm in (True, False):
        for via in ("wait_unshard", "reshard"):
            for r in pool.run(job_failed_unshard_wait, use_shm, via, timeout=60):
                assert r["shm"] is use_shm, r  # each transport really ran
                assert r["err"] == ("RuntimeError", "injected: the gather's wait failed"), r
                assert r["state"] == {"gathering": False, "unsharded": False}, r
                # the next forward gathered again: ref's output up to the dp sum's rounding
                # of the averaged gradient (4 equal fp32 terms: a few ulps per weight)
                assert r["max_diff"] <= 1e-6 * max(r["scale"], 1.0), r
