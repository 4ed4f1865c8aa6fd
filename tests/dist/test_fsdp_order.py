"""The order of FSDP's steps in backward, and the profiler ranges that show it (issue 30
items 3 and 7).

Backward prefetch takes its neighbours from the order in which forwards *finished*, as
torch FSDP2 does: the root finishes last, so its pre-backward already all-gathers the
last block, which the old forward-start order never prefetched (its all-gather was
issued by its own pre-backward, when it was needed). Each pre-backward copies its own
group out before it issues the next all-gather, so the next group's gathered buffer is
allocated after this one's is freed. The order is read from fsdp2d's profiler ranges
(``fsdp2d._trace.span``), replaced here by a recorder; the second test runs a step
under ``torch.profiler`` and reads the same ranges from the trace.
"""

import torch
import torch.nn.functional as F

from fsdp2d import _trace

from . import _parity as P

BLOCKS = ("layers.0", "layers.1")  # _parity's Llama: 2 blocks, each its own group, resharded after forward


def _step(model, s):
    x, y = P.batch_for(0, s)
    return F.cross_entropy(model(x[:2]).flatten(0, 1), y[:2].flatten())


def job_backward_order() -> list[tuple[str, str]]:
    torch.set_num_threads(1)
    s = P.Setup(model="llama", mesh=(4,), names=("dp",))
    model = P.build("llama")
    P.parallelize(model, s)
    _step(model, s).backward()  # the first step records the order
    log: list[tuple[str, str]] = []
    real = _trace.span

    def span(kind: str, where: str):
        log.append((kind, where))
        return real(kind, where)

    loss = _step(model, s)
    _trace.span = span
    try:
        loss.backward()
    finally:
        _trace.span = real
    return log


def test_backward_prefetches_the_last_block_and_copies_out_first(pool):
    for log in pool.run(job_backward_order):
        at = {e: i for i, e in reversed(list(enumerate(log)))}  # first occurrence
        for b in BLOCKS:  # each block's all-gather is issued before its backward needs it
            assert at[("all_gather", b)] < at[("pre_backward", b)], log
        # the last block's by the root's pre-backward (the root's group holds the head)
        assert at[("pre_backward", "")] < at[("all_gather", "layers.1")], log
        # copy-out of layers.1 before the all-gather of layers.0 (one gathered block at a time)
        assert at[("all_gather_copy_out", "layers.1")] < at[("all_gather", "layers.0")], log
        assert log.count(("all_gather", "layers.1")) == log.count(("all_gather", "layers.0")) == 1, log


def job_profiler_ranges() -> list[str]:
    torch.set_num_threads(1)
    s = P.Setup(model="llama", mesh=(4,), names=("dp",))
    model = P.build("llama")
    P.parallelize(model, s)
    _step(model, s).backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(model, s).backward()
    return sorted({e.name for e in prof.events() if e.name.startswith("fsdp2d::")})


def test_profiler_ranges_name_each_step_and_module(pool):
    names = pool.run(job_profiler_ranges)[0]
    for b in BLOCKS:  # the blocks: gathered in forward and again in backward, reduced
        for kind in ("all_gather", "all_gather_copy_out", "pre_backward", "post_backward", "pack",
                     "reduce_scatter", "reduce_scatter_wait"):
            assert f"fsdp2d::{kind} ({b})" in names, names
    assert "fsdp2d::all_gather" in names and "fsdp2d::post_backward" in names, names  # the root
