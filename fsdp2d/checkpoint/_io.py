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
a replicated piece is written once, with its sha256 in the index); files go to a
temporary folder, are fsynced, and the folder is renamed into place only when every rank
succeeded: a crash leaves the previous checkpoint untouched. Load: every rank reads only
the saved boxes that intersect its own boxes (each once, checksum verified; a box is one
rank's shard, never a whole tensor unless it was saved unsharded), checks file sizes,
stages everything, and only when all ranks succeeded copies into the model and
optimizer. Nothing is unpickled: JSON and safetensors only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save as st_save

from ..placement import Box
from ._entries import Entry, materialize_state, model_entries, optimizer_entries, optimizer_hparams

INDEX = "fsdp2d.index.json"
FORMAT, VERSION = "fsdp2d", 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this model (names the file or keys)."""


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


def _errors_everywhere(error: str) -> list[str]:
    """Every rank's error message (empty ones dropped), on every rank. Each step that can
    fail ends with this collective, so one failing rank makes all ranks raise together
    instead of leaving its peers waiting in the next collective."""
    return [e for e in _all_gather_objects(error) if e]


def _key(e: Entry) -> str:
    return f"{e.name}@{','.join(map(str, e.box.global_offset))}"


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         *, extra: dict | None = None) -> None:
    """Write a checkpoint of ``model`` (and ``optimizer``) to the folder ``path``.

    Collective: call on every rank. ``extra`` is any JSON-able dict (step, data position,
    RNG states...), returned by :func:`load`. An existing checkpoint at ``path`` is
    replaced only after the new one is complete on disk; a failed or killed save leaves
    it as it was.
    """
    rank, _ = _rank_world()
    path = Path(path)
    json.dumps(extra or {})  # fail early, on every rank, if extra is not JSON
    entries = model_entries(model) + (optimizer_entries(model, optimizer) if optimizer else [])
    meta = [(_key(e), e.name, _dtype_name(e.tensor.dtype), e.global_shape, e.box.global_offset,
             e.box.local_shape) for e in entries]
    all_meta = _all_gather_objects(meta)
    writer = _assign_writers(all_meta)
    tmp = path.parent / f".{path.name}.tmp-{_shared_nonce()}"
    error = ""
    if rank == 0:
        try:
            tmp.mkdir(parents=True)
        except Exception as exc:
            error = f"rank 0: cannot create {tmp}: {exc!r}"
    _fail_together(path, _errors_everywhere(error))
    file_info, error = None, ""
    try:
        file_info = _write_rank_file(tmp, rank, {_key(e): e for e in entries if writer.get(_key(e)) == rank})
    except Exception as exc:
        error = f"rank {rank}: {exc!r}"
    infos = _all_gather_objects((file_info, error))
    _fail_together(path, [e for _, e in infos if e], tmp if rank == 0 else None)
    error = ""
    if rank == 0:
        try:
            written = [i for i, _ in infos if i is not None]
            index = _index_document(
                files={name: {"size": size} for name, size, _ in written},
                tensors=_tensor_index(all_meta, writer, {k: d for *_, ds in written for k, d in ds.items()}),
                world_size=len(all_meta), mesh=_mesh_meta(entries), extra=extra or {},
                optim_hparams=optimizer_hparams(optimizer) if optimizer else None)
            _fsync_write(tmp / INDEX, json.dumps(index, indent=1).encode())
            _fsync_dir(tmp)
            _commit(tmp, path)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"rank 0: committing {path}: {exc!r}"
    _fail_together(path, _errors_everywhere(error))


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
    _write_file(tmp / fname, data)
    return fname, len(data), {k: _digest(t) for k, t in tensors.items()}


def _fail_together(path: Path, errors: list[str], cleanup: Path | None = None) -> None:
    """Raise on every rank when any rank failed (``errors`` gathered collectively)."""
    if errors:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise CheckpointError(f"save to {path} failed, previous checkpoint kept: {'; '.join(errors)}")


def _index_document(*, files: dict, tensors: dict, world_size: int, mesh: dict, extra: dict,
                    optim_hparams: list | None) -> dict:
    """The ``fsdp2d.index.json`` document (see the module docstring)."""
    return {"format": FORMAT, "version": VERSION, "world_size": world_size, "mesh": mesh, "extra": extra,
            "optim_hparams": optim_hparams, "files": files, "tensors": tensors}


def _digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (any dtype, bf16 included)."""
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


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


def _shared_nonce() -> str:
    return _all_gather_objects(uuid.uuid4().hex[:12])[0]


def _write_file(path: Path, data: bytes) -> None:
    _fsync_write(path, data)


def _commit(tmp: Path, path: Path) -> None:
    """Move the finished folder into place; the old one (if any) goes only afterwards."""
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _mesh_meta(entries: list[Entry]) -> dict:
    layouts = [e.layout for e in entries if e.layout is not None]
    best = max(layouts, key=lambda l: len(l.mesh_shape), default=None)
    if best is None:
        return {"axes": [], "shape": []}
    return {"axes": list(best.axis_names), "shape": list(best.mesh_shape)}


# -- load --------------------------------------------------------------------------------
def read_index(path: str | os.PathLike) -> dict:
    """The parsed index of the checkpoint folder ``path`` (JSON only)."""
    file = Path(path) / INDEX
    if not file.is_file():
        raise CheckpointError(f"{path} is not an fsdp2d checkpoint: {INDEX} is missing")
    try:
        index = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file} is corrupted: {exc}") from None
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointError(f"{file}: unsupported format {index.get('format')!r} version {index.get('version')!r}")
    return index


class _Files:
    """Opens checkpoint files on demand after checking their size against the index,
    and reads boxes verified against their sha256. A box belongs to one tensor, so each
    is read at most once per load and dropped after use."""

    def __init__(self, root: Path, index: dict) -> None:
        self.root, self.index, self.handles = root, index, {}

    def get(self, name: str):
        if name not in self.handles:
            info = self.index["files"].get(name)
            file = self.root / name
            if info is None:
                raise CheckpointError(f"{self.root}: {name} is referenced by a box but not listed in {INDEX}")
            if not file.is_file():
                raise CheckpointError(f"{file} is missing")
            size = file.stat().st_size
            if size != info["size"]:
                raise CheckpointError(f"{file} is truncated or has the wrong size: {size} bytes, "
                                      f"expected {info['size']}")
            try:
                self.handles[name] = safe_open(str(file), framework="pt")
            except Exception as exc:
                raise CheckpointError(f"{file} cannot be read as safetensors: {exc}") from None
        return self.handles[name]

    def box(self, b: dict) -> torch.Tensor:
        """The whole saved box ``b`` (a shard, never more), checksum verified."""
        handle = self.get(b["file"])
        try:
            t = handle.get_tensor(b["key"])
        except Exception as exc:
            raise CheckpointError(f"{self.root / b['file']}: cannot read {b['key']!r}: {exc}") from None
        if tuple(t.shape) != tuple(b["shape"]):
            raise CheckpointError(f"{self.root / b['file']}: {b['key']!r} has shape {tuple(t.shape)}, "
                                  f"the index says {tuple(b['shape'])}")
        if "sha256" in b and _digest(t) != b["sha256"]:
            raise CheckpointError(f"{self.root / b['file']} is corrupted: {b['key']!r} does not match its "
                                  f"sha256 in {INDEX}")
        return t


def _check_names(index: dict, entries: list[Entry], path: Path, with_optim: bool) -> None:
    saved = {n for n in index["tensors"] if n.startswith("model/") or (with_optim and n.startswith("optim/"))}
    wanted = {e.name for e in entries}
    missing, unexpected = sorted(wanted - saved), sorted(saved - wanted)
    if with_optim and not any(n.startswith("optim/") for n in index["tensors"]):
        raise CheckpointError(f"{path} holds no optimizer state; load it with optimizer=None")
    if missing or unexpected:
        raise CheckpointError(f"{path} does not match the model: missing keys {missing[:10]}"
                              f"{' ...' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
                              f"{' ...' if len(unexpected) > 10 else ''}")


def read_box(files: _Files, meta: dict, name: str, target: Box, dtype: torch.dtype) -> torch.Tensor:
    """Assemble ``target`` (a box of tensor ``name``) from the saved boxes it intersects."""
    out = torch.empty(target.local_shape, dtype=dtype)
    covered = 0
    for b in meta["boxes"]:
        saved = Box(tuple(b["offset"]), tuple(b["shape"]))
        inter = target.intersect(saved)
        if inter is None or inter.numel() == 0:
            continue
        src = tuple(slice(o - so, o - so + n) for o, so, n in zip(inter.global_offset, saved.global_offset,
                                                                  inter.local_shape))
        dst = tuple(slice(o - to, o - to + n) for o, to, n in zip(inter.global_offset, target.global_offset,
                                                                 inter.local_shape))
        box = files.box(b)
        out[dst] = box[src] if src else box
        covered += inter.numel()
    if covered != target.numel():
        raise CheckpointError(f"the checkpoint's boxes cover {covered} of the {target.numel()} elements "
                              f"this rank needs of {name!r}")
    return out


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a checkpoint saved on any mesh into ``model`` (and ``optimizer``) on this one.

    Collective. Each rank reads only the saved boxes intersecting its own boxes (each
    whole, to verify its checksum, then sliced; never other ranks' boxes). Errors (a
    missing, truncated or corrupted file, missing or unexpected keys, a shape or dtype
    mismatch) raise :class:`CheckpointError` on every rank and leave the model and
    optimizer untouched. Returns the ``extra`` dict given to :func:`save`.
    """
    path = Path(path)
    created: list = []
    entries, staged, error = [], {}, None
    try:
        index = read_index(path)
        if optimizer is not None:
            created = materialize_state(optimizer)
        entries = model_entries(model) + (optimizer_entries(model, optimizer) if optimizer else [])
        _check_names(index, entries, path, optimizer is not None)
        files = _Files(path, index)
        for e in entries:
            meta = index["tensors"][e.name]
            if tuple(meta["shape"]) != e.global_shape:
                raise CheckpointError(f"{path}: {e.name!r} has shape {tuple(meta['shape'])} in the checkpoint, "
                                      f"{e.global_shape} in the model")
            if meta["dtype"] != _dtype_name(e.tensor.dtype):
                raise CheckpointError(f"{path}: {e.name!r} is {meta['dtype']} in the checkpoint, "
                                      f"{_dtype_name(e.tensor.dtype)} in the model; cast the model first")
            staged[e.name] = read_box(files, meta, e.name, e.box, e.tensor.dtype)
    except CheckpointError as exc:
        error = exc
    except Exception as exc:  # any failure must reach the collective below, or peers hang
        error = CheckpointError(f"loading {path} failed: {exc!r}")
        error.__cause__ = exc
    errors = _errors_everywhere(str(error) if error is not None else "")
    if errors:
        for p in created:  # leave the optimizer as it was
            optimizer.state.pop(p, None)
        raise error or CheckpointError(f"loading {path} failed on another rank, nothing was changed: "
                                       f"{'; '.join(errors)}")
    with torch.no_grad():
        for e in entries:
            e.tensor.copy_(staged[e.name])
    if optimizer is not None:
        for group, hp in zip(optimizer.param_groups, index.get("optim_hparams") or []):
            group.update({k: tuple(v) if isinstance(v, list) else v for k, v in hp.items()})
    return index["extra"]
