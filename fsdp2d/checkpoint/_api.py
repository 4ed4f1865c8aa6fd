"""State dicts, a keep-last-K manager, and the offline export to Hugging Face safetensors."""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save as st_save

from ..bridge import LocalShard, gather_full
from ..placement import Box
from ._entries import model_entries
from . import _commit
from ._files import Folder, _digest, manifest
from ._index import describe_layout, dump_index
from ._io import INDEX, _fsync_write, _index_document, read_box, save
from ._replace import write_replacing

__all__ = ["get_model_state_dict", "CheckpointManager", "export", "inspect"]


def get_model_state_dict(model: torch.nn.Module, *, full: bool = True, rank0_only: bool = False) -> dict[str, Any]:
    """``{fqn: tensor}`` of ``model``.

    ``full=True``: plain full tensors (collective: shards are gathered over the mesh); with
    ``rank0_only`` only rank 0 keeps them (others get ``{}``). ``full=False``: this rank's
    pieces as :class:`~fsdp2d.bridge.LocalShard` (tensor + layout), plain tensors for
    parameters that are not sharded.
    """
    out: dict[str, Any] = {}
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    for e in model_entries(model):
        fqn = e.name.removeprefix("model/")
        if not full:
            out[fqn] = e.tensor if e.layout is None else LocalShard(e.tensor, e.layout)
            continue
        value = e.tensor if e.layout is None else gather_full(e.tensor.contiguous(), e.layout, e)
        if keep:
            out[fqn] = value.detach().clone()
    return out


class CheckpointManager:
    """Numbered checkpoints ``folder/step_00000100`` with the last ``keep_last`` kept.

    Example::

        ckpts = CheckpointManager("runs/x/checkpoints", keep_last=3)
        ckpts.save(step, model, optim, extra={"step": step})
        if (path := ckpts.latest()) is not None:
            extra = fsdp2d.checkpoint.load(path, model, optim)
    """

    def __init__(self, folder: str | os.PathLike, keep_last: int | None = None) -> None:
        self.folder, self.keep_last = Path(folder), keep_last

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints in the folder, ascending."""
        if not self.folder.is_dir():
            return []
        found = [int(m.group(1)) for p in self.folder.iterdir()
                 if (m := re.fullmatch(r"step_(\d+)", p.name)) and (p / INDEX).is_file()]
        return sorted(found)

    def path(self, step: int) -> Path:
        return self.folder / f"step_{step:08d}"

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    def remove(self, step: int) -> None:
        """Delete the checkpoint of ``step`` (not collective: call on one rank)."""
        _commit.remove(self.path(step))

    def save(self, step: int, model: torch.nn.Module, optimizer=None, *, extra: dict | None = None,
             stage_axis: str | None = None) -> Path:
        path = self.path(step)
        save(path, model, optimizer, extra=extra, stage_axis=stage_axis)
        if self.keep_last and (not dist.is_initialized() or dist.get_rank() == 0):
            for old in self.steps()[:-self.keep_last]:
                self.remove(old)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        return path


def export(ckpt: str | os.PathLike, out: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write the model of checkpoint ``ckpt`` as full tensors to the folder ``out``:
    ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json`` when larger than ``max_shard_bytes``), keys = module
    fqns, loadable with ``safetensors.torch.load_file`` into the unparallelized model.
    ``out`` also gets an fsdp2d index (one box per tensor), so ``load`` reads it too. The
    model files of an earlier export in ``out`` are replaced as a set (no stale shard or
    index stays); a failed export leaves them as they were.
    Offline, one process, no process group. Streams: the file split is planned from the
    index, then each file's tensors are assembled, written and freed before the next, so
    memory peaks at about two output files, not the whole model."""
    with Folder(ckpt) as folder:  # into a staging folder, then over any earlier export as a set
        return write_replacing(Path(out), folder.path,
                               lambda stage: [p.name for p in _export(folder, stage, max_shard_bytes)])


def _export(folder: Folder, out: Path, max_shard_bytes: int) -> list[Path]:
    index = folder.index
    names = sorted(n for n in index["tensors"] if n.startswith("model/"))
    plan: list[list[str]] = [[]]
    size = 0
    for name in names:
        meta = index["tensors"][name]
        nbytes = math.prod(meta["shape"]) * getattr(torch, meta["dtype"]).itemsize
        if plan[-1] and size + nbytes > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append(name)
        size += nbytes
    out.mkdir(parents=True, exist_ok=True)
    n = len(plan)
    fnames = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    tensors, weight_map, total, export_id = {}, {}, 0, uuid.uuid4().hex[:16]
    for fname, group in zip(fnames, plan):
        shard, boxes = {}, {}
        for name in group:
            meta = index["tensors"][name]
            shape = tuple(meta["shape"])
            full = read_box(folder, name, Box((0,) * len(shape), shape))
            key = name.removeprefix("model/")
            shard[key] = full
            boxes[key] = ((0,) * len(shape), _digest(full))
            weight_map[key] = fname
            total += full.numel() * full.element_size()
            tensors[name] = {"dtype": meta["dtype"], "shape": list(shape), "layout": describe_layout(None),
                             "file": fname, "key": key}
        data = st_save(shard, metadata=manifest(export_id, fname, boxes))
        del shard
        _fsync_write(out / fname, data)
        del data
    if n > 1:
        _fsync_write(out / "model.safetensors.index.json",
                     json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode())
    fsdp_index = _index_document(tensors=tensors, world_size=1, mesh={"axes": [], "shape": []},
                                 extra=index["extra"], optim_hparams=None, id=export_id,
                                 model=index.get("model"))
    _fsync_write(out / INDEX, dump_index(fsdp_index))
    return [out / f for f in fnames]


def _brief(extra: Any) -> Any:
    """``extra`` for people: an RNG state (base64, ~5 KB for torch's) and any other string
    over 200 characters are named with their size, not printed."""
    if isinstance(extra, dict):
        rng = lambda v: f"<RNG state, {len(v) * 3 // 4 - v.count('=')} bytes>"  # noqa: E731 - base64's size
        return {k: rng(v) if k == "rng" and isinstance(v, str) else _brief(v) for k, v in extra.items()}
    if isinstance(extra, list):
        return [_brief(v) for v in extra]
    if isinstance(extra, str) and len(extra) > 200:
        return f"<{len(extra)} characters>"
    return extra


def inspect(ckpt: str | os.PathLike) -> str:
    """A human-readable summary: mesh, world size, data files, extra, and every tensor
    with its layout (``tp=S(0) dp=S(0)``: sharded along dim 0 over tp, then over dp; ``, stage
    pp=1``: held by the pipeline stage at pp coordinate 1)."""
    with Folder(ckpt) as folder:
        index, files = folder.index, folder.data_files()
    mesh = index["mesh"]
    lines = [f"checkpoint {ckpt}",
             f"saved on {index['world_size']} ranks, mesh "
             + (" x ".join(f"{a}={s}" for a, s in zip(mesh["axes"], mesh["shape"])) or "(none)"),
             f"data files: {len(files)}, {sum(size for _, size in files) / 2**20:.2f} MiB",
             f"id: {index['id']}", f"extra: {json.dumps(_brief(index['extra']))}", "",
             f"{'tensor':<60} {'dtype':<9} {'shape':<18} layout"]
    for name, meta in sorted(index["tensors"].items()):
        lay = meta["layout"]
        where = " ".join(f"{a}={p}" for a, p in zip(lay["axes"], lay["placements"])) or "(one box)"
        where += "".join(f", stage {a}={k}" for a, k in (meta.get("stage") or {}).items())  # a pipeline's
        lines.append(f"{name:<60} {meta['dtype']:<9} {str(tuple(meta['shape'])):<18} {where}")
    return "\n".join(lines)
