"""Gradient division against torch's own FSDP2 on the same gloo ranks, bit for bit.

torch FSDP2 divides a float16 gradient sum around the collectives
(``_get_gradient_divide_factors``): by a power of two near sqrt(N) before the
reduce-scatter, by the rest after the last collective (HSDP: after the all-reduce), and
with ``set_force_sum_reduction_for_comms`` after the last collective too. fsdp2d follows
the same split (``fsdp2d._division.division``), so the reduced gradients are the same
bits: every case below sums the same operands in the same order on both sides (groups of
2 ranks, or equal values on every rank), and its divisions are the same numbers.

Measured before the fix: ``dp4_fp16_overflow`` gave inf where torch gives 30000 (fsdp2d
summed 4 x 30000 in float16 before dividing); ``hsdp_force_sum_factor3`` differed from
torch in the last bit of some elements (fsdp2d divided by 3 after the reduce-scatter, then
summed over the replicas).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from .pool import get_mesh

CASES = {
    # mesh, axis names, param_dtype, divide factor, force_sum, input: "equal" (30000 on
    # every rank, whose float16 sum over 4 ranks overflows) or "random" (per rank)
    "dp4_fp16_overflow": ((4,), ("dp",), torch.float16, None, False, "equal"),
    "hsdp_fp16": ((2, 2), ("replicate", "shard"), torch.float16, None, False, "random"),
    "hsdp_fp16_factor3": ((2, 2), ("replicate", "shard"), torch.float16, 3.0, False, "random"),
    "hsdp_force_sum_factor3": ((2, 2), ("replicate", "shard"), None, 3.0, True, "random"),
}


def _grads(impl: str, case: str) -> torch.Tensor:
    """This rank's reduced gradient shard of a bias-free Linear(16, 8) after one backward."""
    shape, names, param_dtype, factor, force_sum, inp = CASES[case]
    mesh = get_mesh(shape, names)
    if impl == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from fsdp2d import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    lin = nn.Linear(16, 8, bias=False)
    if inp == "equal":
        with torch.no_grad():
            lin.weight.fill_(1.0)
        x = torch.full((1, 16), 30000.0)  # d(sum)/dW = x: 30000 in every element, every rank
    else:
        g = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
        x = torch.randn(3, 16, generator=g)
    fully_shard(lin, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
    if factor is not None:
        lin.set_gradient_divide_factor(factor)
    lin.set_force_sum_reduction_for_comms(force_sum)
    lin(x).sum().backward()
    return lin.weight.grad.to_local().clone()


def job_division(case: str) -> dict:
    torch.set_num_threads(1)
    mine, theirs = _grads("fsdp2d", case), _grads("torch", case)
    return {"equal": torch.equal(mine, theirs), "finite": bool(mine.isfinite().all()),
            "torch_finite": bool(theirs.isfinite().all()), "max_diff": (mine - theirs).abs().max().item()}


@pytest.mark.parametrize("case", list(CASES))
def test_gradient_division_equals_torch_fsdp2_bitwise(pool, case):
    for rank, r in enumerate(pool.run(job_division, case)):
        assert r["torch_finite"], r  # the case is one torch computes
        assert r["finite"] and r["equal"], (rank, r)
