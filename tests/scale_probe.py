"""Run one simulated rank of fsdp2d jobs of several sizes under torch's fake process group.

Usage: ``python tests/scale_probe.py`` prints one JSON object. For each (world size,
shape kind) it builds a Llama on the meta device, applies TP (tp=2) and fully_shard per
block and root, materialises it under ``FakeTensorMode`` (no memory), and counts what
one training step (forward, backward, AdamW step) dispatches: every aten and c10d op,
the collectives among them, and the data-dependent ops (a host sync on a GPU). It also
checks that a dropped model is freed. Run in its own process: it initialises the
(fake) default process group.
"""

from __future__ import annotations

import gc
import json
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import fsdp2d
from fsdp2d.debug import OpCounter, init_fake_world
from fsdp2d.models import Llama, LlamaArgs, llama_tp_plan

TP = 2
DATA_DEPENDENT = ("_local_scalar_dense", "nonzero", "item", "masked_select", "unique")
SHAPES = {
    # every dim divisible by dp x tp at both world sizes (dp = 8 and 1024)
    "even": dict(dim=2048, n_layers=2, n_heads=16, n_kv_heads=16, vocab_size=4096, multiple_of=2048,
                 max_seq_len=16),
    # uneven at both: every TP shard's rows (6 per q/k/v, 18 hidden, 12 norm, 500-501
    # vocab) split unevenly over dp = 8 and dp = 1024
    "uneven": dict(dim=12, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=1001, multiple_of=2,
                   ffn_dim_multiplier=1.15, max_seq_len=16),
}


def build(world: int, kind: str):
    mesh = fsdp2d.init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = Llama(LlamaArgs(**SHAPES[kind]))
    fsdp2d.parallelize_module(model, mesh["tp"], llama_tp_plan())
    for block in model.layers:
        fsdp2d.fully_shard(block, mesh=mesh["dp"])
    fsdp2d.fully_shard(model, mesh=mesh["dp"])
    return model


def step_counts(world: int, kind: str) -> dict:
    init_fake_world(world - 1, world)
    try:
        model = build(world, kind)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
            x = torch.randint(0, SHAPES[kind]["vocab_size"], (2, 16))
            counts, optim = [], []
            for _ in range(3):  # the first step also sets things up: compare the later ones
                with OpCounter() as c:
                    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
                with OpCounter() as o:  # torch's AdamW (its CPU step counters are read with .item())
                    opt.step()
                    opt.zero_grad()
                counts.append(c.ops)
                optim.append(o.ops)
        last = counts[-1]
        return {"total": sum(last.values()), "steady": counts[-1] == counts[-2],
                "collectives": {k: v for k, v in last.items() if k.startswith("c10d")},
                "data_dependent": sum(v for k, v in last.items() if k.split(".")[-1] in DATA_DEPENDENT),
                "optimizer_total": sum(optim[-1].values()), "ops": dict(last)}
    finally:
        dist.destroy_process_group()


def leak() -> dict:
    init_fake_world(0, 16)
    try:
        model = build(16, "uneven")
        refs = [weakref.ref(model), weakref.ref(model.layers[0]), weakref.ref(model._fsdp2d_fsdp)]
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            F.cross_entropy(model(torch.randint(0, 1001, (2, 16))).flatten(0, 1),
                            torch.zeros(32, dtype=torch.long)).backward()
            opt.step()
        del model, opt
        gc.collect()
        return {"alive": sum(r() is not None for r in refs)}
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    out = {f"{kind}-{world}": step_counts(world, kind) for kind in SHAPES for world in (16, 2048)}
    out["leak"] = leak()
    print(json.dumps(out))
