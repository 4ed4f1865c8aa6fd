"""JSON lines, plain, gzip- or zstd-compressed: one document per line, streamed.

The file is read (and hashed) in blocks, decompressed as a stream (``gzip`` from the
standard library, ``zstandard``), and cut at line ends into chunks of about
:data:`~fsdp2d.data.chunks.CHUNK_BYTES`; a worker parses each line with ``json``. A line
longer than a block is carried into the next block, never split.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Iterator

from .chunks import CHUNK_BYTES, Chunk

__all__ = ["jsonl_chunks"]


class _Hashing:
    """A raw file that hashes what is read from it (the compressed bytes, for .gz/.zst)."""

    def __init__(self, f, digest) -> None:
        self.f, self.digest = f, digest

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.digest.update(data)
        return data

    def readinto(self, buf) -> int:  # zstandard's stream reader and gzip may use either
        data = self.read(len(buf))
        buf[:len(data)] = data
        return len(data)


def _stream(raw: _Hashing, kind: str):
    if kind == "jsonl.gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if kind == "jsonl.zst":
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    return raw


def jsonl_chunks(path: Path, kind: str, digest, text_field: str, block: int = CHUNK_BYTES) -> Iterator[Chunk]:
    """Chunks of whole lines of ``path`` (``kind``: ``jsonl``, ``jsonl.gz`` or ``jsonl.zst``)."""
    with open(path, "rb") as f:
        raw = _Hashing(f, digest)
        stream = _stream(raw, kind)
        line, rest = 1, b""
        while True:
            data = stream.read(block)
            if not data:
                break
            data = rest + data
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # no line end yet: a line longer than a block
                rest = data
                continue
            yield Chunk("jsonl", str(path), line, data[:cut], text_field)
            line += data.count(b"\n", 0, cut)
            rest = data[cut:]
        if rest:
            yield Chunk("jsonl", str(path), line, rest, text_field)
        while raw.read(1 << 20):  # hash any bytes the decompressor did not need (none, for a sound file)
            pass
