"""Where a rank's CPU goes, without communication: one process, a fake process group.

    python benchmarks/cpu_floor.py --model llama --size medium

Builds rank 0's part of compare_torch.py's 2x2 run in one process on torch's ``fake``
backend (collectives return at once and move nothing), so what is timed is the rank's
own work: compute plus each stack's Python. Four variants, same model and batch:

* plain:   the TP-local shapes as plain parameters, fsdp2d's hooks and TP forwards removed:
           no TP autograd functions, no DTensors, no FSDP; just the local matmuls a rank
           must do (the compute floor);
* tp only: fsdp2d's ``parallelize_module`` (its autograd collectives, no FSDP; for-loop AdamW);
* fsdp2d:  TP + ``fully_shard`` as benchmarked;
* torch:   torch's DTensor TP + FSDP2 as benchmarked.

Under ``torchrun --nproc_per_node 4`` it runs instead as 4 real gloo ranks (the 2x2 mesh
of ``make bench``): plain, fsdp2d and torch side by side, alternating step by step,
and reports each one's median wall time per step (slowest rank) and process CPU per
rank, with plain/torch and fsdp2d/torch: the ratio this machine allows a stack with no
communication and no overhead at all, next to what fsdp2d reaches.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 benchmarks/cpu_floor.py --model llama --size medium

Otherwise it reports the main thread's CPU ms per training step (forward, backward, AdamW step: fused but
for "tp only"), the
median of 12 steps after 3 warmup steps. The difference between these and the
"CPU ms/step/rank" of a real gloo run is the cost of communication on that machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_torch as ct  # noqa: E402

import fsdp2d  # noqa: E402
from fsdp2d.models import gpt2_tp_plan, llama_tp_plan  # noqa: E402


def plain_local(cfg: ct.Config, mesh: fsdp2d.DeviceMesh, tp_only: bool) -> torch.nn.Module:
    model = ct.build_model(cfg)
    fsdp2d.parallelize_module(model, mesh["tp"], gpt2_tp_plan() if cfg.model == "gpt2" else llama_tp_plan())
    if not tp_only:  # a plain model of local shapes: no TP hooks, forwards or DTensor parameters
        for m in model.modules():
            m._forward_hooks.clear()
            m._forward_pre_hooks.clear()
            m.__dict__.pop("forward", None)  # row-wise Linear / vocab-parallel Embedding forwards
            for name, p in list(m._parameters.items()):
                if isinstance(p, DTensor):
                    m._parameters[name] = torch.nn.Parameter(p.to_local().detach().clone(), p.requires_grad)
    return model


def cpu_per_step(model: torch.nn.Module, cfg: ct.Config, local_vocab: int | None) -> float:
    # fused, as `make bench` (--optim fused); "tp only" mixes DTensor and plain parameters
    # (the norms), which one fused step cannot take: the for-loop there
    fused = len({isinstance(p, DTensor) for p in model.parameters()}) == 1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused, foreach=False if not fused else None)
    times = []
    for step in range(15):
        x, y = ct.batch_for(cfg, step, 0, 2)
        if local_vocab is not None:  # the hook-less embedding and head hold local rows only
            x, y = x % local_vocab, y % local_vocab
        t0 = time.thread_time()
        ct.train_step(model, opt, x, y)
        if step >= 3:
            times.append(time.thread_time() - t0)
    return statistics.median(times) * 1000


def side_by_side(cfg: ct.Config, steps: int) -> None:
    """4 gloo ranks: plain, fsdp2d and torch, alternating as ``make bench`` does (``turn_order``,
    so load hits all alike); median wall per step (slowest rank) and CPU per rank."""
    if dist.get_world_size() != 4:
        raise SystemExit(f"cpu_floor.py: the side-by-side mode is the 2x2 mesh of `make bench`: run it on 4 ranks "
                         f"(torchrun --nproc_per_node 4), not {dist.get_world_size()}")
    mesh = fsdp2d.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"].size()
    impls = {"plain": (plain_local(cfg, mesh, tp_only=False), cfg.vocab // tp),
             "fsdp2d": (ct.build_fsdp2d(cfg, mesh), None), "torch": (ct.build_torch(cfg, mesh), None)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for k, (m, _) in impls.items()}
    wall: dict[str, list[float]] = {k: [] for k in impls}
    cpu: dict[str, list[float]] = {k: [] for k in impls}
    dp_rank = mesh.get_local_rank("dp")
    for step in range(steps + 4):
        for k in ct.turn_order(list(impls), step):
            model, local_vocab = impls[k]
            x, y = ct.batch_for(cfg, step, dp_rank, mesh["dp"].size())
            if local_vocab is not None:
                x, y = x % local_vocab, y % local_vocab
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            ct.train_step(model, opts[k], x, y).item()
            c = time.process_time() - c0
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if step >= 4:  # warmup
                wall[k].append(t.item() * 1000)
                cpu[k].append(c * 1000)
    cpu_median = {k: torch.tensor([statistics.median(v)]) for k, v in cpu.items()}  # per rank
    for v in cpu_median.values():
        dist.all_reduce(v)  # summed over the 4 ranks: printed as their mean
    if dist.get_rank() == 0:
        med = {k: statistics.median(v) for k, v in wall.items()}
        print(f"{cfg.model} {cfg.size}, 4 gloo ranks (2x2), {steps} steps, load {ct.load_avg()}")
        for k in impls:
            print(f"  {k:7s} wall {med[k]:7.1f} ms/step  CPU {cpu_median[k].item() / 4:6.1f} ms/step/rank  "
                  f"{med[k] / med['torch']:.3f} of torch")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("gpt2", "llama"), default="llama")
    p.add_argument("--size", choices=("small", "medium"), default="medium")
    p.add_argument("--steps", type=int, default=20, help="timed steps of the 4-rank mode")
    a = p.parse_args()
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        side_by_side(ct.CONFIGS[(a.model, a.size)], a.steps)
        dist.destroy_process_group()
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    mesh = fsdp2d.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cfg = ct.CONFIGS[(a.model, a.size)]
    variants = {
        "plain (local shapes, no fsdp2d)": lambda: (plain_local(cfg, mesh, tp_only=False), cfg.vocab // 2),
        "fsdp2d tp only": lambda: (plain_local(cfg, mesh, tp_only=True), None),
        "fsdp2d tp + fully_shard": lambda: (ct.build_fsdp2d(cfg, mesh), None),
        "torch tp + fully_shard": lambda: (ct.build_torch(cfg, mesh), None),
    }
    print(f"{a.model} {a.size}, rank 0 of 2x2, fake process group, main-thread CPU ms per step")
    for name, build in variants.items():
        model, local_vocab = build()
        print(f"  {name:34s} {cpu_per_step(model, cfg, local_vocab):7.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
