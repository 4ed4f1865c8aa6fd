"""Saves killed at every phase and at random moments, and concurrent savers (issue 12,
item 9): afterwards PATH always loads, as the old or the new checkpoint, and nothing
is left beside it once a save has finished.

The saver is a forked copy of this process (milliseconds, not the seconds a fresh
interpreter with torch costs), killed with SIGKILL at a phase hook of the save, or by
SIGALRM (no handler: the kernel ends it at once) at a random moment.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import torch

from fsdp2d import checkpoint as ckpt
from fsdp2d.checkpoint import _commit

from . import _ckpt as K

SPEC = {"vocab": 16, "dims": [32, 64, 32], "biases": [True, False], "seed": 0}
PHASES = ["shards", "index", "rename", "link", "replace", "cleanup"]


def _state(seed: int) -> dict:
    return K.build_stack(SPEC, seed=seed).state_dict()


def _fork_save(path: Path, seed: int, kill_at: str | None = None, alarm_s: float | None = None) -> int:
    pid = os.fork()
    if pid == 0:  # the saver
        try:
            if kill_at is not None:
                _commit.phase = lambda name: os.kill(os.getpid(), signal.SIGKILL) if name == kill_at else None
            model = K.build_stack(SPEC, seed=seed)
            if alarm_s is not None:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.setitimer(signal.ITIMER_REAL, alarm_s)
            ckpt.save(path, model)
            os._exit(0)
        finally:
            os._exit(1)
    return pid


def _loaded(path: Path) -> dict:
    model = K.build_stack(SPEC, seed=999)
    ckpt.load(path, model)
    return model.state_dict()


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def _left(path: Path) -> list[str]:
    """What is beside PATH besides PATH and the version it points to."""
    keep = {path.name, os.readlink(path)}
    return sorted(p.name for p in path.parent.iterdir() if p.name not in keep)


def test_killed_saves_leave_old_or_new_and_the_next_save_cleans_up(tmp_path):
    path = tmp_path / "c"
    ckpt.save(path, K.build_stack(SPEC, seed=0))
    model = K.build_stack(SPEC, seed=1)
    t0 = time.monotonic()
    ckpt.save(path, model)
    current, full = 1, time.monotonic() - t0  # how long one save takes
    _fork_save_and_wait = lambda *a, **k: os.waitpid(_fork_save(*a, **k), 0)[1]  # noqa: E731
    assert _left(path) == [] and _equal(_loaded(path), _state(1))
    rng = random.Random(12)
    trials = [(p, None) for p in PHASES] + [(None, rng.uniform(0.0, 1.2 * full)) for _ in range(24)]
    outcomes = {"old": 0, "new": 0}
    for i, (phase, alarm) in enumerate(trials):
        seed = 10 + i
        status = _fork_save_and_wait(path, seed, kill_at=phase, alarm_s=alarm)
        got = _loaded(path)
        if _equal(got, _state(seed)):
            current, which = seed, "new"
        else:
            assert _equal(got, _state(current)), f"trial {i} ({phase or alarm}): PATH is neither old nor new"
            which = "old"
        outcomes[which] += 1
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            assert which == "new" and _left(path) == [], (i, _left(path))
        if phase in ("shards", "index", "rename", "link"):
            assert which == "old", (phase, which)
        if phase in ("replace", "cleanup"):
            assert which == "new", (phase, which)
    print("outcomes", outcomes, "save takes", round(full, 4), "s")
    assert outcomes["old"] >= 4 and outcomes["new"] >= 2, outcomes
    ckpt.save(path, K.build_stack(SPEC, seed=500))  # the next save removes every leftover
    assert _left(path) == [] and _equal(_loaded(path), _state(500))


def test_concurrent_savers_do_not_leak_copies(tmp_path):
    """3 processes saving 4 times each to one PATH: afterwards exactly one checkpoint
    (the last committed, complete) and nothing else (the old code left 14 copies)."""
    path = tmp_path / "c"
    ckpt.save(path, K.build_stack(SPEC, seed=0))
    pids = []
    for w in range(3):
        pid = os.fork()
        if pid == 0:
            try:
                for j in range(4):
                    ckpt.save(path, K.build_stack(SPEC, seed=100 + 10 * w + j))
                os._exit(0)
            finally:
                os._exit(1)
        pids.append(pid)
    assert all(os.waitpid(pid, 0)[1] == 0 for pid in pids)
    assert _left(path) == [], _left(path)
    got = _loaded(path)
    assert any(_equal(got, _state(100 + 10 * w + 3)) for w in range(3))


def test_a_plain_checkpoint_folder_is_replaced_and_other_folders_are_not(tmp_path):
    """A plain folder (an older checkpoint, an export) is swapped for the link; a folder
    that is not a checkpoint is never replaced."""
    import shutil

    import pytest

    ckpt.save(tmp_path / "src" / "s", K.build_stack(SPEC, seed=0))
    path = tmp_path / "run" / "c"
    shutil.copytree((tmp_path / "src" / "s").resolve(), path)
    ckpt.save(path, K.build_stack(SPEC, seed=1))
    assert path.is_symlink() and _left(path) == [] and _equal(_loaded(path), _state(1))
    other = tmp_path / "run" / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    with pytest.raises(ckpt.CheckpointError, match="not an fsdp2d checkpoint; not replacing it"):
        ckpt.save(other, K.build_stack(SPEC, seed=2))
    assert (other / "todo.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path / "run")) == sorted(["c", os.readlink(path), "notes"])
