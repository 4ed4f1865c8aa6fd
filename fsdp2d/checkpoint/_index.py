"""The checkpoint index, checked whole before anything is read into a model.

``validate_index`` accepts only a document ``save`` could have written: every field's
type, every name, every box inside its tensor, the boxes of a tensor adding up to
exactly its size, each (file, key) used once, file names that are plain names inside
the folder, and a sha256 for every box. A hostile or damaged index therefore fails
here, with an error naming the field, before a file is opened or a byte allocated.
What the index cannot tell (a file's own dtype, shape and bytes) is checked against
the safetensors header and the checksum when each box is read (``_files``).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

INDEX = "fsdp2d.index.json"
FORMAT, VERSION = "fsdp2d", 1

# index dtype name -> safetensors dtype code (the only dtypes a checkpoint may hold)
DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
          "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
          "uint16": "U16", "uint32": "U32", "uint64": "U64", "complex64": "C64",
          "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
TORCH_DTYPES = {code: getattr(torch, name) for name, code in DTYPES.items() if hasattr(torch, name)}
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_NDIM = 64


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this model (names the file or keys)."""


def _is_int(x: Any, low: int = 0) -> bool:
    return type(x) is int and x >= low  # (bool is an int subclass: refused)


def _ints(x: Any, n: int | None, low: int = 0) -> bool:
    return (isinstance(x, list) and (n is None or len(x) == n) and len(x) <= _MAX_NDIM
            and all(_is_int(v, low) for v in x))


def valid_file_name(name: Any) -> bool:
    """A plain file name directly inside the folder: no separator, no leading dot
    (so no ``.``/``..`` and none of fsdp2d's hidden version folders)."""
    return isinstance(name, str) and _FILE_NAME.fullmatch(name) is not None


class _Checker:
    """Collects nothing: raises at the first problem, naming ``where`` and the field."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, msg: str) -> None:
        raise CheckpointError(f"{self.where}: {msg}; the index is damaged or was not written by "
                              f"fsdp2d.checkpoint.save: save the checkpoint again")

    def need(self, ok: bool, msg: str) -> None:
        if not ok:
            self.fail(msg)


def validate_index(index: Any, where: str) -> dict:
    """``index`` if it is a well-formed fsdp2d index, else :class:`CheckpointError`."""
    c = _Checker(where)
    c.need(isinstance(index, dict), "the index is not a JSON object")
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointError(f"{where}: unsupported format {index.get('format')!r} version "
                              f"{index.get('version')!r} (this fsdp2d reads {FORMAT!r} version {VERSION})")
    missing = [k for k in ("world_size", "mesh", "extra", "optim_hparams", "files", "tensors") if k not in index]
    c.need(not missing, f"missing fields {missing}")
    c.need(_is_int(index["world_size"], 1), f"world_size={index['world_size']!r} is not an int >= 1")
    mesh = index["mesh"]
    c.need(isinstance(mesh, dict) and isinstance(mesh.get("axes"), list)
           and all(isinstance(a, str) for a in mesh["axes"]) and _ints(mesh.get("shape"), len(mesh["axes"]), 1),
           "mesh must be {\"axes\": [names], \"shape\": [sizes]}")
    c.need(isinstance(index["extra"], dict), "extra is not a JSON object")
    c.need("id" not in index or isinstance(index["id"], str), "id is not a string")
    _check_hparams_doc(c, index["optim_hparams"])
    files = index["files"]
    c.need(isinstance(files, dict), "files is not a JSON object")
    for name, info in files.items():
        c.need(valid_file_name(name), f"file name {name!r} is not a plain name inside the checkpoint folder")
        c.need(isinstance(info, dict) and _is_int(info.get("size")), f"files[{name!r}] needs an int size >= 0")
    tensors = index["tensors"]
    c.need(isinstance(tensors, dict), "tensors is not a JSON object")
    used: set[tuple[str, str]] = set()
    for name, meta in tensors.items():
        _check_tensor(c, name, meta, files, used)
    return index


def _check_hparams_doc(c: _Checker, hp: Any) -> None:
    if hp is None:
        return
    c.need(isinstance(hp, list) and all(isinstance(g, dict) for g in hp),
           "optim_hparams must be null or a list of objects (one per param group)")
    for i, group in enumerate(hp):
        c.need("params" not in group, f"optim_hparams[{i}] holds 'params' (parameters are never saved there)")
        for k, v in group.items():
            c.need(_json_scalar(v) or (isinstance(v, list) and all(_json_scalar(x) for x in v)),
                   f"optim_hparams[{i}][{k!r}] = {v!r} is not a number, string, bool, null or list of them")


def _json_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _check_tensor(c: _Checker, name: Any, meta: Any, files: dict, used: set) -> None:
    c.need(isinstance(name, str) and name.startswith(("model/", "optim/")),
           f"tensor name {name!r} must start with 'model/' or 'optim/'")
    c.need(isinstance(meta, dict), f"tensors[{name!r}] is not an object")
    c.need(meta.get("dtype") in DTYPES, f"{name!r}: dtype {meta.get('dtype')!r} is not one of {sorted(DTYPES)}")
    shape = meta.get("shape")
    c.need(_ints(shape, None), f"{name!r}: shape {shape!r} is not a list of ints >= 0")
    boxes = meta.get("boxes")
    c.need(isinstance(boxes, list), f"{name!r}: boxes is not a list")
    total = 0
    for i, b in enumerate(boxes):
        what = f"{name!r} box {i}"
        c.need(isinstance(b, dict), f"{what} is not an object")
        c.need(_ints(b.get("offset"), len(shape)) and _ints(b.get("shape"), len(shape), 1),
               f"{what}: offset and shape must be {len(shape)} ints (shape >= 1 each)")
        c.need(all(o + n <= s for o, n, s in zip(b["offset"], b["shape"], shape)),
               f"{what} (offset {b['offset']}, shape {b['shape']}) reaches outside the tensor's shape {shape}")
        c.need(valid_file_name(b.get("file")) and b["file"] in files,
               f"{what}: file {b.get('file')!r} is not a file listed in the index")
        c.need(isinstance(b.get("key"), str) and b["key"] != "__metadata__", f"{what}: key is not a string")
        c.need((b["file"], b["key"]) not in used, f"{what}: {b['file']}/{b['key']} is used by another box too")
        used.add((b["file"], b["key"]))
        c.need(isinstance(b.get("sha256"), str) and _SHA256.fullmatch(b["sha256"]) is not None,
               f"{what}: sha256 is missing or not 64 lowercase hex digits (every box is verified)")
        total += math.prod(b["shape"])
    c.need(total == math.prod(shape), f"{name!r}: its boxes hold {total} elements, the tensor {math.prod(shape)}")


def check_hparams(index: dict, param_groups: list[dict], where: str) -> None:
    """The saved hyperparameters fit this optimizer: one dict per param group, keys it
    has, values of the same kind (a number for a number, a list of the same length...)."""
    hp = index.get("optim_hparams")
    if hp is None:
        raise CheckpointError(f"{where} holds no optimizer state (it was saved without an optimizer); "
                              f"load it with optimizer=None")
    if len(hp) != len(param_groups):
        raise CheckpointError(f"{where} has {len(hp)} optimizer param groups, this optimizer "
                              f"{len(param_groups)}: build the optimizer as the saved run did")
    for i, (saved, group) in enumerate(zip(hp, param_groups)):
        for k, v in saved.items():
            if k not in group:
                raise CheckpointError(f"{where}: optimizer hyperparameter {k!r} of param group {i} is not one "
                                      f"this optimizer has ({sorted(k for k in group if k != 'params')})")
            if not _same_kind(v, group[k]):
                raise CheckpointError(f"{where}: optimizer hyperparameter {k!r} of param group {i} is {v!r} in "
                                      f"the checkpoint, {group[k]!r} in this optimizer: not the same kind")


def _same_kind(saved: Any, current: Any) -> bool:
    if isinstance(current, torch.Tensor):
        return isinstance(saved, (int, float)) and not isinstance(saved, bool)
    if isinstance(current, (list, tuple)):
        return isinstance(saved, list) and len(saved) == len(current) and all(
            _same_kind(s, x) for s, x in zip(saved, current))
    if saved is None or current is None:
        return saved is None or isinstance(saved, (bool, int, float, str))
    if isinstance(current, bool) or isinstance(saved, bool):
        return isinstance(current, bool) and isinstance(saved, bool)
    if isinstance(current, (int, float)):
        return isinstance(saved, (int, float))
    return type(saved) is type(current)
