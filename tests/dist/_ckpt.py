"""Worker-side checkpoint jobs: build a model on some mesh, save, load on another."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fsdp2d
from fsdp2d import checkpoint as ckpt
from fsdp2d.models import Llama, LlamaArgs, llama_tp_plan

from . import _parity as P
from .pool import get_mesh

# Meshes every test can pick: (shape, names); None = unparallelized on every rank.
MESHES = {
    "1x1": None,
    "dp4": ((4,), ("dp",)),
    "tp4": ((1, 4), ("dp", "tp")),
    "2x2": ((2, 2), ("dp", "tp")),
    "4x1": ((4, 1), ("dp", "tp")),
    "hsdp2x2": ((2, 2), ("replicate", "shard")),
    "hsdp2x1x2": ((2, 1, 2), ("replicate", "shard", "tp")),
}


class Stack(nn.Module):
    """Embedding then Linear layers of the given (uneven) widths, biases on some."""

    def __init__(self, vocab: int, dims: list[int], biases: list[bool]) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dims[0])
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b, bias in zip(dims, dims[1:], biases))

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return h


def build_stack(spec: dict, seed: int) -> Stack:
    torch.manual_seed(seed)
    return Stack(spec["vocab"], spec["dims"], spec["biases"])


def parallelize_stack(model: Stack, mesh_key: str) -> None:
    if MESHES[mesh_key] is None:
        return
    shape, names = MESHES[mesh_key]
    mesh = get_mesh(shape, names)
    if "tp" in names:
        plan = {"emb": fsdp2d.RowwiseParallel(input_layouts=fsdp2d.Replicate())}
        for i in range(len(model.layers)):  # col, row, col, row ...: widths line up
            plan[f"layers.{i}"] = fsdp2d.ColwiseParallel() if i % 2 == 0 else fsdp2d.RowwiseParallel()
        if len(model.layers) % 2 == 1:
            plan[f"layers.{len(model.layers) - 1}"] = fsdp2d.ColwiseParallel(output_layouts=fsdp2d.Replicate())
        fsdp2d.parallelize_module(model, mesh["tp"], plan)
    dp_names = tuple(n for n in names if n != "tp")
    if dp_names:
        for layer in model.layers:
            fsdp2d.fully_shard(layer, mesh=mesh[dp_names])
        fsdp2d.fully_shard(model, mesh=mesh[dp_names])


def job_save_stack(spec: dict, mesh_key: str, path: str) -> None:
    model = build_stack(spec, seed=spec["seed"])
    parallelize_stack(model, mesh_key)
    ckpt.save(path, model, extra={"spec_seed": spec["seed"]})


def job_load_stack(spec: dict, mesh_key: str, path: str) -> bool:
    """Load into a differently initialised model on another mesh; compare full tensors
    bit for bit with the model the checkpoint was made from."""
    expected = build_stack(spec, seed=spec["seed"]).state_dict()
    model = build_stack(spec, seed=spec["seed"] + 1)
    parallelize_stack(model, mesh_key)
    extra = ckpt.load(path, model)
    got = ckpt.get_model_state_dict(model, full=True)
    assert extra == {"spec_seed": spec["seed"]}, extra
    assert set(got) == set(expected), (sorted(got), sorted(expected))
    for k, v in expected.items():
        assert torch.equal(got[k], v), f"{k} differs after save on one mesh and load on {mesh_key}"
    return True


# -- train, save, reshard, continue --------------------------------------------------------
def _setup(mesh_key: str) -> P.Setup:
    if MESHES[mesh_key] is None:
        return P.Setup(model="llama", fsdp=False, mesh=(4,), names=("none",))
    shape, names = MESHES[mesh_key]
    return P.Setup(model="llama", mesh=shape, names=names)


def _train_model(mesh_key: str):
    model = P.build("llama")
    if MESHES[mesh_key] is not None:
        P.parallelize(model, _setup(mesh_key))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=P.EPS)
    return model, opt


def _steps(model, opt, mesh_key: str, steps: range) -> list[float]:
    s = _setup(mesh_key)
    mesh = get_mesh(*MESHES[mesh_key]) if MESHES[mesh_key] is not None else None
    idx, count = P.data_rank(mesh, s) if mesh is not None else (0, 1)
    losses = []
    for step in steps:
        x, y = P.batch_for(step, s)
        x, y = x.chunk(count)[idx], y.chunk(count)[idx]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if count > 1:
            torch.distributed.all_reduce(total)
            total /= torch.distributed.get_world_size()
        losses.append(total.item())
    return losses


def job_train_and_save(path: str) -> dict:
    torch.set_num_threads(1)
    model, opt = _train_model("2x2")
    _steps(model, opt, "2x2", range(3))
    ckpt.save(path, model, opt, extra={"step": 3})
    state = ckpt.get_model_state_dict(model)
    continued = _steps(model, opt, "2x2", range(3, 5))
    return {"state": state, "continued": continued}


def job_resume(path: str, mesh_key: str) -> dict:
    torch.set_num_threads(1)
    model, opt = _train_model(mesh_key)
    extra = ckpt.load(path, model, opt)
    state = ckpt.get_model_state_dict(model)
    return {"extra": extra, "state": state, "continued": _steps(model, opt, mesh_key, range(3, 5))}


def edit_manifest(file, fn, tensors=None) -> None:
    """Rewrite the data file ``file`` with ``fn`` applied to its manifest (the JSON in
    its header's ``__metadata__["fsdp2d"]``) and, if given, other tensors."""
    import json
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(file, "pt") as f:
        meta = f.metadata()
        tensors = tensors if tensors is not None else {k: f.get_tensor(k) for k in f.keys()}
    doc = json.loads(meta["fsdp2d"])
    fn(doc)
    save_file(tensors, Path(file), metadata={**meta, "fsdp2d": json.dumps(doc)})


# -- faults (issue 12) ----------------------------------------------------------------------
SMALL = {"vocab": 7, "dims": [5, 9, 3], "biases": [True, False], "seed": 0}


def job_mixed_checkpoints(root: str) -> dict:
    """Ranks 0-1 read one checkpoint, ranks 2-3 another (as if PATH were replaced between
    their reads): every rank must refuse, with the model unchanged."""
    import torch.distributed as dist

    from .pool import capture_error

    a, b = f"{root}/a", f"{root}/b"
    ckpt.save(a, build_stack(SMALL, seed=0))
    ckpt.save(b, build_stack(SMALL, seed=1))
    model = build_stack(SMALL, seed=2)
    before = [p.clone() for p in model.parameters()]
    error = capture_error(lambda: ckpt.load(a if dist.get_rank() < 2 else b, model))
    return {"error": error, "unchanged": all(torch.equal(x, y) for x, y in zip(before, model.parameters()))}


def job_one_rank_bad_extra(root: str) -> dict:
    """Rank 0 alone passes an extra that is not JSON: every rank raises at once."""
    import time

    import torch.distributed as dist

    from .pool import capture_error

    extra = {"step": object()} if dist.get_rank() == 0 else {"step": 1}
    t0 = time.monotonic()
    error = capture_error(lambda: ckpt.save(f"{root}/c", build_stack(SMALL, seed=0), extra=extra))
    return {"error": error, "seconds": time.monotonic() - t0}


def job_save_trained(spec: dict, mesh_key: str, path: str) -> dict:
    """One AdamW step of the stack on ``mesh_key``, then a save with the optimizer;
    returns the full model state (what a load must give back)."""
    model = build_stack(spec, seed=spec["seed"])
    parallelize_stack(model, mesh_key)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    model(torch.randint(0, spec["vocab"], (5,))).square().sum().backward()
    opt.step()
    opt.zero_grad()
    ckpt.save(path, model, opt, extra={"step": 1})
    return ckpt.get_model_state_dict(model)


def job_ranks_disagree(root: str) -> dict:
    """Rank 3 alone holds a model with another width: every rank refuses the save (the
    description each rank would write differs), nothing is left."""
    import torch.distributed as dist

    from .pool import capture_error

    spec = SMALL if dist.get_rank() != 3 else {**SMALL, "dims": [5, 8, 3]}
    return {"error": capture_error(lambda: ckpt.save(f"{root}/d", build_stack(spec, seed=0)))}
