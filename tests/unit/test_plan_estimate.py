"""The roofline arithmetic and the errors of ``fsdp2d plan`` (no dry run, no process group)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fsdp2d.plan._format import format_report
from fsdp2d.plan.estimate import GPUS, comm_table, estimate, wire_factor

ROOT = Path(__file__).resolve().parents[2]
H100 = GPUS["h100"]


def _measured(peak: int) -> dict:
    return {"peak": peak, "collectives": {"dp/all_gather": [2, 8 * 10**9], "tp/all_reduce": [4, 10**9]}}


def test_ring_bytes_per_kind():
    assert wire_factor("all_gather", 8) == wire_factor("reduce_scatter", 8) == 7 / 8
    assert wire_factor("all_reduce", 4) == 2 * 3 / 4 and wire_factor("all_gather", 1) == 0


def test_axes_on_nvlink_or_network_and_the_overlap_rule():
    ranks = {"dp": [0, 8, 16, 24], "tp": list(range(8))}  # dp spans 4 nodes of 8, tp is one node
    comm = comm_table(_measured(1), ranks, 8, H100)
    assert comm["dp/all_gather"]["link"] == "network" and comm["tp/all_reduce"]["link"] == "nvlink"
    assert comm["dp/all_gather"]["seconds"] == pytest.approx(8e9 * 3 / 4 / H100.network_bytes_per_s)
    assert comm["tp/all_reduce"]["seconds"] == pytest.approx(1e9 * 2 * 7 / 8 / H100.nvlink_bytes_per_s)
    e = estimate(_measured(1), comm, H100, tokens_per_gpu=8192, flops_per_token=1e9, compute_seconds=0.05)
    dp, tp = comm["dp/all_gather"]["seconds"], comm["tp/all_reduce"]["seconds"]
    assert e["step_s"] == pytest.approx(max(0.05, dp) + tp)  # FSDP overlaps compute, TP does not
    assert e["step_s_serial"] == pytest.approx(0.05 + dp + tp)
    assert e["mfu"] == pytest.approx(1e9 * 8192 / e["step_s"] / H100.bf16_flops)


def test_does_not_fit_says_by_how_much():
    peak = int(H100.hbm_bytes + 3 * 2**30)
    e = estimate(_measured(peak), {}, H100, 1.0, 1.0, 1.0)
    assert not e["fits"] and e["over_bytes"] == 3 * 2**30
    rank = {"rank": 0, "coordinate": {"dp": 0}, "estimate": e, "peak": peak, "peak_breakdown": {"other": peak},
            "phase_peak": {"backward 0": peak}, "dry_run_s": 1.0, "parameters": 0, "padding": 0, "gradients": 0,
            "optimizer": 0, "collectives": {}, "comm": {}, "flops": 0, "roofline_ops": 0}
    report = {"config": {"training": {"global_batch": 1, "mixed_precision": "bf16", "activation_checkpointing": True},
                         "model": {"name": "llama"}, "data": {"seq_len": 1}},
              "gpu_figures": vars(H100), "mesh": {"dp": 1}, "world_size": 1, "gpus_per_node": 1,
              "model_params": 1, "micro_batch": 1, "accum_steps": 1, "tokens_per_gpu_per_step": 1, "ranks": [rank]}
    assert "does not fit: 3.00 GiB over" in format_report(report, "x.toml")


def test_report_shows_each_accumulation_mode():
    """With micro-batches the table prints both ``training.grad_sync`` modes: peak,
    gradients at the peak, the collectives that differ (only those) and the step."""
    from fsdp2d.plan._format import _accumulation

    def mode(peak, grads, rs):
        return {"peak": peak * 2**30, "gradients_at_peak": grads * 2**30, "peak_phase": "forward 3",
                "collectives": {"dp/all_gather": [644, 2**30], "dp/reduce_scatter": [rs, rs * 2**30]},
                "estimate": {"step_s": rs / 100}}

    acc = {"chosen": "every", "accum_steps": 4, "modes": {"every": mode(4.5, 0.04, 324), "last": mode(37.3, 32.86, 81)}}
    lines = _accumulation(acc)
    assert lines[1] == ("    every (chosen)         peak   4.50, gradients at peak   0.04 (forward 3); "
                        "dp/reduce_scatter 324 x 324.00 GiB; step 3.240 s")
    assert lines[2].startswith("    last (other)           peak  37.30, gradients at peak  32.86 (forward 3); "
                               "dp/reduce_scatter 81 x 81.00 GiB") and "all_gather" not in lines[2]
    one = _accumulation({"chosen": "every", "accum_steps": 1, "modes": {"every": mode(1, 0, 1)}})
    assert one == ["  gradient accumulation (training.grad_sync = every): other mode one micro-batch per step: "
                   "both modes are the same step"]


@pytest.mark.parametrize("args,message", [
    (["--world-size", "12"], "world size 12 is not divisible by hsdp_replicate * tp = 1 * 8 = 8"),
    (["--nodes", "2", "--world-size", "16"], "not both"),
    (["--gpu", "tpu"], "--gpu 'tpu' is not in the table"),
    (["--rank", "64"], "--rank 64 is outside the world of 64 ranks"),
])
def test_errors_name_the_thing_at_fault(args, message):
    out = subprocess.run([sys.executable, "-c", "import sys; from fsdp2d.train.cli import main; sys.exit(main())",
                          "plan", "--config", str(ROOT / "configs" / "llama3_70b_64gpu.toml"), *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr
