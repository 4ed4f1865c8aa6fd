"""The run's tokenizer as Hugging Face files, and its BOS/EOS ids.

An HF export is only usable with its tokenizer: :func:`tokenizer_files` gives
``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``, which
``transformers.AutoTokenizer`` loads (``PreTrainedTokenizerFast``).

* A ``tokenizer.json`` (the ``tokenizers`` library's file) is copied as it is. Its BOS and
  EOS are the ones a ``tokenizer_config.json`` beside it names, else its special added
  tokens with the usual names (:data:`BOS_NAMES`, :data:`EOS_NAMES`; GPT-2's
  ``<|endoftext|>`` is both); none found: None.
* fsdp2d's byte tokenizer (``data.tokenizer = "bytes"``: token = byte value, vocab 256)
  is written as an equivalent ``tokenizer.json``: a byte-level BPE with no merges whose
  256 symbols have ids 0-255 in byte order, so ``encode(text).ids == list(text.encode())``
  and decoding restores the bytes. It has no BOS/EOS (256 ids are all bytes).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["special_tokens", "tokenizer_files", "byte_tokenizer", "BOS_NAMES", "EOS_NAMES"]

BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "<|endoftext|>")
EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>", "<|eot_id|>")


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


def _named(config: dict, key: str) -> str | None:
    value = config.get(key)
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def special_tokens(path: str | os.PathLike) -> dict[str, str | int | None]:
    """``{"bos_token", "bos_token_id", "eos_token", "eos_token_id"}`` of the tokenizer file
    ``path`` (None where it has none; see the module doc)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    beside = Path(path).with_name("tokenizer_config.json")
    config = json.loads(beside.read_text()) if beside.is_file() else {}
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    out: dict[str, str | int | None] = {}
    for role, names in (("bos", BOS_NAMES), ("eos", EOS_NAMES)):
        name = _named(config, f"{role}_token") or next((n for n in names if n in specials), None)
        token_id = tok.token_to_id(name) if name is not None else None
        out[f"{role}_token"], out[f"{role}_token_id"] = (name, token_id) if token_id is not None else (None, None)
    return out


def tokenizer_files(tokenizer: str, max_len: int) -> tuple[dict[str, bytes], dict]:
    """The tokenizer files of an HF folder, ``{name: content}``, and :func:`special_tokens`'
    dict. ``tokenizer``: ``"bytes"`` or a ``tokenizer.json`` path."""
    if tokenizer == "bytes":
        files = {"tokenizer.json": byte_tokenizer().to_str().encode()}
        special: dict = {"bos_token": None, "bos_token_id": None, "eos_token": None, "eos_token_id": None}
    else:
        files = {"tokenizer.json": Path(tokenizer).read_bytes()}
        special = special_tokens(tokenizer)
    named = {k: special[k] for k in ("bos_token", "eos_token") if special[k] is not None}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "clean_up_tokenization_spaces": False, **named}
    files["tokenizer_config.json"] = (json.dumps(config, indent=2) + "\n").encode()
    files["special_tokens_map.json"] = (json.dumps(named, indent=2) + "\n").encode()
    return files, special
