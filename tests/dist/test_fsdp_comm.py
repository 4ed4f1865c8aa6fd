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


def _labelled_model(mesh, n_layers: int):
    """A Llama with ``fully_shard`` per block and root on ``mesh``, and each group's name
    by id ("root", "layers.0", ...)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Llama(LlamaArgs(**{**vars(LlamaArgs.debug()), "n_layers": n_layers}))
    for block in model.layers:
        fsdp2d.fully_shard(block, mesh=mesh)
    fsdp2d.fully_shard(model, mesh=mesh)
    label = {id(m._fsdp2d_fsdp.group): name or "root" for name, m in model.named_modules()
             if getattr(m, "_fsdp2d_fsdp", None) is not None}
    return model, label


def job_gather_order(n_layers: int):
    """(forward events, backward events) of the second step: ("issue", group) when an
    all-gather is issued, ("copy_out", group) when a gathered buffer is copied out."""
    from fsdp2d.fsdp._group import FSDPParamGroup

    model, label = _labelled_model(get_mesh((4,), ("dp",)), n_layers)
    events: list[tuple[str, str]] = []
    unshard, wait = FSDPParamGroup.unshard, FSDPParamGroup.wait_unshard

    def unshard_logged(self, async_op=False):
        before = self.counts["all_gather"]
        unshard(self, async_op)
        if self.counts["all_gather"] > before:
            events.append(("issue", label[id(self)]))

    def wait_logged(self):
        if self._gather is not None:
            events.append(("copy_out", label[id(self)]))
        wait(self)

    x = torch.randint(0, 256, (2, 16))
    FSDPParamGroup.unshard, FSDPParamGroup.wait_unshard = unshard_logged, wait_logged
    try:
        for _ in range(2):  # the first forward records the order; the second prefetches
            events.clear()
            loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
            forward = list(events)
            events.clear()
            loss.backward()
    finally:
        FSDPParamGroup.unshard, FSDPParamGroup.wait_unshard = unshard, wait
    return forward, list(events)


def test_next_all_gather_is_issued_before_the_copy_out(pool):
    """Forward: each group's copy-out comes after the next group's all-gather was issued
    (on CUDA the copy-out would otherwise sit in front of the next gather on the stream
    NCCL waits for). Backward (blocks resharded after forward, the root kept): the last
    block's all-gather is issued by the root's pre-backward (issue 30 item 3), and each
    block is copied out before the next all-gather is issued (one gathered buffer at a
    time: its own gather was issued a whole block's backward earlier)."""
    forward, backward = pool.run(job_gather_order, 3)[0]
    blocks = [f"layers.{i}" for i in range(3)]
    expected_fwd = [("issue", "root"), ("issue", blocks[0]), ("copy_out", "root")]
    for here, nxt in zip(blocks, blocks[1:]):
        expected_fwd += [("issue", nxt), ("copy_out", here)]
    expected_fwd.append(("copy_out", blocks[-1]))
    assert forward == expected_fwd
    last, *rest = blocks[::-1]
    expected_bwd = [("issue", last)]
    for here, nxt in zip(blocks[::-1], rest):
        expected_bwd += [("copy_out", here), ("issue", nxt)]
    expected_bwd.append(("copy_out", blocks[0]))
    assert backward == expected_bwd


def job_hsdp_reduce_order(mesh_shape: tuple[int, int]):
    """The backward's reduction events: ("rs", group) a reduce-scatter issued, ("ar", group)
    the replicate all-reduce started, ("finish", group) its result waited for and assigned."""
    model, label = _labelled_model(get_mesh(mesh_shape, ("replicate", "shard")), LlamaArgs.debug().n_layers)
    events: list[tuple[str, str]] = []
    reduce, start, finish = GradReduction.reduce_grads, GradReduction._start_all_reduce, GradReduction.finish_reduce

    def reduce_logged(self):
        reduce(self)
        if self._reduce is not None:
            events.append(("rs", label[id(self)]))

    def start_logged(self):
        events.append(("ar", label[id(self)]))
        start(self)

    def finish_logged(self, assign=True):
        if self._reduce is not None:
            events.append(("finish", label[id(self)]))
        finish(self, assign)

    x = torch.randint(0, 256, (2, 16))
    GradReduction.reduce_grads, GradReduction._start_all_reduce = reduce_logged, start_logged
    GradReduction.finish_reduce = finish_logged
    try:
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    finally:
        GradReduction.reduce_grads, GradReduction._start_all_reduce = reduce, start
        GradReduction.finish_reduce = finish
    return events


def test_hsdp_all_reduce_is_waited_for_one_group_later(pool):
    """HSDP: a group's replicate all-reduce starts once its reduce-scatter is done (at the
    next group's post-backward) and is waited for one group later still, so the next
    group's backward runs while it is in flight; the end of backward starts every pending
    one before waiting for any. (Replicate axis of 2 ranks: the pairwise exchange; of 4
    ranks with a shard axis of 1: gloo's asynchronous all-reduce.)"""
    expected = [("rs", "layers.1"), ("ar", "layers.1"), ("rs", "layers.0"),
                ("finish", "layers.1"), ("ar", "layers.0"), ("rs", "root"),
                ("ar", "root"), ("finish", "layers.0"), ("finish", "root")]  # root's starts before layers.0 is waited
    for shape in ((2, 2), (4, 1)):
        assert pool.run(job_hsdp_reduce_order, shape)[0] == expected, shape
