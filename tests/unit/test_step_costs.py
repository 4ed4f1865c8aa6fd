"""What a training step launches and waits for (issue 30 items 4 and 7), checked on CPU:
the gradient clip's dispatched ops do not grow with the number of parameters, the
gradient average is done inside the collective where the backend can, batches reach a
GPU through pinned memory without a host sync, AdamW takes its fused form, and the
metrics carry the CUDA allocator's figures (CUDA calls are stood in for here)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp2d
from fsdp2d import _division as D
from fsdp2d.debug import OpCounter
from fsdp2d.train import metrics
from fsdp2d.train.optim import adamw_kind
from fsdp2d.train.trainer import to_device


def _params(n: int, seed: int, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> list[nn.Parameter]:
    """``n`` parameters with gradients, one of them empty (a rank's empty shard), their
    dtypes taken in turn from ``dtypes``."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 3)] * (n - 1) + [(0, 3)]
    params = [nn.Parameter(torch.randn(s, generator=g).to(dtypes[i % len(dtypes)])) for i, s in enumerate(shapes)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_ops_do_not_grow_with_the_number_of_parameters(norm_type):
    """A foreach norm and a foreach scale: the same ops for 39 and 390 gradients (before:
    ~8 fp64 kernels per gradient, 321 ops for 39), and torch's result."""
    counts = []
    for n in (39, 390):
        params, ref = _params(n, n), _params(n, n)
        with OpCounter() as ops:
            total = fsdp2d.clip_grad_norm_(params, 0.5, norm_type)
        counts.append(sum(ops.ops.values()))
        # (torch's own refuses an empty gradient with the inf norm: the reference skips it)
        want = torch.nn.utils.clip_grad_norm_(ref[:-1], 0.5, norm_type)
        # fp32 norms of the same gradients in another summation order: ~1e-7 relative
        assert torch.allclose(total, want, rtol=1e-6), (total, want)
        for p, q in zip(params, ref):
            assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    assert counts[0] == counts[1] <= 20, counts


# (dtypes of the gradients, relative tolerance against torch's result). float64: both sum
# float64 norms in another order, ~1e-16. bf16 and fp32 mixed: torch takes each bf16
# gradient's norm in bf16 (relative rounding 2^-9 each), fsdp2d in float32, so the totals
# agree to ~2^-9 (the float64 reference below is tight) and a clipped bf16 gradient may
# round to the neighbouring bf16 value: one ulp, 2^-7 relative at most.
DTYPE_CASES = {"float64": ((torch.float64,), 1e-12), "bf16_fp32": ((torch.bfloat16, torch.float32), 2.0**-7)}


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("case", list(DTYPE_CASES))
def test_clip_follows_torch_for_float64_and_mixed_gradients(norm_type, case):
    """Norms in each gradient's dtype or wider (float64 was refused: "the dtype of the
    input (Double) should be convertible without narrowing"), a total in torch's dtype
    (its gradients' promoted dtype), the same ops for 39 and 390 gradients."""
    dtypes, rtol = DTYPE_CASES[case]
    counts = []
    for n in (39, 390):
        params, ref = _params(n, n, dtypes), _params(n, n, dtypes)
        exact = [p.grad.double().clone() for p in ref[:-1]]
        with OpCounter() as ops:
            total = fsdp2d.clip_grad_norm_(params, 0.5, norm_type)
        counts.append(sum(ops.ops.values()))
        want = torch.nn.utils.clip_grad_norm_(ref[:-1], 0.5, norm_type)
        assert total.dtype == want.dtype == dtypes[-1], (total.dtype, want.dtype)
        assert torch.allclose(total, want, rtol=rtol), (total, want)
        # against float64 arithmetic on the same gradients: only the total's own rounding
        assert torch.allclose(total.double(), torch.nn.utils.get_total_norm(exact, norm_type),
                              rtol=1e-12 if case == "float64" else 1e-6)
        for p, q in zip(params, ref):
            assert torch.allclose(p.grad.double(), q.grad.double(), rtol=rtol, atol=1e-12), p.dtype
    assert counts[0] == counts[1] <= 30, counts  # (a norm and a scale per dtype)


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("backend,dtype,divide,force,want", [
    ("nccl", torch.float32, 8.0, False, (1.0, "AVG", 1.0)),          # the group's size: NCCL averages
    ("nccl", torch.bfloat16, 32.0, False, (1.0, "PREMUL_SUM", 1.0)),  # HSDP's dp size or a custom factor
    ("fake", torch.float32, 8.0, False, (1.0, "AVG", 1.0)),           # `fsdp2d plan` simulates NCCL
    ("nccl", torch.float32, 1.0, False, (1.0, "SUM", 1.0)),           # factor 1 sums: no division at all
    ("nccl", torch.float16, 8.0, False, (4.0, "SUM", 2.0)),           # fp16's range: ~sqrt(8) before, the rest after
    ("gloo", torch.float16, 2.0, False, (2.0, "SUM", 1.0)),           # (torch's loop: 2 ranks, all before)
    ("nccl", torch.float16, 6.0, True, (4.0, "SUM", 1.5)),            # force_sum changes nothing for fp16
    ("nccl", torch.float64, 16.0, False, (4.0, "SUM", 4.0)),          # torch splits float64 too
    ("nccl", torch.float32, 8.0, True, (1.0, "SUM", 8.0)),            # set_force_sum_reduction_for_comms
    ("gloo", torch.float32, 8.0, False, (1.0, "SUM", 8.0)),           # gloo has no AVG for every collective
])
def test_gradient_average_is_inside_the_collective_where_the_backend_has_it(monkeypatch, backend, dtype, divide,
                                                                            force, want):
    """(divide before, the collective's op, divide after) for one collective, as torch
    FSDP2's ``_get_gradient_divide_factors`` splits it."""
    group = _Group(8)
    monkeypatch.setattr(D, "_backend", lambda g: backend)
    d = D.division(divide, dtype, force)
    op, after = D.reduce_op(group, d.within, torch.zeros(1, dtype=dtype))
    name = "PREMUL_SUM" if not isinstance(op, dist.ReduceOp.RedOpType) else op.name
    assert (d.pre, name, after * d.post) == want


@pytest.mark.parametrize("dtype,force", [(torch.float16, False), (torch.float16, True), (torch.float64, False),
                                         (torch.float32, True), (torch.bfloat16, True)])
def test_division_splits_as_torch_fsdp2(dtype, force):
    """Divided around the collectives: the same (pre, post) as torch's own rule for every
    factor up to 64 (the numbers, not just the idea: results then equal torch's bitwise)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    for factor in range(2, 65):
        pre, post, _, _ = _get_gradient_divide_factors(_Group(factor), None, dtype, "cuda", float(factor), force)
        d = D.division(float(factor), dtype, force)
        assert (d.pre, d.within, d.post) == (pre or 1.0, 1.0, post), (factor, d, pre, post)


def test_batches_reach_the_gpu_through_pinned_memory(monkeypatch):
    """A copy from pageable memory waits for the GPU; from pinned memory with
    ``non_blocking`` it does not."""
    calls = []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a: calls.append("pin_memory") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append(("to", a, k)) or self)
    x = torch.zeros(2, 3, dtype=torch.long)
    to_device(x, torch.device("cuda", 0))
    assert calls == ["pin_memory", ("to", (torch.device("cuda", 0),), {"non_blocking": True})]
    calls.clear()
    assert to_device(x, torch.device("cpu")) is x and not calls


def test_adamw_is_fused_where_torch_has_the_kernel():
    assert adamw_kind("cpu") == adamw_kind("cuda") == "fused"  # torch 2.13 has both


def test_metrics_carry_the_cuda_allocators_figures(monkeypatch):
    assert metrics.allocator_metrics("cpu") == {}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"num_alloc_retries": 3})
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 5 * 2**20)
    assert metrics.allocator_metrics("cuda") == {"max_mem_reserved_mib": 5.0, "num_alloc_retries": 3}
