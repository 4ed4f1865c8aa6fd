"""Where a training step's CPU goes: perf samples of every rank, by category.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 benchmarks/step_profile.py \\
        --impl fsdp2d --model llama --size medium [--fake]

Builds one stack as ``compare_torch.py`` does (the 2x2 gloo mesh, fused AdamW), runs 3
warmup steps, then has Linux ``perf record`` sample each rank's process (all its
threads: gloo's too) for ``--steps`` steps and sorts the samples by what they ran:

* gemm, attention, element-wise and reductions, the fused AdamW kernel: compute;
* copies: ``copy_``/``cat``/``memcpy`` kernels (FSDP's copy-out and gradient packing,
  the shared-memory transport's copy into its ring, DTensor's redistribution copies);
* Python: the interpreter (libpython); torch dispatch and autograd: the rest of
  libtorch, libc10, libtorch_python; libc: malloc and friends; kernel: system calls,
  scheduling, page faults; gloo: gloo's own code (torch's collectives run there).

``--impl plain`` profiles ``cpu_floor.py``'s plain local model instead (rank-local
shapes, no fsdp2d, no communication) in the same 4 processes: the floor of this machine,
with the 4 ranks' contention for the 2 cores included. In ms per step per rank (samples /
frequency / steps / ranks). ``--fake`` runs one
process on torch's ``fake`` backend instead (rank 0 of the same 2x2 layout;
collectives move nothing): what is left is the step without communication, so the
difference from the real run is what communication costs that rank in CPU.

For fsdp2d the script also times, with ``time.thread_time`` (CPU of the calling thread
only: blocking waits cost nothing), every collective it issues and waits for, by
kind: that is the main thread's CPU in communication (sending into the rings, token
traffic, the reduction's adds, the all-gather's copy-out into the parameters).

Needs ``perf`` and ``kernel.perf_event_paranoid`` <= 2 (a process may sample itself).
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_torch as ct  # noqa: E402

import fsdp2d  # noqa: E402
from fsdp2d import _collectives as C  # noqa: E402

CATEGORIES = ("gemm", "attention", "element-wise/reductions", "AdamW kernel", "copies", "Python",
              "torch dispatch/autograd", "libc (malloc)", "kernel", "gloo", "other")


def category(dso: str, sym: str) -> str:
    if "sgemm" in sym or "mkl_" in sym or "dnnl" in sym or "gemm" in sym:
        return "gemm"
    if "flash_attention" in sym:
        return "attention"
    if "adam" in sym.lower():
        return "AdamW kernel"
    if any(s in sym for s in ("direct_copy", "copy_kernel", "memmove", "memcpy", "cat_serial", "chunk_cat")):
        return "copies"
    if "gloo::" in sym:
        return "gloo"
    if any(s in sym for s in ("VectorizedLoop", "Sleef", "reduce", "sum_kernel", "_sum", "softmax", "vectorized")):
        return "element-wise/reductions"
    if "libpython" in dso:
        return "Python"
    if dso.startswith("[kernel"):
        return "kernel"
    if dso.startswith("libc.so") or dso.startswith("libm.so"):
        return "libc (malloc)"
    if any(dso.startswith(d) for d in ("libtorch", "libc10", "libstdc++", "ld-linux")):
        return "torch dispatch/autograd"
    return "other"


def perf_categories(path: str) -> collections.Counter:
    out = subprocess.run(["perf", "report", "-i", path, "--no-children", "--sort", "dso,sym", "--stdio",
                          "-g", "none", "-n"], capture_output=True, text=True, check=True).stdout
    counts: collections.Counter = collections.Counter()
    for line in out.splitlines():
        parts = line.split(None, 3)
        if line.startswith("#") or len(parts) < 4 or not parts[1].isdigit():
            continue
        counts[category(parts[2], parts[3].removeprefix("[.] ").removeprefix("[k] "))] += int(parts[1])
    return counts


class CommClock:
    """Main-thread CPU in fsdp2d's collectives, by kind (outermost call only)."""

    def __init__(self) -> None:
        self.ms: collections.Counter = collections.Counter()
        self.depth = 0

    def wrap(self, owner, name: str, kind) -> None:
        fn = getattr(owner, name)
        clock = self

        def timed(*args, **kwargs):
            if clock.depth:
                return fn(*args, **kwargs)
            label = kind(args) if callable(kind) else kind  # (before the call: wait() clears its state)
            clock.depth += 1
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.depth -= 1
                clock.ms[label] += (time.thread_time() - t0) * 1000

        setattr(owner, name, timed)

    def install(self) -> None:
        def wait_kind(args):  # an Exchange: its kind is in its tag (shared memory) or unknown
            tag = getattr(getattr(args[0], "_pending", None), "tag", None)
            return C.EXCHANGE_KINDS.get(tag >> 24, "?") if tag is not None else "wait (gloo point-to-point)"

        self.wrap(C, "all_reduce", "all_reduce")
        self.wrap(C, "all_gather_into", "all_gather")
        if hasattr(C, "all_gather_rows"):
            self.wrap(C, "all_gather_rows", "all_gather")
        self.wrap(C, "reduce_scatter_into", "reduce_scatter")
        self.wrap(C.Exchange, "wait", wait_kind)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=("fsdp2d", "torch", "plain"), default="fsdp2d")
    p.add_argument("--model", choices=("gpt2", "llama"), default="llama")
    p.add_argument("--size", choices=("small", "medium"), default="medium")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--freq", type=int, default=999, help="perf samples per second")
    p.add_argument("--fake", action="store_true", help="one process, fake backend: no communication")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    else:
        dist.init_process_group("gloo")
    mesh = fsdp2d.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cfg = ct.CONFIGS[(a.model, a.size)]
    local_vocab = None  # plain: cpu_floor's local model (no fsdp2d, no communication)
    if a.impl == "plain":
        from cpu_floor import plain_local
        model, local_vocab = plain_local(cfg, mesh, tp_only=False), cfg.vocab // mesh["tp"].size()
    else:
        model = ct.BUILDERS[a.impl](cfg, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    dp_rank = mesh.get_local_rank("dp")
    clock = CommClock()

    def step(i: int) -> None:
        x, y = ct.batch_for(cfg, i, dp_rank, mesh["dp"].size())
        if local_vocab is not None:  # the hook-less embedding and head hold local rows only
            x, y = x % local_vocab, y % local_vocab
        ct.train_step(model, opt, x, y).item()

    for i in range(3):
        step(i)
    if a.impl == "fsdp2d":
        clock.install()
    rank, world = dist.get_rank(), 1 if a.fake else dist.get_world_size()
    fd, path = tempfile.mkstemp(suffix=".perf")
    os.close(fd)
    perf = subprocess.Popen(["perf", "record", "-F", str(a.freq), "-g", "-p", str(os.getpid()), "-o", path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # perf attaches
    dist.barrier()
    c0, w0 = time.process_time(), time.perf_counter()
    for i in range(a.steps):
        step(3 + i)
    cpu, wall = (time.process_time() - c0) * 1000 / a.steps, (time.perf_counter() - w0) * 1000 / a.steps
    perf.send_signal(signal.SIGINT)
    perf.wait()
    counts = perf_categories(path)
    os.unlink(path)
    mine = {"counts": dict(counts), "cpu": cpu, "wall": wall, "comm": dict(clock.ms)}
    every = [mine] * world
    if not a.fake:
        dist.all_gather_object(every, mine)
    if rank == 0:
        scale = 1000 / a.freq / a.steps / world
        total = collections.Counter()
        comm = collections.Counter()
        for r in every:
            total.update(r["counts"])
            comm.update(r["comm"])
        print(f"{a.impl} {a.model} {a.size}{' (fake backend: no communication)' if a.fake else ''}: "
              f"{a.steps} steps, {world} rank(s), load {os.getloadavg()[0]:.2f}; wall {every[0]['wall']:.1f} ms/step, "
              f"process CPU {sum(r['cpu'] for r in every) / world:.1f} ms/step/rank")
        print("| category | ms/step/rank | share |\n|---|---|---|")
        n = sum(total.values())
        for cat in CATEGORIES:
            if total[cat]:
                print(f"| {cat} | {total[cat] * scale:.1f} | {100 * total[cat] / n:.0f}% |")
        print(f"| **sampled total** | {n * scale:.1f} | |")
        if comm:
            print("\nfsdp2d's collectives, main-thread CPU ms/step/rank (issue + wait + reduction/copy-out):")
            for kind, ms in sorted(comm.items(), key=lambda kv: -kv[1]):
                print(f"  {kind:16s} {ms / a.steps / world:6.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
