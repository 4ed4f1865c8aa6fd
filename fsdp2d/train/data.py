"""Pretraining data: token streams, packed sequences, deterministic data-parallel batches.

Design
------
A source becomes one flat token stream (:class:`TokenStream`): text files tokenized
byte-level (token = byte value, vocab 256) or with a local Hugging Face
``tokenizer.json``, or pre-tokenized flat ``uint16``/``uint32`` files opened with
``numpy.memmap`` (no header, little-endian; never pickle). Files are read in sorted
path order, so every rank and every run sees the same stream. The last
``eval_fraction`` of the stream is held out for evaluation.

The stream is cut into ``n = (len - 1) // seq_len`` packed sequences; sequence ``i``
reads tokens ``[i * seq_len, (i + 1) * seq_len + 1)``, so consecutive sequences share
one token and every token is a target once. Inputs are ``seq[:-1]``, targets
``seq[1:]``, both ``(micro_batch, seq_len)`` int64.

Sharding: a *global micro-step* takes ``G = dp_size * micro_batch`` consecutive entries
of this epoch's permutation of sequence ids; data-parallel rank ``r`` gets entries
``[r * micro_batch, (r + 1) * micro_batch)`` of that block. Ranks therefore get disjoint
sequences that together cover the global micro-batch, and ranks of one TP group (same
``dp_rank``; ``dp_rank = rank // tp`` for the TP-innermost mesh) get identical batches.
The permutation of epoch ``e`` is ``default_rng([seed, e]).permutation(n)``, so a batch
is a pure function of (seed, epoch, step): :meth:`TokenBatches.state_dict` stores only
plain ints and a resumed run continues with exactly the next batch. Each rank keeps the
whole stream mapped (text is in memory) but reads only its own sequences.

Example::

    data = build_data(cfg, dp_rank=rank // cfg.parallel.tp)
    for step, (x, y) in zip(range(cfg.training.steps), data.train):  # (B, T) each
        ...
    for x, y in itertools.islice(data.eval_batches(), cfg.training.eval_steps): ...
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from fsdp2d.train.config import DataConfig, JobConfig

__all__ = [
    "TEXT_SUFFIXES", "TokenStream", "TokenBatches", "TrainData", "resolve_data_path",
    "list_files", "load_tokenizer", "load_tokens", "save_tokens", "split_tokens", "build_data",
]

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".text")
"""Files a text folder contributes (searched recursively)."""
TOKEN_SUFFIXES = (".bin",)
"""Files a ``uint16``/``uint32`` folder contributes."""
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "node_modules"}
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def resolve_data_path(path: str | os.PathLike[str]) -> Path:
    """``"stdlib"`` -> the folder of Python's standard-library sources; else ``path``.

    Raises FileNotFoundError if the path does not exist."""
    if str(path) == "stdlib":
        return Path(os.path.dirname(os.__file__))
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data.path {str(path)!r} does not exist (use a file, a "
                                f"folder, or 'stdlib' for Python's own sources)")
    return p


def list_files(root: Path, suffixes: Sequence[str]) -> list[Path]:
    """``root`` itself if it is a file, else its files with these suffixes, recursively,
    in sorted order (hidden folders, ``site-packages`` and ``__pycache__`` skipped)."""
    if root.is_file():
        return [root]
    found = []
    for folder, dirs, files in os.walk(root):  # prune while walking: site-packages is big
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        found += [Path(folder, f) for f in files if f.endswith(tuple(suffixes))]
    if not found:
        raise FileNotFoundError(f"no {'/'.join('*' + s for s in suffixes)} files under {root}")
    return sorted(found)


class TokenStream:
    """Read-only concatenation of 1-D token arrays (in memory or memmaps), O(1) sub-views.

    ``len(s)`` tokens; ``s.read(a, b)`` copies tokens ``[a, b)`` into one array even when
    they span several files; ``s.view(a, b)`` is a stream over that range, copying nothing.
    """

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


def load_tokenizer(path: str | os.PathLike[str]) -> Callable[[list[str]], list[list[int]]]:
    """A batch encoder ``texts -> token ids`` from a Hugging Face ``tokenizer.json``."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ImportError(f"data.tokenizer={str(path)!r} needs the 'tokenizers' package: "
                          f"pip install tokenizers (or use data.tokenizer='bytes')") from e
    tok = Tokenizer.from_file(str(path))
    return lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def _text_tokens(files: list[Path], tokenizer: str) -> np.ndarray:
    if tokenizer == "bytes":
        return np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)
    encode = load_tokenizer(tokenizer)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    ids = [np.asarray(x, dtype=np.uint32) for x in encode(texts)]
    return np.concatenate(ids) if ids else np.empty(0, np.uint32)


def load_tokens(cfg: DataConfig) -> TokenStream:
    """The whole token stream of ``cfg.path`` (``cfg.format`` / ``cfg.tokenizer``)."""
    root = resolve_data_path(cfg.path)
    if cfg.format == "text":
        return TokenStream([_text_tokens(list_files(root, TEXT_SUFFIXES), cfg.tokenizer)])
    dtype = _DTYPES[cfg.format]
    parts = []
    for f in list_files(root, TOKEN_SUFFIXES):
        size = f.stat().st_size
        if size % dtype.itemsize:
            raise ValueError(f"{f}: {size} bytes is not a whole number of {cfg.format} tokens; "
                             f"is data.format right?")
        if size:
            parts.append(np.memmap(f, dtype=dtype, mode="r"))
    return TokenStream(parts)


def save_tokens(path: str | os.PathLike[str], tokens: Any, format: str = "uint16") -> Path:
    """Write ``tokens`` as a flat little-endian ``uint16``/``uint32`` file (no header)."""
    dtype = _DTYPES[format]
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(dtype).max):
        raise ValueError(f"token ids in [{arr.min()}, {arr.max()}] do not fit {format}")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    arr.astype(dtype).tofile(p)
    return p


def split_tokens(tokens: TokenStream, eval_fraction: float) -> tuple[TokenStream, TokenStream]:
    """(train, eval): the eval split is the last ``eval_fraction`` of the stream."""
    cut = len(tokens) - int(len(tokens) * eval_fraction)
    return tokens.view(0, cut), tokens.view(cut, len(tokens))


class TokenBatches:
    """Endless, deterministic ``(inputs, targets)`` micro-batches for one data-parallel rank.

    Args:
        tokens: the token stream (e.g. the train split).
        seq_len: tokens per sequence ``T``; each sample reads ``T + 1`` tokens.
        micro_batch: sequences per batch ``B`` on this rank.
        dp_rank, dp_size: this rank's index among the data-parallel ranks (TP peers
            share it) and their number.
        seed: seed of the per-epoch shuffle.
        shuffle: False keeps stream order (evaluation).
        vocab_size: if given, each batch is checked to hold ids ``< vocab_size``.

    Yields ``(inputs, targets)``, int64 tensors ``(B, T)`` with ``targets`` shifted by one.
    Epochs cycle forever; the trailing ``n % (dp_size * B)`` sequences of an epoch's
    permutation are skipped (a different set each epoch). Raises ValueError when the
    stream holds fewer than ``dp_size * B`` sequences.
    """

    def __init__(self, tokens: TokenStream, seq_len: int, micro_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, *, shuffle: bool = True,
                 vocab_size: int | None = None):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if seq_len < 1 or micro_batch < 1:
            raise ValueError(f"seq_len={seq_len} and micro_batch={micro_batch} must be >= 1")
        self.tokens, self.seq_len, self.micro_batch = tokens, seq_len, micro_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.shuffle, self.vocab_size = shuffle, vocab_size
        self.num_sequences = max(0, (len(tokens) - 1) // seq_len)
        self.global_micro_batch = dp_size * micro_batch
        self.batches_per_epoch = self.num_sequences // self.global_micro_batch
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{len(tokens)} tokens make {self.num_sequences} sequences of {seq_len + 1} "
                f"tokens, fewer than one global micro-batch of dp_size * micro_batch = "
                f"{self.global_micro_batch}: use more data (or a larger data.eval_fraction "
                f"for the eval split), or a smaller seq_len / micro_batch")
        self.epoch, self.step = 0, 0  # position of the next batch
        self._perm_epoch, self._perm = -1, np.empty(0, np.int64)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            n = self.num_sequences
            self._perm = (np.random.default_rng([self.seed, epoch]).permutation(n)
                          if self.shuffle else np.arange(n))
            self._perm_epoch = epoch
        return self._perm

    def sequence_ids(self, epoch: int, step: int) -> np.ndarray:
        """Ids of the ``B`` sequences this rank reads at (epoch, step)."""
        start = step * self.global_micro_batch + self.dp_rank * self.micro_batch
        return self._order(epoch)[start:start + self.micro_batch]

    def batch_at(self, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch at (epoch, step), independent of the iterator's position."""
        T = self.seq_len
        rows = np.stack([self.tokens.read(i * T, i * T + T + 1) for i in
                         self.sequence_ids(epoch, step).tolist()]).astype(np.int64)  # (B, T+1)
        if self.vocab_size is not None and rows.max() >= self.vocab_size:
            raise ValueError(f"token id {rows.max()} at epoch {epoch} step {step} is >= "
                             f"model.vocab_size={self.vocab_size}: raise model.vocab_size "
                             f"to the tokenizer's vocabulary size")
        seq = torch.from_numpy(rows)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()  # (B, T), (B, T)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.epoch, self.step)
        self.step += 1
        if self.step == self.batches_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, int]:
        """Position of the next batch, as plain ints (JSON-serialisable).

        ``consumed`` counts sequences of this epoch taken by all ranks together, so a
        run may resume with another ``dp_size * micro_batch`` that divides it."""
        return {"epoch": self.epoch, "consumed": self.step * self.global_micro_batch,
                "seed": self.seed, "num_sequences": self.num_sequences, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`); ValueError if the data, seed
        or sequence length differ, or ``consumed`` does not split into this run's
        global micro-batches."""
        mine = self.state_dict()
        for key in ("seed", "num_sequences", "seq_len"):
            if int(state[key]) != mine[key]:
                raise ValueError(f"data state has {key}={state[key]} but this loader has "
                                 f"{mine[key]}: the data, seed or seq_len changed since the "
                                 f"checkpoint was saved")
        consumed = int(state["consumed"])
        if consumed % self.global_micro_batch:
            raise ValueError(f"cannot resume after {consumed} sequences with global micro-batch "
                             f"dp_size * micro_batch = {self.global_micro_batch}: keep a "
                             f"micro-batch layout that divides it")
        self.epoch, self.step = int(state["epoch"]), consumed // self.global_micro_batch
        if self.step >= self.batches_per_epoch:  # saved at the very end of an epoch
            self.epoch, self.step = self.epoch + 1, 0


@dataclass
class TrainData:
    """The train iterator of one data-parallel rank plus what evaluation needs."""

    train: TokenBatches
    eval_tokens: TokenStream
    seq_len: int
    micro_batch: int
    dp_rank: int
    dp_size: int
    vocab_size: int | None = None

    def eval_batches(self) -> TokenBatches:
        """A fresh, unshuffled iterator over the eval split (same batches every call).

        Raises ValueError if the eval split is smaller than one global micro-batch."""
        return TokenBatches(self.eval_tokens, self.seq_len, self.micro_batch, self.dp_rank,
                            self.dp_size, shuffle=False, vocab_size=self.vocab_size)


def build_data(cfg: JobConfig, dp_rank: int, dp_size: int | None = None) -> TrainData:
    """Load ``cfg.data``, hold out the eval split, and build this rank's train iterator.

    ``dp_size`` defaults to ``cfg.dp_degree`` (``hsdp_replicate * dp``); the micro-batch
    is ``cfg.micro_batch``; ids are checked against ``cfg.model.vocab_size``."""
    dp_size = cfg.dp_degree if dp_size is None else dp_size
    train, held_out = split_tokens(load_tokens(cfg.data), cfg.data.eval_fraction)
    batches = TokenBatches(train, cfg.data.seq_len, cfg.micro_batch, dp_rank, dp_size,
                           cfg.data.seed, vocab_size=cfg.model.vocab_size)
    return TrainData(batches, held_out, cfg.data.seq_len, cfg.micro_batch, dp_rank, dp_size,
                     cfg.model.vocab_size)
