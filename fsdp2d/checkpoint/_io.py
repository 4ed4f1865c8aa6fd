"""Save and load: safetensors shards plus a JSON index of boxes, on any mesh.

Format (``fsdp2d.index.json`` in the checkpoint folder)::

    {"format": "fsdp2d", "version": 1, "mesh": {...}, "extra": {...}, "optim_hparams": [...],
     "files": {"rank00003.safetensors": {"size": 1234}},
     "tensors": {"model/layers.0.attention.wq.weight":
                 {"dtype": "float32", "shape": [64, 64],
                  "boxes": [{"offset": [0, 0], "shape": [16, 64],
                             "file": "rank00000.safetensors", "key": "...", "sha256": "..."},
                            ...]}}}

Save: every rank lists the boxes it holds; the lowest rank holding a box writes it (so
a replicated piece is written once, with its sha256 in the index); every rank-local
check (``extra`` JSON-able, the optimizer's parameters) runs before the first
collective and travels with it, so one failing rank makes all raise at once. Files go to
a temporary folder, are fsynced, and become ``PATH`` atomically (``_commit``): at every
instant ``PATH`` is the old or the new complete checkpoint. Load: the index is
validated whole (``_index``); every rank reads, through one descriptor of the folder,
only the saved boxes that intersect its own (each once, checked against the file's
header and its sha256; their intersections must cover what it needs exactly once),
stages everything, and only when all ranks succeeded and read the same index (its
sha256) copies into the model and optimizer. Nothing is unpickled: JSON and safetensors.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save as st_save

from ..placement import Box
from . import _commit, _files
from ._entries import (Entry, materialize_state, model_entries, optimizer_entries, optimizer_hparams,
                       param_fqns)
from ._files import Folder, _digest
from ._index import FORMAT, INDEX, VERSION, CheckpointError, check_hparams

__all__ = ["save", "load", "read_index", "read_box", "CheckpointError", "INDEX"]


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather_objects(obj: Any) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)  # our own processes' metadata, never file contents
    return out


def _errors_everywhere(error: str, same: tuple[str, Any] | None = None) -> list[str]:
    """Every rank's error message (empty ones dropped), on every rank. Each step that can
    fail ends with this collective, so one failing rank makes all ranks raise together
    instead of leaving its peers waiting in the next collective. ``same = (what, value)``:
    a value that must be equal on all ranks, else that is the error."""
    gathered = _all_gather_objects((error, same[1] if same else None))
    errors = [e for e, _ in gathered if e]
    values = [v for _, v in gathered]
    if same and not errors and any(v != values[0] for v in values):
        diff = [r for r, v in enumerate(values) if v != values[0]]
        errors.append(f"the ranks disagree on {same[0]}: ranks {diff} have {values[diff[0]]!r}, "
                      f"rank 0 has {values[0]!r}")
    return errors


def _key(e: Entry) -> str:
    return f"{e.name}@{','.join(map(str, e.box.global_offset))}"


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _local_meta(model: torch.nn.Module, optimizer, extra: dict | None) -> tuple[list[Entry], list]:
    """This rank's entries and their metadata; raises on anything rank-local."""
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict, not {type(extra).__name__}")
    json.dumps(extra or {})  # JSON-able?
    entries = model_entries(model) + (optimizer_entries(model, optimizer) if optimizer else [])
    return entries, [(_key(e), e.name, _dtype_name(e.tensor.dtype), e.global_shape, e.box.global_offset,
                      e.box.local_shape) for e in entries]


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         *, extra: dict | None = None) -> None:
    """Write a checkpoint of ``model`` (and ``optimizer``) to ``path``.

    Collective: call on every rank. ``extra`` is any JSON-able dict (step, data position,
    RNG states...), returned by :func:`load`. ``path`` becomes a symbolic link to a
    version folder beside it (``.NAME.v<id>``), replaced atomically: at every instant it
    is the previous or the new complete checkpoint, and a failed or killed save leaves
    the previous one as it was (its leftovers are deleted by the next save to ``path``).
    An error on any rank (``extra`` not JSON-able, a disk error...) raises
    :class:`CheckpointError` on every rank.
    """
    rank, _ = _rank_world()
    path = Path(path)
    entries, all_meta, nonce = _plan(path, rank, model, optimizer, extra)
    writer = _assign_writers(all_meta)
    lock, error = None, ""
    if rank == 0:
        try:
            lock = _commit.begin(path, nonce)
        except Exception as exc:
            error = f"rank 0: cannot create {_commit.tmp_path(path, nonce)}: {exc}"
    _fail_together(path, _errors_everywhere(error))
    file_info, error = None, ""
    try:
        file_info = _write_rank_file(_commit.tmp_path(path, nonce), rank,
                                     {_key(e): e for e in entries if writer.get(_key(e)) == rank})
        _commit.phase("shards")
    except Exception as exc:
        error = f"rank {rank}: {exc!r}"
    infos = _all_gather_objects((file_info, error))
    _fail_together(path, [e for _, e in infos if e], (nonce, lock) if rank == 0 else None)
    error = ""
    if rank == 0:
        try:
            written = [i for i, _ in infos if i is not None]
            index = _index_document(
                files={name: {"size": size} for name, size, _ in written},
                tensors=_tensor_index(all_meta, writer, {k: d for *_, ds in written for k, d in ds.items()}),
                world_size=len(all_meta), mesh=_mesh_meta(entries), extra=extra or {},
                optim_hparams=optimizer_hparams(optimizer) if optimizer else None, id=nonce)
            _fsync_write(_commit.tmp_path(path, nonce) / INDEX, json.dumps(index, indent=1).encode())
            _commit.phase("index")
            lock, fd = None, lock
            _commit.commit(path, nonce, fd)
        except Exception as exc:
            _commit.abort(path, nonce, lock)
            error = f"rank 0: committing {path}: {exc!r}"
    _fail_together(path, _errors_everywhere(error))


def _plan(path: Path, rank: int, model, optimizer, extra) -> tuple[list[Entry], list, str]:
    """The first collective: every rank's boxes, or any rank's local error (raised on
    all ranks), and the save's id (rank 0's)."""
    entries, meta, error = [], [], ""
    try:
        entries, meta = _local_meta(model, optimizer, extra)
    except Exception as exc:
        error = f"rank {rank}: {exc!r}"
    gathered = _all_gather_objects((meta, error, uuid.uuid4().hex[:16]))
    _fail_together(path, [e for _, e, _ in gathered if e])
    return entries, [m for m, _, _ in gathered], gathered[0][2]


def _assign_writers(all_meta: list[list]) -> dict[str, int]:
    """Each distinct non-empty box is written by the lowest rank holding it (replicas once)."""
    writer: dict[str, int] = {}
    for r, rows in enumerate(all_meta):
        for key, *_, shape in rows:
            if key not in writer and all(shape):
                writer[key] = r
    return writer


def _write_rank_file(tmp: Path, rank: int, mine: dict[str, Entry]) -> tuple | None:
    """Write this rank's boxes as one safetensors file; (file name, size, {key: sha256})."""
    if not mine:
        return None
    tensors = {k: e.tensor.detach().contiguous().cpu() for k, e in mine.items()}
    data = st_save(tensors)
    fname = f"rank{rank:05d}.safetensors"
    _fsync_write(tmp / fname, data)
    return fname, len(data), {k: _digest(t) for k, t in tensors.items()}


def _fail_together(path: Path, errors: list[str], cleanup: tuple | None = None) -> None:
    """Raise on every rank when any rank failed (``errors`` gathered collectively)."""
    if errors:
        if cleanup is not None:
            _commit.abort(path, *cleanup)
        raise CheckpointError(f"save to {path} failed, previous checkpoint kept: {'; '.join(errors)}")


def _index_document(*, files: dict, tensors: dict, world_size: int, mesh: dict, extra: dict,
                    optim_hparams: list | None, id: str) -> dict:
    """The ``fsdp2d.index.json`` document (see the module docstring)."""
    return {"format": FORMAT, "version": VERSION, "id": id, "world_size": world_size, "mesh": mesh,
            "extra": extra, "optim_hparams": optim_hparams, "files": files, "tensors": tensors}


def _tensor_index(all_meta: list[list], writer: dict[str, int], digests: dict[str, str]) -> dict:
    tensors: dict[str, dict] = {}
    written: set[str] = set()
    for rows in all_meta:
        for key, name, dtype, gshape, offset, shape in rows:
            t = tensors.setdefault(name, {"dtype": dtype, "shape": list(gshape), "boxes": []})
            if key in writer and key not in written:
                written.add(key)
                t["boxes"].append({"offset": list(offset), "shape": list(shape),
                                   "file": f"rank{writer[key]:05d}.safetensors", "key": key,
                                   "sha256": digests[key]})
    return tensors


def _mesh_meta(entries: list[Entry]) -> dict:
    layouts = [e.layout for e in entries if e.layout is not None]
    best = max(layouts, key=lambda l: len(l.mesh_shape), default=None)
    if best is None:
        return {"axes": [], "shape": []}
    return {"axes": list(best.axis_names), "shape": list(best.mesh_shape)}


# -- load --------------------------------------------------------------------------------
def read_index(path: str | os.PathLike) -> dict:
    """The parsed and validated index of the checkpoint folder ``path`` (JSON only)."""
    with Folder(path) as folder:
        return folder.index


def read_box(folder: Folder, meta: dict, name: str, target: Box) -> torch.Tensor:
    """Assemble ``target`` (a box of tensor ``name``) from the saved boxes it intersects,
    which must cover it exactly once; their headers are checked before anything is
    allocated, and each box is read whole (to verify it) and dropped after use."""
    parts = []
    for b in meta["boxes"]:
        saved = Box(tuple(b["offset"]), tuple(b["shape"]))
        inter = target.intersect(saved)
        if inter is not None and inter.numel():
            parts.append((b, saved, inter))
    covered = sum(inter.numel() for *_, inter in parts)
    overlap = any(x.intersect(y) is not None for i, (*_, x) in enumerate(parts) for *_, y in parts[i + 1:])
    if covered != target.numel() or overlap:
        raise CheckpointError(f"{folder.path}: the boxes of {name!r} do not cover the part this rank needs "
                              f"exactly once ({covered} of {target.numel()} elements"
                              f"{', overlapping' if overlap else ''}); the index is damaged")
    for b, _, _ in parts:
        folder.check(b, meta["dtype"])
    out = _files._empty(target.local_shape, getattr(torch, meta["dtype"]))
    for b, saved, inter in parts:
        src = tuple(slice(o - so, o - so + n) for o, so, n in zip(inter.global_offset, saved.global_offset,
                                                                  inter.local_shape))
        dst = tuple(slice(o - to, o - to + n) for o, to, n in zip(inter.global_offset, target.global_offset,
                                                                 inter.local_shape))
        box = folder.read(b, meta["dtype"])
        out[dst] = box[src] if src else box
        del box
    return out


def _check_names(index: dict, entries: list[Entry], path: Path, with_optim: bool) -> None:
    saved = {n for n in index["tensors"] if n.startswith("model/") or (with_optim and n.startswith("optim/"))}
    wanted = {e.name for e in entries}
    missing, unexpected = sorted(wanted - saved), sorted(saved - wanted)
    if missing or unexpected:
        raise CheckpointError(f"{path} does not match the model: missing keys {missing[:10]}"
                              f"{' ...' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
                              f"{' ...' if len(unexpected) > 10 else ''}")


def _saved_state_fqns(index: dict) -> set[str]:
    """Parameters whose optimizer state the checkpoint holds (``optim/<fqn>/<key>``)."""
    return {n.removeprefix("optim/").rpartition("/")[0] for n in index["tensors"] if n.startswith("optim/")}


def _stage(folder: Folder, model, optimizer, created: list) -> tuple[list[Entry], dict, list]:
    """Validate everything against this model and optimizer and read this rank's part
    into new tensors. Returns (entries, staged tensors, parameters whose state the
    checkpoint does not hold: their state is dropped on success, i.e. fresh)."""
    index, path = folder.index, folder.path
    entries, fresh = model_entries(model), []
    if optimizer is not None:
        check_hparams(index, optimizer.param_groups, str(path))
        saved, fqn_of = _saved_state_fqns(index), param_fqns(model)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        fresh = [p for p in params if fqn_of.get(id(p)) not in saved]
        created += materialize_state(optimizer, only=[p for p in params if fqn_of.get(id(p)) in saved])
        entries += [e for e in optimizer_entries(model, optimizer)
                    if e.name.removeprefix("optim/").rpartition("/")[0] in saved]
    _check_names(index, entries, path, optimizer is not None)
    for e in entries:
        meta = index["tensors"][e.name]
        if tuple(meta["shape"]) != e.global_shape:
            raise CheckpointError(f"{path}: {e.name!r} has shape {tuple(meta['shape'])} in the checkpoint, "
                                  f"{e.global_shape} in the model")
        if meta["dtype"] != _dtype_name(e.tensor.dtype):
            raise CheckpointError(f"{path}: {e.name!r} is {meta['dtype']} in the checkpoint, "
                                  f"{_dtype_name(e.tensor.dtype)} in the model; cast the model first")
    staged = {e.name: read_box(folder, index["tensors"][e.name], e.name, e.box) for e in entries}
    return entries, staged, fresh


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a checkpoint saved on any mesh into ``model`` (and ``optimizer``) on this one.

    Collective. Each rank reads only the saved boxes intersecting its own boxes (each
    whole, to verify its checksum, then sliced; never other ranks' boxes). Nothing
    reaches the model or optimizer before the whole index is validated, every needed
    box is read and verified, and all ranks agree they read the same checkpoint. Errors
    (a missing, truncated or corrupted file, a damaged index, a file outside the folder,
    missing or unexpected keys, a shape or dtype mismatch, hyperparameters that do not
    fit the optimizer, ranks that read different checkpoints because ``path`` was
    replaced meanwhile) raise :class:`CheckpointError` on every rank and leave the model
    and optimizer bit-identical. A checkpoint saved before the optimizer's first step
    (no state) loads with fresh state. Returns the ``extra`` dict given to :func:`save`.
    """
    path = Path(path)
    created: list = []
    entries, staged, fresh, error, index, digest = [], {}, [], None, {}, None
    try:
        with Folder(path) as folder:
            index, digest = folder.index, folder.digest
            entries, staged, fresh = _stage(folder, model, optimizer, created)
    except CheckpointError as exc:
        error = exc
    except Exception as exc:  # any failure must reach the collective below, or peers hang
        error = CheckpointError(f"loading {path} failed: {exc!r}")
        error.__cause__ = exc
    errors = _errors_everywhere(str(error) if error is not None else "",
                                same=("the checkpoint they read (the sha256 of its index: was it replaced "
                                      "during the load? load again)", digest))
    if errors:
        for p in created:  # leave the optimizer as it was
            optimizer.state.pop(p, None)
        raise error or CheckpointError(f"loading {path} failed, nothing was changed: {'; '.join(errors)}")
    with torch.no_grad():
        for e in entries:
            e.tensor.copy_(staged[e.name])
    if optimizer is not None:
        for p in fresh:
            optimizer.state.pop(p, None)
        for group, hp in zip(optimizer.param_groups, index["optim_hparams"]):
            for k, v in hp.items():
                if isinstance(group[k], torch.Tensor):
                    group[k].fill_(v)  # (a tensor lr stays a tensor)
                else:
                    group[k] = tuple(v) if isinstance(group[k], tuple) else v
    return json.loads(json.dumps(index["extra"]))
