"""Check on a GPU that an fsdp2d training step makes no host syncs (DESIGN item 9).

One process stands for one rank of a ``dp x tp`` job: torch's fake process group
(collectives complete at once, no data moves) over real CUDA tensors, so every op of
fsdp2d's step runs on the GPU as it would on a real job, and
``torch.cuda.set_sync_debug_mode("error")`` makes any op that waits for the GPU on
the host (``.item()``, ``.tolist()``, ``nonzero``, a blocking copy) raise. Also reports
the kernels (CUDA ops) a step launches at two data-parallel sizes.

    python benchmarks/cuda_step_check.py [WORLD ...]   # needs one CUDA GPU; not part of CI
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp2d
from fsdp2d.debug import OpCounter
from fsdp2d.models import Llama, LlamaArgs, llama_tp_plan


def check(world: int, tp: int, uneven: bool) -> dict:
    dist.init_process_group("fake", store=FakeStore(), rank=world - 1, world_size=world)
    try:
        torch.cuda.set_device(0)
        mesh = fsdp2d.init_device_mesh("cuda", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        args = LlamaArgs(dim=252 if uneven else 256, n_layers=2, n_heads=2, n_kv_heads=2,
                         vocab_size=1001 if uneven else 1024, multiple_of=2, max_seq_len=64)
        with torch.device("meta"):
            model = Llama(args)
        fsdp2d.parallelize_module(model, mesh["tp"], llama_tp_plan())
        for block in model.layers:
            fsdp2d.fully_shard(block, mesh=mesh["dp"])
        fsdp2d.fully_shard(model, mesh=mesh["dp"])
        model.to_empty(device="cuda")
        model.init_weights()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        x = torch.randint(0, args.vocab_size, (2, 64), device="cuda")
        counts = []
        for step in range(3):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if step else "default")  # step 0 sets up
            with OpCounter() as ops:
                loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
                loss.backward()
                fsdp2d.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            torch.cuda.set_sync_debug_mode("default")
            counts.append(ops.ops)
        torch.cuda.synchronize()
        return {"ok": True, "ops": sum(counts[-1].values()), "loss_finite": bool(torch.isfinite(loss).item())}
    finally:
        dist.destroy_process_group()


def _older_torch_shims() -> list[str]:
    """fsdp2d needs torch 2.13; a GPU machine with an older torch lacks two of its
    collective entry points. Map them to their older equivalents (same semantics) so the
    check can run there; report that it did."""
    shims = []
    if not hasattr(dist, "all_gather_single"):
        dist.all_gather_single = lambda out, inp, group=None, async_op=False: \
            dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)
        shims.append("all_gather_single -> all_gather_into_tensor")
    if not hasattr(dist, "reduce_scatter_single"):
        dist.reduce_scatter_single = lambda out, inp, op=dist.ReduceOp.SUM, group=None, async_op=False: \
            dist.reduce_scatter_tensor(out, inp, op=op, group=group, async_op=async_op)
        shims.append("reduce_scatter_single -> reduce_scatter_tensor")
    return shims


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    print(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
                      "shims": _older_torch_shims()}))
    out = {}
    worlds = [int(w) for w in sys.argv[1:]] or [16, 2048]  # one process per size is cleanest
    for world, tp in ((w, 2) for w in worlds):
        for uneven in (False, True):
            key = f"dp{world // tp}-tp{tp}-{'uneven' if uneven else 'even'}"
            try:
                out[key] = check(world, tp, uneven)
            except Exception as e:  # noqa: BLE001 - report which configuration synced
                out[key] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    print(json.dumps(out, indent=1))
    return 0 if all(v["ok"] for v in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
