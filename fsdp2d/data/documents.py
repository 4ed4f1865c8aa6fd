"""Which document each token belongs to, from the BOS/EOS in the tokens themselves.

For ``model(tokens, document_ids=...)`` with ``data.document_mask = true``: attention
never crosses a document, and positions restart at each document. A token opens a new
document when it is a BOS, or when the token before it is an EOS (an EOS belongs to the
document it closes), so ``... x EOS BOS y ...`` starts one document at the BOS, not two.
Pure tensor ops (a cumulative sum): no host sync, same code on CPU and CUDA.
"""

from __future__ import annotations

import torch

__all__ = ["document_ids"]


def document_ids(tokens: torch.Tensor, bos_id: int | None, eos_id: int | None) -> torch.Tensor:
    """``(B, T)`` int64: the index, within its row, of the document of each token of
    ``tokens`` ``(B, T)``; a row starts in document 0 (usually the tail of one that
    began in an earlier sequence). ValueError if both ids are None.

    Example: ``[[7, EOS, 5, 6, EOS, 9]] -> [[0, 0, 1, 1, 1, 2]]``."""
    if bos_id is None and eos_id is None:
        raise ValueError("document_ids needs a bos_id or an eos_id: the tokens carry no document boundaries")
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    if bos_id is not None:
        starts |= tokens == bos_id
    if eos_id is not None:
        starts[:, 1:] |= tokens[:, :-1] == eos_id
    starts[:, 0] = False  # the first token opens document 0 whatever it is
    return torch.cumsum(starts.to(torch.int64), dim=1)
