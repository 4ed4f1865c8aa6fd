"""Tokenizers: the byte tokenizer, or a Hugging Face ``tokenizer.json``, with its BOS/EOS.

:class:`Tokenizer` wraps either. ``bytes`` maps each UTF-8 byte to its value (vocab 256)
and has no special tokens. A ``tokenizer.json`` (or a folder holding one) is loaded with
the ``tokenizers`` package; its BOS and EOS are found, each from the first of these that
names it: a ``tokenizer_config.json`` beside it (``bos_token`` / ``eos_token``, as
transformers reads them), the post-processor's template (a special token before ``$A`` is
the BOS, one after it the EOS), its special added tokens by their usual names
(``<s>``/``</s>``, ``<|begin_of_text|>``/``<|end_of_text|>``, ``<|endoftext|>``, ...).
Documents are encoded with ``encode_special_tokens``: text that spells a special token is
text, so only the boundaries the data layer adds are BOS/EOS. A file that is not a
tokenizer is refused in one line.
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

__all__ = ["Tokenizer", "TokenizerRecord", "load_tokenizer", "find_special_ids", "tokenizer_file", "file_sha256"]

BYTES = "bytes"
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "<|im_start|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>", "<|eos|>")


@dataclass
class Tokenizer:
    """``encode(texts) -> [ids, ...]`` (no special tokens) plus what the data layer needs."""

    name: str
    """``bytes`` or the tokenizer.json's absolute path."""
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


@dataclass(frozen=True)
class TokenizerRecord:
    """The tokenizer a run's tokens were made with, as its checkpoints record it (for
    ``fsdp2d generate`` and the HF export): what the data layer used, not what the config
    says (a token store names its own)."""

    name: str | None
    """``bytes``, a tokenizer.json's absolute path (as the store's manifest names it, when
    the file is not there), or None: unknown (flat token files, which name none)."""
    sha256: str | None = None
    """The tokenizer file's sha256 (None for ``bytes`` and unknown)."""
    found: bool = True
    """The file is there with that sha256 (always for ``bytes``; never for unknown)."""

    @classmethod
    def of_store(cls, name: str, sha256: str) -> TokenizerRecord:
        """A store's tokenizer (its manifest's name and sha256): found if the file is there unchanged."""
        if name == BYTES:
            return cls(BYTES)
        path = tokenizer_file(name)
        found = path.is_file() and file_sha256(path) == sha256
        return cls(str(path) if found else name, sha256, found)

    def extra(self) -> dict[str, str | None]:
        """``extra["tokenizer"]`` / ``extra["tokenizer_sha256"]`` of a checkpoint."""
        return {"tokenizer": self.name, "tokenizer_sha256": self.sha256}

    def __str__(self) -> str:
        if self.name is None:
            return "unknown (token files that name none: generate needs --tokenizer, the HF export has none)"
        if not self.found:
            return (f"{self.name} (sha256 {self.sha256[:12]}..., the token store's: not found; set data.tokenizer to "
                    f"it, or the HF export has no tokenizer and generate needs --tokenizer)")
        return self.name


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
    """(bos_id, eos_id) of a tokenizer.json (see the module docstring); None where it has none.

    Each id is taken from the first place that names it: a template that adds only the BOS
    (``<s> $A``, Llama's and Mistral's) still gets its EOS from the special tokens' names."""
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    by_name = (next((specials[n] for n in _BOS_NAMES if n in specials), None),
               next((specials[n] for n in _EOS_NAMES if n in specials), None))
    found = [(None, None) if f is None else f for f in (_from_config(path, vocab), _from_template(spec))]
    bos, eos = (next((ids[i] for ids in (*found, by_name) if ids[i] is not None), None) for i in (0, 1))
    return bos, eos


def tokenizer_file(spec: str | os.PathLike[str]) -> Path:
    """The tokenizer.json that ``spec`` names (a folder holding one works too), absolute."""
    path = Path(spec).expanduser()
    return (path / "tokenizer.json" if path.is_dir() else path).resolve()


def load_tokenizer(spec: str | os.PathLike[str]) -> Tokenizer:
    """``"bytes"`` or a tokenizer.json (a folder holding one works too). DataError, in one
    line, for a file that is not a tokenizer; ImportError naming the package without
    ``tokenizers``."""
    if str(spec) == BYTES:
        return Tokenizer(BYTES, 256, None, None, BYTES, _encode_bytes)
    path = tokenizer_file(spec)
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
    # Text that spells a special token ("</s>" quoted in a document, "<|endoftext|>" in web
    # text) is encoded as text: only the data layer puts BOS/EOS, at document boundaries.
    tok.encode_special_tokens = True
    vocab = tok.get_vocab(with_added_tokens=True)
    bos, eos = find_special_ids(path, json.loads(tok.to_str()), vocab)
    size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)

    def encode(texts: list[str]) -> list[Any]:
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    return Tokenizer(str(path), size, bos, eos, hashlib.sha256(raw).hexdigest(), encode)


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's bytes (the key a tokenizer is known by in stores and checkpoints)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _encode_bytes(texts: list[str]) -> list[Any]:
    return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
