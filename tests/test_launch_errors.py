"""Worker-side failures end like launcher-side ones (issue 32 item 14, issue 29 item 6):
one line on stderr, exit code 2, never torchrun's 25-line ChildFailedError report; a
failure after the start leaves its traceback in RUN/logs/ and the line says where.

Each case starts a real job (``fsdp2d train`` -> torchrun -> 2 workers, so the line must
be printed once for several ranks) that fails in the workers: a data refusal before the
start, and a full disk at the first checkpoint.
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
    """The one line of stderr (besides the launcher's tokenizing progress bar)."""
    everything = proc.stdout + proc.stderr
    assert proc.returncode == 2, everything[-3000:]
    assert "Traceback" not in everything and "ChildFailedError" not in everything, everything[-3000:]
    err = "".join(line for line in proc.stderr.splitlines(keepends=True) if not line.startswith("pretokenize ["))
    assert err.count("\n") == 1 and err.startswith(start), everything[-3000:]
    return err


@pytest.mark.dist
def test_a_corpus_the_workers_refuse_is_one_line_even_from_a_folder_named_fsdp2d(tmp_path):
    """A corpus the launcher passes (it tokenizes 36 bytes) and the workers refuse (one
    sequence, fewer than one global micro-batch), on 2 ranks: each worker refused it, then
    torchrun printed its report and exited 1; now the line is printed once, exit 2. The job
    runs from a folder that holds a clone named fsdp2d, as in issue 32 (it crashed every
    rank): the launcher keeps the current directory off the workers' path. (Corpora the
    launcher itself refuses, e.g. an empty .txt, never reach the workers:
    tests/unit/test_train_cli.py; the worker path in-process: tests/test_train_launch.py.)"""
    clone = tmp_path / "fsdp2d"
    clone.mkdir()
    for item in ROOT.iterdir():
        if item.name != ".venv":
            (clone / item.name).symlink_to(item)
    (tmp_path / "b.txt").write_text("hello world, 36 bytes of text here.\n")
    err = _one_line(_train(tmp_path, f"--data.path={tmp_path / 'b.txt'}", dp=2), "config error: source 'b' (")
    assert "fewer than one global micro-batch of 4 (2 data-parallel rank(s)" in err, err
    run = tmp_path / "runs" / "job"
    assert [p.name for p in run.iterdir()] == ["tokens"]  # refused before the start: only the token cache


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
