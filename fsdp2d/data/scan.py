"""Every token id below ``model.vocab_size``, checked before the first step.

The stores are memory-mapped and scanned in chunks of :data:`CHUNK` tokens with numpy
(max, then the first offending offset in the chunk that has one): a few GB/s, and the
memory of one chunk. One line names the file, the offset and the id. The ranks of a job
started by torchrun directly share the scan: rank ``r`` of ``n`` reads the ``r``-th of ``n``
equal spans of every store (``shard``), so no rank reads a multi-terabyte corpus alone while
the others wait for it in a collective that could time out.
"""

from __future__ import annotations

import numpy as np

from .errors import DataError
from .store import TokenStore

__all__ = ["check_ids", "first_at_or_above", "CHUNK"]

CHUNK = 1 << 24


def first_at_or_above(tokens: np.ndarray, limit: int) -> int | None:
    """The first offset in ``tokens`` holding an id ``>= limit``, or None."""
    for start in range(0, len(tokens), CHUNK):
        chunk = tokens[start:start + CHUNK]
        if int(chunk.max()) >= limit:
            return start + int(np.argmax(chunk >= limit))
    return None


def check_ids(store: TokenStore, vocab_size: int, label: str, shard: tuple[int, int] = (0, 1)) -> None:
    """DataError naming the file and first offset of an id ``>= vocab_size`` in this
    ``shard`` (index, count) of each part (the first offset of the shard that has one)."""
    index, count = shard
    for part, name in zip(store.parts, store.names()):
        lo, hi = len(part) * index // count, len(part) * (index + 1) // count
        at = first_at_or_above(part[lo:hi], vocab_size)
        at = None if at is None else lo + at
        if at is not None:
            raise DataError(f"{name}: token id {int(part[at])} at token offset {at} (of {len(part)}; source "
                            f"{label!r}) is >= model.vocab_size={vocab_size}: raise model.vocab_size to the "
                            f"tokenizer's vocabulary, or fix the token file")
