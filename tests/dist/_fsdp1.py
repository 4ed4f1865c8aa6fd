"""Worker side of the FSDP1 parity tests: one training script, two implementations.

:func:`train` is a script written for torch's FSDP1 (``FullyShardedDataParallel`` with
``transformer_auto_wrap_policy``, optionally over a TP model): the only thing ``impl``
changes is where its names are imported from (:func:`imports`): torch's
``torch.distributed.fsdp`` / ``.wrap`` / ``device_mesh`` / ``tensor.parallel``, or
``fsdp2d.fsdp1`` / ``fsdp2d.wrap`` / ``fsdp2d``. Every rank builds the same model from
the same seed and trains 10 AdamW steps on its data-parallel slice of the same global
batch; the job returns the global losses, full (gathered) gradients at the first and
last step and the final full parameters, which the test compares across the two
implementations. :func:`reference` trains the plain model on the whole global batch.

The instrumentation that reads results back (:func:`full_grads`, :func:`full_params`)
uses FSDP1's public API on both sides (``summon_full_params``); only torch's gradients
under ``use_orig_params=False`` need its internals (FlatParameter metadata), since
torch rejects ``summon_full_params(with_grads=True)`` there. Collectives are counted
at c10d (:func:`_counter`), whichever library issued them.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .pool import get_mesh

VOCAB, SEQ, BATCH, LR = 96, 8, 8, 1e-2
# See _parity.EPS: eps=1e-6 keeps Adam from amplifying rounding in near-zero gradients.
EPS = 1e-6
HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
GRAD_STEPS = (0, 9)  # steps whose gradients are snapshotted (first, last)
COUNT_STEP = 1  # the step whose collectives are counted (step 0 may record orders)


@dataclass(frozen=True)
class Setup:
    model: str = "llama"               # "llama" or "gpt2"
    strategy: str = "FULL_SHARD"       # a ShardingStrategy member name
    mp: str = ""                       # "bf16": bf16 params, fp32 reduce; "bf16-reduce": fp32 params, bf16 reduce
    microbatches: int = 1              # >1: gradient accumulation under no_sync()
    use_orig_params: bool = True
    tp: bool = False                   # TP on a 2x2 (dp, tp) mesh, FSDP1 over dp
    steps: int = 10


def imports(impl: str) -> SimpleNamespace:
    """The names the script uses, from torch (``impl="torch"``) or fsdp2d."""
    if impl == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (FullyShardedDataParallel, MixedPrecision,
                                            ShardingStrategy)
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
    elif impl == "fsdp2d":
        from fsdp2d import (ColwiseParallel, Replicate, RowwiseParallel, init_device_mesh,
                            parallelize_module)
        from fsdp2d.fsdp1 import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
        from fsdp2d.wrap import transformer_auto_wrap_policy
    else:
        raise ValueError(f"impl must be 'torch' or 'fsdp2d', not {impl!r}")
    return SimpleNamespace(**{k: v for k, v in locals().items() if k != "impl"})


_TORCH_MESHES: dict = {}


def mesh_for(api: SimpleNamespace, impl: str, shape: tuple, names: tuple):
    """``api.init_device_mesh("cpu", shape, mesh_dim_names=names)``, once per worker
    (gloo groups are expensive and leak sockets when created per test)."""
    if impl == "fsdp2d":
        return get_mesh(shape, names)  # the pool's cache of fsdp2d.init_device_mesh
    key = (shape, names)
    if key not in _TORCH_MESHES:
        _TORCH_MESHES[key] = api.init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _TORCH_MESHES[key]


def build(kind: str) -> tuple[torch.nn.Module, type]:
    """The tiny model (same weights on every rank) and its transformer block class."""
    from fsdp2d.models import GPT2, GPT2Args, Llama, LlamaArgs
    from fsdp2d.models.gpt2 import Block
    from fsdp2d.models.llama import TransformerBlock

    torch.manual_seed(1234)
    if kind == "llama":  # ffn hidden 40, vocab 96: uneven over 4 ranks on purpose
        return Llama(LlamaArgs(dim=32, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=VOCAB,
                               multiple_of=8, max_seq_len=SEQ)), TransformerBlock
    return GPT2(GPT2Args(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=SEQ)), Block


def tp_plan(kind: str, api: SimpleNamespace) -> dict:
    """Megatron-style TP plan (replicated residual stream and logits) from ``api``'s styles."""
    col, row, rep = api.ColwiseParallel, api.RowwiseParallel, api.Replicate
    if kind == "llama":
        emb, head, prefix = "tok_embeddings", "output", "layers.*."
        cols = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
        rows = ("attention.wo", "feed_forward.w2")
    else:
        emb, head, prefix = "wte", "lm_head", "h.*."
        cols, rows = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.c_fc"), ("attn.c_proj", "mlp.c_proj")
    plan = {emb: row(input_layouts=rep(), output_layouts=rep()), head: col(output_layouts=rep())}
    plan.update({prefix + n: col() for n in cols})
    plan.update({prefix + n: row() for n in rows})
    return plan


def batch_for(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch ``(BATCH, SEQ)`` inputs and targets."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _full(t: torch.Tensor, shape: torch.Size, tp_group) -> torch.Tensor:
    """A summoned parameter or gradient as its global tensor of ``shape``: torch gives
    TP-sharded ones as DTensors over the TP mesh, fsdp2d as TP-local plain tensors
    (gathered here over ``tp_group`` along the dim that differs)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    elif t.shape != shape:
        dim = next(d for d, (a, b) in enumerate(zip(t.shape, shape)) if a != b)
        pieces = [torch.empty_like(t) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(pieces, t.contiguous(), group=tp_group)
        t = torch.cat(pieces, dim)
    assert t.shape == shape, f"summoned shape {tuple(t.shape)}, global {tuple(shape)}"
    return t.detach().float().clone()


def full_params(api: SimpleNamespace, model, ctx: SimpleNamespace) -> tuple[dict, dict]:
    """Every parameter, unsharded, by its original name; and what ``summon_full_params``
    showed of each: (is a DTensor, shape)."""
    with api.FullyShardedDataParallel.summon_full_params(model):
        named = [(_clean(n), p) for n, p in model.named_parameters()]
        seen = {n: (type(p).__name__ == "DTensor", tuple(p.shape)) for n, p in named}
        return {n: _full(p, ctx.shapes[n], ctx.tp_group) for n, p in named}, seen


def full_grads(api: SimpleNamespace, impl: str, model, s: Setup, ctx: SimpleNamespace) -> dict:
    """Every gradient, unsharded, by its original parameter's name. torch rejects
    ``summon_full_params(with_grads=True)`` under ``use_orig_params=False``; fsdp2d
    accepts it (it splits the flat gradient at the parameters' offsets)."""
    if impl == "torch" and not s.use_orig_params:
        return _flat_grads_torch(api, model)
    with api.FullyShardedDataParallel.summon_full_params(model, with_grads=True):
        return {_clean(n): _full(p.grad, ctx.shapes[_clean(n)], ctx.tp_group)
                for n, p in model.named_parameters()}


def _flat_grads_torch(api: SimpleNamespace, model) -> dict[str, torch.Tensor]:
    """torch FSDP1 ``use_orig_params=False``: all-gather each FlatParameter's gradient
    shard over its sharding group and split it at the original parameters' boundaries."""
    out = {}
    for unit in api.FullyShardedDataParallel.fsdp_modules(model):
        handle = unit._handle
        if handle is None:
            continue
        flat = handle.flat_param
        shard = flat.grad if flat.grad is not None else torch.zeros_like(flat)
        group = unit.process_group
        if handle.uses_sharded_strategy:
            pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
            dist.all_gather(pieces, shard.contiguous(), group=group)
            shard = torch.cat(pieces)
        prefix = _prefix_of(model, unit)
        offset = 0
        for fqn, shape, numel, is_pad in _views(flat):
            if not is_pad:
                out[prefix + fqn] = shard[offset:offset + numel].view(shape).float().clone()
            offset += numel
    return out


def _views(flat):
    """(fqn, shape, numel, is_padding) of each segment of a torch FlatParameter."""
    fqns, shapes = iter(flat._fqns), iter(flat._shapes)
    for numel, is_pad in zip(flat._numels_with_padding, flat._is_padding_mask):
        if is_pad:
            yield None, None, numel, True
        else:
            yield next(fqns), next(shapes), numel, False


def _prefix_of(model, unit) -> str:
    for name, m in model.named_modules():
        if m is unit:
            name = _clean(name)
            return name + "." if name else ""
    raise KeyError("FSDP unit not found in the model")


def wrap(api: SimpleNamespace, impl: str, s: Setup):
    """The script's setup: build, (TP,) FSDP1 with ``transformer_auto_wrap_policy``.
    Returns the model, this rank's (data slice index, slice count) and the read-back
    context (global shapes, TP group)."""
    model, block_cls = build(s.model)
    ctx = SimpleNamespace(shapes={n: p.shape for n, p in model.named_parameters()}, tp_group=None)
    device_mesh, dp_rank, dp_size = None, dist.get_rank(), dist.get_world_size()
    if s.tp:
        mesh = mesh_for(api, impl, (2, 2), ("dp", "tp"))
        api.parallelize_module(model, mesh["tp"], tp_plan(s.model, api))
        device_mesh, ctx.tp_group = mesh["dp"], mesh["tp"].get_group()
        dp_rank, dp_size = device_mesh.get_local_rank(), device_mesh.size()
    elif s.strategy in HYBRID:  # replicate across the 2 groups, shard within each
        device_mesh = mesh_for(api, impl, (2, 2), ("replicate", "shard"))
    mp = {"": None, "bf16": dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
          "bf16-reduce": dict(reduce_dtype=torch.bfloat16)}[s.mp]
    mp = None if mp is None else api.MixedPrecision(**mp)
    model = api.FullyShardedDataParallel(
        model, sharding_strategy=getattr(api.ShardingStrategy, s.strategy),
        auto_wrap_policy=functools.partial(api.transformer_auto_wrap_policy, transformer_layer_cls={block_cls}),
        mixed_precision=mp, use_orig_params=s.use_orig_params, device_id=torch.device("cpu"),
        device_mesh=device_mesh)
    return model, (dp_rank, dp_size), ctx


def train(impl: str, s: Setup) -> dict:
    """The FSDP1 script: :func:`wrap`, then 10 AdamW steps (``no_sync`` on all but the
    last microbatch). Returns the global losses, gradients at ``GRAD_STEPS``, final
    parameters, what ``summon_full_params`` showed and the collectives of ``COUNT_STEP``."""
    torch.set_num_threads(1)
    api = imports(impl)
    model, (dp_rank, dp_size), ctx = wrap(api, impl, s)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=EPS, foreach=False)
    losses, grads, counts = [], {}, {}
    for step in range(s.steps):
        x, y = batch_for(step)
        x, y = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
        total = torch.zeros(())
        for m, (xm, ym) in enumerate(zip(x.chunk(s.microbatches), y.chunk(s.microbatches))):
            sync = m == s.microbatches - 1
            with model.no_sync() if not sync else contextlib.nullcontext():
                with _counting(counts, step, "forward" if sync else "no_sync forward"):
                    loss = F.cross_entropy(model(xm).flatten(0, 1).float(), ym.flatten()) / s.microbatches
                with _counting(counts, step, "backward" if sync else "no_sync backward"):
                    loss.backward()
            total += loss.detach()
        losses.append(total)
        if step in GRAD_STEPS:
            grads[step] = full_grads(api, impl, model, s, ctx)
        opt.step()
        opt.zero_grad()
    losses = torch.stack(losses)
    dist.all_reduce(losses)  # mean over dp slices (TP ranks of a slice count it equally)
    params, summoned = full_params(api, model, ctx)
    return {"losses": (losses / dist.get_world_size()).tolist(), "grads": grads, "params": params,
            "summoned": summoned, "collectives": counts}


# torch's DTensor TP redistributes with functional collectives (namespace
# ``_c10d_functional``), which fsdp2d's CollectiveCounter (``c10d`` ops) does not count.
_FUNCTIONAL = {"all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
               "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
               "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
               "all_to_all_single": "all_to_all", "broadcast": "broadcast"}


def _counter():
    """fsdp2d's CollectiveCounter (c10d ops of any library, gloo exchanges counted as
    the collective they implement), plus torch's functional collectives."""
    from fsdp2d.debug import CollectiveCounter

    class Counter(CollectiveCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kind = _FUNCTIONAL.get(func._schema.name.split("::")[-1])
            if func.namespace == "_c10d_functional" and kind is not None:
                self._add(None, kind, 0)
            return super().__torch_dispatch__(func, types, args, kwargs)

    return Counter()


@contextlib.contextmanager
def _counting(counts: dict, step: int, phase: str):
    """On step ``COUNT_STEP``: ``counts[(phase, kind)]`` += the collectives issued (over
    all groups)."""
    if step != COUNT_STEP:
        yield
        return
    with _counter() as counter:
        yield
    for (_, kind), (n, _) in counter.counts.items():
        counts[(phase, kind)] = counts.get((phase, kind), 0) + n


def run_both(setups: list[Setup], impls=("torch", "fsdp2d")) -> dict:
    """Pool job: every setup under every impl, results keyed ``(setup, impl)``.

    Exceptions propagate (the pool names the rank and kills the job): a rank that
    swallowed one would leave its peers blocked in a collective."""
    return {(s, impl): train(impl, s) for s in setups for impl in impls}


def reference(kind: str, steps: int = 10) -> dict:
    """The plain model trained on the whole global batch (single process semantics)."""
    torch.set_num_threads(1)
    model, _ = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=EPS, foreach=False)
    losses = []
    for step in range(steps):
        x, y = batch_for(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def torch_hybrid_without_mesh() -> tuple:
    """What torch's FSDP1 does on CPU with HYBRID_SHARD and neither ``device_mesh`` nor
    ``process_group``: (the error of manual wrapping, the shard-group sizes of an
    auto-wrapped model, the warnings it gave)."""
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    model, block_cls = build("llama")
    try:
        FSDP(model, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=torch.device("cpu"))
        error = None
    except ValueError as e:
        error = str(e)
    model, block_cls = build("llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = FSDP(model, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=torch.device("cpu"),
                     auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                        transformer_layer_cls={block_cls}))
    sizes = [dist.get_world_size(u.process_group) for u in FSDP.fsdp_modules(model)]
    return error, sizes, [str(w.message) for w in caught]


ACC_POLICIES = {  # (param_dtype, reduce_dtype) of MixedPrecision / MixedPrecisionPolicy
    "none": (None, None), "bf16": (torch.bfloat16, None), "bf16-fp32_reduce": (torch.bfloat16, torch.float32),
    "bf16_reduce": (None, torch.bfloat16),
}


def accumulator_dtypes() -> dict:
    """Pool job: the dtype the unsharded gradients of a no-sync backward are kept in, per
    MixedPrecision setting, for torch's FSDP1 (``FlatParameter.grad`` under ``no_sync``),
    torch's FSDP2 (``FSDPParam.unsharded_accumulated_grad``, else the unsharded
    parameter's ``.grad``, after ``set_requires_gradient_sync(False)``), fsdp2d's FSDP1
    front end and fsdp2d's ``fully_shard`` (their groups' no-sync accumulators)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP1
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fsdp2d
    from fsdp2d.fsdp1 import FullyShardedDataParallel as FSDP1

    torch.set_num_threads(1)
    mesh = get_mesh((dist.get_world_size(),), ("dp",))
    x = torch.randn(4, 8)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))

    def backward(m):
        m(x).float().square().sum().backward()

    def fsdp2d_acc(m):
        return {p.acc_grad.dtype for s in [m._fsdp2d_fsdp] for p in s.group.params}

    out = {}
    for name, (param, reduce) in ACC_POLICIES.items():
        mp = MixedPrecision(param_dtype=param, reduce_dtype=reduce)
        row = {}
        m = TorchFSDP1(model(), mixed_precision=mp, use_orig_params=False, device_id=torch.device("cpu"))
        with m.no_sync():
            backward(m)
        row["torch FSDP1"] = {m._handle.flat_param.grad.dtype}
        m = FSDP1(model(), mixed_precision=mp, use_orig_params=False, device_id=torch.device("cpu"))
        with m.no_sync():
            backward(m)
        row["fsdp2d FSDP1"] = fsdp2d_acc(m)
        m = torch_fully_shard(model(), mesh=mesh, mp_policy=TorchPolicy(param_dtype=param, reduce_dtype=reduce))
        m.set_requires_gradient_sync(False)
        backward(m)
        row["torch FSDP2"] = {(p.unsharded_accumulated_grad if p.unsharded_accumulated_grad is not None
                               else p._unsharded_param.grad).dtype
                              for p in m._get_fsdp_state()._fsdp_param_group.fsdp_params}
        m = fsdp2d.fully_shard(model(), mesh=mesh, mp_policy=fsdp2d.MixedPrecisionPolicy(param_dtype=param,
                                                                                           reduce_dtype=reduce))
        m.set_requires_gradient_sync(False)
        backward(m)
        row["fsdp2d fully_shard"] = fsdp2d_acc(m)
        out[name] = {k: str(v.pop()).removeprefix("torch.") if len(v) == 1 else sorted(map(str, v))
                     for k, v in row.items()}
    return out
