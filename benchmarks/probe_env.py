"""P0 of the GPU probe: what the machine is, what its torch has, how fast ``_sleep`` spins.

Everything later phases' figures depend on: versions (torch, CUDA, cuDNN, NCCL, the
driver from ``nvidia-smi``, Python), the device (name, SMs, memory, capability), the
torch entry points fsdp2d and the probe use that may be missing from an older torch
(``dist.all_gather_single``, ``split_group``, ``ReduceOp.AVG``, ``torch.cuda._sleep``,
the Python process-group method names), the ``torch.cuda._sleep`` calibration that P3's
emulated communication runs on (cycles per second from CUDA events, and the launch's
fixed cost), and which fsdp2d this is (git commit if the checkout has one, and a digest of
its sources either way).
"""

from __future__ import annotations

import hashlib
import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


def versions() -> dict:
    out = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "cudnn": None, "nccl": None}
    try:
        out["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001 - a CPU wheel
        pass
    try:
        v = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else v
    except Exception:  # noqa: BLE001
        pass
    out["nvidia_smi"] = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"])
    out["nvidia_smi_state"] = _run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,power.limit,pstate,"
                                    "temperature.gpu,clocks_throttle_reasons.active", "--format=csv,noheader"])
    return out


def device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"type": "cpu", "cpus": len(__import__("os").sched_getaffinity(0))}
    p = torch.cuda.get_device_properties(device)
    return {"type": "cuda", "name": p.name, "sms": p.multi_processor_count, "memory_gib": p.total_memory / 2**30,
            "capability": f"{p.major}.{p.minor}", "count": torch.cuda.device_count()}


def features() -> dict:
    """The entry points whose absence changes what runs (after the worker's shims: its
    ``shims`` entry lists the two it mapped on a torch older than 2.13)."""
    pg = dist.ProcessGroup
    return {"dist.all_gather_single": hasattr(dist, "all_gather_single"),
            "dist.reduce_scatter_single": hasattr(dist, "reduce_scatter_single"),
            "dist.split_group": hasattr(dist, "split_group"), "ReduceOp.AVG": hasattr(dist.ReduceOp, "AVG"),
            "ReduceOp.factor": hasattr(dist._make_nccl_premul_sum(0.5), "factor"),
            "torch.cuda._sleep": hasattr(torch.cuda, "_sleep"),
            "set_sync_debug_mode": hasattr(torch.cuda, "set_sync_debug_mode"),
            "ProcessGroup.all_gather_single": hasattr(pg, "all_gather_single"),
            "ProcessGroup._allgather_base": hasattr(pg, "_allgather_base"),
            "Work.block_current_stream": hasattr(dist._Work, "block_current_stream")}


def sleep_calibration(device: torch.device) -> dict:
    """Cycles per second of ``torch.cuda._sleep`` (the slope between 1e6 and 1e7 cycles)
    and the fixed cost per launch (the intercept), both from CUDA events."""
    from fsdp2d.testing.emulated_pg import calibrate_sleep

    rate = calibrate_sleep(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end)
    return {"cycles_per_s": rate, "ghz": rate / 1e9, "ms_1e6_cycles": ms, "fixed_ms": ms - 1e6 / rate * 1e3}


def fsdp2d_source() -> dict:
    digest = hashlib.sha256()
    files = sorted((ROOT / "fsdp2d").rglob("*.py"))
    for f in files:
        digest.update(f.relative_to(ROOT).as_posix().encode())
        digest.update(f.read_bytes())
    commit = _run(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    dirty = _run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
    return {"commit": commit, "dirty": bool(dirty) if commit else None, "source_sha256": digest.hexdigest()[:16],
            "files": len(files)}


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def phase_env(a, device: torch.device, rec) -> None:
    rec.put("versions", versions())
    rec.put("device", device_info(device))
    rec.put("features", features())
    rec.put("fsdp2d", fsdp2d_source())
    rec.check("sleep_calibration", lambda: sleep_calibration(device),
              skip=None if device.type == "cuda" else "cpu")
