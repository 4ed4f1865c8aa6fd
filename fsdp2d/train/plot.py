"""``fsdp2d plot runs/NAME [...]``: the loss curve of a run as ``runs/NAME/loss.png``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The run's logged steps; a resumed run's repeated steps keep their last record."""
    by_step: dict[int, dict] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def plot(run_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss")
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    last = records[-1]
    rate = f"{last['tokens_per_s_per_gpu']:.0f} tok/s/GPU" if "tokens_per_s_per_gpu" in last \
        else f"{last['tokens_per_s']:.0f} tok/s"  # (metrics of earlier versions: the job's rate)
    ax.set_title(f"{Path(run_dir).name}: {rate}, peak {last['peak_mem_mib']:.0f} MiB/rank")
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(run_dir) / "loss.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fsdp2d plot", description="the loss curve of a run as RUN/loss.png")
    parser.add_argument("run_dir", nargs="+", help="a run folder (holding metrics.jsonl), e.g. runs/debug_cpu")
    args = parser.parse_args(argv)
    for run_dir in args.run_dir:
        if not (Path(run_dir) / "metrics.jsonl").is_file():
            print(f"error: {Path(run_dir) / 'metrics.jsonl'} does not exist (is {run_dir} a run folder, and has "
                  f"its run logged a step?)", file=sys.stderr)
            return 2
        print(plot(run_dir))
    return 0
