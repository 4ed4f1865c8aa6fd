"""Worker-side jobs for tests/dist/test_hf.py: HF folders onto a 2D mesh."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

import fsdp2d
from fsdp2d.checkpoint._entries import model_entries
from fsdp2d.models import GPT2, Llama
from fsdp2d.models.hf import config_from_hf, load_hf_into, model_spec

from . import _parity as P


def build_loaded(folder: str, mesh_shape: tuple) -> tuple[torch.nn.Module, P.Setup, object]:
    """The user's flow: meta model -> TP plan -> fully_shard per block and root ->
    to_empty -> load the HF weights (each rank its own boxes)."""
    torch.set_num_threads(1)
    arch, args = config_from_hf(json.loads(open(f"{folder}/config.json").read()))
    with torch.device("meta"):
        model = (Llama if arch == "llama" else GPT2)(args)
    s = P.Setup(model=arch, mesh=mesh_shape, fsdp=True)
    P.parallelize(model, s)
    model.to_empty(device="cpu")
    stats = load_hf_into(model, folder)
    return model, s, stats


def job_load(folder: str, mesh_shape: tuple, x: torch.Tensor) -> dict:
    model, _, stats = build_loaded(folder, mesh_shape)
    own = sum(e.box.numel() * e.tensor.element_size() for e in model_entries(model))
    with torch.no_grad():
        logits = model(x)  # (B, T, V), replicated on every rank
    return {"logits": logits, "bytes": stats.bytes, "own": own}


def job_train_save(folder: str, mesh_shape: tuple, steps: int, ckpt: str, x: torch.Tensor) -> torch.Tensor:
    """``steps`` AdamW steps on the mesh (each data-parallel rank its slice), save with
    the model spec that export --format hf reads, return the logits of ``x``."""
    model, s, _ = build_loaded(folder, mesh_shape)
    mesh = P.get_mesh(s.mesh, s.names)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=P.EPS)
    idx, count = P.data_rank(mesh, s)
    for step in range(steps):
        xb, yb = P.batch_for(step, s)
        loss = F.cross_entropy(model(xb.chunk(count)[idx]).flatten(0, 1), yb.chunk(count)[idx].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    fsdp2d.checkpoint.save(ckpt, model, opt, extra={"model": model_spec(model)})
    with torch.no_grad():
        return model(x)
