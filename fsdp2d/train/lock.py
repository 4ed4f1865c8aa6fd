"""One run per run folder: an exclusive lock on ``RUN/.lock`` for the life of the run.

Two runs started together in one folder both passed the "earlier run" check, then
interleaved their ``metrics.jsonl`` rows and overwrote each other's checkpoints. Rank 0
now takes an exclusive ``flock`` on ``RUN/.lock`` before anything else happens to the
folder and holds it until the run ends; a second run is refused in one line naming the
folder and the holder (its pid, host and start time, written into the file).

Stale locks: the kernel drops a ``flock`` when its holder dies (even by ``kill -9``), so a
lock file left behind by a dead run is simply locked again; the pid in the file is only
for the message. The file is unlinked on release, which is safe because a taker checks,
after locking, that the path still names the inode it locked (else it retries). A file
system without locks (some network mounts) gets a warning and the run goes on unlocked.
The lock is per process and re-entrant: a second :func:`acquire` of a folder this process
holds (tests build several trainers in one process) is a no-op.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from .config import ConfigError

__all__ = ["acquire", "release", "holder", "NAME"]

NAME = ".lock"
_held: dict[Path, tuple[int, list[Path]]] = {}  # folder -> (fd, folders this process created for it)


def _describe(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "a process that has not written its pid yet"


def _refusal(folder: Path, fd: int) -> ConfigError:
    return ConfigError(f"the run folder {folder} is in use by another run ({_describe(fd)}): wait for it to end, "
                       f"or start this one in another folder (--metrics.run_name=NAME)")


def _make(folder: Path) -> list[Path]:
    """mkdir -p ``folder``; the folders it created, deepest first (to undo a refused start)."""
    created = []
    for p in [folder, *folder.parents]:
        if p.exists():
            break
        created.append(p)
    folder.mkdir(parents=True, exist_ok=True)
    return created


def acquire(folder: str | os.PathLike) -> None:
    """Hold ``folder``'s run lock (creating the folder). ConfigError if another run holds it."""
    folder = Path(folder).resolve()
    if folder in _held:
        return
    created = _make(folder)
    path = folder / NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            err = _refusal(folder, fd)
            os.close(fd)
            raise err from None
        except OSError as exc:  # ENOLCK, EOPNOTSUPP...: no locks on this file system
            os.close(fd)
            print(f"warning: cannot lock {path} ({exc.strerror}): two runs in this folder would not be stopped",
                  file=sys.stderr, flush=True)
            _held[folder] = (-1, created)
            return
        try:  # a holder may have unlinked the file between our open and our lock
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
              .encode(), 0)
    _held[folder] = (fd, created)


def release(folder: str | os.PathLike, *, undo: bool = False) -> None:
    """Let go of ``folder``'s lock (unlink, then unlock). ``undo``: the run never started,
    so also remove the folders :func:`acquire` created, if they are still empty."""
    folder = Path(folder).resolve()
    fd, created = _held.pop(folder, (None, []))
    if fd is None:
        return
    if fd >= 0:
        try:
            (folder / NAME).unlink()
        except FileNotFoundError:
            pass
        os.close(fd)
    for p in created if undo else []:
        try:
            p.rmdir()
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                raise
            break


def release_all() -> None:
    for folder in list(_held):
        release(folder)


def holder(folder: str | os.PathLike) -> None:
    """(The launcher, before torchrun.) ConfigError if a live run holds ``folder``; creates nothing."""
    path = Path(folder) / NAME
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return  # no lock file (or unreadable: the workers will say)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _refusal(Path(folder), fd) from None
    except OSError:
        pass
    finally:
        os.close(fd)  # (closing drops a lock we took)
