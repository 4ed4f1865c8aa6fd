"""The files of a Hugging Face folder, read as untrusted input.

Design
------
:class:`HFFolder` opens ``config.json`` and the safetensors files (one
``model.safetensors``, or the shards a ``model.safetensors.index.json`` names) and
nothing else: every name is resolved (symlinks included) and must land inside the
folder (:meth:`HFFolder.resolve`), so an index entry ``../x``, an absolute path or a
symlink out of the folder is an :class:`HFError`, not a read of someone else's file.
One layout is known and allowed: the hub cache's ``snapshots/<rev>/`` folder, whose
files are symlinks into the sibling ``blobs/`` of the same model.
Opening a folder reads every file's header up front and checks it against the index
(each listed tensor is where the index says, no file holds a tensor the index places
elsewhere, both layouts at once are ambiguous), so the loader can validate the whole
set (names, shapes, dtypes) before a byte reaches a model. Data is then read lazily,
one box at a time, with safetensors' ``get_slice``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from .._export_stage import interrupted_swap
from .config import HFError

__all__ = ["HFFolder", "ReadStats", "FLOAT_DTYPES"]

INDEX, SINGLE, CONFIG = "model.safetensors.index.json", "model.safetensors", "config.json"
# safetensors dtypes a float weight may be stored in without losing meaning. Integers and
# bools are not weights; fp8 needs the scales of a quantized checkpoint fsdp2d cannot apply.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


@dataclass
class ReadStats:
    """What a load read from the HF files: bytes of tensor data and slices."""

    bytes: int = 0
    slices: int = 0


def _no_duplicates(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError(f"duplicate keys {sorted({k for k in keys if keys.count(k) > 1})[:3]}")
    return dict(pairs)


class HFFolder:
    """Checked, lazy, sliced access to an HF folder (single file or sharded); a context
    manager that closes its files. ``meta[name] = (shape, dtype, file)`` for every stored
    tensor, read from the headers on construction."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise HFError(f"{self.path}: not a folder (a Hugging Face model folder holds config.json and weights)")
        previous = interrupted_swap(self.path)
        if previous is not None:
            raise HFError(f"{self.path}: an export into this folder was killed while replacing its model files "
                          f"(the earlier ones wait in {previous}): it may hold parts of two models. Export again "
                          f"(the launcher's --resume ends with one) or restore the files from {previous}")
        self._root = os.path.realpath(self.path)
        # The Hugging Face hub cache keeps a revision as snapshots/<rev>/NAME -> ../../blobs/<sha>:
        # that one sibling folder is part of the model too.
        self._roots = [self._root]
        if self.path.absolute().parent.name == "snapshots":
            self._roots.append(os.path.realpath(self.path.absolute().parent.parent / "blobs"))
        self.stats = ReadStats()
        self._files: dict[str, Any] = {}
        try:
            self.weight_map = self._weight_map()
            self.meta = self._headers()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "HFFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def resolve(self, name: Any, what: str) -> str:
        """The real path of ``name`` inside the folder; :class:`HFError` if it resolves
        outside (``..``, absolute, a symlink out) or is not a file."""
        if not isinstance(name, str) or not name:
            raise HFError(f"{self.path}: {what} {name!r} is not a file name")
        real = os.path.realpath(os.path.join(self._root, name))
        if not any(real.startswith(root + os.sep) for root in self._roots):
            raise HFError(f"{self.path}: {what} {name!r} resolves to {real}, outside the folder: refused")
        if not os.path.isfile(real):
            raise HFError(f"{self.path}: {what} {name!r} is missing (or not a file)")
        return real

    def _json(self, name: str) -> Any:
        real = self.resolve(name, "file")
        try:
            with open(real, "rb") as f:
                return json.loads(f.read(), object_pairs_hook=_no_duplicates)
        except (ValueError, UnicodeDecodeError) as exc:
            raise HFError(f"{self.path / name}: not valid JSON: {exc}") from exc

    def config(self) -> dict:
        if not os.path.lexists(self.path / CONFIG):
            raise HFError(f"{self.path}: no config.json")
        return self._json(CONFIG)

    def _weight_map(self) -> dict[str, str]:
        has_index, has_single = os.path.lexists(self.path / INDEX), os.path.lexists(self.path / SINGLE)
        if has_index and has_single:
            raise HFError(f"{self.path}: holds both {SINGLE} and {INDEX} (two exports in one folder?); "
                          f"transformers would read one, fsdp2d the other: remove the stale one")
        if has_index:
            index = self._json(INDEX)
            wm = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise HFError(f"{self.path / INDEX}: weight_map must be an object of tensor name -> file name")
            return wm
        if has_single:
            return {k: SINGLE for k in self._open(SINGLE).keys()}
        raise HFError(f"{self.path}: has neither {SINGLE} nor {INDEX}")

    def _open(self, fname: str) -> Any:
        if fname not in self._files:
            real = self.resolve(fname, "weights file")
            try:
                self._files[fname] = safe_open(real, framework="pt").__enter__()
            except Exception as exc:  # safetensors' own error types for a damaged file
                raise HFError(f"{self.path / fname}: not a readable safetensors file: {exc}") from exc
        return self._files[fname]

    def _headers(self) -> dict[str, tuple[tuple[int, ...], str, str]]:
        meta = {}
        for fname in sorted(set(self.weight_map.values())):
            f = self._open(fname)
            for key in f.keys():
                if self.weight_map.get(key) != fname:
                    raise HFError(f"{self.path / fname}: holds {key!r}, which the index places in "
                                  f"{self.weight_map.get(key)!r}")
                s = f.get_slice(key)
                meta[key] = (tuple(s.get_shape()), s.get_dtype(), fname)
        missing = sorted(k for k in self.weight_map if k not in meta)
        if missing:
            raise HFError(f"{self.path / INDEX}: lists {missing[:3]} in files that do not hold them")
        return meta

    def key(self, name: str) -> str:
        """The stored key of HF tensor ``name`` (the original GPT-2 files lack ``transformer.``)."""
        if name not in self.meta and name.removeprefix("transformer.") in self.meta:
            return name.removeprefix("transformer.")
        if name not in self.meta:
            raise HFError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        return name

    def shape(self, name: str) -> tuple[int, ...]:
        return self.meta[self.key(name)][0]

    def dtype(self, name: str) -> str:
        return self.meta[self.key(name)][1]

    def slice(self, name: str) -> Any:
        key = self.key(name)
        return self._open(self.meta[key][2]).get_slice(key)

    def close(self) -> None:
        for f in self._files.values():
            f.__exit__(None, None, None)
        self._files.clear()
