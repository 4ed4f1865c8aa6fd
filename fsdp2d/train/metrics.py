"""Training metrics: ``metrics.jsonl``, a console progress line, MFU, peak memory, and the
start-up progress lines.

Only rank 0 writes. Each logged step is one JSON object with at least ``step``, ``loss``,
``lr``, ``grad_norm``, ``tokens_per_s`` (the whole job), ``tokens_per_s_per_gpu`` (per
rank: the job's rate over the world size, as ``fsdp2d plan`` reports it),
``tokens_seen`` (samples consumed by all ranks x ``seq_len``: ``step * global_batch *
seq_len`` until a resume changes ``global_batch``) and ``peak_mem_mib``, and ``mfu``
where the device's peak is known; evaluation adds ``eval_loss``; on CUDA
``max_mem_reserved_mib`` and ``num_alloc_retries`` come too (:func:`allocator_metrics`).
Loss and gradient norm are the logged step's; throughput, ``step_time_s`` and MFU are the
mean over the steps since the previous logged (or checkpointed) step, the only steps at which the trainer
reads device values (see :mod:`fsdp2d.train.trainer`). MFU = achieved model FLOP/s per
device (6 N + 12 L H d_head T per token, the model's ``flops_per_token``, times
``tokens_per_s_per_gpu``) over the device's dense bf16 peak: ``metrics.peak_flops`` when
set, else the CUDA device's by name (:func:`device_peak`); no ``mfu`` on CPU or on a GPU
not in the table (a CPU "peak" is not a figure anyone compares against). Metrics files
of earlier versions (with a per-job ``tokens_per_s`` only) read as before.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

_VARIANTS_ELSEWHERE = ("PCIe", "NVL")
"""H100/H200 variants with a lower peak than the SXM parts of fsdp2d.plan's GPU table."""
T0_ENV = "FSDP2D_T0"
"""When ``fsdp2d train`` started (``time.time()``), for the workers' progress lines."""


def device_peak(device: str, configured: float | None) -> float | None:
    """One device's dense bf16 peak FLOP/s for MFU: ``configured``; else, on CUDA, the
    datasheet figure of :data:`fsdp2d.plan.estimate.GPUS` (H100/H200 SXM, A100) when the
    device name says which; else None (no MFU: set ``metrics.peak_flops``)."""
    if configured:
        return configured
    if device != "cuda":
        return None
    from fsdp2d.plan.estimate import GPUS

    name = torch.cuda.get_device_name()
    if any(v in name for v in _VARIANTS_ELSEWHERE) and "A100" not in name:  # (A100 PCIe: the same peak)
        return None
    return next((gpu.bf16_flops for key, gpu in GPUS.items() if key.upper() in name), None)


def throughput(tokens_per_step: int, step_s: float, world: int, flops_per_token: int,
               peak: float | None) -> dict[str, float]:
    """The throughput entries of a logged record (see the module doc)."""
    job = tokens_per_step / step_s
    out = {"tokens_per_s": job, "tokens_per_s_per_gpu": job / world}
    if peak:
        out["mfu"] = flops_per_token * job / world / peak
    return out


class Progress:
    """Start-up progress, one line per phase on rank 0: ``[+12.3s] mesh dp=2 x tp=2 ...``,
    timed from the launch (:data:`T0_ENV`) or from this object's creation."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.t0 = float(os.environ.get(T0_ENV) or time.time())

    def __call__(self, what: str) -> None:
        if self.enabled:
            print(f"[+{time.time() - self.t0:.1f}s] {what}", flush=True)


def peak_memory_mib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def allocator_metrics(device: str) -> dict[str, float]:
    """On CUDA, what the caching allocator says about memory beyond the peak allocated:
    ``max_mem_reserved_mib`` (held from the driver: what the job really needs) and
    ``num_alloc_retries`` (allocations that had to free cached blocks and retry, a sign
    of fragmentation near the limit; each one synchronizes the device). Nothing on CPU."""
    if device != "cuda":
        return {}
    stats = torch.cuda.memory_stats()
    return {"max_mem_reserved_mib": torch.cuda.max_memory_reserved() / 2**20,
            "num_alloc_retries": stats.get("num_alloc_retries", 0)}


def _si(n: float) -> str:
    """1234567 -> '1.2M'."""
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


class Metrics:
    """Appends one JSON line per logged step; draws a progress line on a terminal (at
    logged and checkpointed steps: the others' losses are not read yet)."""

    def __init__(self, run_dir: Path, total_steps: int, enabled: bool, writers: Sequence[Any] = ()) -> None:
        self.enabled, self.total = enabled, total_steps
        self.path = run_dir / "metrics.jsonl"
        self.tty = sys.stdout.isatty()
        self.writers = list(writers)  # TensorBoard / W&B (fsdp2d.train.writers), fed every logged record
        self._first: tuple[int, float] | None = None  # (step, time) of the first step shown: for the ETA

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)  # (not before the run starts)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for writer in self.writers:
            writer.write(record)
        self.progress(record, final=True)

    def forget_after(self, step: int) -> None:
        """(On resume from ``step``.) Drop the lines of later steps: the resumed run logs
        them again, and a run stopped between a log and a checkpoint had logged them.
        The same for the sample log (``data.log_samples``), ``samples.jsonl``."""
        if not self.enabled:
            return
        for path in (self.path, self.path.with_name("samples.jsonl")):
            if not path.exists():
                continue
            lines = path.read_text().splitlines(keepends=True)
            kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
            if len(kept) != len(lines):
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text("".join(kept))
                tmp.replace(path)  # whole or not at all

    def close(self) -> None:
        for writer in self.writers:
            writer.close()

    def eta(self, step: int) -> str | None:
        """Time left, ``h:mm:ss``, at the mean time of the steps since the first one shown
        (start-up and the first, slowest step do not count); None until 3 are timed."""
        now = time.perf_counter()
        if self._first is None:
            self._first = (step, now)
        step0, t0 = self._first
        if step - step0 < 3:
            return None
        left = (now - t0) / (step - step0) * max(self.total - step, 0)
        return f"{int(left) // 3600}:{int(left) % 3600 // 60:02d}:{int(left) % 60:02d}"

    def progress(self, record: dict[str, Any], final: bool = False) -> None:
        if not self.enabled:
            return
        step = record["step"]
        width = 24
        filled = int(width * step / max(self.total, 1))
        bar = "#" * filled + "." * (width - filled)
        text = f"[{bar}] step {step}/{self.total} loss {record['loss']:.4f} lr {record['lr']:.2e} "
        if "tokens_per_s_per_gpu" in record:
            text += f"{record['tokens_per_s_per_gpu']:.0f} tok/s/GPU ({record['tokens_per_s']:.0f} job)"
        else:  # (records of earlier versions)
            text += f"{record['tokens_per_s']:.0f} tok/s"
        if "mfu" in record:
            text += f" mfu {100 * record['mfu']:.1f}%"
        if "tokens_seen" in record:
            text += f" {_si(record['tokens_seen'])} tokens"
        if "eval_loss" in record:
            text += f" eval {record['eval_loss']:.4f}"
        eta = self.eta(step)
        text += f" ETA {eta}" if eta else ""
        if self.tty:
            print("\r" + text, end="\n" if step == self.total else "", flush=True)
        elif final:
            print(text, flush=True)
