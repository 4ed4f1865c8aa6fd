"""What the trainer holds: this rank's batches, the eval split, the data state of a
checkpoint (and the checks that make a resume exact), metrics and the sample log."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .batches import Batches, EvalBatches
from .errors import DataError
from .mixture import Blend, Era, SourceOrder
from .sources import SourceSpec
from .split import train_prefix_matches
from .store import TokenStore
from .stream import TokenStream
from .tokenizer import TokenizerRecord

__all__ = ["SourceData", "TrainData", "DataStateError"]


class DataStateError(DataError):
    """A checkpoint's data state that this run cannot continue exactly (the checkpoint
    itself is sound): the message says what changed and what to do."""


@dataclass
class SourceData:
    spec: SourceSpec
    store: TokenStore
    train: TokenStream
    held_out: TokenStream
    sequences: int

    def file_rows(self) -> list[str]:
        """One fingerprint per file, in order (sha256 of the content; legacy: name and size)."""
        sources = self.store.manifest.get("sources")
        if sources:
            return [row[3] for row in sources[0]["files"]]
        return [f"{name}:{len(part)}" for name, part in zip(self.store.names(), self.store.parts)]

    def state(self, files: int | None = None) -> dict:
        """What this source's tokens depend on: the files (sha256), the tokenizer, and how
        the files became tokens (the BOS/EOS ids added, the text field, the format asked)."""
        rows = self.file_rows()
        rows = rows if files is None else rows[:files]
        made = (self.store.manifest.get("sources") or [{}])[0]
        return {"documents": self.store.documents, "files": len(rows),
                "files_sha256": hashlib.sha256("\n".join(rows).encode()).hexdigest(),
                "tokenizer": self.store.manifest.get("tokenizer", {}).get("sha256", ""),
                "bos": self.store.special("bos_id"), "eos": self.store.special("eos_id"),
                "text_field": made.get("text_field", self.spec.text_field), "format": made.get("format", self.spec.format)}


@dataclass
class TrainData:
    """The train iterator of one data-parallel rank plus what evaluation, checkpoints and
    metrics need. ``bos_id``/``eos_id``: the ids that close documents in the token stream
    (None where there is none), for document masks."""

    train: Batches
    sources: list[SourceData]
    blend: Blend
    seq_len: int
    micro_batch: int
    dp_rank: int
    dp_size: int
    vocab_size: int | None
    bos_id: int | None
    eos_id: int | None
    seed: int = 0
    eval_fraction: float = 0.0
    tokenizer: TokenizerRecord = TokenizerRecord("bytes")
    """What the tokens were made with (checkpoints record it: :meth:`TokenizerRecord.extra`)."""

    @property
    def eval_tokens(self) -> TokenStream:
        return TokenStream([p for s in self.sources for p in s.held_out.parts])

    def eval_batches(self) -> EvalBatches:
        """A fresh iterator over the eval split (the same batches every call); ValueError
        if a source's eval split is smaller than one sequence."""
        return EvalBatches([s.held_out for s in self.sources], self.blend, self.seq_len, self.micro_batch,
                           self.dp_rank, self.dp_size, vocab_size=self.vocab_size,
                           names=[s.spec.label for s in self.sources])

    def describe(self) -> str:
        """One line for the start of a run: sources, weights, documents, tokens, specials."""
        def special(i):
            return "none" if i is None else str(i)
        parts = [f"{s.spec.label} (w {s.spec.weight:g}, {s.store.documents:,} docs, {len(s.train):,} train tokens)"
                 for s in self.sources]
        return (f"data: {'; '.join(parts)}; tokenizer {self.tokenizer}, bos {special(self.bos_id)}, "
                f"eos {special(self.eos_id)}")

    def metrics(self) -> dict[str, float]:
        """samples_seen, tokens_seen, epoch, and per source its share of the tokens and its epoch."""
        counts = self.train.source_samples()
        total = max(int(counts.sum()), 1)
        epochs = self.train.epochs()
        out: dict[str, float] = {"samples_seen": self.train.samples, "tokens_seen": self.train.samples * self.seq_len,
                                 "epoch": max(epochs)}
        for s, c, e in zip(self.sources, counts.tolist(), epochs):
            out[f"share/{s.spec.label}"] = c / total
            out[f"epoch/{s.spec.label}"] = e
        return out

    # -- checkpoint state ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain JSON: the position (samples), each source's position, epoch and eras, and
        what the order depends on (seed, seq_len, weights, files, documents)."""
        state = self.train.state_dict()
        state.update(seed=self.seed, eval_fraction=self.eval_fraction)
        for entry, s in zip(state["sources"], self.sources):
            entry.update(weight=s.spec.weight, **s.state())
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue after the last sample of ``state``; DataStateError (one line) when the
        data or its order changed in a way that cannot continue exactly."""
        _check_same(state, self)
        orders = []
        for i, (old, s) in enumerate(zip(state["sources"], self.sources)):
            _check_source(old, s, i, self)
            order = SourceOrder(int(old["sequences"]), self.seed, i, [Era(*map(int, e)) for e in old["eras"]])
            if s.sequences > order.sequences:  # appended documents: a new era from the next sample on
                order.grow(int(old["samples"]), s.sequences)
            orders.append(order)
        self.train.orders = orders
        self.train.samples = int(state["samples"])
        warn, self.train.warn = self.train.warn, None
        self.train._check_wrap()  # the epochs reached so far are not news
        self.train.warn = warn

    # -- the debug sample log ------------------------------------------------------------
    def log_samples(self, path: Path, step: int, start: int, stop: int) -> None:
        """Append ``{"step", "first", "ids": [[source, epoch, sequence], ...]}`` for the
        global samples ``[start, stop)`` of ``step`` (``data.log_samples``, rank 0)."""
        ids = self.train.sample_ids(start, stop - start).tolist()
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "first": start, "ids": ids}) + "\n")


_FIX = ("resume with the data and [data] settings it was saved with, or start a new run from its weights with "
        "checkpoint.init_from=CHECKPOINT")


def _check_same(state: dict, data: TrainData) -> None:
    if state.get("version") != 2:
        raise DataStateError(f"the checkpoint's data position was saved by an older fsdp2d (no sample count): its "
                             f"weights load with checkpoint.init_from=CHECKPOINT (new data order from step 0)")
    names = [s["name"] for s in state["sources"]]
    weights = [s.get("weight") for s in state["sources"]]
    now = [s.spec.label for s in data.sources], [s.spec.weight for s in data.sources]
    for what, then, current in (("data.seq_len", state["seq_len"], data.seq_len), ("data.seed", state["seed"], data.seed),
                                ("data.eval_fraction", state["eval_fraction"], data.eval_fraction),
                                ("the sources", names, now[0]), ("the source weights", weights, now[1])):
        if then != current:
            raise DataStateError(f"{what} was {then} when the checkpoint was saved and is {current} now: {_FIX}")


def _check_source(old: dict, s: SourceData, index: int, data: TrainData) -> None:
    name = s.spec.label
    now = s.state()
    if old["tokenizer"] != now["tokenizer"]:
        raise DataStateError(f"source {name!r} was tokenized with another tokenizer when the checkpoint was saved: {_FIX}")
    for key, what in (("bos", "data.bos (the BOS id before each document)"), ("eos", "data.eos (the EOS id after "
                      "each document)"), ("text_field", "the text_field"), ("format", "the format")):
        if key in old and old[key] != now[key]:  # (checkpoints of earlier versions do not say)
            raise DataStateError(f"source {name!r}: {what} was {old[key]!r} when the checkpoint was saved and is "
                                 f"{now[key]!r} now, so the same files are other tokens: {_FIX}")
    files, docs = int(old["files"]), int(old["documents"])
    if len(s.file_rows()) < files or s.state(files)["files_sha256"] != old["files_sha256"]:
        raise DataStateError(f"source {name!r} changed since the checkpoint other than by new files sorted after its "
                             f"{files} files (a file was edited, removed, or a new one sorts among them): {_FIX}, "
                             f"or name new files so they sort last")
    if s.store.documents < docs or not train_prefix_matches(docs, s.store.documents, data.eval_fraction, data.seed, index):
        raise DataStateError(f"source {name!r} went from {docs} to {s.store.documents} documents, which moves documents "
                             f"between the train and eval splits (a source of fewer than 1/eval_fraction documents "
                             f"holds out its last one): {_FIX}")
    if s.sequences < int(old["sequences"]):
        raise DataStateError(f"source {name!r} has {s.sequences} train sequences, fewer than the {old['sequences']} "
                             f"when the checkpoint was saved: {_FIX}")
