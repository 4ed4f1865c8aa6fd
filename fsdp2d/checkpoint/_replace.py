"""Exports replace the model files of an earlier export as a set.

An export folder may already hold an earlier export, of another layout (one
``model.safetensors`` then, shards and an index now, or the reverse). Writing over it
file by file would leave the old index or shards beside the new weights, and a reader
(transformers, :func:`fsdp2d.hf.from_hf`) could load the old model. So an export is
written into a staging folder inside ``out`` (same file system: renames are atomic),
then :func:`_swap` moves the old export's files aside and the new ones in. The files an
export owns are the model files (both layouts, :data:`_MODEL_FILES`) and every name the
earlier export wrote, which each export lists in :data:`LISTING` (so the tokenizer files
of an earlier export with a tokenizer do not stay beside the weights of one without);
other files (the user's README, a tokenizer put there by hand) stay. A failed export
leaves the previous one as it was.

A killed export (SIGKILL, power loss) cannot roll back: killed while writing, it leaves
a staging folder and the old export intact; killed inside the swap (a few renames), a mix
whose old files wait in ``STAGE/.previous``. Readers refuse a folder in that state
(``fsdp2d._export_stage.interrupted_swap``, loudly, never a mix of two models), and the next export into
it (``--resume`` ends with one) replaces every model file and removes stale stages.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from .._export_stage import STAGE_PREFIX
from ._index import CheckpointError

__all__ = ["write_replacing", "remove_export", "LISTING"]

LISTING = ".fsdp2d-export.json"
"""The names an export wrote (a JSON list), beside them: the next export replaces them all."""

# The files an export owns in its folder (both formats), replaced as a set.
_MODEL_FILES = re.compile(r"(model\.safetensors(\.index\.json)?|model-\d+-of-\d+\.safetensors|"
                          r"(generation_)?config\.json|fsdp2d\.index\.json)")


def write_replacing(out: Path, ckpt: Path, write: Callable[[Path], list[str]]) -> list[Path]:
    """``write(stage)`` writes a complete export into a staging folder and returns the
    names to report; they then replace ``out``'s model files. Returns ``out / name``."""
    if os.path.realpath(out) == os.path.realpath(ckpt):
        raise CheckpointError(f"{out} is the checkpoint being exported: export into another folder")
    out.mkdir(parents=True, exist_ok=True)
    stale = [p for p in out.glob(STAGE_PREFIX + "*") if p.is_dir()]  # left by killed exports
    stage = Path(tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=out))
    try:
        reported = write(stage)
        names = sorted(p.name for p in stage.iterdir())
        (stage / LISTING).write_text(json.dumps(names) + "\n")
        _swap(stage, out, [*names, LISTING])
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    for p in stale:  # only now: until the swap, one may hold the files of a half-swapped export
        shutil.rmtree(p, ignore_errors=True)
    return [out / name for name in reported]


def _swap(stage: Path, out: Path, names: list[str]) -> None:
    """Replace the model files of ``out`` (an earlier export's, whatever its layout) by the
    complete set in ``stage``. The old ones (and any file the new set replaces, e.g. a
    tokenizer) move aside first, into the stage, so no stale index or shard stays beside
    the new weights; a failure midway moves them back."""
    aside = stage / ".previous"
    aside.mkdir()
    moved, placed = [], []
    owned = set(names) | _listed(out)
    try:
        for p in sorted(out.iterdir()):
            if (_MODEL_FILES.fullmatch(p.name) or p.name in owned) and not p.is_dir():
                os.replace(p, aside / p.name)
                moved.append(p.name)
        for name in names:
            os.replace(stage / name, out / name)
            placed.append(name)
    except BaseException:
        for name in placed:
            os.replace(out / name, stage / name)
        for name in moved:
            os.replace(aside / name, out / name)
        raise
    _fsync_dir(out)


def remove_export(out: Path) -> None:
    """Delete the export in ``out``: the files it owns (as :func:`_swap` replaces them), nothing else."""
    if not out.is_dir():
        return
    owned = _listed(out) | {LISTING}
    for p in out.iterdir():
        if (_MODEL_FILES.fullmatch(p.name) or p.name in owned) and p.is_file():
            p.unlink()


def _listed(out: Path) -> set[str]:
    """The names the earlier export in ``out`` wrote (plain names only; none if unreadable)."""
    try:
        names = json.loads((out / LISTING).read_text())
    except (OSError, ValueError):
        return set()
    return {n for n in names if isinstance(n, str) and n == Path(n).name and not n.startswith(".")} \
        if isinstance(names, list) else set()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


