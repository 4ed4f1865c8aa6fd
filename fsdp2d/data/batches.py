"""Deterministic ``(inputs, targets)`` micro-batches over a weighted mixture of sources.

Each source's train split is one token stream, cut into ``N = (len - 1) // T`` packed
sequences: sequence ``i`` reads tokens ``[i T, (i + 1) T + 1)``, so consecutive sequences
share one token and every token is a target once. Documents (closed by BOS/EOS where the
tokenizer has them) run on across sequence boundaries.

The run's samples are numbered ``k = 0, 1, ...``; sample ``k`` reads the sequence that
:mod:`fsdp2d.data.mixture` assigns it, a pure function of (seed, k). A global micro-step
takes the next ``G = dp_size * micro_batch`` samples and data-parallel rank ``r`` reads
samples ``[k + r B, k + (r + 1) B)`` of them; ranks of one TP group (same ``dp_rank``) read
the same. The position is ``samples`` (all ranks together), so a checkpoint's data state
is plain ints and a run resumed with another mesh, ``global_batch`` or ``micro_batch``
continues with the next sample, none repeated or skipped.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import torch

from .mixture import Blend, SourceOrder
from .stream import TokenStream

__all__ = ["Batches", "EvalBatches"]


def _rows(streams: list[TokenStream], s: np.ndarray, seq: np.ndarray, T: int) -> np.ndarray:
    return np.stack([streams[a].read(b * T, b * T + T + 1) for a, b in zip(s.tolist(), seq.tolist())])


def _tensors(rows: np.ndarray, vocab_size: int | None, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    rows = rows.astype(np.int64)  # (B, T + 1)
    if vocab_size is not None and rows.size and rows.max() >= vocab_size:
        raise ValueError(f"token id {rows.max()} at {where} is >= model.vocab_size={vocab_size}: raise "
                         f"model.vocab_size to the tokenizer's vocabulary size")
    seq = torch.from_numpy(rows)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()  # (B, T), (B, T)


class Batches:
    """Endless train micro-batches of one data-parallel rank.

    Args:
        streams: each source's train token stream.
        orders: each source's :class:`~fsdp2d.data.mixture.SourceOrder`.
        blend: the sources' :class:`~fsdp2d.data.mixture.Blend`.
        seq_len, micro_batch, dp_rank, dp_size: ``T``, ``B``, this rank and the ranks.
        vocab_size: if given, each batch is checked to hold ids below it.
        warn: called (once per source) when a source wraps into a new epoch.
    """

    def __init__(self, streams: list[TokenStream], orders: list[SourceOrder], blend: Blend, seq_len: int,
                 micro_batch: int, dp_rank: int = 0, dp_size: int = 1, *, vocab_size: int | None = None,
                 names: list[str] | None = None, warn: Callable[[str], None] | None = None) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if seq_len < 1 or micro_batch < 1:
            raise ValueError(f"seq_len={seq_len} and micro_batch={micro_batch} must be >= 1")
        self.streams, self.orders, self.blend = streams, orders, blend
        self.seq_len, self.micro_batch, self.dp_rank, self.dp_size = seq_len, micro_batch, dp_rank, dp_size
        self.vocab_size, self.warn = vocab_size, warn
        self.names = names or [f"source{i}" for i in range(len(streams))]
        self.global_micro_batch = dp_size * micro_batch
        self.samples = 0  # samples taken by all ranks together: the position of the next micro-step
        self._warned = [False] * len(streams)  # a wrap is warned once per source and process
        self._epoch = [0] * len(streams)  # each source's epoch at the last check

    def sample_ids(self, start: int, count: int) -> np.ndarray:
        """``(count, 3)`` int64: (source, epoch, sequence) of samples ``[start, start + count)``."""
        s, j = self.blend.locate(np.arange(start, start + count))
        out = np.empty((count, 3), np.int64)
        for n, (a, b) in enumerate(zip(s.tolist(), j.tolist())):
            out[n] = (a, *self.orders[a].locate(b))
        return out

    def batch_at(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch of the global micro-step that starts at sample ``start``."""
        ids = self.sample_ids(start + self.dp_rank * self.micro_batch, self.micro_batch)
        rows = _rows(self.streams, ids[:, 0], ids[:, 2], self.seq_len)
        return _tensors(rows, self.vocab_size, f"samples {start}+")

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.samples)
        self.samples += self.global_micro_batch
        self._check_wrap()
        return batch

    def source_samples(self) -> np.ndarray:
        """Samples taken from each source so far."""
        return self.blend.counts(self.samples)

    def epochs(self) -> list[float]:
        """Each source's epochs so far (1.5 = one and a half passes)."""
        return [o.progress(c) for c, o in zip(self.source_samples().tolist(), self.orders)]

    def _check_wrap(self) -> None:
        for i, c in enumerate(self.source_samples().tolist()):
            epoch = self.orders[i].epoch_of(c - 1) if c else 0  # of the last sample taken
            if epoch > self._epoch[i] and not self._warned[i] and self.warn is not None:
                self._warned[i] = True
                self.warn(f"data: source {self.names[i]!r} wrapped into epoch {epoch + 1} by sample {self.samples} "
                          f"(each of its {self.orders[i].sequences} sequences seen): it repeats, reshuffled; later "
                          f"wraps are not warned, metrics log epoch/{self.names[i]}")
            self._epoch[i] = epoch

    def state_dict(self) -> dict:
        """The position and what it depends on, as plain ints (JSON-serialisable)."""
        counts = self.source_samples().tolist()
        return {"version": 2, "samples": self.samples, "seq_len": self.seq_len,
                "sources": [{"name": n, "samples": c, "epoch": o.epoch_of(c), "sequences": o.sequences,
                             "eras": [[e.start, e.epoch, e.before, e.sequences] for e in o.eras]}
                            for n, c, o in zip(self.names, counts, self.orders)]}


class EvalBatches:
    """The same micro-batches every call: sample ``k`` of an evaluation reads the next
    unshuffled sequence of the source the blend gives it (a source's eval sequences wrap)."""

    def __init__(self, streams: list[TokenStream], blend: Blend, seq_len: int, micro_batch: int, dp_rank: int,
                 dp_size: int, *, vocab_size: int | None = None, names: list[str] | None = None) -> None:
        self.counts = [max(0, (len(s) - 1) // seq_len) for s in streams]
        for name, n, s in zip(names or [str(i) for i in range(len(streams))], self.counts, streams):
            if n == 0:
                raise ValueError(f"the eval split of source {name!r} holds {len(s)} tokens, fewer than one sequence "
                                 f"of seq_len + 1 = {seq_len + 1}")
        self.streams, self.blend, self.seq_len, self.micro_batch = streams, blend, seq_len, micro_batch
        self.dp_rank, self.global_micro_batch, self.vocab_size = dp_rank, dp_size * micro_batch, vocab_size
        self.samples = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.samples + self.dp_rank * self.micro_batch
        s, j = self.blend.locate(np.arange(start, start + self.micro_batch))
        seq = j % np.asarray(self.counts)[s]
        self.samples += self.global_micro_batch
        return _tensors(_rows(self.streams, s, seq, self.seq_len), self.vocab_size, f"eval sample {start}+")
