"""``fsdp2d train`` and ``fsdp2d plot``: the launcher's entry points.

``fsdp2d train --config configs/NAME.toml [--section.key=value ...]`` (also
``python -m fsdp2d.train``): outside torchrun it relaunches itself through
``torch.distributed.run`` with the processes the config asks for; under torchrun (one or
many nodes, e.g. inside a SLURM allocation) it uses their environment. After a torchrun
restart (``--max-restarts``) it resumes from the latest checkpoint that verifies.
Mistakes found before the run starts (config, device, run folder, data: see
``preflight``) are one line on stderr and exit code 2, with nothing written but the token
cache of raw sources tokenized before the refusal (reused by the next start). Failures in
the workers end the same way, never with torchrun's report: one line, exit code 2 (1 for
an unexpected exception), the traceback in ``RUN/logs/`` (see :mod:`fsdp2d.train.failure`).
Start-up prints a line per phase, timed from the command (``[+3.2s] mesh ...``).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

from ..mesh import shutdown
from . import lock, preflight
from ._shadow import exit_if_shadowed
from .config import ConfigError, JobConfig, help_text, load_config, validate
from .failure import LAUNCHER_ENV, RUN_DIR_ENV, worker_failed
from .metrics import T0_ENV
from ..hf.launch import apply_init_from


def _split(argv: list[str]) -> tuple[str | None, list[str], list[str]]:
    """(--config, the --section.key overrides, the --config-overlay files in order)."""
    config, rest, overlays, i = None, [], [], 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in ("--config", "--config-overlay"):
            if not eq:  # the file is the next argument
                if i + 1 == len(argv) or argv[i + 1].startswith("--"):
                    raise ConfigError(f"{flag} needs a file: {flag} FILE.toml (presets are in configs/)")
                value, i = argv[i + 1], i + 1
            if flag == "--config":
                config = value
            else:
                overlays.append(value)
        elif argv[i] in ("--resume", "--overwrite"):
            rest.append(f"--checkpoint.{argv[i][2:]}=true")
        else:
            rest.append(argv[i])
        i += 1
    return config, rest, overlays


def train(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print("usage: fsdp2d train --config FILE.toml [--config-overlay FILE.toml ...] [--resume | --overwrite] "
              "[--section.key=value ...]\n")
        print(help_text())
        return 0
    t0 = time.time()
    try:
        config, overrides, overlays = _split(argv)
        cfg = apply_init_from(load_config(config, overrides, overlays))
        if "LOCAL_RANK" not in os.environ:  # not under torchrun: launch ourselves
            validate(cfg)
            preflight.check_device(cfg)
            preflight.check_data_path(cfg)
            lock.holder(cfg.run_dir)
            preflight.check_run_folder(cfg)
            preflight.prepare_data(cfg)  # tokenize once, check the vocabulary and every id, before any rank
            nproc = cfg.parallel.nproc or cfg.world_size
            cmd = [sys.executable, "-m", "fsdp2d.train._torchrun", "--standalone", "--nproc_per_node", str(nproc),
                   "-m", "fsdp2d.train", *argv]
            print(f"[+{time.time() - t0:.1f}s] config {config or '(defaults)'} checked; starting {nproc} "
                  f"process{'es' if nproc > 1 else ''} (torchrun), run folder {cfg.run_dir}", flush=True)
            return _launch(cmd, env=_child_env(cfg, nproc, t0))
    except ConfigError as exc:
        if "LOCAL_RANK" in os.environ:  # a worker: said once, by the launcher or rank 0
            return worker_failed(exc, Path("."), int(os.environ.get("RANK", "0")))
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    return _worker(cfg)


def _child_env(cfg: JobConfig, nproc: int, t0: float) -> dict[str, str]:
    """The environment of the launched torchrun and its workers."""
    env = dict(os.environ, **{LAUNCHER_ENV: "1", RUN_DIR_ENV: str(Path(cfg.run_dir).resolve()), T0_ENV: repr(t0)})
    env["PYTHONSAFEPATH"] = "1"  # no current directory on sys.path: a folder named fsdp2d there cannot hide us
    _import_this_fsdp2d(env)
    if nproc > 1:  # torchrun's own default, set here so that it does not print a banner about it
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _import_this_fsdp2d(env: dict[str, str]) -> None:
    """Make the workers import the fsdp2d this launcher runs. Without the current directory
    on their path, a checkout run as ``python -m fsdp2d.train`` from its root (fsdp2d not
    installed, or another copy installed) would not be found, or another copy would be: then
    this package's parent folder goes first on ``PYTHONPATH``. Asked of a fresh interpreter
    with the workers' environment (import machinery only: nothing is imported)."""
    here = Path(__file__).resolve().parents[1] / "__init__.py"
    probe = "import importlib.util as u; s = u.find_spec('fsdp2d'); print(s.origin if s else '')"
    found = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout.strip()
    if not found or Path(found).resolve() != here:
        env["PYTHONPATH"] = os.pathsep.join([str(here.parents[1]), *filter(None, [env.get("PYTHONPATH")])])


def _worker(cfg: JobConfig) -> int:
    """A torchrun worker's run; every failure ends as :mod:`~fsdp2d.train.failure` says."""
    if os.environ.get("RANK", "0") != "0":
        # torch warns once per process: rank 0's copy is shown, once. Not silenced: on a
        # CPU mesh torch has no DTensor RNG tracker, so a random op on a DTensor draws
        # every rank's shard from the same generator state (fsdp2d's models initialise
        # through fsdp2d.models._init.init_, which does not; a user's own init may).
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
    from .trainer import Trainer  # imported only in the workers

    trainer, clean = None, False
    try:
        trainer = Trainer(cfg)
        trainer.maybe_resume()
        trainer.start()
        trainer.run()
        clean = True
    except KeyboardInterrupt:  # Ctrl-C: every rank gets SIGINT (torchrun forwards it)
        if os.environ.get("RANK", "0") == "0":
            print(_interrupted(trainer), file=sys.stderr, flush=True)
        return 130
    except Exception as exc:  # noqa: BLE001  (one line and the traceback in RUN/logs, never a traceback here)
        return worker_failed(exc, cfg.run_dir, int(os.environ.get("RANK", "0")))
    finally:
        lock.release_all()
        # Free the model (and its reference cycles) first, so the process groups are
        # destructed here, on this thread, rather than in the interpreter's exit-time
        # teardown (the benchmark, which did not do this, aborted twice in ~25 runs at
        # exit, after its results, with "terminate called without an active exception").
        # After Ctrl-C or an exception, collectives may be unfinished: abort, not destroy
        # (destroying NCCL communicators waits for them).
        trainer = None
        gc.collect()
        shutdown(abort=not clean)
    return 0


def _launch(cmd: list[str], env: dict[str, str] | None = None) -> int:
    """Run torchrun; on Ctrl-C (which reaches torchrun and us alike) wait for it to stop
    its workers rather than kill it, so rank 0 can say where the run stopped."""
    proc = subprocess.Popen(cmd, env={**(os.environ if env is None else env), preflight.DATA_CHECKED: "1"})  # the ranks skip the id scan
    try:
        return proc.wait()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not orphan the workers
        proc.wait()
        return 130


def _interrupted(trainer) -> str:
    """The one message of an interrupted run: its step, its newest checkpoint, how to go on."""
    if trainer is None:
        return "interrupted before training started; nothing to resume"
    latest = trainer.ckpts.latest()
    where = f"latest checkpoint: {latest}" if latest else "no checkpoint yet (--resume starts again from step 0)"
    return (f"interrupted at step {trainer.step}; {where}. Continue with the same command plus --resume "
            f"(make train ARGS=--resume)")


_COMMANDS = {
    "train": "train a model on this machine or under torchrun (--config FILE.toml, --resume)",
    "plan": "will a job fit and how fast will it run, before getting the GPUs (a dry run)",
    "plot": "the loss curve of a run as runs/NAME/loss.png",
    "pretokenize": "tokenize text, JSON lines, parquet or Arrow once into the token store training reads",
    "generate": "sample text from a checkpoint on one process",
}


def _usage() -> str:
    rows = "\n".join(f"  {name:<12} {what}" for name, what in _COMMANDS.items())
    return f"usage: fsdp2d COMMAND [--help] ...\n\ncommands:\n{rows}\n"


def main(argv: list[str] | None = None) -> int:
    exit_if_shadowed()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(_usage(), end="")
        return 0
    if not argv or argv[0] not in _COMMANDS:
        said = f"fsdp2d: unknown command {argv[0]!r}\n" if argv else ""
        print(f"{said}{_usage()}", end="", file=sys.stderr)
        return 2
    if argv[0] == "plan":  # dry run of one rank under the fake process group (fsdp2d.plan)
        from fsdp2d.plan.cli import main as plan_main

        return plan_main(argv[1:])
    if argv[0] in ("pretokenize", "generate"):
        from importlib import import_module

        return import_module("fsdp2d.data.pretokenize" if argv[0] == "pretokenize" else
                             f"fsdp2d.train.{argv[0]}").main(argv[1:])
    if argv[0] == "plot":
        from .plot import main as plot_main

        return plot_main(argv[1:])
    return train(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
