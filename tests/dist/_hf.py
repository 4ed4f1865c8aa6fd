"""Worker-side jobs for tests/dist/test_hf.py: HF folders onto a 2D mesh."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

import fsdp2d
import fsdp2d.hf
from fsdp2d.checkpoint._entries import model_entries
from fsdp2d.models import GPT2, Llama
from fsdp2d.hf.weights import config_from_hf, load_hf_into, model_spec

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


def hf_model(kind: str) -> torch.nn.Module:
    """A tiny transformers model, dropout off (parity needs determinism), seed fixed."""
    import transformers as T

    torch.manual_seed(1234)
    if kind.startswith("gpt2"):
        cfg = T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=P.VOCAB, n_positions=P.SEQ,
                           attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                           tie_word_embeddings=kind == "gpt2")
        return T.GPT2LMHeadModel(cfg)
    cfg = T.LlamaConfig(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=4, vocab_size=P.VOCAB, max_position_embeddings=P.SEQ)
    return T.LlamaForCausalLM(cfg)


def job_hf_model_parity(kind: str, mesh_shape: tuple, steps: int) -> dict:
    """The transformers model itself: TP with fsdp2d.hf.tp_plan, fully_shard per block
    and root over dp, ``steps`` AdamW steps against the same model on one process."""
    import copy

    torch.set_num_threads(1)
    ref = hf_model(kind)
    model = copy.deepcopy(ref)
    mesh = P.get_mesh(mesh_shape, ("dp", "tp"))
    fsdp2d.parallelize_module(model, mesh["tp"], fsdp2d.hf.tp_plan(model))
    for block in (model.transformer.h if kind.startswith("gpt2") else model.model.layers):
        fsdp2d.fully_shard(block, mesh=mesh["dp"])
    try:
        fsdp2d.fully_shard(model, mesh=mesh["dp"])
    except ValueError as exc:  # an fsdp2d without tie support refuses the tied head (same on every rank)
        if "tied weights" in str(exc):
            return {"refused": str(exc)}
        raise
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=P.EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=P.EPS)
    s = P.Setup(model=kind, mesh=mesh_shape)
    idx, count = P.data_rank(mesh, s)
    loss_err = 0.0
    for step in range(steps):
        x, y = P.batch_for(step, s)
        ref_loss = F.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten())
        ref_loss.backward()
        loss = F.cross_entropy(model(x.chunk(count)[idx]).logits.flatten(0, 1), y.chunk(count)[idx].flatten())
        loss.backward()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)  # each dp slice's loss counted once per TP rank
        total /= torch.distributed.get_world_size()
        loss_err = max(loss_err, abs(total.item() - ref_loss.item()) / abs(ref_loss.item()))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    params = P.full_tensors(model, mesh, "param")
    errs = {n: (params[n].reshape(p.shape) - p.detach()).abs().max().item() for n, p in ref.named_parameters()}
    tied = kind != "gpt2" or model.lm_head.weight is model.transformer.wte.weight
    return {"loss": loss_err, "param_abs": max(errs.values()), "worst": max(errs, key=errs.get), "tied": tied}
