"""The launcher's data, re-exported from :mod:`fsdp2d.data` (its own package since
issue 29), plus two conveniences over it kept for existing callers:
:func:`load_tokens` (one source's whole token stream) and :func:`TokenBatches` (batches
over one in-memory stream)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdp2d.data import (
    Batches, Blend, DataError, SourceOrder, SourceSpec, TokenStream, TrainData, build_data, list_files,
    load_tokenizer, open_legacy, open_store, resolve_data_path, resolve_source, save_tokens, split_tokens,
)
from fsdp2d.data.detect import TEXT_SUFFIXES
from fsdp2d.data.pretokenize import encode_source, specials

if TYPE_CHECKING:
    from fsdp2d.train.config import DataConfig

__all__ = ["TEXT_SUFFIXES", "TokenStream", "TokenBatches", "TrainData", "DataError", "resolve_data_path",
           "list_files", "load_tokenizer", "load_tokens", "save_tokens", "split_tokens", "build_data"]


def load_tokens(cfg: DataConfig) -> TokenStream:
    """Every document of ``cfg.path`` back to back (with BOS/EOS as ``cfg`` says): token
    stores and flat files memory-mapped, raw sources tokenized in this process."""
    source = resolve_source(SourceSpec(cfg.path, cfg.format, cfg.text_field))
    if source.kind == "tokens":
        return TokenStream(open_store(source.root).parts)
    if source.kind == "legacy":
        return TokenStream(open_legacy([f for f, _ in source.files], source.files[0][1]).parts)
    tok = load_tokenizer(cfg.tokenizer)
    bos, eos = specials(tok, cfg.bos, cfg.eos)
    return TokenStream([tokens for _, tokens, _ in encode_source(source, tok, bos, eos)])


def TokenBatches(tokens: TokenStream, seq_len: int, micro_batch: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, *, vocab_size: int | None = None) -> Batches:
    """Train batches over the one stream ``tokens`` (see :class:`fsdp2d.data.Batches`)."""
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise ValueError(f"{len(tokens)} tokens make no sequence of seq_len + 1 = {seq_len + 1} tokens")
    return Batches([tokens], [SourceOrder(n, seed, 0)], Blend([1.0]), seq_len, micro_batch, dp_rank, dp_size,
                   vocab_size=vocab_size)
