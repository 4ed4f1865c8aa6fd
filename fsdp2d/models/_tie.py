"""Tied LM heads that survive ``to_empty()`` / ``.to()``.

``nn.Module._apply`` (behind ``to_empty``, ``.to``, ``.float``) gives each module its own
new Parameter when the storage type changes (meta -> cpu), so a head tied to the
embedding silently becomes a copy. The models call :func:`retie` after ``_apply`` to
share the embedding's Parameter again. Tensor parallelism shards the embedding and the
head as two modules (two Parameters, one per style); those are left alone: a loader
fills both from the same tensor.
"""

from __future__ import annotations

from torch import nn


def retie(head: nn.Module, embedding: nn.Module) -> None:
    """``head.weight = embedding.weight`` unless either was sharded by tensor parallelism."""
    if "weight" in getattr(head, "_fsdp2d_tp", {}) or "weight" in getattr(embedding, "_fsdp2d_tp", {}):
        return
    if head.weight is not embedding.weight and head.weight.shape == embedding.weight.shape:
        head.weight = embedding.weight
