"""The data layer's one error type, and the reading errors it stands for."""

from __future__ import annotations

import sys
import zlib
from contextlib import contextmanager
from typing import Iterator

__all__ = ["DataError", "reading"]


class DataError(ValueError):
    """Data that cannot be read as asked (a file that is not what its name or
    ``data.format`` says, a record without its text, a token id the model cannot embed,
    a changed corpus at resume). The message is one line naming the file, and what to do."""


def _read_error(exc: Exception) -> bool:
    """An error of reading a file: the OS's, a truncated or damaged gzip/zstd stream, or
    pyarrow's (their classes are looked up only if the library is loaded: it raised)."""
    kinds: tuple[type, ...] = (OSError, EOFError, zlib.error)
    for module, name in (("pyarrow", "ArrowException"), ("zstandard", "ZstdError")):
        if (lib := sys.modules.get(module)) is not None:
            kinds += (getattr(lib, name),)
    return isinstance(exc, kinds)


@contextmanager
def reading(path, what: str) -> Iterator[None]:
    """Inside, an error of reading ``path`` as ``what`` (JSON lines, parquet, ...) becomes one
    DataError naming the file (the launcher and ``pretokenize`` print it as one line)."""
    try:
        yield
    except DataError:
        raise
    except Exception as exc:
        if not _read_error(exc):
            raise
        first = (str(exc).strip().splitlines() or [""])[0]
        raise DataError(f"{path}: cannot be read as {what} ({type(exc).__name__}: {first}): the file is truncated or "
                        f"damaged, or unreadable; fix or replace it, or leave it out of the data folder") from None
