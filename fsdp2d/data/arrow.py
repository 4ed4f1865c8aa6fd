"""Parquet files, Arrow IPC files, and Hugging Face ``datasets`` folders (``save_to_disk``).

All read with pyarrow. A parquet file becomes one chunk per row group: the worker reads
that row group's text column itself, so the reading process holds no rows. An Arrow file
or stream (``save_to_disk`` writes Arrow *streams*, ``data-00000-of-0000N.arrow``, listed
in ``state.json``) is memory-mapped and becomes one chunk per record batch. A
``save_to_disk`` folder is read without the ``datasets`` package: its ``state.json``
names the data files (each must lie in the folder), which hold the rows in order
(``save_to_disk`` writes a selection or shuffle out flat). A ``DatasetDict`` folder
(``dataset_dict.json``) is refused, naming its splits: point ``data.path`` at one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from .chunks import Chunk
from .errors import DataError, reading
from .files import inside

__all__ = ["parquet_chunks", "arrow_chunks", "hf_dataset_files", "is_hf_dataset"]


def _hash_file(path: Path, digest) -> None:
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)


def _check_column(path: Path, schema, field: str) -> None:
    import pyarrow as pa

    if field not in schema.names:
        raise DataError(f"{path} has no {field!r} column (it has {', '.join(map(repr, schema.names))}): set "
                        f"data.text_field (or the source's text_field) to the column that holds the text")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataError(f"{path}: column {field!r} holds {kind}, not strings: set text_field to a string column")


def parquet_chunks(path: Path, digest, text_field: str) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    with reading(path, "parquet"):  # a truncated file has no footer: pyarrow raises ArrowInvalid
        _hash_file(path, digest)
        meta = pq.ParquetFile(path)
        _check_column(path, meta.schema_arrow, text_field)
        row = 0
        for group in range(meta.num_row_groups):
            yield Chunk("parquet", str(path), row, group, text_field)
            row += meta.metadata.row_group(group).num_rows


def arrow_chunks(path: Path, digest, text_field: str) -> Iterator[Chunk]:
    with reading(path, "an Arrow file or stream"):  # (a stream cut short fails at its last batch)
        yield from _arrow_chunks(path, digest, text_field)


def _arrow_chunks(path: Path, digest, text_field: str) -> Iterator[Chunk]:
    import pyarrow as pa

    _hash_file(path, digest)
    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_file(source) if source.read(6) == b"ARROW1" else None
            if reader is None:
                source.seek(0)
                reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid as exc:
            raise DataError(f"{path} looks like Arrow but does not open as an Arrow file or stream: {exc}") from None
        _check_column(path, reader.schema, text_field)
        column = reader.schema.get_field_index(text_field)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) \
            if isinstance(reader, pa.ipc.RecordBatchFileReader) else reader
        row = 0
        for batch in batches:
            yield Chunk("arrow", str(path), row, batch.column(column), text_field)
            row += batch.num_rows


def is_hf_dataset(folder: Path) -> bool:
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def hf_dataset_files(folder: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` folder, in row order (DataError if unreadable)."""
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        except ValueError:
            splits = []
        raise DataError(f"{folder} is a DatasetDict (splits {', '.join(map(repr, splits)) or 'unknown'}): set the "
                        f"path to one split's folder, e.g. {folder / (splits[0] if splits else 'train')}")
    try:
        names = [entry["filename"] for entry in json.loads((folder / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{folder / 'state.json'} is not a datasets save_to_disk state ({exc!r}): save the "
                        f"dataset again with Dataset.save_to_disk") from None
    files = [folder / name for name in names]
    for f in files:
        if not isinstance(f.name, str) or not inside(f, folder) or not f.is_file():
            raise DataError(f"{folder / 'state.json'} names {f}, which is not a file inside {folder}")
    return files
