"""Documents -> tokens: each document tokenized alone, then closed with BOS/EOS.

This runs in the tokenizing workers (or in-process with ``workers=0``). A worker loads
the tokenizer once (:func:`init_worker`), with the ``tokenizers`` thread pool off
(``TOKENIZERS_PARALLELISM=false``): the parallelism is the workers'.
"""

from __future__ import annotations

import itertools
import os

import numpy as np

from .chunks import Chunk, chunk_texts
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["encode_documents", "init_worker", "encode_chunk"]

_STATE: tuple[Tokenizer, int | None, int | None] | None = None


def encode_documents(texts: list[str], tok: Tokenizer, bos: int | None, eos: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, lengths): the documents back to back, each ``[bos] ids [eos]`` (a
    special left out where None), and each document's length (int64)."""
    ids = tok.encode(texts)
    sizes = np.fromiter((len(i) for i in ids), np.int64, len(ids))
    if ids and isinstance(ids[0], np.ndarray):
        content = np.concatenate(ids).astype(tok.dtype, copy=False)
    else:
        content = np.fromiter(itertools.chain.from_iterable(ids), tok.dtype, int(sizes.sum()))
    head, tail = int(bos is not None), int(eos is not None)
    if not head + tail:
        return content, sizes
    lengths = sizes + head + tail
    ends = np.cumsum(lengths)
    starts = ends - lengths
    out = np.empty(int(ends[-1]) if len(ends) else 0, tok.dtype)
    # content token t of document k goes to starts[k] + head + (t - its first index in content)
    shift = np.repeat(starts + head - (np.cumsum(sizes) - sizes), sizes)
    out[np.arange(content.size) + shift] = content
    if head:
        out[starts] = bos
    if tail:
        out[ends - 1] = eos
    return out, lengths


def init_worker(tokenizer: str, bos: int | None, eos: int | None) -> None:
    global _STATE
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _STATE = (load_tokenizer(tokenizer), bos, eos)


def encode_chunk(chunk: Chunk) -> tuple[np.ndarray, np.ndarray]:
    """A worker's task: the chunk's documents as (tokens, lengths)."""
    assert _STATE is not None, "init_worker first"
    tok, bos, eos = _STATE
    return encode_documents(chunk_texts(chunk), tok, bos, eos)
