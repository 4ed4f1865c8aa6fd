"""Text files: one document per file (``.txt``, ``.md``, ``.py``, ... or any UTF-8 file)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from .chunks import Chunk
from .errors import reading

__all__ = ["text_chunks"]


def text_chunks(path: Path, digest, *, skip_invalid: bool = False) -> Iterator[Chunk]:
    """The one chunk of a text file (its bytes; the worker checks they are UTF-8)."""
    with reading(path, "text"):
        raw = path.read_bytes()
    digest.update(raw)
    yield Chunk("text", str(path), 0, raw, skip_invalid=skip_invalid)
