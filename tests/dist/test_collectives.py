"""fsdp2d's pairwise-exchange collectives on gloo (``fsdp2d._collectives``) against
gloo's native ones and against sums computed independently on the driver.

Every rank fills its input from a seed of its own rank, so the driver can rebuild every
rank's input and compute the expected results exactly (float64 inputs and integer-valued
float32 sums are exact in any order; the float32 random case is compared with the
native collective on the same data, and across ranks bit for bit).
"""

import torch

from .pool import capture_error, get_mesh

WORLD = 4


def _input(rank: int, n: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def job_exchanges():
    import torch.distributed as dist
    from fsdp2d import _collectives as C
    from fsdp2d.debug import CollectiveCounter

    mesh = get_mesh((2, 2), ("dp", "tp"))
    out = {}
    for name, group in (("world", dist.group.WORLD), ("tp", mesh.get_group("tp"))):
        k, me = dist.get_world_size(group), dist.get_rank(group)
        assert C._exchange_peers(group, torch.zeros(1)) is not None
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
        out[name] = {"k": k, "me": me, "ranks": dist.get_process_group_ranks(group),
                     "gathered": gathered, "rs": rs_out, "ar": ar, "x_after": x,
                     "async_ag": a_out, "async_rs": b_out,
                     "counts": {kind: c for (g, kind), c in counter.counts.items() if g == group.group_name}}
    # float32 random data: the exchange equals gloo's own all-reduce / reduce-scatter
    tp = mesh.get_group("tp")
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
    return out


def test_exchanges_match_independent_sums_and_gloo(pool):
    results = pool.run(job_exchanges)
    for rank, res in enumerate(results):
        for name in ("world", "tp"):
            r = res[name]
            k, me, ranks = r["k"], r["me"], r["ranks"]
            assert ranks[me] == rank
            expect_ag = torch.cat([_input(g, 6) for g in ranks])
            assert torch.equal(r["gathered"], expect_ag), (rank, name)
            expect_rs = sum(_input(g, 3 * k)[3 * me:3 * me + 3] for g in ranks)
            torch.testing.assert_close(r["rs"], expect_rs, rtol=1e-15, atol=0)
            if k == 2:
                torch.testing.assert_close(r["ar"], _input(ranks[0], 6) + _input(ranks[1], 6), rtol=0, atol=0)
                assert torch.equal(r["x_after"], _input(rank, 6))  # inplace=False left x alone
            assert torch.equal(r["async_ag"], torch.arange(k, dtype=torch.float32).repeat_interleave(2))
            assert r["async_rs"].item() == sum(me + j for j in range(k))  # chunk me of (arange(k) + j)
            expect_counts = {"all_gather": [1, 6 * k * 8], "reduce_scatter": [1, 3 * k * 8]}
            if k == 2:
                expect_counts["all_reduce"] = [1, 6 * 8]
            assert r["counts"] == expect_counts, (name, r["counts"])
        f = res["f32"]
        assert torch.equal(f["ar"], f["ar_native"]) and torch.equal(f["rs"], f["rs_native"])
        for err in res["errors"]:
            assert err is not None and err[0] == "ValueError" and "same dtype" in err[1], err
        assert torch.equal(res["after_errors"], torch.full((2,), 2.0))
    for a, b in ((0, 1), (2, 3)):  # both TP ranks hold the bit-identical sum
        assert torch.equal(results[a]["f32"]["ar"], results[b]["f32"]["ar"])
