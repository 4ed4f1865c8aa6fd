"""A read-only concatenation of token arrays (in memory or memory-mapped), O(1) sub-views."""

from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

__all__ = ["TokenStream"]


class TokenStream:
    """``len(s)`` tokens; ``s.read(a, b)`` copies tokens ``[a, b)`` into one array even when
    they span several parts; ``s.view(a, b)`` is a stream over that range, copying nothing."""

    def __init__(self, parts: Sequence[np.ndarray], start: int = 0, stop: int | None = None):
        self.parts = [p for p in parts if len(p)]
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts]).tolist()
        total = self.offsets[-1]
        self.start, self.stop = start, total if stop is None else stop
        if not 0 <= self.start <= self.stop <= total:
            raise ValueError(f"range [{start}, {stop}) outside a stream of {total} tokens")

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def dtype(self) -> np.dtype:
        return self.parts[0].dtype if self.parts else np.dtype(np.uint8)

    def view(self, start: int, stop: int) -> TokenStream:
        return TokenStream(self.parts, self.start + start, self.start + stop)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of this stream as one array (a copy)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"read [{start}, {stop}) of a stream of {len(self)} tokens")
        a, b = self.start + start, self.start + stop
        pieces, i = [], bisect.bisect_right(self.offsets, a) - 1
        while a < b:
            lo, hi = self.offsets[i], self.offsets[i + 1]
            pieces.append(self.parts[i][a - lo:min(b, hi) - lo])
            a, i = min(b, hi), i + 1
        return np.concatenate(pieces) if pieces else np.empty(0, self.dtype)
