"""Streaming pretokenize: sources -> a token store, in parallel, in bounded memory.

``fsdp2d pretokenize SRC OUT [--tokenizer T] [--workers N] [--format F] [--text-field F]
[--no-bos] [--no-eos]`` writes a token store (:mod:`fsdp2d.data.store`) to ``OUT``. This
process reads the files in order, hashing every byte, and cuts them into chunks
(:mod:`fsdp2d.data.chunks`: JSON lines streamed and decompressed block by block, parquet
by row group, Arrow by record batch); a pool of worker processes, each with the tokenizer
loaded once, turns chunks into tokens (each document alone, closed with BOS/EOS); the
results are written in order as they come back. At most ``2 x workers`` chunks are in
flight, so memory stays bounded whatever the corpus size (measured:
benchmarks/pretokenize_throughput.py). The output appears atomically (temporary files
renamed, manifest last); no input is ever opened for writing; a store whose manifest
matches the sources (names, sizes, mtimes), tokenizer and BOS/EOS is reused as it is.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from .arrow import arrow_chunks, parquet_chunks
from .chunks import Chunk, chunk_texts
from .encode import encode_chunk, encode_documents, init_worker
from .errors import DataError
from .files import inside
from .jsonl import jsonl_chunks
from .sources import ResolvedSource, SourceSpec, resolve_source
from .store import DOCUMENTS, MANIFEST, TOKENS, StoreWriter, open_store
from .text import text_chunks
from .tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    import numpy as np

__all__ = ["pretokenize", "build_store", "specials", "source_key", "is_fresh", "encode_source", "main"]


def specials(tok: Tokenizer, bos: bool | None, eos: bool | None) -> tuple[int | None, int | None]:
    """The (bos_id, eos_id) to put around documents: ``None`` (auto) = the tokenizer's own
    if it has one; ``True`` needs one (DataError naming the tokenizer otherwise). A
    tokenizer whose BOS and EOS are one token (GPT-2's ``<|endoftext|>``) gets it once per
    document, as GPT-2 was trained: after it (the EOS), or before it with ``eos=False``."""
    out = []
    for name, want, have in (("bos", bos, tok.bos_id), ("eos", eos, tok.eos_id)):
        if want and have is None:
            what = "the byte tokenizer has no special tokens" if tok.name == "bytes" else \
                f"{tok.name} has no {name.upper()} token (none in tokenizer_config.json, its post-processor or its special tokens)"
            raise DataError(f"data.{name}=true but {what}: set data.{name}=false, or use a tokenizer with one")
        out.append(have if want is not False else None)
    if out[0] is not None and out[0] == out[1]:  # one separator, not two (document_ids reads it as an EOS)
        return None, out[1]
    return out[0], out[1]


def _file_rows(source: ResolvedSource) -> list[list]:
    rows = []
    for f, _ in source.files:
        st = f.stat()
        rel = f.relative_to(source.root).as_posix() if f != source.root else f.name
        rows.append([rel, st.st_size, st.st_mtime_ns])
    return rows


def source_key(source: ResolvedSource, tok: Tokenizer, bos: int | None, eos: int | None) -> dict:
    """What a store of ``source`` depends on (compared by :func:`is_fresh`)."""
    return {"tokenizer": {"name": tok.name, "sha256": tok.digest, "vocab_size": tok.vocab_size,
                          "bos_id": tok.bos_id, "eos_id": tok.eos_id},
            "bos": bos is not None, "eos": eos is not None,
            "source": {"path": str(source.root), "format": source.spec.format, "text_field": source.spec.text_field}}


def is_fresh(manifest: dict | None, source: ResolvedSource, tok: Tokenizer, bos, eos) -> bool:
    if not manifest or manifest.get("format") != "fsdp2d-tokens":
        return False
    key = source_key(source, tok, bos, eos)
    same = all(manifest.get(k) == v for k, v in key.items() if k != "source")
    src = (manifest.get("sources") or [{}])[0]
    return same and {k: src.get(k) for k in key["source"]} == key["source"] and \
        [row[:3] for row in src.get("files", [])] == _file_rows(source)


class _Counter:
    """A hash that also counts the bytes it saw (for progress)."""

    def __init__(self) -> None:
        self.sha, self.bytes = hashlib.sha256(), 0

    def update(self, data) -> None:
        self.sha.update(data)
        self.bytes += len(data)


def _chunks(source: ResolvedSource, index: int, counter: _Counter) -> Iterator[Chunk]:
    path, kind = source.files[index]
    field = source.spec.text_field
    if kind == "text":
        return text_chunks(path, counter, skip_invalid=source.skip_invalid)
    if kind.startswith("jsonl"):
        return jsonl_chunks(path, kind, counter, field)
    return parquet_chunks(path, counter, field) if kind == "parquet" else arrow_chunks(path, counter, field)


def encode_source(source: ResolvedSource, tok: Tokenizer, bos: int | None, eos: int | None,
                  counters: list | None = None) -> Iterator[tuple[int, "np.ndarray", "np.ndarray"]]:
    """(file index, tokens, lengths) of every chunk of ``source``, in order, tokenized in
    this process (``workers=0``; :func:`fsdp2d.train.data.load_tokens`)."""
    for i in range(len(source.files)):
        for chunk in _chunks(source, i, counters[i] if counters else _Counter()):
            yield (i, *encode_documents(chunk_texts(chunk), tok, bos, eos))


class _Progress:
    """``pretokenize [#####.....] 12/40 files 3.1 MB/s ETA 0:09`` on stderr: redrawn on a
    terminal; on a log, a line every tenth of the work once it has run 2 s, and the last."""

    def __init__(self, total_bytes: int, total_files: int, enabled: bool) -> None:
        self.total, self.files, self.enabled = max(total_bytes, 1), total_files, enabled
        self.tty, self.t0, self.next_line = sys.stderr.isatty(), time.perf_counter(), 0.1

    def update(self, done_bytes: int, done_files: int) -> None:
        if not self.enabled:
            return
        frac = min(done_bytes / self.total, 1.0)
        elapsed = time.perf_counter() - self.t0
        eta = elapsed * (1 - frac) / frac if frac > 0 else 0.0
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        text = (f"pretokenize [{bar}] {done_files}/{self.files} files {done_bytes / max(elapsed, 1e-9) / 1e6:.1f} "
                f"MB/s ETA {int(eta) // 60}:{int(eta) % 60:02d}")
        last = done_files == self.files
        if self.tty:
            print("\r" + text, end="\n" if last else "", file=sys.stderr, flush=True)
        elif last or (frac >= self.next_line and elapsed > 2):
            print(text, file=sys.stderr, flush=True)
            self.next_line = frac + 0.1
            self.enabled = not last  # one final line


def _run(source: ResolvedSource, tok: Tokenizer, bos, eos, writer: StoreWriter, workers: int,
         bar: _Progress) -> list[list]:
    """Tokenize every chunk in order into ``writer``; the per-file manifest rows."""
    rows = _file_rows(source)
    counts = [[0, 0] for _ in rows]  # documents, tokens per file
    counters = [_Counter() for _ in rows]
    done_files = 0

    def take(i: int, result) -> None:
        tokens, lengths = result
        writer.append(tokens, lengths)
        counts[i][0] += len(lengths)
        counts[i][1] += int(tokens.size)
        bar.update(sum(c.bytes for c in counters), done_files)

    if workers == 0:  # in this process (tests, the byte tokenizer)
        for i, tokens, lengths in encode_source(source, tok, bos, eos, counters):
            take(i, (tokens, lengths))
            done_files = i
    else:
        ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
        if ctx.get_start_method() == "forkserver":  # import once in the server, not in every worker
            ctx.set_forkserver_preload(["fsdp2d.data.encode"])
        with ctx.Pool(workers, init_worker, (tok.name, bos, eos)) as pool:
            pending: deque = deque()
            for i in range(len(rows)):
                for chunk in _chunks(source, i, counters[i]):
                    pending.append((i, pool.apply_async(encode_chunk, (chunk,))))
                    while len(pending) > 2 * workers:  # bounded: memory holds only the chunks in flight
                        j, result = pending.popleft()
                        take(j, result.get())
                done_files += 1
            while pending:
                j, result = pending.popleft()
                take(j, result.get())
    bar.update(sum(c.bytes for c in counters), len(rows))
    return [[*row, c.sha.hexdigest(), *n] for row, c, n in zip(rows, counters, counts)]


def _refuse_overwriting_inputs(source: ResolvedSource, tok: Tokenizer, out: Path) -> None:
    """``out`` must not be a source's folder or inside it, and no output may be an input:
    opening one for writing would truncate the input it is about to read."""
    if source.root.is_dir() and inside(out, source.root):
        raise DataError(f"pretokenize: the output {out} is inside the source folder {source.root}; "
                        f"choose an output folder outside it")
    outputs = {os.path.realpath(out / name): name for name in (TOKENS, DOCUMENTS, MANIFEST)}
    inputs = [f for f, _ in source.files] + ([Path(tok.name)] if tok.name != "bytes" else [])
    for f in inputs:
        if (real := os.path.realpath(f)) in outputs:
            raise DataError(f"pretokenize: the output {out / outputs[real]} is the input {f}; "
                            f"choose an output folder that holds none of the inputs' names")


def build_store(source: ResolvedSource, out: Path, tok: Tokenizer, bos: int | None, eos: int | None, *,
                workers: int | None = None, progress: bool = True) -> dict:
    """Tokenize the raw ``source`` into a store in ``out`` (reused when fresh); its manifest."""
    _refuse_overwriting_inputs(source, tok, out)
    try:
        current = open_store(out).manifest if (out / MANIFEST).is_file() else None
    except DataError:
        current = None
    if is_fresh(current, source, tok, bos, eos):
        return current
    workers = (os.cpu_count() or 1) if workers is None else workers
    bar = _Progress(sum(f.stat().st_size for f, _ in source.files), len(source.files), progress)
    writer = StoreWriter(out, tok.dtype)
    try:
        files = _run(source, tok, bos, eos, writer, workers, bar)
    except BaseException:
        writer.abort()
        raise
    key = source_key(source, tok, bos, eos)
    entry = {**key["source"], "files": files, "skipped": [r[0] for r in files if r[4] == 0 and r[1] > 0]}
    content = hashlib.sha256("\n".join(r[3] for r in files).encode()).hexdigest()
    return writer.commit({"tokenizer": key["tokenizer"], "bos": key["bos"], "eos": key["eos"],
                          "sources": [entry], "content_sha256": content})


def pretokenize(src: str | os.PathLike, out: str | os.PathLike, tokenizer: str = "bytes", *, format: str = "auto",
                text_field: str = "text", bos: bool | None = None, eos: bool | None = None,
                workers: int | None = None, progress: bool = True) -> dict:
    """Tokenize the source ``src`` into the token store ``out`` (see the module docstring).

    ``tokenizer``: ``"bytes"`` or a ``tokenizer.json``; ``bos``/``eos``: None = the
    tokenizer's own when it has one. ``workers``: processes (default: the CPU count; 0 =
    this process). Returns the manifest. Raises FileNotFoundError for a missing source and
    DataError (a ValueError) for data or a tokenizer that cannot be read as asked."""
    tok = load_tokenizer(tokenizer)
    source = resolve_source(SourceSpec(str(src), format, text_field))
    if source.kind != "raw":
        raise DataError(f"{src} is already tokens ({source.kind}): nothing to pretokenize")
    bos_id, eos_id = specials(tok, bos, eos)
    return build_store(source, Path(out), tok, bos_id, eos_id, workers=workers, progress=progress)


def main(argv: list[str]) -> int:
    """``fsdp2d pretokenize SRC OUT [--tokenizer T] [--workers N] [--format F] ...``."""
    import argparse

    parser = argparse.ArgumentParser(prog="fsdp2d pretokenize", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a file or folder: text, JSON lines (.jsonl, .gz, .zst), parquet, Arrow, a "
                                    "datasets save_to_disk folder (or 'stdlib')")
    parser.add_argument("out", help="folder for tokens.bin, documents.bin and manifest.json")
    parser.add_argument("--tokenizer", default="bytes", help="'bytes' or a tokenizer.json (or its folder)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: CPU count; 0: this one)")
    parser.add_argument("--format", default="auto", help="auto (by content), text, jsonl, parquet or arrow")
    parser.add_argument("--text-field", default="text", help="the field/column that holds a document's text")
    parser.add_argument("--no-bos", action="store_true", help="no BOS before each document")
    parser.add_argument("--no-eos", action="store_true", help="no EOS after each document")
    args = parser.parse_args(argv)
    if args.workers is not None and args.workers < 0:
        parser.error(f"--workers={args.workers} must be at least 0")
    try:
        m = pretokenize(args.src, args.out, args.tokenizer, format=args.format, text_field=args.text_field,
                        bos=False if args.no_bos else None, eos=False if args.no_eos else None, workers=args.workers)
    except (OSError, ValueError, ImportError) as exc:  # DataError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 1
    tok = m["tokenizer"]
    print(f"{m['tokens']} tokens in {m['documents']} documents ({m['dtype']}, vocab {tok['vocab_size']}, "
          f"bos {tok['bos_id'] if m['bos'] else 'none'}, eos {tok['eos_id'] if m['eos'] else 'none'}) in "
          f"{Path(args.out) / TOKENS}")
    return 0
