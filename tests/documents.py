"""Packed batches of documents and the per-document reference, for the document-mask tests.

The reference runs each document alone (its own forward, positions from 0, nothing else in
the row) and puts the logits back where the document sits in the packed row, so the same
loss over the same targets can be taken from both. Boundaries are found on the host here:
this is the test's reference, not the code under test.
"""

from __future__ import annotations

from typing import Callable

import torch

EOS = 0


def packed_batch(step: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y), each (batch, seq) int64: random tokens in [1, vocab) with EOS (0) at random
    places (about one token in four), so rows hold documents of 1 to ~seq tokens."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(1, vocab, (batch, seq + 1), generator=g)
    ends = torch.rand(batch, seq + 1, generator=g) < 0.25
    tokens[ends] = EOS
    return tokens[:, :-1], tokens[:, 1:]


def runs(ids: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, stop)] of the runs of equal ids in one row (B = 1 view)."""
    cuts = [0] + [t for t in range(1, len(ids)) if ids[t] != ids[t - 1]] + [len(ids)]
    return list(zip(cuts, cuts[1:]))


def per_document(forward: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
    """(B, T, V): every document of every row through ``forward`` alone, logits in place."""
    rows = []
    for row, row_ids in zip(tokens, ids):
        rows.append(torch.cat([forward(row[a:b].unsqueeze(0)) for a, b in runs(row_ids)], dim=1))
    return torch.cat(rows, dim=0)
