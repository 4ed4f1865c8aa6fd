"""The emulated NCCL group's values equal real collectives' when every rank passes the
same input (``fsdp2d.testing.emulated_pg``'s semantics for one simulated rank).

Each of the 4 gloo ranks makes the same inputs from one seed, runs every collective kind
that fsdp2d, torch's FSDP2 and torch's TP issue (and the rest the group implements) once
on a real gloo group and once on an ``EmulatedProcessGroup`` standing for that rank of a
group of the same size, and returns both. Integer-valued float32 and int64 inputs keep
every sum exact in any order, so equality is bitwise. gloo has no AVG and no PREMUL_SUM:
the emulated ones are compared with gloo's SUM divided / multiplied on the driver side
of the job (exact: /2, /4 and x0.5 are powers of two). The groups: the world (4 ranks)
and the 2 x 2 mesh's two axes (group rank != global rank on ``dp``).
"""

import pytest
import torch

from .pool import get_mesh


def _inputs(k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)  # the same on every rank
    return {"x": torch.randint(-8, 9, (4 * k,), generator=g).float(),
            "i": torch.randint(0, 256, (4 * k,), generator=g)}


def job_compare(axis: str) -> dict:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch._C._distributed_c10d import _register_process_group, _unregister_process_group

    from fsdp2d.testing.emulated_pg import EmulatedProcessGroup

    R = dist.ReduceOp
    group = dist.group.WORLD if axis == "world" else get_mesh((2, 2), ("dp", "tp")).get_group(axis)
    ranks = dist.get_process_group_ranks(group)
    k, me = len(ranks), dist.get_rank(group)
    emu = EmulatedProcessGroup(me, k, ranks)
    name = f"emulated_test_{axis}"
    emu._set_group_name(name)
    _register_process_group(name, emu)  # torch's functional collectives find groups by name
    inp = _inputs(k)
    x, xi = inp["x"], inp["i"]
    out: dict = {}

    def both(key, fn, real_post=lambda t: t):
        out[key] = (real_post(fn(group)), fn(emu))

    def all_reduce(t, op, async_op=False):
        def run(g):
            y = t.clone()
            work = dist.all_reduce(y, op=op, group=g, async_op=async_op)
            if async_op:
                work.wait()
            return y
        return run

    try:
        for op in (R.SUM, R.MAX, R.MIN, R.PRODUCT):
            both(f"all_reduce/{op}", all_reduce(x, op))
        for op in (R.BAND, R.BOR, R.BXOR):
            both(f"all_reduce/{op}/int64", all_reduce(xi, op))
        both("all_reduce/async", all_reduce(x, R.SUM, async_op=True))
        out["all_reduce/AVG"] = (all_reduce(x, R.SUM)(group) / k, all_reduce(x, R.AVG)(emu))
        out["all_reduce/PREMUL_SUM"] = (all_reduce(x, R.SUM)(group) * 0.5,
                                        all_reduce(x, dist._make_nccl_premul_sum(0.5))(emu))
        chunk = x[:4].clone()

        def gather_single(g):
            o = torch.empty(4 * k)
            dist.all_gather_into_tensor(o, chunk, group=g)
            return o

        def gather_in_place(g):  # FSDP's layout: the input is this rank's chunk of the output
            o = torch.zeros(4 * k)
            o[4 * me:4 * me + 4] = chunk
            dist.all_gather_into_tensor(o, o[4 * me:4 * me + 4], group=g)
            return o

        def gather_list(g):
            outs = [torch.empty(4) for _ in range(k)]
            dist.all_gather(outs, chunk, group=g)
            return torch.cat(outs)

        def scatter_single(op):
            def run(g):
                o = torch.empty(4)
                dist.reduce_scatter_tensor(o, x, op=op, group=g)
                return o
            return run

        def to_all(g):
            o = torch.empty(4 * k)
            dist.all_to_all_single(o, x, group=g)
            return o

        both("all_gather_into_tensor", gather_single)
        both("all_gather_into_tensor/in_place", gather_in_place)
        both("all_gather/list", gather_list)
        both("reduce_scatter_tensor/SUM", scatter_single(R.SUM))
        out["reduce_scatter_tensor/AVG"] = (scatter_single(R.SUM)(group) / k, scatter_single(R.AVG)(emu))
        both("all_to_all_single", to_all)
        both("funcol/all_reduce", lambda g: funcol.wait_tensor(funcol.all_reduce(x, "sum", g)))
        both("funcol/all_gather_tensor", lambda g: funcol.wait_tensor(funcol.all_gather_tensor(chunk, 0, g)))
        both("funcol/reduce_scatter_tensor",
             lambda g: funcol.wait_tensor(funcol.reduce_scatter_tensor(x, "sum", 0, g)))
        real = x.clone() if me == 0 else torch.full_like(x, 99.0)  # the root's value reaches every rank
        dist.broadcast(real, src=ranks[0], group=group)
        mine = x.clone()  # (every rank holds the root's value already)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        emu.broadcast([mine], opts).wait()
        out["broadcast"] = (real, mine)
        if me == 0:  # gloo's reduce leaves scratch values on the other ranks: compare the root's
            real = x.clone()
            dist.reduce(real, dst=ranks[0], group=group)
            mine = x.clone()
            ropts = dist.ReduceOptions()
            ropts.rootRank, ropts.reduceOp = 0, R.SUM
            emu.reduce([mine], ropts).wait()
            out["reduce/root"] = (real, mine)
        else:
            dist.reduce(x.clone(), dst=ranks[0], group=group)
    finally:
        _unregister_process_group(name)
    return out


KINDS = {f"all_reduce/RedOpType.{op}" for op in ("SUM", "MAX", "MIN", "PRODUCT")} | \
    {f"all_reduce/RedOpType.{op}/int64" for op in ("BAND", "BOR", "BXOR")} | \
    {"all_reduce/async", "all_reduce/AVG", "all_reduce/PREMUL_SUM", "all_gather_into_tensor",
     "all_gather_into_tensor/in_place", "all_gather/list", "reduce_scatter_tensor/SUM", "reduce_scatter_tensor/AVG",
     "all_to_all_single", "funcol/all_reduce", "funcol/all_gather_tensor", "funcol/reduce_scatter_tensor", "broadcast"}


@pytest.mark.parametrize("axis", ["world", "dp", "tp"])
def test_emulated_values_equal_gloo_with_equal_inputs(pool, axis):
    results = pool.run(job_compare, axis)
    for rank, res in enumerate(results):
        group_rank = rank if axis == "world" else rank // 2 if axis == "dp" else rank % 2
        assert set(res) == KINDS | ({"reduce/root"} if group_rank == 0 else set()), sorted(res)
        for key, (real, emulated) in res.items():
            assert real.dtype == emulated.dtype and torch.equal(real, emulated), (axis, rank, key, real, emulated)
