"""How fully_shard issues its collectives (issue 20 item 4), checked on CPU ranks where
the CUDA path's reason can be observed without a GPU: gradient packing hands
``torch._chunk_cat`` inputs its one-kernel CUDA path accepts, the next group's
all-gather is issued before the current group's copy-out, and HSDP's replicate
all-reduce is started asynchronously and waited for one group later."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp2d
from fsdp2d.debug import OpCounter
from fsdp2d.fsdp._grads import GradReduction
from fsdp2d.models import Llama, LlamaArgs

from .pool import get_mesh


class _ChunkCatInputs(TorchDispatchMode):
    """Records, for every ``_chunk_cat.out``: whether every input is contiguous, the
    inputs' dtypes and the output's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[bool, set, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._chunk_cat.out:
            inputs, out = args[0], kwargs["out"]
            self.calls.append((all(t.is_contiguous() for t in inputs), {t.dtype for t in inputs}, out.dtype))
        return func(*args, **kwargs)


def _fast_path(call: tuple[bool, set, torch.dtype]) -> bool:
    """The condition of CUDA's one-kernel ``_chunk_cat.out`` (aten/src/ATen/native/cuda/
    TensorShape.cu): contiguous inputs of one dtype, equal to the output's or bf16 into fp32."""
    contiguous, dtypes, out = call
    src = next(iter(dtypes)) if len(dtypes) == 1 else None
    return contiguous and (src == out or (src, out) == (torch.bfloat16, torch.float32))


def job_packing(param_dtype, reduce_dtype, freeze: bool):
    torch.set_num_threads(1)
    mesh = get_mesh((4,), ("dp",))
    torch.manual_seed(0)
    model = Llama(LlamaArgs.debug())
    if freeze:
        model.layers[0].attention_norm.weight.requires_grad_(False)
    mp = fsdp2d.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers:
        fsdp2d.fully_shard(block, mesh=mesh, mp_policy=mp)
    fsdp2d.fully_shard(model, mesh=mesh, mp_policy=mp)
    ops: list[dict] = []
    orig = GradReduction._pack_grads

    def counted(self, grads):
        with OpCounter() as c:
            out = orig(self, grads)
        ops.append(dict(c.ops))
        return out

    x = torch.randint(0, 256, (2, 16))
    GradReduction._pack_grads = counted
    try:
        for _ in range(2):
            ops.clear()
            with _ChunkCatInputs() as seen:
                F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
    finally:
        GradReduction._pack_grads = orig
    return seen.calls, ops


def test_packing_takes_chunk_cats_fast_path(pool):
    """Every pack is one ``_chunk_cat`` whose inputs CUDA copies in one kernel (no stride-0
    flags, no dtype it does not cast), with no per-gradient cast before it: 2 ops per
    group (the output's ``empty`` and the ``_chunk_cat``), bf16 gradients reduced in fp32
    included; a frozen parameter adds its zero gradient."""
    for param_dtype, reduce_dtype in ((None, None), (torch.bfloat16, torch.float32), (torch.bfloat16, None)):
        for freeze in (False, True):
            calls, ops = pool.run(job_packing, param_dtype, reduce_dtype, freeze)[0]
            assert len(calls) == LlamaArgs.debug().n_layers + 1 == len(ops)
            assert all(_fast_path(c) for c in calls), (param_dtype, reduce_dtype, calls)
            assert sum(o.pop("aten.zeros", 0) for o in ops) == int(freeze), ops
            assert all(o == {"aten.empty": 1, "aten._chunk_cat": 1} for o in ops), (param_dtype, reduce_dtype, ops)
