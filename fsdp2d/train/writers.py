"""Optional metric writers beside ``metrics.jsonl``: TensorBoard and Weights & Biases.

Configured in ``[metrics]``: ``tensorboard = true`` writes event files to
``RUN/tensorboard`` with ``torch.utils.tensorboard`` (needs the ``tensorboard``
package, which fsdp2d does not install: ``pip install tensorboard``);
``wandb = "offline"`` (no network; ``wandb sync RUN/wandb/...`` later) or ``"online"``
logs to Weights & Biases (needs ``pip install wandb``). A writer whose package is
missing fails at start-up with the command that installs it, never mid-run. Each
writer gets every logged record: numbers as scalars ``train/<key>`` at ``step``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class Writer(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    return {f"train/{k}": float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardWriter:
    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError("metrics.tensorboard = true needs the tensorboard package: pip install tensorboard "
                              "(or set metrics.tensorboard = false)") from exc
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        for key, value in _scalars(record).items():
            self.writer.add_scalar(key, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    def __init__(self, mode: str, project: str, name: str, run_dir: Path, config: dict) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(f"metrics.wandb = {mode!r} needs the wandb package: pip install wandb "
                              f"(or set metrics.wandb = \"off\")") from exc
        run_dir.mkdir(parents=True, exist_ok=True)  # W&B writes RUN/wandb/ and wants the parent
        self.run = wandb.init(project=project, name=name, dir=str(run_dir), mode=mode, config=config)

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(_scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def build_writers(metrics_cfg: Any, run_dir: Path, config: dict) -> list[Writer]:
    """The writers ``[metrics]`` asks for (rank 0 only)."""
    writers: list[Writer] = []
    if getattr(metrics_cfg, "tensorboard", False):
        writers.append(TensorBoardWriter(run_dir / "tensorboard"))
    mode = getattr(metrics_cfg, "wandb", "off")
    if mode != "off":
        writers.append(WandbWriter(mode, metrics_cfg.wandb_project, run_dir.name, run_dir, config))
    return writers
