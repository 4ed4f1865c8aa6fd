"""How a failed run ends: one line on stderr, exit code 2 (or 1 for a bug), the traceback in
the run folder, and never torchrun's report on the terminal.

Two sides share this module.

**A worker** (``cli.train`` under torchrun) that fails calls :func:`worker_failed`. The
error becomes one line: ``config error: ...`` for a refused config or data, ``error: ...``
for a checkpoint, a non-finite loss or an OS error (a full disk), ``error: TYPE: ...`` for
anything else (a bug: exit code 1). Every failure but a refused config writes its
traceback to ``RUN/logs/rank{R}.log`` (appended; best effort: on a full disk the line says
it could not) and the line ends with that path. The line goes to torchrun's per-worker
error file (``TORCHELASTIC_ERROR_FILE``, torch's JSON reply-file format, with an
``"fsdp2d"`` entry holding the line, exit code, whether all ranks share it, and the time). Launched by ``fsdp2d train`` (the
environment says :data:`LAUNCHER_ENV`), the worker prints nothing: the launcher prints the
line once. Under a user's own torchrun, rank 0 prints a failure all ranks share (config,
checkpoint, loss: they agree collectively), and every failing rank prints its own.

**The launcher's torchrun** (``fsdp2d.train._torchrun``) catches torchrun's
``ChildFailedError`` and calls :func:`child_failed`: it prints one fsdp2d line (rank 0's
for a failure all ranks share, else the first failure's: its peers may have failed
because of it) and exits with its code; a worker that died without one (a signal, the OOM killer)
gets a line naming its rank and how it ended, with torchrun's report written to
``RUN/logs/torchrun.log``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

from fsdp2d.checkpoint import CheckpointError

from .config import ConfigError

__all__ = ["LAUNCHER_ENV", "RUN_DIR_ENV", "REFUSED", "BUG", "worker_failed", "child_failed", "one_line"]

LAUNCHER_ENV = "FSDP2D_LAUNCHER"
"""Set (to 1) in the environment of the torchrun that ``fsdp2d train`` starts."""
RUN_DIR_ENV = "FSDP2D_RUN_DIR"
"""The run folder, for the launcher's torchrun to write its report into."""
REFUSED, BUG = 2, 1
"""Exit codes: fsdp2d said what is wrong and what to do (2); an unexpected exception (1)."""


def _training_error() -> type:
    try:  # (the failure may be that the trainer does not import)
        from .trainer import TrainingError
    except Exception:  # noqa: BLE001
        return ConfigError
    return TrainingError


def _agreed(exc: BaseException) -> bool:
    """Failures every rank raises together (they agree collectively before raising)."""
    return isinstance(exc, (ConfigError, CheckpointError, _training_error()))


def one_line(exc: BaseException) -> tuple[str, int]:
    """(the message without its traceback location, the exit code) of ``exc``."""
    if isinstance(exc, ConfigError):
        return f"config error: {exc}", REFUSED
    if isinstance(exc, (CheckpointError, _training_error(), OSError)):
        return f"error: {exc}", REFUSED
    return f"error: {type(exc).__name__}: {exc}", BUG


def _write_traceback(run_dir: Path, rank: int) -> str:
    """Append this exception's traceback to ``RUN/logs/rank{R}.log``; the line's suffix."""
    path = run_dir / "logs" / f"rank{rank}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}\n{traceback.format_exc()}\n")
    except OSError as err:
        return f" (traceback not saved: {err.strerror})"
    return f" (traceback: {path})"


def _reply(line: str, code: int, agreed: bool) -> None:
    """torchrun's per-worker error file, read back by :func:`child_failed`."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": traceback.format_exc(),
                                                       "timestamp": str(int(time.time()))}},
            "fsdp2d": {"line": line, "exitcode": code, "agreed": agreed,
                       "time": time.time()}}  # (torch's timestamp is in whole seconds)
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


def worker_failed(exc: BaseException, run_dir: Path, rank: int) -> int:
    """Report ``exc`` as described in the module doc; the exit code."""
    line, code = one_line(exc)
    line = " ".join(line.split("\n")) if code == BUG else line  # (a config error may list problems)
    if not isinstance(exc, ConfigError):
        line += _write_traceback(run_dir, rank)
    agreed = _agreed(exc)
    if not agreed and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        line = f"rank {rank}: {line}"
    _reply(line, code, agreed)
    if not os.environ.get(LAUNCHER_ENV) and (rank == 0 or not agreed):
        print(line, file=sys.stderr, flush=True)
    return code


def _fsdp2d_entry(failure) -> dict | None:
    data = getattr(failure, "error_file_data", None)
    entry = data.get("fsdp2d") if isinstance(data, dict) else None
    return entry if isinstance(entry, dict) else None


def child_failed(exc, run_dir: str | None) -> int:
    """(Launcher side.) Print the one line of torchrun's ``ChildFailedError`` ``exc``; the exit code."""
    failures = exc.failures  # {global rank: ProcessFailure}
    # A failure all ranks share: rank 0's (the lowest reported). Else the first to fail: its
    # peers may have failed after it, because of it.
    ours = sorted((not entry.get("agreed"), 0 if entry.get("agreed") else entry["time"], rank, entry)
                  for rank, f in failures.items() if (entry := _fsdp2d_entry(f)))
    if ours:
        entry = ours[0][-1]
        print(entry["line"], file=sys.stderr, flush=True)
        return int(entry["exitcode"])
    rank, failure = min(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
    report = ""
    if run_dir:
        path = Path(run_dir) / "logs" / "torchrun.log"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(exc.format_msg() + "\n")
            report = f"; torchrun's report: {path}"
        except OSError as err:
            report = f"; torchrun's report not saved: {err.strerror}"
    print(f"error: rank {rank} {how} without an fsdp2d message (out of memory? a crash in native code?)"
          f"{report}", file=sys.stderr, flush=True)
    return BUG
