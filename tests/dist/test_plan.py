"""``fsdp2d plan`` checked against a real run of the same small job on 4 CPU ranks.

One fixture runs ``fsdp2d plan --config tests/plan_small.toml --json`` (a subprocess:
fake process group, ``FakeTensorMode``, ranks 0 and 3 of 4); the pool job builds the
same job for real (the trainer's ``build_model`` on a 2 x 2 gloo mesh), takes one real
warm-up step, then one real step of every micro-batch measured two ways that share no
code with the estimator: the benchmark's storage tracker (``benchmarks/compare_torch.py``
``StepTracker``: peak of live tensor storage, as ``make bench`` reports it) and
``fsdp2d.debug.CollectiveCounter`` (collectives per process group, mapped to axes).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .pool import get_mesh

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "tests" / "plan_small.toml"


def _storage_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    local = [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]
    return sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in local}.values())


def job_real_step(config: str, overrides: tuple[str, ...] = ()) -> dict:
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from compare_torch import StepTracker

    from fsdp2d.debug import CollectiveCounter
    from fsdp2d.plan._dryrun import axis_groups, build_optimizer, trainer_step
    from fsdp2d.plan.cli import resolve
    from fsdp2d.train.trainer import build_model

    cfg = resolve(config, list(overrides), 4)
    mesh = get_mesh(cfg.mesh_shape, cfg.mesh_dim_names)
    model = build_model(cfg, mesh)
    opt = build_optimizer(model.parameters(), cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.micro_batch, cfg.data.seq_len), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (cfg.micro_batch, cfg.data.seq_len), generator=g)
    trainer_step(model, opt, cfg, x, y)  # warm-up: optimizer state exists from here on
    gc.collect()
    params = list(model.parameters())
    tracker = StepTracker({})
    tracker.track(params, list(opt.state.values()), list(model.buffers()), x, y)
    with CollectiveCounter() as counter, tracker:
        trainer_step(model, opt, cfg, x, y, zero_grad=False)
    axis = axis_groups(mesh)
    out = {
        "peak": tracker.peak, "parameters": _storage_bytes(params),
        "gradients": _storage_bytes([p.grad for p in params]),
        "optimizer": _storage_bytes([t for s in opt.state.values() for t in s.values()]),
        "collectives": {f"{axis.get(group, 'other')}/{kind}": v for (group, kind), v in counter.counts.items()},
    }
    opt.zero_grad()
    return out


@pytest.fixture(scope="module")
def planned() -> dict:
    out = subprocess.run([str(Path(sys.executable).with_name("fsdp2d")), "plan", "--config", str(CONFIG), "--json"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def real(pool) -> dict[str, list[dict]]:
    """The real step in each ``training.grad_sync`` mode, per rank."""
    return {mode: pool.run(job_real_step, str(CONFIG), (f"--training.grad_sync={mode}",))
            for mode in ("every", "last")}


def test_plan_json_fields(planned):
    """(c) ``fsdp2d plan --json`` on a small config: ranks 0 and the last, every figure."""
    assert planned["world_size"] == 4 and planned["mesh"] == {"dp": 2, "tp": 2}
    assert planned["accum_steps"] == 3 and planned["gpu"] == "h100"
    assert [r["rank"] for r in planned["ranks"]] == [0, 3]
    for r in planned["ranks"]:
        for key in ("parameters", "gradients", "optimizer", "peak", "padding", "flops"):
            assert isinstance(r[key], int) and r[key] >= 0, key
        assert r["peak"] > r["parameters"] + r["optimizer"] > 0
        assert set(r["collectives"]) >= {"dp/all_gather", "dp/reduce_scatter", "tp/all_gather"}
        for row in r["collectives"].values():
            assert set(row) == {"count", "bytes", "wire_bytes", "link", "seconds"}
            assert row["link"] == "nvlink"  # 4 ranks: one node of 8
        e = r["estimate"]
        assert e["fits"] and e["over_bytes"] == 0
        assert e["step_s"] >= e["compute_s"] > 0 and e["step_s_serial"] >= e["step_s"]
        assert e["tokens_per_s_per_gpu"] == pytest.approx(planned["tokens_per_gpu_per_step"] / e["step_s"])
        assert 0 < e["mfu"] < 1
    # dim 40: the SwiGLU rows split 27 / 26 over dp, so the last dp rank's shards are padded
    assert planned["ranks"][0]["padding"] == 0 and planned["ranks"][1]["padding"] > 0


@pytest.mark.parametrize("index,rank", [(0, 0), (1, 3)])
def test_memory_matches_a_real_run(planned, real, index, rank):
    """(a) The dry run's memory against the real run's storage-level peak: within 10%."""
    plan, got = planned["ranks"][index], real["every"][rank]  # the default mode
    print(f"rank {rank}: plan {({k: plan[k] for k in got if k != 'collectives'})} real "
          f"{({k: v for k, v in got.items() if k != 'collectives'})}")
    for key in ("peak", "parameters", "gradients", "optimizer"):
        assert abs(plan[key] - got[key]) <= 0.10 * got[key], (key, plan[key], got[key])


@pytest.mark.parametrize("index,rank", [(0, 0), (1, 3)])
def test_collectives_match_a_real_run(planned, real, index, rank):
    """(b) Collectives and bytes per mesh axis: equal to what the real step issued (the
    dry run extrapolates the middle micro-batch; the real run ran all three)."""
    plan = {k: [v["count"], v["bytes"]] for k, v in planned["ranks"][index]["collectives"].items()}
    assert plan == real["every"][rank]["collectives"]


@pytest.mark.parametrize("mode", ["every", "last"])
@pytest.mark.parametrize("index,rank", [(0, 0), (1, 3)])
def test_each_accumulation_mode_matches_a_real_run(planned, real, mode, index, rank):
    """(d) The report's figures for both ``training.grad_sync`` modes (the default
    ``every`` and the other, ``last``, measured in the same dry run) against a real step
    in that mode: peak within 10%, collectives equal. In ``every`` the gradients live at
    the peak are the sharded gradients; ``last`` holds the unsharded accumulators too."""
    acc, plan = planned["ranks"][index]["accumulation"], planned["ranks"][index]
    assert acc["chosen"] == "every" and acc["accum_steps"] == 3 and set(acc["modes"]) == {"every", "last"}
    m, got = acc["modes"][mode], real[mode][rank]
    assert abs(m["peak"] - got["peak"]) <= 0.10 * got["peak"], (m["peak"], got["peak"])
    assert m["collectives"] == got["collectives"]
    if mode == "every":  # the chosen mode's figures are the report's own
        assert m["peak"] == plan["peak"] and m["gradients_at_peak"] == plan["gradients"]
        assert m["estimate"] == plan["estimate"]
    else:
        # dp = 2: full TP-local accumulators are ~2x the sharded gradients (the shards carry padding)
        assert m["gradients_at_peak"] > 1.5 * acc["modes"]["every"]["gradients_at_peak"]


@pytest.mark.parametrize("device", ["cuda", "cpu"])  # AdamW's foreach ops (as on CUDA) and its for-loop
def test_dry_run_steps_the_shards_as_dtensor_would(device):
    """The dry run's AdamW on the parameters' local shards (``ShardOptimizer``, 12 s less
    for 70B) measures the same step as AdamW through DTensor: every figure equal, ranks
    0 and 3 (the last one's shards padded). In this process: fake process group only."""
    from fsdp2d.plan._dryrun import dry_run
    from fsdp2d.plan.cli import resolve

    cfg = resolve(str(CONFIG), [f"--parallel.device={device}"], None)
    for rank in (0, 3):
        assert dry_run(cfg, 4, rank) == dry_run(cfg, 4, rank, shard_optimizer=False), rank


def test_selective_checkpointing_dry_run_matches_a_real_run(pool):
    """``fsdp2d plan`` dry-runs the job's checkpointing mode: under ``selective`` its
    memory is the real run's (within 10%, as above) with the same collectives, and lies
    between ``none``'s and ``full``'s; its FLOPs are ``none``'s (no matmul recomputed)."""
    from fsdp2d.plan._dryrun import dry_run
    from fsdp2d.plan.cli import resolve

    modes = ("none", "selective", "full")
    cfgs = {m: resolve(str(CONFIG), [f"--training.activation_checkpointing={m}"], None) for m in modes}
    real = pool.run(job_real_step, str(CONFIG), ("--training.activation_checkpointing=selective",))
    for rank in (0, 3):
        plan = {m: dry_run(cfgs[m], 4, rank) for m in modes}
        got = plan["selective"]
        for key in ("peak", "parameters", "gradients", "optimizer"):
            assert abs(got[key] - real[rank][key]) <= 0.10 * real[rank][key], (key, got[key], real[rank][key])
        assert {k: list(v) for k, v in got["collectives"].items()} == real[rank]["collectives"]
        assert plan["none"]["peak"] > got["peak"] > plan["full"]["peak"]
        assert plan["none"]["flops"] == got["flops"] < plan["full"]["flops"]
