"""Random init of sharded parameters on a CPU mesh: every shard its own draws.

torch's DTensor RNG gives shards distinct values only on CUDA-like meshes; on a CPU mesh
each rank drew its local shard from the same generator state, so a TP/FSDP-sharded
weight held the same block on every rank (duplicated heads, silently). fsdp2d's models
initialise through ``fsdp2d.models._init.init_``: on 2x2, meta-built and materialised
with ``to_empty()`` + ``init_weights()``, they must equal one process's init with the
same seed, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import fsdp2d
from fsdp2d.models import GPT2, GPT2Args, Llama, LlamaArgs, gpt2_tp_plan, llama_tp_plan

from .pool import get_mesh


def _build(kind: str):
    if kind == "llama":
        return Llama(LlamaArgs(dim=32, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=96, multiple_of=8,
                               max_seq_len=8)), llama_tp_plan(), "layers"
    return GPT2(GPT2Args(n_layer=2, n_head=4, n_embd=32, vocab_size=96, block_size=8)), gpt2_tp_plan(), "h"


def job_init_matches_one_process(kind: str) -> dict:
    torch.set_num_threads(1)
    mesh = get_mesh((2, 2), ("dp", "tp"))
    with torch.device("meta"):
        model, plan, blocks = _build(kind)
    fsdp2d.parallelize_module(model, mesh["tp"], plan)
    for block in getattr(model, blocks):
        fsdp2d.fully_shard(block, mesh=mesh["dp"])
    fsdp2d.fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    torch.manual_seed(7)
    model.init_weights()
    ref, _, _ = _build(kind)
    torch.manual_seed(7)
    ref.init_weights()
    ref_params = dict(ref.named_parameters())
    worst = {fqn: (p.detach().full_tensor() - ref_params[fqn].detach()).abs().max().item() for fqn, p in model.named_parameters()}
    w = dict(model.named_parameters())["layers.0.attention.wq.weight" if kind == "llama" else "h.0.attn.q_proj.weight"]
    local = w.detach().to_local()
    return {"worst": max(worst.values()), "local": local.clone()}


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_sharded_init_equals_one_process(pool, kind):
    out = pool.run(job_init_matches_one_process, kind)
    assert all(r["worst"] == 0.0 for r in out), [r["worst"] for r in out]
    locals_ = [r["local"] for r in out]  # four different boxes: no two ranks hold the same values
    assert all(not torch.equal(a, b) for i, a in enumerate(locals_) for b in locals_[i + 1:])
