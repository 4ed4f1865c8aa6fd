"""Tokenize a text corpus once into the flat ``uint16``/``uint32`` files training reads.

``fsdp2d pretokenize SRC OUT --tokenizer tokenizer.json [--workers N]`` (or
``--data.pretokenize=OUT`` on ``fsdp2d train``) writes ``OUT/tokens.bin`` plus
``OUT/manifest.json`` (source files with sizes and mtimes, tokenizer digest, dtype,
token count). The stream is exactly what ``data.format="text"`` would build in memory:
files in sorted order, each tokenized without special tokens, concatenated. Files are
tokenized in parallel by a pool of processes (each loads the tokenizer once) and
written in order as they come back, so memory holds only the files in flight. The dtype
is ``uint16`` when the vocabulary fits, else ``uint32``. A manifest that matches the
sources and tokenizer means the work is done: the call returns at once.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from .config import ConfigError
from .data import TEXT_SUFFIXES, list_files, load_tokenizer, resolve_data_path

__all__ = ["pretokenize", "read_manifest"]

MANIFEST, TOKENS = "manifest.json", "tokens.bin"
_ENCODE: Callable[[list[str]], list[list[int]]] | None = None


def _init_worker(tokenizer: str) -> None:
    global _ENCODE
    _ENCODE = None if tokenizer == "bytes" else load_tokenizer(tokenizer)


def _encode_file(path: str) -> np.ndarray:
    """One file's ids, as ``data.format="text"`` makes them (bytes: the raw bytes), in the
    narrowest exact dtype: the array crosses a process boundary."""
    if _ENCODE is None:
        return np.frombuffer(Path(path).read_bytes(), dtype=np.uint8)
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    return np.asarray(_ENCODE([text])[0], dtype=np.uint32)  # tokenizers' ids are u32


def _vocab_size(tokenizer: str) -> int:
    if tokenizer == "bytes":
        return 256
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tokenizer).get_vocab_size()


def _sources(files: list[Path], tokenizer: str) -> dict:
    digest = "bytes" if tokenizer == "bytes" else hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()
    return {"tokenizer": digest,
            "files": [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]}


def read_manifest(out: str | os.PathLike) -> dict | None:
    path = Path(out) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


class _Progress:
    """``[#####.....] 12/40 files 3.1 MB/s ETA 0:09`` redrawn on a terminal; on a log,
    a plain line at every tenth of the work."""

    def __init__(self, total_bytes: int, total_files: int, enabled: bool) -> None:
        self.total, self.files, self.enabled = max(total_bytes, 1), total_files, enabled
        self.tty, self.t0, self.next_line = sys.stderr.isatty(), time.perf_counter(), 0.1

    def update(self, done_bytes: int, done_files: int) -> None:
        if not self.enabled:
            return
        frac = done_bytes / self.total
        elapsed = time.perf_counter() - self.t0
        eta = elapsed * (1 - frac) / frac if frac > 0 else 0.0
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        text = (f"pretokenize [{bar}] {done_files}/{self.files} files {done_bytes / max(elapsed, 1e-9) / 1e6:.1f} "
                f"MB/s ETA {int(eta) // 60}:{int(eta) % 60:02d}")
        if self.tty:
            print("\r" + text, end="\n" if done_files == self.files else "", file=sys.stderr, flush=True)
        elif frac >= self.next_line or done_files == self.files:
            print(text, file=sys.stderr, flush=True)
            self.next_line = frac + 0.1


def pretokenize(src: str | os.PathLike, out: str | os.PathLike, tokenizer: str = "bytes", *,
                workers: int | None = None, progress: bool = True) -> dict:
    """Tokenize the text files of ``src`` into ``out`` (see the module docstring).

    ``tokenizer``: ``"bytes"`` or a ``tokenizer.json`` path. ``workers``: processes
    (default: the CPU count). Returns the manifest. Raises ``FileNotFoundError`` for a
    missing source, ``ValueError`` for ids that do not fit the chosen dtype.
    """
    files = list_files(resolve_data_path(src), TEXT_SUFFIXES)
    out = Path(out)
    _refuse_overwriting_inputs(files, tokenizer, out)
    sources = _sources(files, tokenizer)
    done = read_manifest(out)
    if done is not None and {k: done.get(k) for k in sources} == sources and (out / TOKENS).is_file():
        return done
    vocab = _vocab_size(tokenizer)
    fmt = "uint16" if vocab <= 2**16 else "uint32"
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # a crash midway leaves no manifest: redone next time
    bar = _Progress(sum(f.stat().st_size for f in files), len(files), progress)
    partial = out / f".{TOKENS}.{os.getpid()}.partial"  # renamed over tokens.bin once complete
    try:
        count = _write_tokens(files, tokenizer, fmt, partial, workers, bar)
        os.replace(partial, out / TOKENS)
    finally:
        partial.unlink(missing_ok=True)
    manifest = {**sources, "format": fmt, "tokens": count, "vocab_size": vocab}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _refuse_overwriting_inputs(files: list[Path], tokenizer: str, out: Path) -> None:
    """``out/tokens.bin`` and ``out/manifest.json`` must not be a source or the tokenizer:
    opening one for writing would truncate the input it is about to read."""
    outputs = {os.path.realpath(out / name): name for name in (TOKENS, MANIFEST)}
    inputs = [*files, *([] if tokenizer == "bytes" else [Path(tokenizer)])]
    for f in inputs:
        if (real := os.path.realpath(f)) in outputs:
            raise ValueError(f"pretokenize: the output {out / outputs[real]} is the input {f}; "
                             f"choose an output folder that holds none of the inputs' names")


def _write_tokens(files: list[Path], tokenizer: str, fmt: str, path: Path, workers: int | None,
                  bar: _Progress) -> int:
    """Tokenize ``files`` in a process pool into ``path``, in order; the token count."""
    count, done_bytes = 0, 0
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    with open(path, "wb") as sink, ctx.Pool(workers or os.cpu_count() or 1, _init_worker, (tokenizer,)) as pool:
        for i, ids in enumerate(pool.imap(_encode_file, [str(f) for f in files], chunksize=1)):
            if ids.size and ids.max() >= 2 ** (16 if fmt == "uint16" else 32):
                raise ValueError(f"{files[i]}: token id {ids.max()} does not fit {fmt}")
            sink.write(ids.astype("<u2" if fmt == "uint16" else "<u4").tobytes())
            count += ids.size
            done_bytes += files[i].stat().st_size
            bar.update(done_bytes, i + 1)
    return count


def apply_pretokenize(cfg, *, may_work: bool) -> None:
    """``data.pretokenize=DIR`` with ``data.format="text"``: make sure DIR holds the
    tokenized corpus (tokenizing it when ``may_work``: the launcher process, before any
    rank starts) and point ``cfg.data`` at it (in place). Ranks started by an outside
    torchrun only check: they raise ``ConfigError`` if DIR is missing or stale."""
    d = cfg.data
    if not d.pretokenize or d.format != "text":
        return
    if may_work:
        manifest = pretokenize(d.path, d.pretokenize, d.tokenizer)
    else:
        manifest = read_manifest(d.pretokenize)
        sources = _sources(list_files(resolve_data_path(d.path), TEXT_SUFFIXES), d.tokenizer)
        if manifest is None or {k: manifest.get(k) for k in sources} != sources:
            raise ConfigError(f"data.pretokenize={d.pretokenize!r} is missing or stale: run "
                             f"`fsdp2d pretokenize {d.path} {d.pretokenize} --tokenizer {d.tokenizer}` first")
    d.path, d.format = d.pretokenize, manifest["format"]


def main(argv: list[str]) -> int:
    """``fsdp2d pretokenize SRC OUT [--tokenizer T] [--workers N]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="fsdp2d pretokenize", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a text file or folder (or 'stdlib')")
    parser.add_argument("out", help="folder for tokens.bin and manifest.json")
    parser.add_argument("--tokenizer", default="bytes", help="'bytes' or a tokenizer.json")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: CPU count)")
    args = parser.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers={args.workers} must be at least 1")
    try:
        m = pretokenize(args.src, args.out, args.tokenizer, workers=args.workers)
    except (OSError, ValueError, ConfigError) as exc:  # a missing source, an output over an input
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{m['tokens']} tokens ({m['format']}, vocab {m['vocab_size']}) in {Path(args.out) / TOKENS}")
    return 0
