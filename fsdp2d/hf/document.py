"""Document masking for ``transformers`` models: the keywords that make a packed row behave
as its documents run alone.

``model(input_ids=x, **document_inputs(model, ids))`` passes two things transformers already
accepts: ``position_ids`` (B, T), restarting at 0 at each document (RoPE for Llama, the
learned table for GPT-2), and a ready 4D ``attention_mask`` (B, 1, T, T) that transformers
(5.x, ``masking_utils``) hands to the attention as it is: causal and same-document. The
mask's form depends on the attention implementation: ``sdpa`` takes a bool mask (True =
attend); ``eager`` *adds* the mask to the scores, so it gets 0 / float32-min (a bool mask
there would add 1 and silently attend everywhere). Other implementations (flash attention,
flex attention) take no such mask and are refused.

transformers can also detect packing from ``position_ids`` alone (no mask), but that check
reads the device (``.all()`` in Python) at every forward: a host sync, which fsdp2d's steps
avoid (DESIGN item 9). The explicit mask needs none.
"""

from __future__ import annotations

import torch

from ..models.document import document_mask, document_positions

__all__ = ["document_inputs"]

_MASKS = ("sdpa", "eager")


def document_inputs(model: torch.nn.Module, document_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"position_ids", "attention_mask"}`` for a transformers model whose tokens belong to
    the documents ``document_ids`` (B, T) (:func:`fsdp2d.models.document_ids` makes them).

    Raises ``ValueError`` for a model whose attention implementation takes no 4D mask.
    """
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in _MASKS:
        raise ValueError(f"document masking needs attn_implementation 'sdpa' or 'eager', this model uses "
                         f"{impl!r}: load it with from_pretrained(..., attn_implementation='sdpa')")
    mask = document_mask(document_ids)  # (B, 1, T, T) bool
    if impl == "eager":
        blocked = torch.full((), torch.finfo(torch.float32).min, device=mask.device)
        mask = torch.where(mask, torch.zeros((), device=mask.device), blocked)  # added to the scores
    return {"position_ids": document_positions(document_ids), "attention_mask": mask}
