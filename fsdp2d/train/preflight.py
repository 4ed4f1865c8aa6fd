"""What a job must pass before anything on disk changes or step 1 runs.

The launcher runs the cheap checks (config file, device, run folder) in the parent
process, so a mistake costs one line and exit code 2 instead of a torchrun start-up;
the workers run them again (a job started by torchrun directly has no parent) together
with the checks that need the data, and agree on the outcome collectively, so every
rank stops together, before any rank writes. What is checked:

* ``parallel.device=cuda`` needs CUDA;
* a run without resume refuses a run folder that holds an earlier run (its rotation
  would sort both runs' checkpoints by step and delete the new one): ``--resume``, a
  new ``metrics.run_name``, or ``--overwrite`` (which deletes the earlier run's files that
  a new run would add to: :func:`clear_earlier_run`);
* the data (:func:`prepare_data`): every source exists and is what it says, raw sources
  are tokenized once into the cache, ``model.vocab_size`` covers the tokenizer and every
  token id in the memory maps (the launcher checks this before torchrun starts and tells
  the ranks so through :data:`DATA_CHECKED`; under an outside torchrun each rank scans
  1/world of every store and the ranks agree, so the collective waits for no long scan);
  each source holds its part of a global micro-batch, and the eval split a sequence per
  source when the run evaluates.
* a resumed run has steps left to train (``check_steps_left``, after the checkpoint loaded).
"""

from __future__ import annotations

import os
import re

import torch
import torch.distributed as dist

from fsdp2d.data import DataError, Prepared
from fsdp2d.data import prepare_data as _prepare

from .config import ConfigError, JobConfig
from .data import TrainData, resolve_data_path

DATA_CHECKED = "FSDP2D_DATA_CHECKED"
"""Set by the launcher once it has checked every token id: the ranks skip the scan."""

_STEP = re.compile(r"step_\d+")


def check_device(cfg: JobConfig) -> None:
    if cfg.parallel.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"parallel.device=cuda but this machine has no usable CUDA device (torch "
                          f"{torch.__version__}): run on a GPU machine or set parallel.device=cpu")


def resuming(cfg: JobConfig) -> bool:
    """``--resume``, or a torchrun restart (which continues the run it restarts)."""
    return cfg.checkpoint.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def _earlier_run(cfg: JobConfig) -> list[str]:
    found = [n for n in ("config.toml", "metrics.jsonl") if (cfg.run_dir / n).exists()]
    folder = cfg.checkpoint_dir
    steps = sorted(p.name for p in folder.iterdir() if _STEP.fullmatch(p.name)) if folder.is_dir() else []
    if steps:
        found.append(f"{len(steps)} checkpoint(s) in {folder}")
    return found


def check_run_folder(cfg: JobConfig) -> None:
    if resuming(cfg) or cfg.checkpoint.overwrite:
        return
    found = _earlier_run(cfg)
    if found:
        raise ConfigError(f"{cfg.run_dir} holds an earlier run ({', '.join(found)}): continue it with --resume, "
                          f"start a new one with --metrics.run_name=NAME, or replace it with --overwrite")


def clear_earlier_run(cfg: JobConfig) -> None:
    """(``--overwrite``, rank 0.) Delete the earlier run's files that fsdp2d writes and a new
    run would add to (its config, metrics, sample log, loss plot, TensorBoard events,
    checkpoints and HF export), nothing else: its logs stay, and its token cache, which is
    keyed by content, is reused."""
    from fsdp2d.checkpoint import CheckpointManager
    from fsdp2d.checkpoint._replace import remove_export

    run = cfg.run_dir
    for name in ("config.toml", "metrics.jsonl", "samples.jsonl", "loss.png"):
        (run / name).unlink(missing_ok=True)
    for events in (run / "tensorboard").glob("events.out.tfevents.*"):  # else TensorBoard draws both runs as one
        events.unlink()
    remove_export(run / "hf")
    manager = CheckpointManager(cfg.checkpoint_dir)
    for step in manager.steps():
        manager.remove(step)


def check_data_path(cfg: JobConfig) -> None:
    try:
        resolve_data_path(cfg.data.path)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None


def prepare_data(cfg: JobConfig, *, progress: bool = True) -> Prepared:
    """Sources resolved and tokenized (once), vocabulary and ids checked: ConfigError
    (one line) for anything that would otherwise surface mid-run."""
    try:
        scan = os.environ.get(DATA_CHECKED) != "1"  # the launcher scanned already
        worker = "LOCAL_RANK" in os.environ  # a torchrun worker: each rank scans its 1/world of every store
        shard = (int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))) if worker else (0, 1)
        return _prepare(cfg, progress=progress, scan=scan, shard=shard)
    except (DataError, OSError, ImportError) as exc:  # (an unreadable file: the OS's message names it)
        raise ConfigError(str(exc)) from None


def check_data(cfg: JobConfig, data: TrainData) -> None:
    """Everything the data implies that would otherwise surface mid-run."""
    t = cfg.training
    if t.eval_every and t.eval_every <= t.steps:
        try:
            data.eval_batches()
        except ValueError as exc:
            raise ConfigError(f"the eval split (data.eval_fraction={cfg.data.eval_fraction}) is too small: "
                              f"{exc}") from None


def check_steps_left(cfg: JobConfig, step: int, path) -> None:
    """(A resumed run, before anything is written.) ConfigError when checkpoint ``path``
    is at or past the last step to run: there is nothing to train. Except in a restart by
    ``torchrun --max-restarts`` of this very run at its last step (a rank died after the
    final checkpoint): the run is complete, and the restart finishes it (its end of run:
    the export, the last line) without training."""
    t = cfg.training
    stop, field = (t.stop_at, "training.stop_at") if t.stop_at and t.stop_at < t.steps else (t.steps, "training.steps")
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if step > stop or (step == stop and not restarted):
        raise ConfigError(f"nothing to train: {path} is at step {step} and {field}={stop}; set training.steps above "
                          f"{step} to train on (the learning-rate schedule follows training.steps), or start a new "
                          f"run with --metrics.run_name=NAME")


def agree(error: str) -> None:
    """Collective: raise ConfigError on every rank if any rank's ``error`` is not empty."""
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    errors = [e for e in errors if e]
    if errors:
        raise ConfigError(errors[0])
