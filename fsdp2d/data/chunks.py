"""A chunk: a bounded piece of one source file, cut by the reading process and turned
into document texts by a tokenizing worker.

The reading process (which also hashes every byte it reads) cuts each file into chunks
of at most about :data:`CHUNK_BYTES`: a text file is one chunk (one document); JSON
lines are cut at line ends (decompressed on the way, for ``.gz``/``.zst``); a parquet
file is one chunk per row group (the worker reads that row group itself); an Arrow
stream is one chunk per record batch. A worker turns a chunk into its texts with
:func:`chunk_texts`, refusing a record without its text field, or a value that is not a
string, by file and line or row. Chunks are what crosses the process boundary, so memory
stays bounded by the chunks in flight, whatever the corpus size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .errors import DataError, reading

__all__ = ["Chunk", "chunk_texts", "CHUNK_BYTES"]

CHUNK_BYTES = 4 << 20
"""Target size of one chunk of JSON lines (bytes, before decompression of the next one)."""


@dataclass(frozen=True)
class Chunk:
    kind: str
    """``text``, ``jsonl``, ``parquet`` or ``arrow``."""
    path: str
    """The file it comes from (for messages; parquet workers read it)."""
    first: int
    """Line (jsonl, 1-based) or row (parquet, arrow, 0-based) of its first record."""
    payload: Any
    """text: the file's bytes; jsonl: whole lines; parquet: the row group's index;
    arrow: the text column of one record batch (a ``pyarrow.Array``)."""
    text_field: str = "text"
    skip_invalid: bool = False
    """Text only: a file that is not UTF-8 holds no document (``stdlib``'s test fixtures
    in other encodings) instead of being refused."""


def _text(chunk: Chunk) -> list[str]:
    try:
        return [chunk.payload.decode("utf-8")]
    except UnicodeDecodeError as exc:
        if chunk.skip_invalid:
            return []
        raise DataError(f"{chunk.path} is not UTF-8 text (byte {exc.start} is {chunk.payload[exc.start:exc.start + 1]!r}): "
                        f"convert it to UTF-8, or leave it out of the data folder") from None


def _jsonl(chunk: Chunk) -> list[str]:
    texts, field = [], chunk.text_field
    for i, line in enumerate(chunk.payload.split(b"\n")):
        if not line.strip():
            continue
        where = f"{chunk.path}:{chunk.first + i}"
        try:
            record = json.loads(line)
        except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
            raise DataError(f"{where}: not a JSON line ({exc}): fix the line, or the file is not JSON lines") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: a JSON {type(record).__name__}, not an object with a {field!r} field")
        texts.append(_field(record.get(field, _MISSING), field, where, lambda: sorted(record)))
    return texts


_MISSING = object()


def _field(value: Any, field: str, where: str, keys) -> str:
    if value is _MISSING:
        raise DataError(f"{where}: no {field!r} field (it has {', '.join(map(repr, keys())) or 'none'}): "
                        f"set data.text_field (or the source's text_field) to the field that holds the text")
    if not isinstance(value, str):
        raise DataError(f"{where}: {field!r} is {type(value).__name__ if value is not None else 'null'}, "
                        f"not a string: fix the record, or set text_field to a string field")
    return value


def _column(chunk: Chunk, values: list[Any]) -> list[str]:
    for i, value in enumerate(values):
        if not isinstance(value, str):
            _field(value, chunk.text_field, f"{chunk.path}: row {chunk.first + i}", lambda: [])
    return values


def _parquet(chunk: Chunk) -> list[str]:
    import pyarrow.parquet as pq

    with reading(chunk.path, f"parquet (row group {chunk.payload})"):
        table = pq.ParquetFile(chunk.path).read_row_group(chunk.payload, columns=[chunk.text_field])
    return _column(chunk, table.column(0).to_pylist())


def _arrow(chunk: Chunk) -> list[str]:
    return _column(chunk, chunk.payload.to_pylist())


_READERS = {"text": _text, "jsonl": _jsonl, "parquet": _parquet, "arrow": _arrow}


def chunk_texts(chunk: Chunk) -> list[str]:
    """The document texts of ``chunk``, in order (DataError for a bad record)."""
    return _READERS[chunk.kind](chunk)
