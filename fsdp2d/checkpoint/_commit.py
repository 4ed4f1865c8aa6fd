"""Putting a finished checkpoint at ``PATH`` atomically; cleaning what killed saves left.

Why a symbolic link: rename(2) cannot replace a non-empty folder, so replacing a
checkpoint folder with renames alone has an instant where ``PATH`` is missing (kill -9
there and neither checkpoint is at ``PATH``). ``renameat2(RENAME_EXCHANGE)`` swaps two
folders atomically, but only on some Linux filesystems (not NFS, most FUSE mounts). A
symbolic link works on every POSIX filesystem: ``PATH`` is a link to a sibling version
folder ``.NAME.v<id>``, and replacing the link is one ``rename``. So a save

1. writes ``.NAME.tmp-<id>`` (every rank its file, rank 0 the index), fsynced, while
   rank 0 holds an ``flock`` on that folder (released by the kernel if it dies);
2. under an ``flock`` of the parent folder (concurrent savers take turns): renames it
   to ``.NAME.v<id>``, points a new link ``.NAME.link-<id>`` at it, renames the link
   onto ``PATH`` and fsyncs the parent; then deletes every other ``.NAME.v*`` and
   ``.NAME.link-*``, and every ``.NAME.tmp-*`` whose lock can be taken (its saver is
   gone). At every instant ``PATH`` is the old or the new complete checkpoint, and
   nothing is left once the last save has finished.

``PATH`` being a plain folder (a checkpoint written before links, an export) is swapped
for the link with ``RENAME_EXCHANGE`` where the filesystem has it; elsewhere it is
renamed away first, the only case with an instant without ``PATH``. A ``PATH`` that is
neither a checkpoint nor fsdp2d's link is never replaced.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ._files import version_pattern
from ._index import INDEX, CheckpointError


def phase(name: str) -> None:
    """Called between the steps of a save (the fault tests kill the saver here)."""


def tmp_path(path: Path, nonce: str) -> Path:
    return path.parent / f".{path.name}.tmp-{nonce}"


def _lock(fd: int, block: bool = True) -> bool | None:
    """flock(LOCK_EX): True once held, False if another holder has it (non-blocking),
    None on a filesystem without flock (some network mounts): there concurrent savers
    are not serialized and killed saves' folders are kept (never a broken PATH)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None


@contextmanager
def _parent_locked(path: Path) -> Iterator[int]:
    """A descriptor of ``path``'s parent folder, holding its lock (saves to any path in
    it take turns at creating, committing and cleaning up)."""
    pfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _lock(pfd)
        yield pfd
    finally:
        os.close(pfd)  # (releases the lock)


def begin(path: Path, nonce: str) -> int:
    """(Rank 0.) Check that ``path`` may be replaced, create the temporary folder and
    lock it; returns the lock's descriptor (keep it until :func:`commit` or :func:`abort`)."""
    if path.is_symlink():
        if not version_pattern(path.name).fullmatch(os.readlink(path)):
            raise CheckpointError(f"{path} is a symbolic link that fsdp2d did not make; not replacing it")
    elif path.exists() and not (path / INDEX).is_file():
        if not path.is_dir() or any(path.iterdir()):
            raise CheckpointError(f"{path} exists and is not an fsdp2d checkpoint; not replacing it "
                                  f"(remove it or save elsewhere)")
    tmp = tmp_path(path, nonce)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _parent_locked(path):  # a cleanup must not see the new folder before it is locked
        tmp.mkdir()
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        _lock(fd)
    return fd


def abort(path: Path, nonce: str, fd: int | None) -> None:
    shutil.rmtree(tmp_path(path, nonce), ignore_errors=True)
    if fd is not None:
        os.close(fd)


def commit(path: Path, nonce: str, fd: int) -> None:
    """(Rank 0.) Make the finished temporary folder the checkpoint at ``path``."""
    parent, name = path.parent, path.name
    version, link = f".{name}.v{nonce}", f".{name}.link-{nonce}"
    try:
        os.fsync(fd)  # the folder's entries (every file was fsynced by its writer)
        with _parent_locked(path) as pfd:
            os.rename(tmp_path(path, nonce), parent / version)
            phase("rename")
            os.symlink(version, parent / link)
            phase("link")
            if path.is_dir() and not path.is_symlink():
                _replace_plain_folder(pfd, parent, link, path)
            else:
                os.replace(parent / link, path)
            phase("replace")
            os.fsync(pfd)
            cleanup(path)
            phase("cleanup")
    finally:
        os.close(fd)


def _replace_plain_folder(pfd: int, parent: Path, link: str, path: Path) -> None:
    if _exchange(pfd, link, path.name):
        shutil.rmtree(parent / link)  # now the old folder
        return
    os.rename(path, parent / f".{path.name}.v{uuid.uuid4().hex[:12]}")  # deleted by cleanup
    os.replace(parent / link, path)


def _exchange(dir_fd: int, a: str, b: str) -> bool:
    """renameat2(a, b, RENAME_EXCHANGE) in ``dir_fd``; False where unsupported."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    if fn(dir_fd, a.encode(), dir_fd, b.encode(), 2) == 0:  # 2 = RENAME_EXCHANGE
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def cleanup(path: Path) -> None:
    """Delete what saves to ``path`` left beside it: versions ``path`` no longer points
    to, stray links, and temporary folders whose saver is gone (their lock is free).
    Call with the parent's lock held."""
    current = os.readlink(path) if path.is_symlink() else None
    versions = version_pattern(path.name)
    for entry in os.scandir(path.parent):
        n = entry.name
        if not n.startswith(f".{path.name}."):
            continue
        stale = (versions.fullmatch(n) and n != current) or n.startswith(
            (f".{path.name}.link-", f".{path.name}.old-"))
        if n.startswith(f".{path.name}.tmp-") and entry.is_dir(follow_symlinks=False):
            stale = _abandoned(Path(entry.path))
        if stale:
            _remove(Path(entry.path))


def _abandoned(folder: Path) -> bool:
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return _lock(fd, block=False) is True  # (no flock: cannot tell, keep it)
    finally:
        os.close(fd)


def _remove(p: Path) -> None:
    if p.is_symlink() or not p.is_dir():
        p.unlink(missing_ok=True)
    else:
        shutil.rmtree(p, ignore_errors=True)


def remove(path: Path) -> None:
    """Delete the checkpoint at ``path`` (the link first, so it vanishes at once)."""
    path = Path(path)
    with _parent_locked(path):
        _remove(path)
        cleanup(path)
