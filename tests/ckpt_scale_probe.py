"""Checkpoint metadata at scale: one simulated rank saving and loading under torch's fake
process group.

Usage: ``python tests/ckpt_scale_probe.py FOLDER`` prints one JSON object. For each world
size W (64 = 8 x 8 and 8192 = 1024 x 8, (dp, tp)) it builds a small Llama on the meta
device, applies TP (tp=8) and ``fully_shard`` per block and root, materialises this
rank's shards on the CPU (a few KiB), gives AdamW its state, and then:

- as rank 0: saves (counting every collective and its bytes with ``CollectiveCounter``:
  the metadata this rank hands to the network), measures the index and its own data
  file, and loads the checkpoint back on the same mesh (collectives, files opened);
- as the last rank: saves (collectives) and measures its data file. Under the fake
  process group a collective moves nothing, so rank 0's save id never reaches it: the
  probe creates the temporary folder rank 0 would have created for id 0.

Run in its own process: it initialises the (fake) default process group.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fsdp2d
from fsdp2d import checkpoint as ckpt
from fsdp2d.checkpoint import _commit
from fsdp2d.checkpoint._entries import materialize_state
from fsdp2d.debug import CollectiveCounter, init_fake_world
from fsdp2d.models import Llama, LlamaArgs, llama_tp_plan

TP = 8
ARGS = dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=8, vocab_size=8192, multiple_of=256, max_seq_len=16)
_OPENED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _OPENED is not None and isinstance(args[0], str) and args[0].endswith(".safetensors"):
        _OPENED.append(args[0])


def build(world: int):
    mesh = fsdp2d.init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = Llama(LlamaArgs(**ARGS))
    fsdp2d.parallelize_module(model, mesh["tp"], llama_tp_plan())
    for block in model.layers:
        fsdp2d.fully_shard(block, mesh=mesh["dp"])
    fsdp2d.fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(i)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    materialize_state(opt)
    return model, opt


def _counted(counter: CollectiveCounter) -> dict:
    return {"count": sum(c for c, _ in counter.counts.values()), "bytes": sum(b for _, b in counter.counts.values()),
            "kinds": sorted({kind for _, kind in counter.counts})}


def one_rank(world: int, rank: int, folder: Path) -> dict:
    global _OPENED
    init_fake_world(rank, world)
    try:
        model, opt = build(world)
        path = folder / f"w{world}"
        if rank != 0:
            _commit.tmp_path(path, f"{0:016x}").mkdir(parents=True)
        t0 = time.perf_counter()
        with CollectiveCounter() as saving:
            ckpt.save(path, model, opt, extra={"step": 1})
        out = {"save": _counted(saving), "save_s": round(time.perf_counter() - t0, 3)}
        written = path if rank == 0 else _commit.tmp_path(path, f"{0:016x}")
        files = {f.name: f.stat().st_size for f in written.iterdir()}
        out["own_file_bytes"] = files.get(f"rank{rank:05d}.safetensors", 0)
        if rank == 0:
            out["index_bytes"] = files["fsdp2d.index.json"]
            out["files_written"] = sorted(files)
            _OPENED = []
            with CollectiveCounter() as loading:
                ckpt.load(path, model, opt)
            out["load"], out["load_opened"] = _counted(loading), sorted(set(_OPENED))
            _OPENED = None
        return out
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.addaudithook(_audit)
    root = Path(sys.argv[1])
    shutil.rmtree(root, ignore_errors=True)
    result = {}
    for world in (64, 8192):
        result[str(world)] = {"first": one_rank(world, 0, root / "first"),
                              "last": one_rank(world, world - 1, root / "last")}
    print(json.dumps(result))
