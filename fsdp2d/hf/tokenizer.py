"""The run's tokenizer as Hugging Face files, and its BOS/EOS ids.

An HF export is only usable with its tokenizer: :func:`tokenizer_files` gives
``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``, which
``transformers.AutoTokenizer`` loads (``PreTrainedTokenizerFast``).

* A ``tokenizer.json`` (the ``tokenizers`` library's file) is copied as it is. Its BOS and
  EOS are the ones training added to every document (:func:`fsdp2d.data.tokenizer.find_special_ids`:
  a ``tokenizer_config.json`` beside it, else its post-processor's template, else special
  added tokens with the usual names); none found: None.
* fsdp2d's byte tokenizer (``data.tokenizer = "bytes"``: token = byte value, vocab 256)
  is written as an equivalent ``tokenizer.json``: a byte-level BPE with no merges whose
  256 symbols have ids 0-255 in byte order, so ``encode(text).ids == list(text.encode())``
  and decoding restores the bytes. It has no BOS/EOS (256 ids are all bytes).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .config import HFError

__all__ = ["special_tokens", "tokenizer_files", "byte_tokenizer", "recorded_tokenizer"]


def byte_tokenizer():
    """fsdp2d's byte tokenizer as a ``tokenizers.Tokenizer`` (ids = byte values)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # Byte-level BPE shows byte b as one printable character: itself where Latin-1 prints
    # it, else chr(256 + k) for the k-th byte that does not (the byte-level alphabet).
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    symbol, k = {}, 0
    for b in range(256):
        if b in printable:
            symbol[b] = chr(b)
        else:
            symbol[b], k = chr(256 + k), k + 1
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in symbol.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def special_tokens(path: str | os.PathLike) -> dict[str, str | int | None]:
    """``{"bos_token", "bos_token_id", "eos_token", "eos_token_id"}`` of the tokenizer file
    ``path`` (None where it has none): the same ids the data layer closes documents with."""
    from tokenizers import Tokenizer

    from fsdp2d.data.tokenizer import load_tokenizer

    ids = load_tokenizer(path)  # (a folder: its tokenizer.json)
    tok = Tokenizer.from_file(ids.name)
    out: dict[str, str | int | None] = {}
    for role, token_id in (("bos", ids.bos_id), ("eos", ids.eos_id)):
        out[f"{role}_token"], out[f"{role}_token_id"] = (tok.id_to_token(token_id), token_id) \
            if token_id is not None else (None, None)
    return out


def tokenizer_files(tokenizer: str, max_len: int) -> tuple[dict[str, bytes], dict]:
    """The tokenizer files of an HF folder, ``{name: content}``, and :func:`special_tokens`'
    dict. ``tokenizer``: ``"bytes"`` or a ``tokenizer.json`` (or its folder)."""
    from fsdp2d.data.tokenizer import tokenizer_file

    if tokenizer == "bytes":
        files = {"tokenizer.json": byte_tokenizer().to_str().encode()}
        special: dict = {"bos_token": None, "bos_token_id": None, "eos_token": None, "eos_token_id": None}
    else:
        files = {"tokenizer.json": tokenizer_file(tokenizer).read_bytes()}
        special = special_tokens(tokenizer)
    named = {k: special[k] for k in ("bos_token", "eos_token") if special[k] is not None}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "clean_up_tokenization_spaces": False, **named}
    files["tokenizer_config.json"] = (json.dumps(config, indent=2) + "\n").encode()
    files["special_tokens_map.json"] = (json.dumps(named, indent=2) + "\n").encode()
    return files, special


def recorded_tokenizer(index: dict, ckpt: str | os.PathLike) -> str | None:
    """The tokenizer checkpoint ``ckpt`` records (``extra["tokenizer"]``, written by
    ``fsdp2d train``): ``"bytes"``, or the recorded tokenizer.json when it is still there,
    unchanged (its ``extra["tokenizer_sha256"]``); None when the checkpoint records none or
    records that the run's tokens named none (``extra["tokenizer"] = None``). HFError, one
    line naming the file and ``--tokenizer``, when the recorded file is gone or changed:
    the tokenizer is never guessed."""
    from fsdp2d.data.tokenizer import file_sha256

    extra = index.get("extra", {})
    name, sha = extra.get("tokenizer"), extra.get("tokenizer_sha256")
    if name is None or name == "bytes":
        return name
    path = Path(name)
    if not path.is_file():
        what = f" (sha256 {sha})" if sha else ""
        raise HFError(f"{ckpt} was trained with the tokenizer {name}{what}, which is not there: pass --tokenizer "
                      f"PATH (that tokenizer.json, or its folder)")
    if sha and file_sha256(path) != sha:
        raise HFError(f"{ckpt} was trained with the tokenizer {name} (sha256 {sha}), which has changed since: pass "
                      f"--tokenizer PATH (the tokenizer.json the run used)")
    return name
