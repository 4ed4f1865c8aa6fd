"""What a file holds, read from its first bytes, and whether its name agrees.

The content decides, never the suffix alone: gzip (``1f 8b``), zstd (``28 b5 2f fd``),
parquet (``PAR1``), Arrow IPC files (``ARROW1``) and streams (``ff ff ff ff`` then a
length: what ``datasets.save_to_disk`` writes), JSON lines (the first line is a JSON
object; every line is checked when read), text (valid UTF-8 with no NUL byte); an empty
file holds no documents. A
compressed file is opened to see what it holds. A file whose name says one thing and
whose bytes another, a binary file given as text, or content of no known kind is refused
in one line that names the file and what it looks like.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from .errors import DataError, reading

__all__ = ["sniff", "suffix_kind", "check_kind", "TEXT_SUFFIXES", "JSONL_SUFFIXES", "DATA_SUFFIXES",
           "KIND_NAMES"]

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".text")
"""Files a text folder contributes (one document each)."""
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".jsonl.zst", ".ndjson.zst", ".jsonl.zstd")
DATA_SUFFIXES = JSONL_SUFFIXES + (".parquet", ".arrow")
"""Files a folder of records contributes (one document per row or line)."""
KIND_NAMES = {
    "text": "UTF-8 text", "jsonl": "JSON lines", "jsonl.gz": "gzip-compressed JSON lines",
    "jsonl.zst": "zstd-compressed JSON lines", "parquet": "a parquet file", "arrow": "an Arrow IPC file",
    "gz": "gzip-compressed data", "zst": "zstd-compressed data",
    "binary": "binary data (not UTF-8 text)", "empty": "an empty file",
}
_SNIFF = 1 << 16


def _utf8_prefix(raw: bytes) -> bool:
    """Whether ``raw`` (maybe cut mid-character at its end) is UTF-8 text without NUL."""
    if b"\x00" in raw:
        return False
    for cut in range(4):  # a multi-byte character may straddle the end of the sample
        try:
            raw[:len(raw) - cut].decode("utf-8")
            return True
        except UnicodeDecodeError:
            continue
    return False


def _plain_kind(raw: bytes) -> str:
    """Kind of uncompressed bytes: parquet, arrow, jsonl, text, binary or empty."""
    if not raw:
        return "empty"
    if raw.startswith(b"PAR1"):
        return "parquet"
    if raw.startswith(b"ARROW1") or raw.startswith(b"\xff\xff\xff\xff"):
        return "arrow"
    if not _utf8_prefix(raw):
        return "binary"
    body = raw.lstrip(b"\xef\xbb\xbf \t\r\n")
    if not body.startswith(b"{"):
        return "text"
    line, newline, _ = body.partition(b"\n")
    if not newline:  # a first line longer than the sample: every line is checked when read
        return "jsonl"
    try:
        return "jsonl" if isinstance(json.loads(line), dict) else "text"
    except ValueError:  # text that starts with a brace
        return "text"


def _decompressed_head(path: Path, codec: str) -> bytes:
    try:
        with reading(path, KIND_NAMES[codec]):  # (a file cut short within the sample, named)
            if codec == "gz":
                with gzip.open(path, "rb") as f:
                    return f.read(_SNIFF)
            import zstandard

            with open(path, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as f:
                return f.read(_SNIFF)
    except ImportError:
        raise DataError(f"{path} is zstd-compressed: reading it needs the 'zstandard' package "
                        f"(pip install zstandard)") from None


def sniff(path: Path) -> str:
    """The kind of ``path``'s content: one of :data:`KIND_NAMES`' keys."""
    with open(path, "rb") as f:
        raw = f.read(_SNIFF)
    for magic, codec in ((b"\x1f\x8b", "gz"), (b"\x28\xb5\x2f\xfd", "zst")):
        if raw.startswith(magic):
            inner = _plain_kind(_decompressed_head(path, codec))
            return f"jsonl.{codec}" if inner == "jsonl" else codec
    return _plain_kind(raw)


def suffix_kind(path: Path) -> str | None:
    """The kind ``path``'s name promises, or None for a name that promises nothing known."""
    name = path.name.lower()
    for suffixes, kind in ((JSONL_SUFFIXES[2:4], "jsonl.gz"), (JSONL_SUFFIXES[4:], "jsonl.zst"),
                           (JSONL_SUFFIXES[:2] + (".json",), "jsonl"), ((".parquet",), "parquet"),
                           ((".arrow",), "arrow"), (TEXT_SUFFIXES, "text"), ((".gz",), "gz"), ((".zst",), "zst")):
        if name.endswith(tuple(suffixes)):
            return kind
    return None


def check_kind(path: Path, want: str | None = None) -> str:
    """The kind of ``path`` (see :func:`sniff`), checked against its name and against
    ``want`` (a family asked for by ``data.format``: text, jsonl, parquet, arrow; None =
    any). DataError, in one line, when they disagree or the content is not readable. A
    ``.txt`` file of JSON lines is read as JSON lines with ``want="jsonl"`` and as text with
    ``want="text"``; by content alone it is refused (which of the two is meant?)."""
    kind = sniff(path)
    said = suffix_kind(path)
    if kind == "empty":  # no documents, whatever the name says
        return "empty"
    family = kind.split(".")[0]
    if kind in ("gz", "zst", "binary"):
        asked = f" (data.format={want})" if want else ""
        raise DataError(f"{path}{asked} holds {KIND_NAMES[kind]}: fsdp2d reads UTF-8 text, JSON lines (plain, .gz, "
                        f".zst), parquet and Arrow; convert it to one of those")
    if want == "text" and kind == "jsonl":  # JSON read as raw text, as data.format=text asks
        return "text"
    if want is not None and family != want:
        raise DataError(f"{path} is given as {want} (data.format={want}) but holds {KIND_NAMES[kind]}: set "
                        f"data.format=auto (read by content) or {family}")
    if said is not None and said != kind and not (said == "text" and kind == "jsonl" and want == "jsonl"):
        if said == "text" and kind == "jsonl":
            raise DataError(f"{path} holds JSON lines, which data.format=auto would train on as raw JSON text: "
                            f"set data.format=jsonl (one document per line) or data.format=text")
        raise DataError(f"{path} is named as {KIND_NAMES[said]} but holds {KIND_NAMES[kind]}: rename it "
                        f"(e.g. to {_suggest(path, kind)}) or fix the file")
    return kind


def _suggest(path: Path, kind: str) -> str:
    ext = {"jsonl": ".jsonl", "jsonl.gz": ".jsonl.gz", "jsonl.zst": ".jsonl.zst", "parquet": ".parquet",
           "arrow": ".arrow", "text": ".txt"}[kind]
    stem = path.name.split(".")[0]
    return stem + ext
