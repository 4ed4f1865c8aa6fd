"""Worker-side failures end like launcher-side ones (issue 32 item 14, issue 29 item 6):
one line on stderr, exit code 2, never torchrun's 25-line ChildFailedError report; a
failure after the start leaves its traceback in RUN/logs/ and the line says where.

Each case starts a real job (``fsdp2d train`` -> torchrun -> 2 workers, so the line must
be printed once for several ranks).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from .test_train import SMALL

ROOT = Path(__file__).resolve().parents[1]
FSDP2D = str(Path(sys.executable).parent / "fsdp2d")  # the console script, as a user runs it


def _train(cwd: Path, *extra: str, dp: int = 1, env: dict | None = None,
           preexec=None) -> subprocess.CompletedProcess:
    args = [*SMALL, f"--parallel.dp={dp}", "--parallel.tp=1", f"--training.global_batch={2 * dp}",
            "--training.eval_every=0", f"--metrics.runs_dir={cwd / 'runs'}", "--metrics.run_name=job", *extra]
    return subprocess.run([FSDP2D, "train", *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=env, preexec_fn=preexec)


def _one_line(proc: subprocess.CompletedProcess, start: str) -> str:
    everything = proc.stdout + proc.stderr
    assert proc.returncode == 2, everything[-3000:]
    assert "Traceback" not in everything and "ChildFailedError" not in everything, everything[-3000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(start), everything[-3000:]
    return proc.stderr


@pytest.mark.dist
def test_a_refused_corpus_is_one_line_even_from_a_folder_named_fsdp2d(tmp_path):
    """An empty .txt corpus on 2 ranks: each worker refused it, then torchrun printed its
    report and exited 1; now the line is printed once, exit 2. The job runs from a folder
    that holds a clone named fsdp2d, as in issue 32 (it crashed every rank): the launcher
    keeps the current directory off the workers' path. (An empty tokens.bin and a 36-byte
    corpus end in the same worker path: tests/test_train_launch.py runs it in-process.)"""
    clone = tmp_path / "fsdp2d"
    clone.mkdir()
    for item in ROOT.iterdir():
        if item.name != ".venv":
            (clone / item.name).symlink_to(item)
    (tmp_path / "empty.txt").write_text("")
    _one_line(_train(tmp_path, f"--data.path={tmp_path / 'empty.txt'}", dp=2), "config error: ")
    assert not (tmp_path / "runs").exists()  # refused before anything was written


@pytest.mark.dist
def test_a_save_on_a_full_disk_is_one_line_with_the_traceback_in_the_run_folder(tmp_path):
    """A full disk at the first checkpoint (here: a 200 KiB file-size limit, which fails
    writes with EFBIG as a full disk fails them with ENOSPC), on 2 ranks."""
    data = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 256, 20_000).astype("<u2").tofile(data)

    def limit():  # in the child: writes past 200 KiB fail (SIGXFSZ ignored, so they return EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200 * 1024, resource.RLIM_INFINITY))

    env = dict(os.environ, FSDP2D_SHM="0")  # (the shared-memory rings are files too)
    proc = _train(tmp_path, f"--data.path={data}", "--data.format=uint16", "--training.steps=2",
                  "--checkpoint.every=2", "--model.dim=128", dp=2, env=env, preexec=limit)
    run = tmp_path / "runs" / "job"
    err = _one_line(proc, f"error: save to {run / 'checkpoints' / 'step_00000002'} failed")
    log = run / "logs" / "rank0.log"
    assert err.endswith(f"(traceback: {log})\n") and "File too large" in err, err
    assert "Traceback (most recent call last)" in log.read_text()
