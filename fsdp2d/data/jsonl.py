"""JSON lines, plain, gzip- or zstd-compressed: one document per line, streamed.

The file is read (and hashed) in blocks, decompressed as a stream (``gzip`` from the
standard library, ``zstandard``), and cut at line ends into chunks of about
:data:`~fsdp2d.data.chunks.CHUNK_BYTES`; a worker parses each line with ``json``. A line
longer than a block is carried into the next block, never split. A compressed file that
ends early (cut mid-member or mid-frame: a copy that stopped, a full disk) or is damaged
is refused in one line naming it: gzip raises for it; zstandard's stream reader returns
the data up to a cut at a block boundary without a word, so zstd frames are decompressed
with ``decompressobj`` and the input must end where a frame does (``eof``).
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Iterator

from .chunks import CHUNK_BYTES, Chunk
from .errors import reading

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


class _ZstdFrames:
    """zstd frames back to back, decompressed a piece of input at a time; EOFError when the
    input ends inside a frame (zstandard's ``eof`` says where each one ends)."""

    PIECE = 1 << 16  # compressed bytes per decompress call (bounds the output of one call)

    def __init__(self, raw: _Hashing) -> None:
        import zstandard

        self.raw, self.new = raw, zstandard.ZstdDecompressor().decompressobj
        self.frame, self.open = self.new(), False  # open: the current frame has had input

    def read(self, n: int) -> bytes:
        """About ``n`` bytes (at least one piece's worth), b"" at the end of the last frame."""
        out, size = [], 0
        while size < n:
            data = self.raw.read(self.PIECE)
            if not data:
                if self.open:
                    raise EOFError("the compressed data ends inside a zstd frame")
                break
            while data:
                out.append(self.frame.decompress(data))
                size, self.open = size + len(out[-1]), True
                data = b""
                if self.frame.eof:  # the frame is whole: what follows starts the next one
                    data, self.frame, self.open = self.frame.unused_data, self.new(), False
        return b"".join(out)


def _stream(raw: _Hashing, kind: str):
    if kind == "jsonl.gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    return _ZstdFrames(raw) if kind == "jsonl.zst" else raw


def jsonl_chunks(path: Path, kind: str, digest, text_field: str, block: int = CHUNK_BYTES) -> Iterator[Chunk]:
    """Chunks of whole lines of ``path`` (``kind``: ``jsonl``, ``jsonl.gz`` or ``jsonl.zst``);
    DataError naming the file when it cannot be read or decompressed to its end."""
    with reading(path, {"jsonl": "JSON lines", "jsonl.gz": "gzip-compressed JSON lines",
                        "jsonl.zst": "zstd-compressed JSON lines"}[kind]):
        yield from _chunks(path, kind, digest, text_field, block)


def _chunks(path: Path, kind: str, digest, text_field: str, block: int) -> Iterator[Chunk]:
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
