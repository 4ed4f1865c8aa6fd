"""fsdp2d's pairwise-exchange collectives on gloo (``fsdp2d._collectives``) against
gloo's native ones and against sums computed independently on the driver, over both
transports: shared memory (``fsdp2d._shm``, the default on one host) and gloo's own
``isend``/``irecv`` (the fallback).

Every rank fills its input from a seed of its own rank, so the driver can rebuild every
rank's input and compute the expected results exactly (float64 inputs and integer-valued
float32 sums are exact in any order; the float32 random case is compared with the
native collective on the same data, and across ranks bit for bit).
"""

import pytest
import torch

from .pool import capture_error

WORLD = 4
_GROUPS: dict = {}  # per worker: transport -> (world group, tp group)


def _input(rank: int, n: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def _groups(transport: str):
    """A 4-rank and a 2-rank (ranks 0-1 / 2-3) gloo group whose exchanges use
    ``transport``, made once per worker (gloo groups are slow to make)."""
    if transport not in _GROUPS:
        import torch.distributed as dist
        from fsdp2d import _collectives as C

        world = dist.new_group(list(range(WORLD)))
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        tp = pairs[dist.get_rank() // 2]
        old, C.USE_SHM = C.USE_SHM, transport == "shm"
        try:
            for g in (world, tp):  # a group's first exchange picks its transport
                C._exchange_peers(g, torch.zeros(1))
        finally:
            C.USE_SHM = old
        _GROUPS[transport] = (world, tp)
    return _GROUPS[transport]


def job_exchanges(transport: str):
    import torch.distributed as dist
    from fsdp2d import _collectives as C
    from fsdp2d.debug import CollectiveCounter

    world, tp = _groups(transport)
    out = {}
    for name, group in (("world", world), ("tp", tp)):
        k, me = dist.get_world_size(group), dist.get_rank(group)
        info = C._exchange_peers(group, torch.zeros(1))
        assert info is not None and (info.links is not None) == (transport == "shm"), transport
        x = _input(dist.get_rank(), 6)  # 6 elements: all-gather output 6k
        gathered = torch.empty(6 * k, dtype=x.dtype)
        with CollectiveCounter() as counter:
            C.all_gather_into(gathered, x, group)
            rs_out = torch.empty(3, dtype=x.dtype)
            C.reduce_scatter_into(rs_out, _input(dist.get_rank(), 3 * k), group)
            ar = C.all_reduce(x, group, inplace=False) if k == 2 else None
        # two exchanges in flight on one group at once, waited in reverse order
        a_out, b_out = torch.empty(2 * k), torch.empty(1)
        a = C.all_gather_into(a_out, torch.full((2,), float(me)), group, async_op=True)
        b = C.reduce_scatter_into(b_out, torch.arange(k, dtype=torch.float32) + me, group, async_op=True)
        b.wait()
        a.wait()
        # big messages, several in flight (the shared-memory rings must grow), waited in reverse
        n = 300_000
        bigs = [torch.empty(n * k) for _ in range(3)]
        works = [C.all_gather_into(o, torch.full((n,), float(10 * i + me)), group, async_op=True)
                 for i, o in enumerate(bigs)]
        for w in reversed(works):
            w.wait()
        big_ok = all(torch.equal(o.view(k, n), (torch.arange(k) + 10.0 * i).unsqueeze(1).expand(k, n))
                     for i, o in enumerate(bigs))
        # the gather into nothing (shared memory only): every rank's piece where it lies
        rows, got = C.all_gather_rows(x, group), None
        if rows is not None:
            got = {}
            rows.wait(lambda parts: got.update({j: t.clone() for j, t in parts.items()}))
            C.all_gather_rows(x, group).wait()  # received and freed unread: the group stays in step
        shaped = torch.empty(6 * k)  # a (2, 3) input: only the bytes matter, as with gloo
        C.all_gather_into(shaped, torch.arange(6.0).view(2, 3) + me, group)
        out[name] = {"k": k, "me": me, "ranks": dist.get_process_group_ranks(group), "shaped": shaped,
                     "gathered": gathered, "rows": got, "rs": rs_out, "ar": ar, "x_after": x,
                     "async_ag": a_out, "async_rs": b_out, "big_ok": big_ok,
                     "counts": {kind: c for (g, kind), c in counter.counts.items() if g == group.group_name}}
    # float32 random data: the exchange equals gloo's own all-reduce / reduce-scatter
    y = _input(dist.get_rank(), 1000, torch.float32)
    native = y.clone()
    dist.all_reduce(native, group=tp)
    mine = C.all_reduce(y.clone(), tp)
    rs_native, rs_mine = torch.empty(500), torch.empty(500)
    dist.reduce_scatter_tensor(rs_native, y, group=tp)
    C.reduce_scatter_into(rs_mine, y, tp)
    out["f32"] = {"ar_native": native, "ar": mine, "rs_native": rs_native, "rs": rs_mine}
    out["errors"] = [capture_error(lambda: C.all_gather_into(torch.empty(5), torch.zeros(2), tp)),
                     capture_error(lambda: C.reduce_scatter_into(torch.empty(2), torch.zeros(4).double(), tp))]
    out["after_errors"] = C.all_reduce(torch.ones(2), tp)  # the exchange sequence is still in step
    out["ar_grad"] = C.all_reduce(torch.ones(3, requires_grad=True), tp, inplace=False).requires_grad
    return out


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_exchanges_match_independent_sums_and_gloo(pool, transport):
    results = pool.run(job_exchanges, transport)
    for rank, res in enumerate(results):
        for name in ("world", "tp"):
            r = res[name]
            k, me, ranks = r["k"], r["me"], r["ranks"]
            assert ranks[me] == rank
            expect_ag = torch.cat([_input(g, 6) for g in ranks])
            assert torch.equal(r["gathered"], expect_ag), (rank, name)
            if transport == "shm":
                assert sorted(r["rows"]) == list(range(k)), r["rows"]
                assert all(torch.equal(r["rows"][j], _input(g, 6)) for j, g in enumerate(ranks)), (rank, name)
            else:
                assert r["rows"] is None  # gloo's point-to-point: callers use all_gather_into
            expect_rs = sum(_input(g, 3 * k)[3 * me:3 * me + 3] for g in ranks)
            torch.testing.assert_close(r["rs"], expect_rs, rtol=1e-15, atol=0)
            if k == 2:
                torch.testing.assert_close(r["ar"], _input(ranks[0], 6) + _input(ranks[1], 6), rtol=0, atol=0)
                assert torch.equal(r["x_after"], _input(rank, 6))  # inplace=False left x alone
            assert torch.equal(r["async_ag"], torch.arange(k, dtype=torch.float32).repeat_interleave(2))
            assert r["async_rs"].item() == sum(me + j for j in range(k))  # chunk me of (arange(k) + j)
            assert r["big_ok"], (rank, name)
            assert torch.equal(r["shaped"], torch.cat([torch.arange(6.0) + j for j in range(k)]))
            expect_counts = {"all_gather": [1, 6 * k * 8], "reduce_scatter": [1, 3 * k * 8]}
            if k == 2:
                expect_counts["all_reduce"] = [1, 6 * 8]
            assert r["counts"] == expect_counts, (name, r["counts"])
        f = res["f32"]
        assert torch.equal(f["ar"], f["ar_native"]) and torch.equal(f["rs"], f["rs_native"])
        for err in res["errors"]:
            assert err is not None and err[0] == "ValueError" and "same dtype" in err[1], err
        assert torch.equal(res["after_errors"], torch.full((2,), 2.0))
        assert res["ar_grad"]  # the out-of-place sum stays differentiable
    for a, b in ((0, 1), (2, 3)):  # both TP ranks hold the bit-identical sum
        assert torch.equal(results[a]["f32"]["ar"], results[b]["f32"]["ar"])


def job_transport_agreement():
    """One rank has FSDP2D_SHM=0: every rank of a new group must fall back to gloo."""
    import os

    import torch.distributed as dist
    from fsdp2d import _collectives as C

    if dist.get_rank() == 3:
        os.environ["FSDP2D_SHM"] = "0"
    try:
        group = dist.new_group(list(range(WORLD)))
        out = torch.empty(2 * WORLD)
        C.all_gather_into(out, torch.full((2,), float(dist.get_rank())), group)
    finally:
        os.environ.pop("FSDP2D_SHM", None)
    return C._exchange_peers(group, out).links is None, out


def test_one_rank_without_shared_memory_makes_all_fall_back(pool):
    for no_links, out in pool.run(job_transport_agreement):
        assert no_links
        assert torch.equal(out, torch.arange(float(WORLD)).repeat_interleave(2))


def job_comm_debug_mode_sees_collectives():
    """Under torch's CommDebugMode the collectives run as torch's functional collectives
    (so the mode counts them under torch's names) and give the exchange path's results
    (integer-valued float32: exact in any summation order)."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from fsdp2d import _collectives as C, _funcol

    funcol = torch.ops.c10d_functional
    _, tp = _groups("shm")
    out = {}
    for name, group in (("world", dist.group.WORLD), ("tp", tp)):
        x = (_input(dist.get_rank(), 8) * 100).round().float()
        plain = (C.all_gather(x, 0, group), C.reduce_scatter(x.view(4, 2), 0, group),
                 C.all_reduce(x, group, inplace=False), C.all_reduce(x, group, dist.ReduceOp.MAX, inplace=False))
        assert not _funcol.watched()
        with CommDebugMode() as mode:
            assert _funcol.watched()
            seen = (C.all_gather(x, 0, group), C.reduce_scatter(x.view(4, 2), 0, group),
                    C.all_reduce(x, group, inplace=False), C.all_reduce(x, group, dist.ReduceOp.MAX, inplace=False))
        assert all(torch.equal(a, b) for a, b in zip(plain, seen)), name
        counts = mode.get_comm_counts()
        out[name] = (counts[funcol.all_gather_into_tensor], counts[funcol.reduce_scatter_tensor],
                     counts[funcol.all_reduce], mode.get_total_counts())
    return out


def test_comm_debug_mode_counts_fsdp2d_collectives(pool):
    for result in pool.run(job_comm_debug_mode_sees_collectives):
        assert result == {"world": (1, 1, 2, 4), "tp": (1, 1, 2, 4)}
