"""benchmarks/gpu_step.py's CPU smoke mode: the GPU benchmark's code path (fake process
group, both stacks, timing, profiler, sync check, table, JSON) on a tiny model, so the
script a GPU run needs is known to work before a GPU is lent. No figure is asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_step.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_step", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_step", mod)  # (its dataclasses look their module up there)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_smoke_mode_runs_both_stacks_on_both_jobs(tmp_path):
    out = tmp_path / "smoke.json"
    root = str(SCRIPT.parents[1])  # this checkout's fsdp2d, whatever is installed
    path = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--steps", "1", "--warmup", "0",
                          "--json", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    per_layer = "per layer (1->2)"
    assert [(r["config"], r["side"], r["layers"]) for r in rows] == [
        ("8b-fsdp8", "fsdp2d", 2), ("8b-fsdp8", "torch", 2),
        ("70b-fsdp32-tp8", "fsdp2d", 1), ("70b-fsdp32-tp8", "torch", 1),
        ("70b-fsdp32-tp8", "fsdp2d", 2), ("70b-fsdp32-tp8", "torch", 2),
        ("70b-fsdp32-tp8", "fsdp2d", per_layer), ("70b-fsdp32-tp8", "torch", per_layer)]
    for r in rows:
        assert r["sync_error"] is None and r["host_reads"] == 0, r
        assert r["ops"]["gemm"] > 0 and r["ops"]["nccl"] > 0, r  # the step ran, collectives issued
        assert r["kernel_ms"] is None, r  # not measured on the CPU
    fsdp8 = rows[0]
    # 2 blocks + root: forward 3 all-gathers, backward 2 (root kept), 3 reduce-scatters
    assert fsdp8["ops"]["nccl"] == 8, fsdp8["ops"]
    # one more block: its all-gather in forward and in backward, its reduce-scatter, and
    # TP's all-reduces (attention and MLP outputs in forward, their inputs in backward)
    assert rows[6]["ops"]["nccl"] == 3 + 4, rows[6]["ops"]
    assert f"| 70b-fsdp32-tp8 | torch | {per_layer} |" in run.stdout
    assert "| kernel ms/step (busy) |" in run.stdout


def test_kernel_kinds():
    kind = _module().kernel_kind
    assert kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kind("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "gemm"
    assert kind("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>") == "gemm"
    assert kind("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "nccl"
    assert kind("void at::native::(anonymous namespace)::chunk_cat_cuda_kernel<float, c10::BFloat16>") == "copy"
    assert kind("Memcpy DtoD (Device -> Device)") == "copy"
    assert kind("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>") == "elementwise"
    assert kind("void at::native::(anonymous namespace)::fused_adam_kernel") == "elementwise"
    assert kind("aten.mm") == "gemm" and kind("c10d.allgather_") == "nccl" and kind("aten.add") == "elementwise"


def test_busy_time_is_the_union_of_kernel_spans():
    # GPU busy time: the events' span also counts the gaps where a host-bound step leaves
    # the GPU idle, and a sum of durations would count kernels on overlapping streams
    # (torch FSDP2's side streams) twice: the union of the spans, in ms
    busy = _module().busy_ms
    assert busy([]) == 0.0
    assert busy([(0.0, 100.0), (300.0, 400.0)]) == 0.2  # a 200 us idle gap is not busy
    assert busy([(0.0, 100.0), (50.0, 150.0), (60.0, 70.0), (150.0, 200.0)]) == 0.2  # overlaps once
    assert busy([(500.0, 600.0), (0.0, 1000.0)]) == 1.0  # unsorted, nested
