"""What letting torch's ``CommDebugMode`` see fsdp2d's collectives costs the hot path.

    torchrun --nproc_per_node 2 benchmarks/collective_watch.py [--iters 2000]

fsdp2d's collectives (``fsdp2d._collectives``) ask ``watched()`` before each call: one C
call (``torch._C._len_torch_dispatch_stack``) when no dispatch mode is active. This prints
that check's cost per call and, for scale, the smallest TP collective it guards (a
2-rank all-reduce of one float, the pairwise exchange), both as medians of 5 timed loops.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from fsdp2d import _collectives as C
from fsdp2d._funcol import watched


def _per_call(fn, iters: int) -> float:
    """Median seconds per call of ``fn`` over 5 loops of ``iters`` calls."""
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t) / iters)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    x = torch.ones(1)
    C.all_reduce(x, group)  # the group's first exchange sets up its links
    check = _per_call(watched, args.iters * 50)
    reduce = _per_call(lambda: C.all_reduce(x, group, inplace=False), args.iters)
    if dist.get_rank() == 0:
        print(f"watched() check: {check * 1e9:.0f} ns/call; all_reduce of 1 float over "
              f"{dist.get_world_size()} ranks: {reduce * 1e6:.1f} us/call; check / collective = "
              f"{check / reduce:.2%}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
