"""Tokenizers: the byte tokenizer, or a Hugging Face ``tokenizer.json``, with its BOS/EOS.

:class:`Tokenizer` wraps either. ``bytes`` maps each UTF-8 byte to its value (vocab 256)
and has no special tokens. A ``tokenizer.json`` (or a folder holding one) is loaded with
the ``tokenizers`` package; its BOS and EOS are found, in this order, from a
``tokenizer_config.json`` beside it (``bos_token`` / ``eos_token``, as transformers reads
them), from the post-processor's template (a special token before ``$A`` is the BOS, one
after it the EOS), and from its special added tokens by their usual names
(``<s>``/``</s>``, ``<|begin_of_text|>``/``<|end_of_text|>``, ``<|endoftext|>``, ...).
A file that is not a tokenizer is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .errors import DataError

__all__ = ["Tokenizer", "load_tokenizer", "find_special_ids"]

BYTES = "bytes"
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "<|im_start|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>", "<|eos|>")


@dataclass
class Tokenizer:
    """``encode(texts) -> [ids, ...]`` (no special tokens) plus what the data layer needs."""

    name: str
    """``bytes`` or the tokenizer.json path."""
    vocab_size: int
    """Ids are < this (added tokens included)."""
    bos_id: int | None
    eos_id: int | None
    digest: str
    """sha256 of the tokenizer file (``bytes`` for the byte tokenizer): caches key on it."""
    encode: Callable[[list[str]], list[Any]] = field(repr=False)

    @property
    def dtype(self) -> np.dtype:
        """The narrowest unsigned dtype that holds every id."""
        return np.dtype("<u1" if self.vocab_size <= 256 else "<u2" if self.vocab_size <= 2**16 else "<u4")


def _token_name(value: Any) -> str | None:
    """``"<s>"`` or ``{"content": "<s>", ...}`` (tokenizer_config.json) -> ``"<s>"``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _from_config(path: Path, vocab: dict[str, int]) -> tuple[int | None, int | None] | None:
    cfg_path = path.parent / "tokenizer_config.json"
    if not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError):
        return None
    ids = [vocab.get(_token_name(cfg.get(key)) or "") for key in ("bos_token", "eos_token")]
    return (ids[0], ids[1]) if any(i is not None for i in ids) else None


def _from_template(spec: dict) -> tuple[int | None, int | None] | None:
    """BOS/EOS from a TemplateProcessing post-processor (``<s> $A </s>``), possibly in a Sequence."""
    post = spec.get("post_processor") or {}
    procs = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for proc in procs:
        if proc.get("type") != "TemplateProcessing":
            continue
        items, specials = proc.get("single", []), proc.get("special_tokens", {})
        names = [next(iter(i.values())).get("id") if "SpecialToken" in i else "$" for i in items]
        if "$" not in names:
            continue
        at = names.index("$")
        before = names[at - 1] if at > 0 else None
        after = names[at + 1] if at + 1 < len(names) else None
        bos, eos = (((specials.get(n) or {}).get("ids") or [None])[0] if n else None for n in (before, after))
        if bos is not None or eos is not None:
            return bos, eos
    return None


def find_special_ids(path: Path, spec: dict, vocab: dict[str, int]) -> tuple[int | None, int | None]:
    """(bos_id, eos_id) of a tokenizer.json (see the module docstring); None where it has none."""
    found = _from_config(path, vocab) or _from_template(spec)
    if found is not None:
        return found
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    bos = next((specials[n] for n in _BOS_NAMES if n in specials), None)
    eos = next((specials[n] for n in _EOS_NAMES if n in specials), None)
    return bos, eos


def load_tokenizer(spec: str | os.PathLike[str]) -> Tokenizer:
    """``"bytes"`` or a tokenizer.json (a folder holding one works too). DataError, in one
    line, for a file that is not a tokenizer; ImportError naming the package without
    ``tokenizers``."""
    if str(spec) == BYTES:
        return Tokenizer(BYTES, 256, None, None, BYTES, _encode_bytes)
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError as e:
        raise ImportError(f"data.tokenizer={str(spec)!r} needs the 'tokenizers' package: "
                          f"pip install tokenizers (or use data.tokenizer='bytes')") from e
    if not path.is_file():
        raise DataError(f"tokenizer {str(spec)!r} does not exist: give a tokenizer.json (or its folder) or 'bytes'")
    raw = path.read_bytes()
    try:
        tok = HFTokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # tokenizers raises a plain Exception for anything it cannot parse
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{path} is not a Hugging Face tokenizer.json ({first}): give the tokenizer.json a "
                        f"tokenizers.Tokenizer saved, or 'bytes'") from None
    vocab = tok.get_vocab(with_added_tokens=True)
    bos, eos = find_special_ids(path, json.loads(tok.to_str()), vocab)
    size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)

    def encode(texts: list[str]) -> list[Any]:
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    return Tokenizer(str(path), size, bos, eos, hashlib.sha256(raw).hexdigest(), encode)


def _encode_bytes(texts: list[str]) -> list[Any]:
    return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
