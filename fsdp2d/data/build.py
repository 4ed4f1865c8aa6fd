"""From ``[data]`` to a rank's batches: sources, token stores, splits, checks.

:func:`prepare_data` runs in the launcher before any rank starts (and again, cheaply, in
each rank): it resolves every source, loads the tokenizer, checks ``model.vocab_size``
against it, tokenizes each raw source once into a token store in the cache folder
(``data.pretokenize``, default ``RUN/tokens``; one process builds, under a file lock,
the others wait and then find it fresh), and scans every store's memory map for ids at
or above ``model.vocab_size``. Ranks then memory-map the stores: the corpus is never
held in a rank's memory. :func:`build_data` adds the eval split, the mixture and this
rank's batches.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from .batches import Batches
from .errors import DataError
from .mixture import Blend, SourceOrder
from .pretokenize import build_store, specials
from .scan import check_ids
from .sources import ResolvedSource, SourceSpec, resolve_source
from .split import split_store
from .store import TokenStore, open_legacy, open_store
from .tokenizer import Tokenizer, TokenizerRecord, load_tokenizer
from .train_data import SourceData, TrainData

if TYPE_CHECKING:
    from fsdp2d.train.config import JobConfig

__all__ = ["source_specs", "prepare_data", "build_data", "Prepared"]


def source_specs(cfg: JobConfig) -> list[SourceSpec]:
    """``[[data.sources]]``, or ``data.path`` as the one source; per-source format and
    text_field default to ``data.format`` / ``data.text_field``."""
    d = cfg.data
    if not d.sources:
        return [SourceSpec(d.path, d.format, d.text_field, 1.0)]
    specs = [SourceSpec(s.path, s.format or d.format, s.text_field or d.text_field, s.weight, s.name)
             for s in d.sources]
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise DataError(f"[[data.sources]] names {labels} repeat: give each source a distinct name = \"...\"")
    return specs


@dataclass
class Prepared:
    """What :func:`prepare_data` found: each source's store, the tokenizer, the specials."""

    specs: list[SourceSpec]
    stores: list[TokenStore]
    tokenizer: TokenizerRecord
    """The tokenizer the tokens were made with (the stores' own, whatever data.tokenizer says)."""
    vocab_size: int | None
    bos_id: int | None
    eos_id: int | None


def _cache_folder(cfg: JobConfig, source: ResolvedSource, tok: Tokenizer, bos, eos) -> Path:
    root = Path(cfg.data.pretokenize) if cfg.data.pretokenize else cfg.run_dir / "tokens"
    key = json.dumps([os.path.realpath(source.root), source.spec.format, source.spec.text_field, tok.digest, bos, eos])
    return root / f"{source.spec.label}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _locked_build(cfg: JobConfig, source: ResolvedSource, tok: Tokenizer, bos, eos, progress: bool) -> TokenStore:
    out = _cache_folder(cfg, source, tok, bos, eos)
    out.mkdir(parents=True, exist_ok=True)
    workers = cfg.data.workers if cfg.data.workers is not None else (0 if tok.name == "bytes" else None)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process tokenizes; the others wait, then find it fresh
        build_store(source, out, tok, bos, eos, workers=workers, progress=progress)
    return open_store(out)


def _store_specials(stores: list[TokenStore], specs: list[SourceSpec]) -> tuple[str, int | None, int | None, int | None]:
    """(tokenizer sha256, vocab, bos, eos) the stores agree on (DataError if they do not)."""
    seen = {}
    for store, spec in zip(stores, specs):
        tok = store.manifest.get("tokenizer")
        if tok is None:  # legacy flat files: nothing known
            continue
        seen[spec.label] = (tok.get("sha256"), tok.get("vocab_size"), store.special("bos_id"), store.special("eos_id"))
    if len(set(seen.values())) > 1:
        raise DataError(f"the sources were tokenized differently (tokenizer, vocab, bos, eos): {seen}: pretokenize "
                        f"them all with one tokenizer and the same BOS/EOS")
    return next(iter(seen.values()), ("", None, None, None))


def _record(tok: Tokenizer | None, stores: list[TokenStore]) -> TokenizerRecord:
    """What the tokens were made with: the loaded tokenizer (raw sources, or data.tokenizer
    checked against the stores), else the stores' manifest's, else unknown (flat files)."""
    if tok is not None:
        return TokenizerRecord(tok.name, None if tok.name == "bytes" else tok.digest)
    named = next((s.manifest["tokenizer"] for s in stores if s.manifest.get("tokenizer")), None)
    return TokenizerRecord(None, None, False) if named is None else \
        TokenizerRecord.of_store(str(named.get("name")), str(named.get("sha256")))


def _refuse_shared_files(stores: list[TokenStore], specs: list[SourceSpec]) -> None:
    """No file's bytes in two sources (one source twice, a folder and a file in it, two
    stores of one corpus): each source holds out its own documents, so the copy held out
    by one would be trained on by the other. Within a source, files of equal bytes are the
    corpus' own (its duplicates: deduplicate before, if they matter)."""
    owner: dict[str, tuple[str, str]] = {}
    for store, spec in zip(stores, specs):
        for row in (store.manifest.get("sources") or [{}])[0].get("files", []):  # [name, size, mtime, sha256, docs, ...]
            if len(row) < 5 or not row[4]:
                continue
            first = owner.setdefault(row[3], (spec.label, row[0]))
            if first[0] != spec.label:
                raise DataError(f"source {spec.label!r} file {row[0]} and source {first[0]!r} file {first[1]} hold the "
                                f"same bytes (sha256 {row[3][:16]}...): a document held out for evaluation in one would "
                                f"be trained on in the other; leave the file in one source only")


def _check_vocab(cfg: JobConfig, vocab: int | None, what: str) -> None:
    if vocab is not None and cfg.model.vocab_size < vocab:
        raise DataError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the vocabulary of {what} ({vocab} "
                        f"ids): set model.vocab_size={vocab} (or more)")


def prepare_data(cfg: JobConfig, *, progress: bool = True, scan: bool = True,
                 shard: tuple[int, int] = (0, 1)) -> Prepared:
    """Resolve, tokenize (once, into the cache) and check every source (see the module doc);
    ``scan``: check every token id, this ``shard`` (index, count) of each store.

    Raises DataError / FileNotFoundError / ImportError with a one-line message."""
    specs = source_specs(cfg)
    resolved = [resolve_source(s) for s in specs]
    raw = [r for r in resolved if r.kind == "raw"]
    tok = load_tokenizer(cfg.data.tokenizer) if raw or cfg.data.tokenizer != "bytes" else None
    if tok is not None:
        _check_vocab(cfg, tok.vocab_size, f"tokenizer {tok.name}")
    bos, eos = specials(tok, cfg.data.bos, cfg.data.eos) if tok is not None else (None, None)
    stores = []
    for r in resolved:
        if r.kind == "raw":
            stores.append(_locked_build(cfg, r, tok, bos, eos, progress))
        elif r.kind == "tokens":
            stores.append(open_store(r.root))
        else:
            stores.append(open_legacy([f for f, _ in r.files], r.files[0][1]))
    _refuse_shared_files(stores, specs)
    digest, vocab, bos, eos = _store_specials(stores, specs)
    if tok is not None and digest and digest != tok.digest:
        raise DataError(f"data.tokenizer={cfg.data.tokenizer} is not the tokenizer the token stores were made with: "
                        f"set data.tokenizer to that one (see their manifest.json) or pretokenize again")
    _check_vocab(cfg, vocab, "the token stores' tokenizer")
    shared = any((t := s.manifest.get("tokenizer") or {}).get("eos_id") is not None and t.get("bos_id") == t["eos_id"]
                 for s in stores)  # BOS = EOS: one separator per document stands for both (specials)
    for name, asked, have in (("bos", cfg.data.bos, bos), ("eos", cfg.data.eos, eos)):
        if asked and shared and (bos is not None or eos is not None):
            continue
        if asked is not None and asked != (have is not None):
            raise DataError(f"data.{name}={str(asked).lower()} but the tokens were made {'with' if have is not None else 'without'} "
                            f"{name.upper()}: pretokenize them again (--no-{name} leaves it out), or leave data.{name} unset")
    if cfg.data.document_mask and bos is None and eos is None:
        raise DataError("data.document_mask=true needs document boundaries in the tokens (an EOS or a BOS), but "
                        f"{'the byte tokenizer has no special tokens' if cfg.data.tokenizer == 'bytes' else 'the data has neither'}"
                        ": use a tokenizer.json with an EOS token (data.eos=true), or data.document_mask=false")
    if scan:
        for store, spec in zip(stores, specs):
            check_ids(store, cfg.model.vocab_size, spec.label, shard)
    return Prepared(specs, stores, _record(tok, stores), vocab, bos, eos)


def build_data(cfg: JobConfig, dp_rank: int, dp_size: int | None = None, *, prepared: Prepared | None = None,
               warn: Callable[[str], None] | None = None, scan: bool = False) -> TrainData:
    """This rank's :class:`TrainData` (``dp_size`` defaults to ``cfg.dp_degree``; the
    micro-batch is ``cfg.micro_batch``). ``warn`` gets the one-off data warnings."""
    p = prepared or prepare_data(cfg, progress=False, scan=scan)
    dp_size = cfg.dp_degree if dp_size is None else dp_size
    d, T = cfg.data, cfg.data.seq_len
    blend = Blend([spec.weight for spec in p.specs])
    G = dp_size * cfg.micro_batch  # one global micro-batch: no sequence may be read twice in it
    sources = []
    for i, (spec, store, need) in enumerate(zip(p.specs, p.stores, blend.most_in(G).tolist())):
        train, held = split_store(store, d.eval_fraction, d.seed, i)
        n = (len(train) - 1) // T
        if n < need:
            batch = f"one global micro-batch of {G} ({dp_size} data-parallel rank(s) x micro_batch {cfg.micro_batch})"
            what = batch if need == G else f"the {need} samples its weight gives {batch}"
            raise DataError(f"source {spec.label!r} ({spec.path}) has {len(train)} train tokens: {n} sequence(s) of "
                            f"seq_len + 1 = {T + 1} tokens, fewer than {what}, so a step would read a sequence twice: "
                            f"use more data, or a smaller data.seq_len or training.micro_batch")
        sources.append(SourceData(spec, store, train, held, n))
    orders = [SourceOrder(s.sequences, d.seed, i) for i, s in enumerate(sources)]
    names = [s.spec.label for s in sources]
    batches = Batches([s.train for s in sources], orders, blend, T, cfg.micro_batch, dp_rank, dp_size,
                      vocab_size=cfg.model.vocab_size, names=names, warn=warn)
    return TrainData(batches, sources, blend, T, cfg.micro_batch, dp_rank, dp_size, cfg.model.vocab_size,
                     p.bos_id, p.eos_id, d.seed, d.eval_fraction, p.tokenizer)
