"""The token store: flat tokens plus a document index, memory-mapped, with a manifest.

A store is a folder::

    tokens.bin      every document's tokens, back to back (uint8/uint16/uint32, little-endian)
    documents.bin   int64 offsets, documents + 1 of them: document i is tokens[off[i]:off[i+1]]
    manifest.json   {"format": "fsdp2d-tokens", "version": 1, "dtype", "documents", "tokens",
                     "max_id", "tokenizer": {name, sha256, vocab_size, bos_id, eos_id},
                     "bos", "eos", "sources": [{path, format, text_field, files, ...}],
                     "content_sha256"}

Both binary files are read with ``numpy.memmap`` (never pickled). A writer appends to
temporary files beside the outputs and renames them into place, the manifest last, so a
folder whose manifest exists is complete; opening one checks the file sizes against the
manifest. Flat ``.bin`` files from before (no index) open as one document per file
(:func:`open_legacy`).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DataError

__all__ = ["TokenStore", "StoreWriter", "open_store", "open_legacy", "save_tokens", "TOKENS", "DOCUMENTS",
           "MANIFEST", "FORMAT", "DTYPES"]

TOKENS, DOCUMENTS, MANIFEST, FORMAT = "tokens.bin", "documents.bin", "manifest.json", "fsdp2d-tokens"
DTYPES = {"uint8": np.dtype("<u1"), "uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


@dataclass
class TokenStore:
    """Documents as memory-mapped parts: ``parts[p]`` is a 1-D token array and
    ``offsets[p]`` its ``documents + 1`` int64 document boundaries."""

    path: Path
    parts: list[np.ndarray]
    offsets: list[np.ndarray]
    manifest: dict[str, Any]

    @property
    def documents(self) -> int:
        return sum(len(o) - 1 for o in self.offsets)

    @property
    def tokens(self) -> int:
        return sum(len(p) for p in self.parts)

    def special(self, key: str) -> int | None:
        """The ``bos_id``/``eos_id`` the documents carry, or None."""
        on = self.manifest.get(key.split("_")[0], False)
        return self.manifest.get("tokenizer", {}).get(key) if on else None

    def names(self) -> list[str]:
        """A file per part (for messages)."""
        return self.manifest.get("part_files") or [str(self.path / TOKENS)]


def _memmap(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    size = path.stat().st_size if path.is_file() else -1
    if size != count * dtype.itemsize:
        raise DataError(f"{path} holds {size} bytes where its manifest says {count} x {dtype.itemsize}: the store "
                        f"is incomplete or was changed; make it again with `fsdp2d pretokenize`")
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,)) if count else np.empty(0, dtype)


def open_store(folder: str | os.PathLike) -> TokenStore:
    """Open a store made by :class:`StoreWriter` (DataError if it is not one, or incomplete)."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        dtype, docs, count = DTYPES[manifest["dtype"]], int(manifest["documents"]), int(manifest["tokens"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{folder} is not a complete token store ({exc!r}): make it with `fsdp2d pretokenize`") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{folder / MANIFEST} is not an fsdp2d token manifest: make it with `fsdp2d pretokenize`")
    tokens = _memmap(folder / TOKENS, dtype, count)
    offsets = _memmap(folder / DOCUMENTS, np.dtype("<i8"), docs + 1)
    if docs and (offsets[0] != 0 or offsets[-1] != count or np.any(np.diff(offsets) < 0)):
        raise DataError(f"{folder / DOCUMENTS} is not a valid document index for {count} tokens: make the store again")
    return TokenStore(folder, [tokens], [offsets], manifest)


def open_legacy(files: list[Path], fmt: str) -> TokenStore:
    """Flat token files (no header, no index) as a store of one document per file."""
    dtype = DTYPES[fmt]
    parts, offsets = [], []
    for f in files:
        size = f.stat().st_size
        if size % dtype.itemsize:
            raise DataError(f"{f}: {size} bytes is not a whole number of {fmt} tokens; is data.format right?")
        part = np.memmap(f, dtype=dtype, mode="r") if size else np.empty(0, dtype)
        parts.append(part)
        offsets.append(np.array([0, len(part)], dtype=np.int64))
    manifest = {"format": "legacy", "dtype": fmt, "part_files": [str(f) for f in files]}
    return TokenStore(files[0].parent if files else Path("."), parts, offsets, manifest)


class StoreWriter:
    """Appends documents to a new store in ``out``; :meth:`commit` makes it visible.

    A store already in ``out`` stays readable until the commit replaces its files (its
    manifest goes first, so a crash between the renames leaves no valid-looking store)."""

    def __init__(self, out: Path, dtype: np.dtype) -> None:
        self.out, self.dtype = out, np.dtype(dtype)
        out.mkdir(parents=True, exist_ok=True)
        nonce = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self.tmp = {name: out / f".{name}.{nonce}.partial" for name in (TOKENS, DOCUMENTS, MANIFEST)}
        self.files = {name: open(self.tmp[name], "wb") for name in (TOKENS, DOCUMENTS)}
        self.files[DOCUMENTS].write(np.zeros(1, "<i8").tobytes())
        self.tokens, self.documents, self.max_id = 0, 0, -1

    def append(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents of ``lengths`` tokens each, back to back in ``tokens``."""
        if tokens.size:
            self.max_id = max(self.max_id, int(tokens.max()))
        self.files[TOKENS].write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        ends = self.tokens + np.cumsum(lengths, dtype=np.int64)
        self.files[DOCUMENTS].write(ends.astype("<i8").tobytes())
        self.tokens += int(tokens.size)
        self.documents += len(lengths)

    def commit(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Rename the files into place, manifest last; returns the full manifest."""
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        full = {"format": FORMAT, "version": 1, "dtype": {1: "uint8", 2: "uint16", 4: "uint32"}[self.dtype.itemsize],
                "documents": self.documents, "tokens": self.tokens, "max_id": self.max_id, **manifest}
        self.tmp[MANIFEST].write_text(json.dumps(full, indent=1))
        (self.out / MANIFEST).unlink(missing_ok=True)
        for name in (TOKENS, DOCUMENTS, MANIFEST):
            os.replace(self.tmp[name], self.out / name)
        return full

    def abort(self) -> None:
        for f in self.files.values():
            f.close()
        for path in self.tmp.values():
            path.unlink(missing_ok=True)


def save_tokens(path: str | os.PathLike[str], tokens: Any, format: str = "uint16") -> Path:
    """Write ``tokens`` as a flat little-endian ``uint16``/``uint32`` file (no header):
    the legacy format ``data.format=uint16|uint32`` reads as one document."""
    dtype = DTYPES[format]
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(dtype).max):
        raise ValueError(f"token ids in [{arr.min()}, {arr.max()}] do not fit {format}")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    arr.astype(dtype).tofile(p)
    return p
