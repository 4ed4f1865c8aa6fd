"""Document boundaries inside packed sequences: ids, per-document positions, the attention mask.

Design
------
Pretraining packs several documents into one ``(B, T)`` row. With a *document mask* a token
attends only to earlier tokens of its own document and its position (RoPE) restarts at 0 at
the document's first token, so each document is computed as if it were alone in the row.

A document is a maximal run of equal ids along ``T`` (``[0, 0, 1, 1, 1, 2]`` is three
documents of 2, 3 and 1 tokens). Everything here is built with tensor ops only: no
``.item()``, no ``nonzero``, no shape that depends on the data (DESIGN item 9), so it runs
unchanged on CUDA without a host sync and under ``FakeTensorMode``. Ids need not be
increasing or start at 0: only where they change matters (``[5, 5, 3, 5]`` is three
documents, the last one separate from the first).

Example::

    ids = document_ids(tokens, eos_id=tok.eos)      # (B, T) int64
    logits = llama(tokens, document_ids=ids)        # never attends across an EOS

The mask is ``(B, 1, T, T)`` bool (True = may attend), materialised: ``B * T * T`` bytes
(8 MiB per sequence at T = 2048). Scaled-dot-product attention with an explicit mask uses
the memory-efficient or math kernel, not flash attention.
"""

from __future__ import annotations

import torch

__all__ = ["document_ids", "document_positions", "document_mask"]


def document_ids(tokens: torch.Tensor, *, eos_id: int | None = None, bos_id: int | None = None) -> torch.Tensor:
    """The document index of every token of ``tokens`` (B, T): (B, T) int64, 0 at t = 0.

    An EOS token belongs to the document it closes (ids increase *after* it); a BOS token
    opens a new document (ids increase *at* it); with both, ``... x EOS BOS y ...`` is one
    boundary, between EOS and BOS. A BOS or EOS at the row's edge opens or closes nothing
    more (each row starts a document). One token as both (``bos_id == eos_id``, GPT-2's
    ``<|endoftext|>``, which the data layer puts once, after each document) is an EOS: it
    closes its document. ``ValueError`` when neither id is given.
    """
    if eos_id is None and bos_id is None:
        raise ValueError("document_ids: give eos_id, bos_id or both (the tokens that close or open a document)")
    if bos_id == eos_id:
        bos_id = None
    starts = torch.zeros_like(tokens, dtype=torch.bool)  # (B, T): token t opens a document
    if eos_id is not None:
        starts[:, 1:] |= tokens[:, :-1] == eos_id
    if bos_id is not None:
        starts[:, 1:] |= tokens[:, 1:] == bos_id
    return starts.long().cumsum(dim=1)


def _starts(ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: token t opens a document (t = 0, or its id differs from token t-1's)."""
    first = torch.ones_like(ids[:, :1], dtype=torch.bool)
    return torch.cat([first, ids[:, 1:] != ids[:, :-1]], dim=1)


def document_positions(ids: torch.Tensor) -> torch.Tensor:
    """(B, T) int64: each token's position within its document (0 at its first token).

    ``t - (index of the last document start at or before t)``: the starts' indices, 0
    elsewhere, carried forward by a running maximum."""
    T = ids.shape[1]
    t = torch.arange(T, device=ids.device).expand(ids.shape[0], T)  # (B, T)
    start_index = torch.where(_starts(ids), t, torch.zeros_like(t))
    return t - start_index.cummax(dim=1).values


def document_mask(ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool: query t may attend key s iff s <= t and both are in one document."""
    T = ids.shape[1]
    run = _starts(ids).long().cumsum(dim=1)  # (B, T): documents numbered along the row
    same = run.unsqueeze(2) == run.unsqueeze(1)  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()  # (T, T)
    return (same & causal).unsqueeze(1)
