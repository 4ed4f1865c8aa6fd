"""``fsdp2d plot runs/NAME``: the loss curve of a run as ``runs/NAME/loss.png``."""

from __future__ import annotations

import json
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
    ax.set_title(f"{Path(run_dir).name}: {records[-1]['tokens_per_s']:.0f} tok/s, "
                 f"peak {records[-1]['peak_mem_mib']:.0f} MiB/rank")
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(run_dir) / "loss.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
