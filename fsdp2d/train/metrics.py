"""Training metrics: ``metrics.jsonl``, a console progress line, MFU and peak memory.

Only rank 0 writes. Each logged step is one JSON object with at least ``step``, ``loss``,
``lr``, ``grad_norm``, ``tokens_per_s``, ``mfu`` and ``peak_mem_mib``; evaluation adds
``eval_loss``; on CUDA ``max_mem_reserved_mib`` and ``num_alloc_retries`` come too
(:func:`allocator_metrics`). Loss and gradient norm are the logged step's; ``tokens_per_s``,
``step_time_s`` and MFU are the mean over the steps since the previous logged (or
checkpointed) step, the only steps at which the trainer reads device values (see
:mod:`fsdp2d.train.trainer`). MFU = achieved model FLOP/s (6 N + 12 L H d_head T per
token, the model's ``flops_per_token``) over the peak of all ranks:
``metrics.peak_flops`` per device when set, H100/A100 bf16 defaults on CUDA, and on CPU
a matmul peak measured at start-up on one thread (what each rank gets here).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

GPU_PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s


def measure_cpu_peak(n: int = 256, reps: int = 20) -> float:
    """FLOP/s of an fp32 n x n matmul on this process's threads (best of ``reps``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def device_peak(device: str, configured: float | None) -> float:
    if configured:
        return configured
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for key, peak in GPU_PEAKS.items():
            if key in name:
                return peak
        return GPU_PEAKS["A100"]
    return measure_cpu_peak()


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
        them again, and a run stopped between a log and a checkpoint had logged them."""
        if not self.enabled or not self.path.exists():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
        if len(kept) != len(lines):
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(kept))
            tmp.replace(self.path)  # whole or not at all

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
        text = (f"[{bar}] step {step}/{self.total} loss {record['loss']:.4f} lr {record['lr']:.2e} "
                f"{record['tokens_per_s']:.0f} tok/s mfu {100 * record['mfu']:.2f}%")
        if "eval_loss" in record:
            text += f" eval {record['eval_loss']:.4f}"
        eta = self.eta(step)
        text += f" ETA {eta}" if eta else ""
        if self.tty:
            print("\r" + text, end="\n" if step == self.total else "", flush=True)
        elif final:
            print(text, flush=True)
