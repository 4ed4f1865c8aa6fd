"""P2 and P3 of the GPU probe: fsdp2d against torch FSDP2 (+TP), interleaved, without and
with emulated communication.

Both use :mod:`gpu_step`'s jobs (one rank of Llama-3 8B on FSDP 8, and of 70B on TP 8 x
FSDP 32 at two depths, bf16 compute, fp32 reduction, batch 1 x 2048, fused AdamW) with
**both sides resident in one process group**: each side is built and warmed up in turn
(its memory at rest is what ``memory_allocated`` grew by), then the sides alternate in
rounds (fsdp2d first in even rounds, torch first in odd ones), a few steps each, so drift
in clocks and temperature hits both alike; medians over all the steps.

**P2** runs on torch's fake group (collectives move nothing, take no time): per side
the GPU span per step (CUDA events around the step), host time, kernel busy time and
kernels by kind (``torch.profiler``, one step), peak allocated (at rest + the largest rise
during its steps), peak reserved (the process's, so both sides' caches), and the sync
check. 70B at two depths gives per-layer rows (``gpu_step.per_layer``).

**P3** runs on the emulated NCCL group (:mod:`fsdp2d.testing.emulated_pg`): each round
runs every side twice, with the modelled communication time (``torch.cuda._sleep`` on
the groups' side streams) and with zero time (same streams, events and value fills), so
``exposed = span(emulated) - span(zero-time)`` is the communication the stack did not
hide, against the modelled total per step (per mesh axis, from the group's counters).
``fsdp2d plan``'s roofline assumes FSDP overlapped and TP exposed: its exposed time is
``max(0, fsdp - step) + tp + other`` with the measured zero-time step as compute; the
table puts it beside the measured one. A self-test first checks the group on the device:
values (``dist.*`` and torch's functional collectives) and the stream contract (the host
and the current stream run on past an async collective until ``wait()``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

import gpu_step as G
from fsdp2d.plan.estimate import FSDP_AXES
from fsdp2d.testing import emulated_pg as E

SIDES = ("fsdp2d", "torch")
RUNS = [("8b-fsdp8", None), ("70b-fsdp32-tp8", 4), ("70b-fsdp32-tp8", 8)]
TINY_RUNS = [("8b-fsdp8", 2), ("70b-fsdp32-tp8", 1), ("70b-fsdp32-tp8", 2)]
GiB = 2**30


def _ns(a: argparse.Namespace, layers: int | None) -> argparse.Namespace:
    return argparse.Namespace(layers=layers, tiny=a.tiny, seq=32 if a.tiny else 2048, batch=1)


def _order(items: tuple, r: int) -> tuple:
    return items if r % 2 == 0 else items[::-1]


def _alloc(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def build_pair(config: str, ns: argparse.Namespace, device: torch.device, warmup: int) -> tuple[dict, dict]:
    """Both sides' jobs on the current world, each warmed up; bytes at rest per side."""
    jobs, rest = {}, {}
    for side in SIDES:
        before = _alloc(device)
        jobs[side] = job = G.prepare(side, config, ns, device, G.make_mesh(side, config, device))
        for _ in range(warmup):
            job.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        rest[side] = _alloc(device) - before
    return jobs, rest


def timed(job: G.Job, steps: int, device: torch.device) -> dict:
    """``steps`` steps: GPU spans and host times (ms), the largest rise of allocated memory
    above the start, the process's peak reserved, and the emulated groups' counters."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = _alloc(device)
    E.STATE.reset()
    timer = G._Timer(device)
    for _ in range(steps):
        timer.time(job.step)
    gpu = timer.gpu_ms()
    return {"gpu": gpu or [], "host": timer.host, "stats": dict(E.STATE.stats),
            "rise": torch.cuda.max_memory_allocated(device) - base if cuda else 0,
            "reserved": torch.cuda.max_memory_reserved(device) if cuda else 0}


def rounds(jobs: dict, modes: tuple, a: argparse.Namespace, device: torch.device, deadline: float) -> dict:
    """Interleaved rounds: {(side, mode): [chunk, ...]}; stops early at ``deadline``."""
    n_rounds = a.rounds or (1 if a.tiny else 4 if modes == (None,) else 3)
    steps = a.steps or (1 if a.tiny else 3)
    chunks: dict = {(s, m): [] for s in SIDES for m in modes}
    for r in range(n_rounds):
        if r and time.time() > deadline:
            break
        for mode in _order(modes, r):
            if mode is not None:
                E.STATE.comm_time = mode == "emulated"
            for side in _order(SIDES, r):
                chunks[(side, mode)].append(timed(jobs[side], steps, device))
    E.STATE.comm_time = True
    return chunks


def _share(deadline: float, left: int) -> float:
    """When this config's rounds should stop: an equal share of the time left."""
    now = time.time()
    return now + max(0.0, deadline - now) / left


def _median(chunks: list, key: str) -> float | None:
    values = [v for c in chunks for v in c[key]]
    return statistics.median(values) if values else None


# -- P2 ----------------------------------------------------------------------------------
def timing_rows(config: str, layers: int | None, a: argparse.Namespace, device: torch.device,
                deadline: float) -> list[dict]:
    ns = _ns(a, layers)
    G.init_fake_world(0, G.CONFIGS[config][1])
    jobs: dict = {}
    try:
        jobs, rest = build_pair(config, ns, device, warmup=1 if a.tiny else 2)
        chunks = rounds(jobs, (None,), a, device, deadline)
        rows = []
        for side in SIDES:
            mine = chunks[(side, None)]
            job = jobs[side]
            row = {**G.job_row(job, ns, device), "gpu_ms": _median(mine, "gpu"), "host_ms": _median(mine, "host"),
                   "rounds": len(mine), "steps_per_round": len(mine[0]["host"]),
                   "gpu_ms_by_round": [statistics.median(c["gpu"]) if c["gpu"] else None for c in mine],
                   "rest_gib": rest[side] / GiB,
                   "peak_gib": (rest[side] + max(c["rise"] for c in mine)) / GiB if device.type == "cuda" else None,
                   "reserved_gib": max(c["reserved"] for c in mine) / GiB if device.type == "cuda" else None}
            row["kernels"], busy = G.profile_kernels(job.step, device)
            row["kernel_ms"] = busy if device.type == "cuda" else None
            row.update(G.sync_check(job.step, device))
            rows.append(row)
        del job
        return rows
    finally:
        dist.destroy_process_group()
        jobs.clear()
        G.free_device_memory(device)


def phase_timing(a: argparse.Namespace, device: torch.device, rec, deadline: float) -> None:
    rows: list[dict] = []
    runs = TINY_RUNS if a.tiny else RUNS
    for i, (config, layers) in enumerate(runs):
        key = f"{config}@{layers or 'all'}"
        share = _share(deadline, len(runs) - i)

        def run() -> dict:
            got = timing_rows(config, layers, a, device, share)
            rows.extend(got)
            return {"ok": all(r["sync_error"] is None and r["host_reads"] == 0 for r in got), "rows": got,
                    "summary": " ".join(f"{r['side']} {G._fmt(r['gpu_ms'], '.1f')} ms" for r in got)}
        rec.check(key, run, skip="budget" if time.time() > deadline - 20 else None)
    rec.put("per_layer", G.per_layer(rows))
    rec.put("table", G.table(rows + G.per_layer(rows)))


# -- P3 ----------------------------------------------------------------------------------
@contextlib.contextmanager
def emulated_world(world: int, link: E.LinkModel, device: torch.device):
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore

    E.register(link)
    _clear_sharding_prop_cache()  # (as init_fake_world: no cached spec from an earlier world)
    dist.init_process_group(E.BACKEND, store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def link_model(a: argparse.Namespace) -> E.LinkModel:
    d = E.LinkModel()
    return E.LinkModel(nvlink_bytes_per_s=(a.nvlink_gbps or d.nvlink_bytes_per_s / 1e9) * 1e9,
                       network_bytes_per_s=(a.network_gbps or d.network_bytes_per_s / 1e9) * 1e9,
                       gpus_per_node=a.gpus_per_node or d.gpus_per_node)


def selftest(device: torch.device) -> dict:
    """The emulated group on this device, 8 ranks: values through ``dist.*`` and torch's
    functional collectives; on CUDA the stream contract, timed on a slow (1 GB/s) link."""
    import torch.distributed._functional_collectives as funcol

    x = torch.arange(1.0, 5.0, device=device)  # this rank's input (every rank holds it)
    big = torch.arange(32.0, device=device)
    with emulated_world(8, E.LinkModel(), device):
        g = dist.group.WORLD
        out, rs, avg, ar = torch.empty(32, device=device), torch.empty(4, device=device), \
            torch.empty(4, device=device), x.clone()
        dist.all_gather_single(out, x)
        dist.reduce_scatter_single(rs, big)
        dist.reduce_scatter_single(avg, big, op=dist.ReduceOp.AVG)
        dist.all_reduce(ar)
        f_ar = funcol.wait_tensor(funcol.all_reduce(x, "sum", g))
        f_ag = funcol.wait_tensor(funcol.all_gather_tensor(x, 0, g))
        f_rs = funcol.wait_tensor(funcol.reduce_scatter_tensor(big, "sum", 0, g))
        values = {"all_gather": torch.equal(out, x.repeat(8)), "reduce_scatter_sum": torch.equal(rs, 8 * big[:4]),
                  "reduce_scatter_avg": torch.equal(avg, big[:4]), "all_reduce": torch.equal(ar, 8 * x),
                  "funcol_all_reduce": torch.equal(f_ar, 8 * x), "funcol_all_gather": torch.equal(f_ag, x.repeat(8)),
                  "funcol_reduce_scatter": torch.equal(f_rs, 8 * big[:4])}
        out = {"values": values, "ok": all(values.values())}
        if device.type == "cuda":
            out["streams"] = _stream_contract(device)
            out["ok"] = out["ok"] and out["streams"]["ok"]
    return out


def _stream_contract(device: torch.device) -> dict:
    """An async all-gather of a 32 MiB output on a 1 GB/s link (7/8 x 32 MiB / 1e9 = 29 ms
    modelled): the host and the current stream go on at once; after ``wait()`` the
    current stream has waited the modelled time. No host sync (checked)."""
    old = E.STATE.link
    E.STATE.link = E.LinkModel(nvlink_bytes_per_s=1e9, network_bytes_per_s=1e9)
    try:
        inp = torch.ones(1 << 20, device=device)  # 4 MiB, x 8 ranks
        out = torch.empty(8 << 20, device=device)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            ev[0].record()
            t0 = time.perf_counter()
            work = dist.all_gather_single(out, inp, async_op=True)
            issue_ms = (time.perf_counter() - t0) * 1e3
            ev[1].record()
            work.wait()
            host_ms = (time.perf_counter() - t0) * 1e3
            ev[2].record()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        modelled = 7 / 8 * out.numel() * 4 / 1e9 * 1e3
        before_wait, after_wait = ev[0].elapsed_time(ev[1]), ev[0].elapsed_time(ev[2])
        return {"ok": before_wait < 2 and abs(after_wait - modelled) < 0.2 * modelled and host_ms < 10
                and bool(torch.all(out == 1)), "modelled_ms": modelled, "current_stream_before_wait_ms": before_wait,
                "current_stream_after_wait_ms": after_wait, "host_issue_ms": issue_ms, "host_total_ms": host_ms}
    finally:
        E.STATE.link = old


def _axis_names(jobs: dict) -> dict[str, str]:
    out = {}
    for job in jobs.values():
        for name in job.mesh.mesh_dim_names:
            out[job.mesh.get_group(name).group_name] = name
    return out


def _comm_ms(chunks: list, axes: dict[str, str]) -> dict[str, float]:
    """Modelled communication per step (ms) by axis: FSDP axes, tp, other."""
    total: dict[str, float] = {}
    steps = sum(len(c["host"]) for c in chunks)
    for c in chunks:
        for (group, kind), (_, _, seconds) in c["stats"].items():
            axis = axes.get(group, "other")
            axis = "fsdp" if axis in FSDP_AXES else axis
            total[axis] = total.get(axis, 0.0) + seconds * 1e3 / steps
    return total


def _sleep_ms(step, device: torch.device) -> float | None:
    """The ``_sleep`` kernels' own time in one profiled step (clock drift check)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(e.time_range.elapsed_us() for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and "spin" in e.name.lower()) / 1e3


def comm_rows(config: str, layers: int | None, a: argparse.Namespace, device: torch.device,
              deadline: float) -> list[dict]:
    ns = _ns(a, layers)
    jobs: dict = {}
    with emulated_world(G.CONFIGS[config][1], link_model(a), device):
        try:
            jobs, _ = build_pair(config, ns, device, warmup=1 if a.tiny else 2)
            chunks = rounds(jobs, ("zero", "emulated"), a, device, deadline)
            axes = _axis_names(jobs)
            rows = []
            for side in SIDES:
                zero, emu = _median(chunks[(side, "zero")], "gpu"), _median(chunks[(side, "emulated")], "gpu")
                comm = _comm_ms(chunks[(side, "emulated")], axes)
                fsdp, tp = comm.get("fsdp", 0.0), comm.get("tp", 0.0)
                other = sum(v for k, v in comm.items() if k not in ("fsdp", "tp"))
                row = {**G.job_row(jobs[side], ns, device), "zero_ms": zero, "emulated_ms": emu,
                       "host_zero_ms": _median(chunks[(side, "zero")], "host"),
                       "host_emulated_ms": _median(chunks[(side, "emulated")], "host"),
                       "rounds": len(chunks[(side, "zero")]), "comm_ms": comm, "comm_total_ms": fsdp + tp + other}
                if zero is not None and emu is not None:
                    row["exposed_ms"] = emu - zero
                    row["hidden_pct"] = 100 * (1 - row["exposed_ms"] / row["comm_total_ms"]) \
                        if row["comm_total_ms"] else None
                    row["plan_exposed_ms"] = max(0.0, fsdp - zero) + tp + other
                row["sleep_kernel_ms"] = _sleep_ms(jobs[side].step, device)
                row.update(G.sync_check(jobs[side].step, device))
                rows.append(row)
            return rows
        finally:
            jobs.clear()
            G.free_device_memory(device)


def phase_comm(a: argparse.Namespace, device: torch.device, rec, deadline: float) -> None:
    link = link_model(a)
    if device.type == "cuda":
        E.register(link, cycles_per_s=E.calibrate_sleep(device))
    rec.put("model", {"link": dataclasses.asdict(link),
                      "cycles_per_s": E.STATE.cycles_per_s,
                      "cost": "ring: all-gather/reduce-scatter (k-1)/k x logical bytes, all-reduce 2(k-1)/k, "
                              "broadcast/all-to-all 1x; NVLink if the group is inside one node, else network"})
    rec.check("selftest", lambda: selftest(device))
    rows: list[dict] = []
    runs = TINY_RUNS if a.tiny else RUNS
    for i, (config, layers) in enumerate(runs):
        share = _share(deadline, len(runs) - i)

        def run() -> dict:
            got = comm_rows(config, layers, a, device, share)
            rows.extend(got)
            return {"ok": all(r["sync_error"] is None for r in got), "rows": got,
                    "summary": " ".join(f"{r['side']} exposed {G._fmt(r.get('exposed_ms'), '.1f')} of "
                                        f"{r['comm_total_ms']:.1f} ms" for r in got)}
        rec.check(f"{config}@{layers or 'all'}", run, skip="budget" if time.time() > deadline - 25 else None)
