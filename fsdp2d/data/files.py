"""Where a source's files are: ``stdlib``, a file, or a folder walked in sorted order.

A folder is walked recursively in sorted path order (so every rank and every run sees
the same documents in the same order), skipping hidden folders, ``__pycache__`` and
``site-packages``. Nothing outside the folder is read: a symbolic link whose target
lies outside it is refused (naming the link), and linked folders are not descended.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from .errors import DataError

__all__ = ["STDLIB", "resolve_data_path", "list_files", "inside"]

STDLIB = "stdlib"
"""The special ``data.path``: Python's own standard-library sources, text on every machine."""
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "node_modules"}


def resolve_data_path(path: str | os.PathLike[str]) -> Path:
    """``"stdlib"`` -> the folder of Python's standard-library sources; else ``path``.

    Raises FileNotFoundError if the path does not exist."""
    if str(path) == STDLIB:
        return Path(os.path.dirname(os.__file__))
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data.path {str(path)!r} does not exist (use a file, a "
                                f"folder, or 'stdlib' for Python's own sources)")
    return p


def inside(path: Path, root: Path) -> bool:
    """Whether ``path``, links resolved, lies in the folder ``root`` (resolved too)."""
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def list_files(root: Path, suffixes: Sequence[str]) -> list[Path]:
    """``root`` itself if it is a file, else its files whose names end with one of
    ``suffixes``, recursively, in sorted order. FileNotFoundError if there are none;
    DataError for a link that leads out of ``root``."""
    if root.is_file():
        return [root]
    found = []
    for folder, dirs, files in os.walk(root):  # prune while walking: site-packages is big
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        for name in files:
            if not name.endswith(tuple(suffixes)) or name.startswith("."):
                continue
            path = Path(folder, name)
            if path.is_symlink() and not inside(path, root):
                raise DataError(f"{path} is a link to {os.path.realpath(path)}, outside the data folder {root}: "
                                f"copy the file into the folder (nothing outside it is read)")
            found.append(path)
    if not found:
        raise FileNotFoundError(f"no {'/'.join('*' + s for s in suffixes)} files under {root}")
    return sorted(found)
