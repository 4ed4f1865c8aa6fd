"""Checkpoint save/load throughput: fsdp2d.checkpoint against torch.distributed.checkpoint.

    torchrun --nproc_per_node 4 benchmarks/checkpoint_throughput.py [--dim 512] [--layers 8] [--repeats 3]

Both save the same Llama state on a 2 (dp) x 2 (tp) CPU mesh, with AdamW state: fsdp2d's
model built with fsdp2d's TP + FSDP, torch's with its native 2D path
(``parallelize_module`` + ``fully_shard``) from the same seed, so the bytes saved match.
Alternates the two, reports median seconds and GB/s (state bytes / time) per operation.
"""

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

import fsdp2d
from fsdp2d import checkpoint
from fsdp2d.models import Llama, LlamaArgs, llama_tp_plan


def _torch_plan():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()), "output": ColwiseParallel(output_layouts=Replicate())}
    for name in ("wq", "wk", "wv"):
        plan[f"layers.*.attention.{name}"] = ColwiseParallel()
    plan["layers.*.attention.wo"] = RowwiseParallel()
    plan["layers.*.feed_forward.w1"] = plan["layers.*.feed_forward.w3"] = ColwiseParallel()
    plan["layers.*.feed_forward.w2"] = RowwiseParallel()
    return plan


def build(kind, args, mesh):
    torch.manual_seed(0)
    model = Llama(args)
    if kind == "fsdp2d":
        fsdp2d.parallelize_module(model, mesh["tp"], llama_tp_plan())
        for b in model.layers:
            fsdp2d.fully_shard(b, mesh=mesh["dp"])
        fsdp2d.fully_shard(model, mesh=mesh["dp"])
    else:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        tmesh = mesh
        parallelize_module(model, tmesh["tp"], _torch_plan())
        for b in model.layers:
            fully_shard(b, mesh=tmesh["dp"])
        fully_shard(model, mesh=tmesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, args.vocab_size, (2, 16))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()  # materialise AdamW state
    return model, opt


def state_bytes(model, opt) -> int:
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    local += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor))
    t = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(t)
    return int(t.item())


def timed(fn, *args, **kwargs) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    dist.barrier()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    mesh = fsdp2d.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    args = LlamaArgs(dim=a.dim, n_layers=a.layers, n_heads=8, n_kv_heads=4, vocab_size=8192, max_seq_len=64)
    ours, ours_opt = build("fsdp2d", args, mesh)
    theirs, theirs_opt = build("torch", args, mesh)
    nbytes = state_bytes(ours, ours_opt)
    root = tempfile.mkdtemp(prefix="ckpt_bench_") if dist.get_rank() == 0 else None
    obj = [root]
    dist.broadcast_object_list(obj)
    root = obj[0]
    times = {k: [] for k in ("fsdp2d save", "fsdp2d load", "torch DCP save", "torch DCP load")}
    for i in range(a.repeats):
        p1, p2 = f"{root}/fsdp2d_{i}", f"{root}/dcp_{i}"
        times["fsdp2d save"].append(timed(checkpoint.save, p1, ours, ours_opt))
        state = {"model": theirs.state_dict(), "optim": _dcp_optim_state(theirs, theirs_opt)}
        times["torch DCP save"].append(timed(dcp.save, state, checkpoint_id=p2))
        times["fsdp2d load"].append(timed(checkpoint.load, p1, ours, ours_opt))
        state = {"model": theirs.state_dict(), "optim": _dcp_optim_state(theirs, theirs_opt)}
        times["torch DCP load"].append(timed(dcp.load, state, checkpoint_id=p2))
    if dist.get_rank() == 0:
        print(f"state: {nbytes / 2**20:.1f} MiB (params + AdamW), 2x2 mesh, 4 gloo ranks, {a.repeats} repeats")
        print("| operation | median s | GB/s | runs (s) |\n|---|---|---|---|")
        for k, v in times.items():
            med = statistics.median(v)
            print(f"| {k} | {med:.3f} | {nbytes / med / 1e9:.2f} | {', '.join(f'{t:.3f}' for t in v)} |")
    dist.destroy_process_group()


def _dcp_optim_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt)


if __name__ == "__main__":
    main()
