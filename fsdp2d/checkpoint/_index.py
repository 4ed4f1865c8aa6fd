"""The checkpoint index: each tensor's layout, checked whole before anything is read.

Format (``fsdp2d.index.json``, version 2)::

    {"format": "fsdp2d", "version": 2, "id": "<the save's id>", "world_size": 8192,
     "mesh": {"axes": ["dp", "tp"], "shape": [1024, 8]},
     "extra": {...}, "optim_hparams": [...], "model": {"arch": "llama", "args": {...}} or null,
     "tensors": {"model/layers.0.attention.wq.weight":
                 {"dtype": "float32", "shape": [4096, 4096],
                  "layout": {"axes": ["tp", "dp"], "placements": ["S(0)", "S(0)"],
                             "split_order": [0, 1]}}}}

Its size is O(parameters), whatever the world size: an entry holds a tensor's layout
(placements over some of the mesh's axes, ``S(dim)`` or ``R``), not its boxes. Every
box follows from the layout (:class:`~fsdp2d.placement.Layout`), and so does its file:
the box of layout coordinate ``c`` is written once, by its replica owner, the rank at
``c`` on the layout's axes and 0 on the others, into ``rank<r>.safetensors`` where
``r`` is that rank's row-major index in ``mesh`` (:func:`writer_file`), under the
tensor's name. A tensor on no axis is one box, in ``rank00000.safetensors`` or (an
export) under the optional ``"key"`` in the ``"file"`` its entry names. What a box's
file must hold (its offset and sha256) is in that file's own manifest (``_files``), so
nothing in the index grows with the number of ranks.

A pipeline-parallel save (``save(..., stage_axis="pp")``) splits the model over one mesh
axis instead of copying it: a tensor's entry then carries ``"stage": {"pp": k}``, the
coordinate on that axis of the ranks holding it, and its boxes are in the files of the
ranks at ``k`` on it (not 0), so every stage's tensors are in the one index.

``validate_index`` accepts only a document ``save`` could have written: every field's
type, every name, axes that are the mesh's (each once), placements on dims the tensor
has (no ``Partial``: a summand is not a value to save), a split order over the
layout's axes, file names that are plain names inside the folder. Such a layout tiles
its tensor exactly by construction (``torch.chunk`` pieces, each split dividing the
previous piece), so a hostile index fails here, naming the tensor and the field,
before a file is opened or a byte allocated. What the index cannot tell (a file's
dtype, shapes, offsets and bytes) is checked against the file's header, manifest and
checksums when each box is read (``_files``).
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from ..placement import Layout, Placement, Replicate, Shard

INDEX = "fsdp2d.index.json"
FORMAT, VERSION = "fsdp2d", 2

# index dtype name -> safetensors dtype code (the only dtypes a checkpoint may hold)
DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
          "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
          "uint16": "U16", "uint32": "U32", "uint64": "U64", "complex64": "C64",
          "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
TORCH_DTYPES = {code: getattr(torch, name) for name, code in DTYPES.items() if hasattr(torch, name)}
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
SHA256 = re.compile(r"[0-9a-f]{64}")
_PLACEMENT = re.compile(r"S\(([0-9]{1,2})\)|R")
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


def validate_index(index: Any, where: str) -> tuple[dict, dict[str, Layout]]:
    """``(index, {tensor name: its Layout})`` if ``index`` is a well-formed fsdp2d
    index, else :class:`CheckpointError`. The layouts are at coordinate 0 (see
    :meth:`~fsdp2d.placement.Layout.owners_intersecting` for the others)."""
    c = _Checker(where)
    c.need(isinstance(index, dict), "the index is not a JSON object")
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        older = " (written by an older fsdp2d, which listed every box: load it with that version and save " \
                "again)" if index.get("format") == FORMAT and index.get("version") == 1 else ""
        raise CheckpointError(f"{where}: unsupported format {index.get('format')!r} version "
                              f"{index.get('version')!r} (this fsdp2d reads {FORMAT!r} version {VERSION}){older}")
    missing = [k for k in ("id", "world_size", "mesh", "extra", "optim_hparams", "tensors") if k not in index]
    c.need(not missing, f"missing fields {missing}")
    c.need(_is_int(index["world_size"], 1), f"world_size={index['world_size']!r} is not an int >= 1")
    mesh = index["mesh"]
    c.need(isinstance(mesh, dict) and isinstance(mesh.get("axes"), list)
           and all(isinstance(a, str) for a in mesh["axes"]) and len(set(mesh["axes"])) == len(mesh["axes"])
           and _ints(mesh.get("shape"), len(mesh["axes"]), 1),
           "mesh must be {\"axes\": [distinct names], \"shape\": [sizes >= 1]}")
    c.need(isinstance(index["extra"], dict), "extra is not a JSON object")
    c.need(index.get("model") is None or isinstance(index["model"], dict), "model is not a JSON object or null")
    c.need(isinstance(index["id"], str), "id is not a string")
    _check_hparams_doc(c, index["optim_hparams"])
    tensors = index["tensors"]
    c.need(isinstance(tensors, dict), "tensors is not a JSON object")
    sizes = dict(zip(mesh["axes"], mesh["shape"]))
    return index, {name: _check_tensor(c, name, meta, sizes) for name, meta in tensors.items()}


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


def _check_tensor(c: _Checker, name: Any, meta: Any, mesh: dict[str, int]) -> Layout:
    c.need(isinstance(name, str) and name.startswith(("model/", "optim/")),
           f"tensor name {name!r} must start with 'model/' or 'optim/'")
    c.need(isinstance(meta, dict), f"tensors[{name!r}] is not an object")
    c.need(isinstance(meta.get("dtype"), str) and meta["dtype"] in DTYPES,
           f"{name!r}: dtype {meta.get('dtype')!r} is not one of {sorted(DTYPES)}")
    shape = meta.get("shape")
    c.need(_ints(shape, None), f"{name!r}: shape {shape!r} is not a list of ints >= 0")
    layout = _check_layout(c, name, meta.get("layout"), shape, mesh)
    if "stage" in meta:
        stage = meta["stage"]
        c.need(isinstance(stage, dict) and len(stage) == 1 and all(
            a in mesh and a not in layout.axis_names and _is_int(k) and k < mesh[a] for a, k in stage.items()),
            f"{name!r}: stage {stage!r} is not {{axis: coordinate}} on one mesh axis outside its layout")
    if "file" in meta or "key" in meta:  # an export's tensor: one box, in a file of its own naming
        c.need(valid_file_name(meta.get("file")), f"{name!r}: file {meta.get('file')!r} is not a plain name "
                                                  f"inside the checkpoint folder")
        c.need(isinstance(meta.get("key"), str) and meta["key"] != "__metadata__", f"{name!r}: key is not a string")
        c.need(not layout.axis_names, f"{name!r}: 'file' and 'key' are only for a tensor on no mesh axis (one box)")
    return layout


def _check_layout(c: _Checker, name: str, layout: Any, shape: list[int], mesh: dict[str, int]) -> Layout:
    """The Layout an index entry describes (a layout that does not tile is refused)."""
    what = f"{name!r}: layout"
    c.need(isinstance(layout, dict) and all(isinstance(layout.get(k), list)
                                            for k in ("axes", "placements", "split_order")),
           f"{what} must be {{\"axes\": [...], \"placements\": [...], \"split_order\": [...]}}")
    axes, placements, order = layout["axes"], layout["placements"], layout["split_order"]
    c.need(len(axes) == len(placements) == len(order), f"{what} needs one placement and split position per axis")
    c.need(all(isinstance(a, str) and a in mesh for a in axes) and len(set(axes)) == len(axes),
           f"{what} axes {axes!r} are not distinct axes of the mesh {sorted(mesh)}")
    c.need(sorted(o for o in order if _is_int(o)) == list(range(len(axes))),
           f"{what} split_order {order!r} is not a permutation of 0..{len(axes) - 1}")
    parsed: list[Placement] = []
    for p in placements:
        m = _PLACEMENT.fullmatch(p) if isinstance(p, str) else None
        c.need(m is not None and (m.group(1) is None or int(m.group(1)) < len(shape)),
               f"{what} placement {p!r} is not 'R' or 'S(dim)' with dim < {len(shape)} (nothing else tiles the "
               f"tensor exactly)")
        parsed.append(Replicate() if m.group(1) is None else Shard(int(m.group(1))))
    return Layout(tuple(shape), tuple(mesh[a] for a in axes), tuple(axes), tuple(parsed), (0,) * len(axes),
                  tuple(order))


def describe_layout(layout: Layout | None) -> dict:
    """The index's description of ``layout`` (None: on no axis), without the coordinate."""
    if layout is None:
        return {"axes": [], "placements": [], "split_order": []}
    bad = [p for p in layout.placements if not isinstance(p, (Shard, Replicate))]
    if bad:
        raise ValueError(f"a tensor with placements {layout.placements} cannot be saved: {bad[0]} holds a "
                         f"summand, not a piece of the value")
    return {"axes": list(layout.axis_names),
            "placements": [f"S({p.dim})" if isinstance(p, Shard) else "R" for p in layout.placements],
            "split_order": list(layout.split_order)}


def dump_index(index: dict) -> bytes:
    """The index as JSON text: indented, one line per tensor (readable, and compact)."""
    head = json.dumps({k: v for k, v in index.items() if k != "tensors"}, indent=1)
    tensors = ",\n".join(f"  {json.dumps(name)}: {json.dumps(meta)}" for name, meta in index["tensors"].items())
    return (head[:-2] + ',\n "tensors": {\n' + tensors + "\n }\n}\n").encode()


def stage_of(meta: dict) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(axes, coordinates) of the pipeline stage an index entry pins its tensor to (none: ())."""
    stage = meta.get("stage") or {}
    return tuple(stage), tuple(stage.values())


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def writer_file(mesh: tuple[tuple[str, ...], tuple[int, ...]], axes: tuple[str, ...],
                coordinate: tuple[int, ...]) -> str:
    """The data file of the rank at ``coordinate`` on ``axes`` and 0 on the mesh's other
    axes: ``rank<r>.safetensors``, ``r`` its row-major index in the mesh ``(axes, shape)``.
    A box is in the file of its replica owner's coordinate (0 on every non-Shard axis)."""
    at = dict(zip(axes, coordinate))
    index = 0
    for axis, size in zip(*mesh):
        index = index * size + at.get(axis, 0)
    return rank_file(index)


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
