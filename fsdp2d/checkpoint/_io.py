"""Save and load: one safetensors file per writing rank plus a JSON index of layouts.

The format is in ``_index`` (the index: each tensor's dtype, global shape and layout
over the mesh) and ``_files`` (a data file's manifest: its boxes' offsets and sha256).
Nothing a rank sends, writes or parses grows with the world size beyond its own data
(DESIGN items 7 and 9).

Save: every rank describes the tensors from its own layouts, no box lists exchanged:
the description (the index's tensors and mesh) is the same on every rank, and one
all-reduce of a few integers (``_agree``) checks that it is, carries every rank-local
error (``extra`` not JSON-able, a parameter on another mesh...) so one failing rank
makes all raise at once, and draws the save's id. Each rank then writes the boxes it is
the replica owner of (a replicated piece once) into its own file with their sha256;
rank 0 writes the index. Files go to a temporary folder, are fsynced, and become
``PATH`` atomically (``_commit``): at every instant ``PATH`` is the old or the new
complete checkpoint. Each step ends with the same O(1) agreement.

Load: the index is validated whole (``_index``); every rank computes from each saved
layout which boxes meet its own (``Layout.owners_intersecting``, never walking the
mesh) and reads, through one descriptor of the folder, only those (each once, checked
against its file's header and manifest and its sha256), stages everything, and only
when all ranks succeeded and read the same index (its sha256) copies into the model and
optimizer. Nothing is unpickled: JSON and safetensors.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save as st_save

from ..mesh import DeviceMesh, axis_names, axis_size, coordinate
from ..placement import Box
from . import _commit, _files
from ._agree import agree
from ._entries import (Entry, materialize_state, model_entries, optimizer_entries, optimizer_hparams,
                       param_fqns)
from ._files import Folder, _digest, manifest
from ._index import (FORMAT, INDEX, VERSION, CheckpointError, check_hparams, describe_layout, dump_index,
                     writer_file)

__all__ = ["save", "load", "read_index", "read_box", "CheckpointError", "INDEX"]


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class _Plan:
    """What this rank saves: the index's mesh and tensors (equal on every rank), and the
    entries it writes into ``file`` (None: it writes nothing)."""

    mesh: dict
    tensors: dict
    mine: list[Entry]
    file: str | None

    @property
    def digest(self) -> str:
        return json.dumps({"mesh": self.mesh, "tensors": self.tensors}, sort_keys=True)


def _model_mesh(entries: list[Entry]) -> DeviceMesh | None:
    """The one root mesh of every sharded entry (None: nothing is sharded)."""
    meshes = list({id(e.mesh): e.mesh for e in entries if e.mesh is not None}.values())
    for m in meshes[1:]:
        if m != meshes[0]:
            raise ValueError(f"the model's parameters lie on two meshes ({meshes[0]} and {m}); a checkpoint holds "
                             f"one: build one mesh with init_device_mesh and slice it for TP and FSDP")
    return meshes[0] if meshes else None


def _plan(model: torch.nn.Module, optimizer, extra: dict | None, stage_axis: str | None = None) -> _Plan:
    """This rank's plan; raises on anything rank-local. With ``stage_axis`` its tensors are
    this rank's pipeline stages' only, pinned to its coordinate on that axis."""
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict, not {type(extra).__name__}")
    json.dumps(extra or {})  # JSON-able?
    entries = model_entries(model) + (optimizer_entries(model, optimizer) if optimizer else [])
    root = _model_mesh(entries)
    if root is None:  # one box per tensor, written by rank 0
        mesh, coord = ((), ()), (() if not dist.is_initialized() or dist.get_rank() == 0 else None)
    else:
        mesh, coord = (axis_names(root), tuple(root.shape)), coordinate(root)
    stage = {}
    if stage_axis is not None:
        if root is None or stage_axis not in mesh[0]:
            raise ValueError(f"stage_axis={stage_axis!r} is not an axis of the model's mesh {mesh[0]}")
        stage = {stage_axis: coord[mesh[0].index(stage_axis)]}
    tensors = {}
    for e in entries:
        if e.layout is not None:
            _check_on_mesh(e, root)
            if stage_axis in e.layout.axis_names:
                raise ValueError(f"{e.name}: its layout uses the pipeline axis {stage_axis!r}")
        tensors[e.name] = {"dtype": _dtype_name(e.tensor.dtype), "shape": list(e.global_shape),
                           "layout": describe_layout(e.layout), **({"stage": stage} if stage else {})}
    file = writer_file(mesh, mesh[0], coord) if coord is not None else None
    mine = [e for e in entries if file is not None and e.box.numel() and _writer(mesh, e, stage) == file]
    return _Plan({"axes": list(mesh[0]), "shape": list(mesh[1])}, tensors, mine, file)


def _writer(mesh: tuple, e: Entry, stage: dict) -> str | None:
    """The file of ``e``'s box if this rank is its replica owner (in its pipeline
    ``stage``, ``{axis: coordinate}``, if any), else None."""
    axes, at = tuple(stage), tuple(stage.values())
    if e.layout is None:
        return writer_file(mesh, axes, at)
    if not e.layout.is_replica_owner():
        return None
    return writer_file(mesh, e.layout.axis_names + axes, e.layout.coordinate + at)


def _all_stages(plan: _Plan, model: torch.nn.Module, stage_axis: str) -> None:
    """Every stage's tensors in ``plan.tensors`` (the index's), gathered over the pipeline
    axis: O(parameters) in all, each stage's description once per stage. ValueError if
    two stages hold one name."""
    root = _model_mesh(model_entries(model))
    mine = json.dumps(plan.tensors)
    parts: list = [None] * axis_size(root, stage_axis)
    dist.all_gather_object(parts, mine, group=root.get_group(stage_axis))
    tensors: dict = {}
    for part in parts:
        for name, meta in json.loads(part).items():
            if name in tensors:
                raise ValueError(f"{name} is held by two pipeline stages ({stage_axis} coordinates "
                                 f"{tensors[name]['stage'][stage_axis]} and {meta['stage'][stage_axis]})")
            tensors[name] = meta
    plan.tensors = tensors


def _check_on_mesh(e: Entry, root: DeviceMesh) -> None:
    lay, names = e.layout, axis_names(root)
    at = dict(zip(names, zip(root.shape, coordinate(root))))
    if any(at.get(a) != (n, c) for a, n, c in zip(lay.axis_names, lay.mesh_shape, lay.coordinate)):
        raise ValueError(f"{e.name}: its layout (axes {lay.axis_names}, sizes {lay.mesh_shape}, coordinate "
                         f"{lay.coordinate}) does not sit on the model's mesh {root}")


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         *, extra: dict | None = None, stage_axis: str | None = None) -> None:
    """Write a checkpoint of ``model`` (and ``optimizer``) to ``path``.

    Collective: call on every rank. ``extra`` is any JSON-able dict (step, data position,
    RNG states...), returned by :func:`load`. ``path`` becomes a symbolic link to a
    version folder beside it (``.NAME.v<id>``), replaced atomically: at every instant it
    is the previous or the new complete checkpoint, and a failed or killed save leaves
    the previous one as it was (its leftovers are deleted by the next save to ``path``).
    An error on any rank (``extra`` not JSON-able, a disk error, ranks holding different
    tensors...) raises :class:`CheckpointError` on every rank. Each rank sends a few
    integers and writes its own boxes, whatever the world size.

    ``stage_axis``: the mesh axis over which ``model`` is split into pipeline stages (each
    rank passes its own stages, e.g. ``"pp"``): each rank saves its stages' tensors, and
    the index holds every stage's under the whole model's names, so :func:`load` reads
    it on any number of stages (pipeline axis or none). The stages' descriptions are
    gathered over that axis (O(parameters) in all).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = Path(path)
    plan, error = None, ""
    try:
        plan = _plan(model, optimizer, extra, stage_axis)
    except Exception as exc:
        error = f"rank {rank}: {exc!r}"
    if stage_axis is not None:  # every rank reached the gather, or all raise here
        _fail_together(path, agree(error).error)
        try:
            _all_stages(plan, model, stage_axis)
        except ValueError as exc:
            error = f"rank {rank}: {exc}"
    agreed = agree(error, plan.digest if plan is not None else "",
                   "the tensors to save (names, dtypes, global shapes, layouts or the mesh): build the same "
                   "model and optimizer on every rank")
    _fail_together(path, agreed.error)
    assert plan is not None
    nonce, tmp = agreed.nonce, _commit.tmp_path(path, agreed.nonce)
    lock, error = None, ""
    if rank == 0:
        try:
            lock = _commit.begin(path, nonce)
        except Exception as exc:
            error = f"rank 0: cannot create {tmp}: {exc}"
    _fail_together(path, agree(error).error)
    error = ""
    try:
        _write_rank_file(tmp, plan, nonce)
        _commit.phase("shards")
    except Exception as exc:
        error = f"rank {rank}: {exc!r}"
    _fail_together(path, agree(error).error, (nonce, lock) if rank == 0 else None)
    error = ""
    if rank == 0:
        try:
            index = _index_document(tensors=plan.tensors, mesh=plan.mesh, extra=extra or {}, id=nonce,
                                    world_size=dist.get_world_size() if dist.is_initialized() else 1,
                                    optim_hparams=optimizer_hparams(optimizer) if optimizer else None,
                                    model=_model_spec(model))
            _fsync_write(tmp / INDEX, dump_index(index))
            _commit.phase("index")
            lock, fd = None, lock
            _commit.commit(path, nonce, fd)
        except Exception as exc:
            _commit.abort(path, nonce, lock)
            error = f"rank 0: committing {path}: {exc!r}"
    _fail_together(path, agree(error).error)


def _write_rank_file(tmp: Path, plan: _Plan, nonce: str) -> None:
    """This rank's boxes as one safetensors file, keyed by tensor name, with its manifest."""
    if not plan.mine or plan.file is None:
        return
    tensors = {e.name: e.tensor.detach().contiguous().cpu() for e in plan.mine}
    boxes = {e.name: (e.box.global_offset, _digest(tensors[e.name])) for e in plan.mine}
    _fsync_write(tmp / plan.file, st_save(tensors, metadata=manifest(nonce, plan.file, boxes)))


def _fail_together(path: Path, error: str, cleanup: tuple | None = None) -> None:
    """Raise on every rank when any rank failed (``error`` agreed collectively)."""
    if error:
        if cleanup is not None:
            _commit.abort(path, *cleanup)
        raise CheckpointError(f"save to {path} failed, previous checkpoint kept: {error}")


def _index_document(*, tensors: dict, world_size: int, mesh: dict, extra: dict, optim_hparams: list | None,
                    id: str, model: dict | None = None) -> dict:
    """The ``fsdp2d.index.json`` document (see ``_index``)."""
    return {"format": FORMAT, "version": VERSION, "id": id, "world_size": world_size, "mesh": mesh,
            "extra": extra, "optim_hparams": optim_hparams, "model": model, "tensors": tensors}


def _model_spec(model: torch.nn.Module) -> dict | None:
    """``{"arch", "args"}`` of an fsdp2d Llama or GPT2 (an FSDP1 wrapper's too), which
    ``export --format hf`` needs to write ``config.json``; None for any other model."""
    from ..hf.weights import HFError, model_spec

    for m in (model, getattr(model, "module", None)):
        try:
            return model_spec(m) if m is not None else None
        except HFError:
            continue
    return None


# -- load --------------------------------------------------------------------------------
def read_index(path: str | os.PathLike) -> dict:
    """The parsed and validated index of the checkpoint folder ``path`` (JSON only)."""
    with Folder(path) as folder:
        return folder.index


def read_box(folder: Folder, name: str, target: Box) -> torch.Tensor:
    """Assemble ``target`` (a box of tensor ``name``) from the saved boxes that meet it,
    computed from the tensor's saved layout; each box's header and manifest are checked
    before anything is allocated, and each is read whole (to verify it), then dropped."""
    parts = []
    for coord, saved in folder.layouts[name].owners_intersecting(target):
        parts.append((folder.source(name, coord), saved, target.intersect(saved)))
    covered = sum(inter.numel() for *_, inter in parts)
    if covered != target.numel():  # (a validated layout tiles: the last guard before a model sees garbage)
        raise CheckpointError(f"{folder.path}: the layout of {name!r} covers {covered} of the "
                              f"{target.numel()} elements this rank needs; the index is damaged")
    for source, saved, _ in parts:
        folder.check(source, name, saved)
    out = _files._empty(target.local_shape, getattr(torch, folder.index["tensors"][name]["dtype"]))
    for source, saved, inter in parts:
        src = tuple(slice(o - so, o - so + n) for o, so, n in zip(inter.global_offset, saved.global_offset,
                                                                  inter.local_shape))
        dst = tuple(slice(o - to, o - to + n) for o, to, n in zip(inter.global_offset, target.global_offset,
                                                                 inter.local_shape))
        box = folder.read(source, name, saved)
        out[dst] = box[src] if src else box
        del box
    return out


def _check_names(index: dict, entries: list[Entry], path: Path, with_optim: bool, stage: bool = False) -> None:
    """The model's tensors are the saved ones (with ``stage``, a pipeline stage's: some of them)."""
    saved = {n for n in index["tensors"] if n.startswith("model/") or (with_optim and n.startswith("optim/"))}
    wanted = {e.name for e in entries}
    missing, unexpected = sorted(wanted - saved), [] if stage else sorted(saved - wanted)
    if missing or unexpected:
        raise CheckpointError(f"{path} does not match the model: missing keys {missing[:10]}"
                              f"{' ...' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
                              f"{' ...' if len(unexpected) > 10 else ''}")


def _unread_by_every_stage(index: dict, entries: list[Entry], model, stage_axis: str, path: Path,
                           with_optim: bool) -> CheckpointError | None:
    """A stage loads only its own tensors: the saved ones that no stage of this pipeline
    wants (a checkpoint of a deeper model) would be dropped without a word. The names each
    stage read are gathered over the pipeline axis (once per load); those left over are
    unexpected keys, as without stages."""
    try:
        group = _model_mesh(model_entries(model)).get_group(stage_axis)
    except Exception as exc:  # (the same on every rank of the pipeline: the model's mesh)
        return CheckpointError(f"{path}: stage_axis={stage_axis!r}: {exc!r}")
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, sorted(e.name for e in entries), group=group)
    if not index or any(not p for p in parts):  # an error elsewhere already stops the load
        return None
    saved = {n for n in index["tensors"] if n.startswith("model/") or (with_optim and n.startswith("optim/"))}
    unread = sorted(saved - {n for p in parts for n in p})
    if not unread:
        return None
    return CheckpointError(f"{path} does not match the model: unexpected keys {unread[:10]}"
                           f"{' ...' if len(unread) > 10 else ''} (no pipeline stage holds them)")


def _saved_state_fqns(index: dict) -> set[str]:
    """Parameters whose optimizer state the checkpoint holds (``optim/<fqn>/<key>``)."""
    return {n.removeprefix("optim/").rpartition("/")[0] for n in index["tensors"] if n.startswith("optim/")}


def _stage(folder: Folder, model, optimizer, created: list, stage: bool = False) -> tuple[list[Entry], dict, list]:
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
    _check_names(index, entries, path, optimizer is not None, stage)
    for e in entries:
        meta = index["tensors"][e.name]
        if tuple(meta["shape"]) != e.global_shape:
            raise CheckpointError(f"{path}: {e.name!r} has shape {tuple(meta['shape'])} in the checkpoint, "
                                  f"{e.global_shape} in the model")
        if meta["dtype"] != _dtype_name(e.tensor.dtype):
            raise CheckpointError(f"{path}: {e.name!r} is {meta['dtype']} in the checkpoint, "
                                  f"{_dtype_name(e.tensor.dtype)} in the model; cast the model first")
    staged = {e.name: read_box(folder, e.name, e.box) for e in entries}
    return entries, staged, fresh


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         stage_axis: str | None = None) -> dict:
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
    ``stage_axis``: ``model`` is this rank's pipeline stages (see :func:`save`), which hold
    some of the saved tensors: the others are not read (none of its own may be missing).
    """
    path = Path(path)
    created: list = []
    entries, staged, fresh, error, index, digest = [], {}, [], None, {}, None
    try:
        with Folder(path) as folder:
            index, digest = folder.index, folder.digest
            entries, staged, fresh = _stage(folder, model, optimizer, created, stage_axis is not None)
    except CheckpointError as exc:
        error = exc
    except Exception as exc:  # any failure must reach the collective below, or peers hang
        error = CheckpointError(f"loading {path} failed: {exc!r}")
        error.__cause__ = exc
    if stage_axis is not None:  # (collective: every rank, error or not)
        error = _unread_by_every_stage(index, entries, model, stage_axis, path, optimizer is not None) or error
    rank = dist.get_rank() if dist.is_initialized() else 0
    agreed = agree(f"rank {rank}: {error}" if error is not None else "", digest or "",
                   "the checkpoint they read (the sha256 of its index: was it replaced during the load? "
                   "load again)")
    if agreed.error:
        for p in created:  # leave the optimizer as it was
            optimizer.state.pop(p, None)
        raise error or CheckpointError(f"loading {path} failed, nothing was changed: {agreed.error}")
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
