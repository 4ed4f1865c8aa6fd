"""Gradient division happens exactly once, end to end, on the path NCCL takes (division
inside the collective: ``AVG``, ``PREMUL_SUM``; float16 around it), without a GPU.

One process is rank 0 of 8 under the emulated NCCL group (:mod:`fsdp2d.testing.emulated_pg`),
whose collectives return what real ones give when every rank holds this rank's input
(SUM = 8 x it over 8 ranks, AVG = it, PREMUL_SUM(f) = 8 f x it). The reference's rows
repeat with period ``rows / 8``, so every rank's shard is the same block and the gathered
weights equal the reference's: the averaged gradient must then equal one process's
gradient (x N / f with a custom divide factor f). A division done twice or skipped is off
by a factor of 8 (or 2, 4). Every factor here is a power of two, so the comparison is exact.

Cases: meshes (8,), (2, 4) (HSDP: reduce-scatter over 4, all-reduce over 2) and (8, 1)
(HSDP with one shard: the all-reduce divides alone); a custom factor; force_sum; bf16;
bf16 reduced in fp32; fp16 (divided before and after: torch FSDP2's split); accumulation
with the sync on the last micro-batch or on every one.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp2d
from fsdp2d.placement import chunk_range
from fsdp2d.testing import emulated_pg as E

N = 8


@pytest.fixture(scope="module")
def emulated_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    E.register()
    dist.init_process_group(E.BACKEND, store=FakeStore(), rank=0, world_size=N)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


CASES = {
    "dp8": ((8,), {}),
    "hsdp_2x4": ((2, 4), {}),
    "hsdp_2x4_factor2": ((2, 4), dict(factor=2.0)),
    "dp8_factor2": ((8,), dict(factor=2.0)),
    "hsdp_2x4_force_sum": ((2, 4), dict(force=True)),
    "hsdp_8x1": ((8, 1), {}),
    "hsdp_2x4_bf16": ((2, 4), dict(dtype=torch.bfloat16)),
    "hsdp_2x4_bf16_fp32_reduce": ((2, 4), dict(dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    "hsdp_2x4_accum_last": ((2, 4), dict(accum=3, sync="last")),
    "hsdp_2x4_accum_every": ((2, 4), dict(accum=3, sync="every")),
    "dp8_fp16": ((8,), dict(dtype=torch.float16)),
    "hsdp_2x4_fp16_factor4_force_sum": ((2, 4), dict(dtype=torch.float16, factor=4.0, force=True)),
}


def _worst_error(shape, dtype=torch.float32, factor=None, force=False, reduce_dtype=None, accum=1, sync="last"):
    torch.manual_seed(0)
    ref = _MLP().to(dtype)
    with torch.no_grad():  # rows periodic with period R/8: every rank's shard is the same block
        for q in ref.parameters():
            q.copy_(q[:q.shape[0] // N].repeat(N, *([1] * (q.ndim - 1))))
    model = copy.deepcopy(ref)
    names = ("dp_replicate", "dp_shard") if len(shape) == 2 else ("dp",)
    mesh = fsdp2d.init_device_mesh("cpu", shape, mesh_dim_names=names)
    mp = fsdp2d.MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for m in (model.a, model.b, model):
        fsdp2d.fully_shard(m, mesh=mesh, mp_policy=mp)
        if factor:
            m.set_gradient_divide_factor(factor)
        m.set_force_sum_reduction_for_comms(force)
    x = torch.randn(4, 16).to(dtype)
    for i in range(accum):
        model.set_requires_gradient_sync(sync == "every" or i == accum - 1)
        model(x).sum().backward()
        ref(x).sum().backward()
    k, worst = shape[-1], 0.0
    for p, q in zip(model.parameters(), ref.parameters()):
        start, n = chunk_range(q.shape[0], k, 0)
        want = q.grad[start:start + n].float() * N / (factor or N)
        worst = max(worst, ((p.grad.to_local().float() - want).norm() / want.norm()).item())
    return worst


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_are_divided_exactly_once(emulated_world, case):
    shape, kwargs = CASES[case]
    assert _worst_error(shape, **kwargs) == 0.0
