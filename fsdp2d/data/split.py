"""The eval split: whole documents held out of every source, chosen by index and seed.

Document ``d`` of a source with ``n`` documents is held out when ``floor((d + 1) f + u)
> floor(d f + u)``, with ``f = eval_fraction`` and ``u`` in [0, 1) drawn from (seed,
source index): an evenly spread ``floor(n f)`` or ``ceil(n f)`` of its documents, and
whether a document is held out depends only on its index, so documents appended to a
source later never move an earlier one between the splits. A source with no document
chosen that way (fewer than about ``1 / f`` documents) holds out its last one. A source
of one document (a single text file, a flat legacy token file) cannot give a whole
document: its last ``f`` of tokens is held out instead, as before documents existed.
"""

from __future__ import annotations

import numpy as np

from .store import TokenStore
from .stream import TokenStream

__all__ = ["held_out", "split_store", "split_tokens", "train_prefix_matches"]


def held_out(n: int, fraction: float, seed: int, source: int) -> np.ndarray:
    """Sorted indices of the held-out documents among ``n`` (see the module docstring)."""
    if fraction <= 0 or n < 2:
        return np.empty(0, np.int64)
    u = np.random.default_rng([seed, source, 0xE5A1]).random()
    crossings = np.arange(1, int(np.floor(n * fraction + u)) + 1)
    held = np.ceil((crossings - u) / fraction).astype(np.int64) - 1
    held = held[(held >= 0) & (held < n)]
    return held if held.size else np.array([n - 1], np.int64)


def split_tokens(tokens: TokenStream, eval_fraction: float) -> tuple[TokenStream, TokenStream]:
    """(train, eval) of one document: the eval split is its last ``eval_fraction``."""
    cut = len(tokens) - int(len(tokens) * eval_fraction)
    return tokens.view(0, cut), tokens.view(cut, len(tokens))


def split_store(store: TokenStore, fraction: float, seed: int, source: int) -> tuple[TokenStream, TokenStream]:
    """(train, eval) streams of a store: train = its kept documents back to back, in order;
    eval = its held-out documents back to back."""
    n = store.documents
    if n == 1:
        return split_tokens(TokenStream(store.parts), fraction)
    held = held_out(n, fraction, seed, source)
    train, evaluation, first = [], [], 0
    for part, offsets in zip(store.parts, store.offsets):
        count = len(offsets) - 1
        start = 0  # first document of the current run of kept ones
        lo, hi = np.searchsorted(held, [first, first + count])
        for d in (held[lo:hi] - first).tolist():
            train.append(part[offsets[start]:offsets[d]])
            evaluation.append(part[offsets[d]:offsets[d + 1]])
            start = d + 1
        train.append(part[offsets[start]:offsets[count]])
        first += count
    return TokenStream(train), TokenStream(evaluation)


def train_prefix_matches(old_n: int, new_n: int, fraction: float, seed: int, source: int) -> bool:
    """Whether the train split of the first ``old_n`` documents, alone, is the start of the
    train split of ``new_n`` documents (so a run can continue over appended documents)."""
    if old_n == new_n:
        return True
    if old_n < 2 or new_n < old_n:
        return False
    old, new = held_out(old_n, fraction, seed, source), held_out(new_n, fraction, seed, source)
    return bool(np.array_equal(new[new < old_n], old))
