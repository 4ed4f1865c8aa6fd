"""Worker-side jobs: fsdp2d's FSDP1 state dicts side by side with torch's FSDP1.

Every job builds the same model from the same seed under torch's
``FullyShardedDataParallel`` (``impl="torch"``) and fsdp2d's (``impl="fsdp2d"``), with
the same wrap policy and the same per-rank batches, and returns measurements (booleans,
key lists, worst differences), never tensors; the tests assert on them.

Why two AdamW steps first: state dicts of freshly initialised models would pass with
any layout that returns the initial values. After two steps both implementations hold
the same trained values up to the order of their gradient reductions (fp32 rounding).

torch on CPU (measured here, torch 2.13; see ../shared/TORCH_CPU_NOTES.md):
``FullStateDictConfig(offload_to_cpu=True, rank0_only=True)`` segfaults, so that
configuration runs on fsdp2d's side only; ``summon_full_params(offload_to_cpu=True)``
with ``use_orig_params=False`` fails inside torch ("setStorage: ... out of bounds for
storage of size 0"); ``with_grads=True`` with ``use_orig_params=False`` raises
NotImplementedError in torch. fsdp2d supports the last two (checked against torch's
``use_orig_params=True`` results).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.tensor import DTensor

import fsdp2d
import fsdp2d.fsdp1 as F1
from fsdp2d import wrap as W
from fsdp2d.models import Llama, LlamaArgs, llama_tp_plan
from fsdp2d.models.llama import TransformerBlock

from .pool import capture_error, get_mesh

VOCAB, SEQ = 11, 4
SD = F1.StateDictType
_GROUPS: dict = {}  # per worker: process groups and torch meshes (all ranks create them together)


# -- models -----------------------------------------------------------------------------
class Block(nn.Module):
    """Uneven on purpose: fc1 has 5 rows (chunks of 2, 2, 1 and none over 4 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 5)
        self.fc2 = nn.Linear(5, 8, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x))) * self.scale


class Net(nn.Module):
    """Embedding of 11 rows (3, 3, 3, 2), two wrapped blocks, a head of 3 rows (fewer
    than the 4 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def build(kind: str) -> nn.Module:
    torch.manual_seed(1234)
    if kind == "llama":
        return Llama(LlamaArgs(dim=32, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=96,
                               multiple_of=8, max_seq_len=SEQ))
    return Net()


def wrapped(impl: str, kind: str, use_orig_params: bool, model: nn.Module | None = None, **kw) -> nn.Module:
    """``kind``'s model under torch's FSDP1 or fsdp2d's: same seed, same wrap policy
    (transformer blocks for Llama, ``Block`` for Net), each with its own policy objects."""
    model = build(kind) if model is None else model
    if impl == "torch":
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy
        cls, kw = TorchFSDP, {"device_id": torch.device("cpu"), **kw}  # FSDP1 on CPU needs it
    else:
        ModuleWrapPolicy, transformer_auto_wrap_policy = W.ModuleWrapPolicy, W.transformer_auto_wrap_policy
        cls = F1.FullyShardedDataParallel
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock}) \
        if kind == "llama" else ModuleWrapPolicy({Block})
    return cls(model, auto_wrap_policy=policy, use_orig_params=use_orig_params, **kw)


def batch(kind: str, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 96 if kind == "llama" else VOCAB, (2, SEQ), generator=g)


def backward(model: nn.Module, kind: str, step: int, data_rank: int | None = None) -> None:
    rank = dist.get_rank() if data_rank is None else data_rank
    model(batch(kind, step, rank)).float().pow(2).mean().backward()


def train(model: nn.Module, kind: str, steps: int = 2, opt=None, start: int = 0, data_rank: int | None = None):
    """``steps`` AdamW steps on this rank's batches (``data_rank``'s: TP ranks of one
    data-parallel rank see the same batch); returns the optimizer."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    for step in range(start, start + steps):
        backward(model, kind, step, data_rank)
        opt.step()
        opt.zero_grad()
    return opt


def subgroup(ranks: tuple[int, ...]):
    """A process group over ``ranks`` (every rank must call this the first time)."""
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks))
    return _GROUPS[ranks]


def torch_mesh_1d():
    """torch's own 1-D mesh over the 4 ranks (what an FSDP1 script passes as device_mesh)."""
    if "torch4" not in _GROUPS:
        from torch.distributed.device_mesh import init_device_mesh
        _GROUPS["torch4"] = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    return _GROUPS["torch4"]


def quiet(fn):
    """torch warns on every FSDP1 state-dict call (deprecations); keep the logs readable."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        torch.set_num_threads(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)
    return run


# -- state-dict helpers ---------------------------------------------------------------------
def state_dict(model: nn.Module, kind: SD, cfg=None) -> dict:
    with type(model).state_dict_type(model, kind, cfg):
        return model.state_dict()


def full(model: nn.Module, **cfg) -> dict:
    return state_dict(model, SD.FULL_STATE_DICT, F1.FullStateDictConfig(**cfg))


def load(model: nn.Module, kind: SD, sd: dict) -> None:
    with type(model).state_dict_type(model, kind):
        model.load_state_dict(sd)


def max_diff(a: dict, b: dict) -> float:
    """Worst absolute difference over the tensors of two state dicts with equal keys."""
    worst = 0.0
    for k, x in a.items():
        y = b[k]
        if isinstance(x, ShardedTensor):
            x, y = (t.local_shards()[0].tensor if t.local_shards() else torch.zeros(0) for t in (x, y))
        elif isinstance(x, DTensor):
            x, y = x.to_local(), y.to_local()
        if isinstance(x, torch.Tensor) and x.numel():
            worst = max(worst, (x.float() - y.float()).abs().max().item())
    return worst


def equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(x, b[k]) for k, x in a.items())


def meta(v) -> tuple:
    """What a sharded value says about its layout (everything but the numbers)."""
    if isinstance(v, ShardedTensor):
        m = v.metadata()
        return ("ShardedTensor", tuple(m.size), m.tensor_properties.dtype,
                [(tuple(s.shard_offsets), tuple(s.shard_sizes), str(s.placement)) for s in m.shards_metadata],
                [(tuple(s.metadata.shard_offsets), tuple(s.tensor.shape)) for s in v.local_shards()])
    if isinstance(v, DTensor):
        return ("DTensor", tuple(v.shape), v.dtype, tuple(v.placements), v.device_mesh.mesh.tolist(),
                tuple(v.to_local().shape))
    return ("Tensor", tuple(v.shape), v.dtype)


# -- 1. FULL_STATE_DICT ---------------------------------------------------------------------
@quiet
def job_full(kind: str, use_orig_params: bool) -> dict:
    """Trained torch and fsdp2d models: FULL state dicts (plain, rank0_only, offload) and
    loading each side's full state dict into a fresh model of the other."""
    rank = dist.get_rank()
    ref, ours = wrapped("torch", kind, use_orig_params), wrapped("fsdp2d", kind, use_orig_params)
    train(ref, kind), train(ours, kind)
    a, b = full(ref), full(ours)
    out = {"keys": list(b) == list(a), "diff": max_diff(a, b),
           "plain": all(type(v) is torch.Tensor for v in b.values()),
           "dtype_shape": all(v.dtype == a[k].dtype and v.shape == a[k].shape for k, v in b.items())}
    # rank0_only without offload runs on torch's side too: the other ranks get {}.
    a0, b0 = full(ref, rank0_only=True), full(ours, rank0_only=True)
    out["rank0_only"] = (list(b0) == list(a0) and max_diff(a0, b0) == out["diff"]) if rank == 0 \
        else (a0 == {} and b0 == {})
    # offload_to_cpu + rank0_only: fsdp2d only (torch segfaults on CPU); rank 0 holds b.
    b1 = full(ours, offload_to_cpu=True, rank0_only=True)
    out["offload_rank0_only"] = (equal(b1, b) and all(v.device.type == "cpu" for v in b1.values())) \
        if rank == 0 else b1 == {}
    # Full state dicts load across the implementations, bit for bit.
    ours2, ref2 = wrapped("fsdp2d", kind, use_orig_params), wrapped("torch", kind, use_orig_params)
    load(ours2, SD.FULL_STATE_DICT, a)
    load(ref2, SD.FULL_STATE_DICT, b)
    out["torch_into_fsdp2d"] = equal(full(ours2), a)
    out["fsdp2d_into_torch"] = equal(full(ref2), b)
    return out


# -- 2. SHARDED_STATE_DICT ------------------------------------------------------------------
@quiet
def job_sharded_meta(use_orig_params: bool) -> dict:
    """Trained Net (uneven rows) under both: SHARDED_STATE_DICT keys, layout metadata and
    local values; ShardedTensor without a mesh, DTensor with ``device_mesh`` (torch's
    mesh, and fsdp2d's own ``init_device_mesh`` mesh on fsdp2d's side)."""
    out = {}
    forms = {"process_group": ({}, {}), "torch_mesh": ({"device_mesh": torch_mesh_1d()},) * 2,
             "fsdp2d_mesh": ({"device_mesh": torch_mesh_1d()}, {"device_mesh": get_mesh((4,), ("dp",))})}
    for form, (ref_kw, our_kw) in forms.items():
        ref = wrapped("torch", "net", use_orig_params, **ref_kw)
        ours = wrapped("fsdp2d", "net", use_orig_params, **our_kw)
        train(ref, "net"), train(ours, "net")
        a, b = state_dict(ref, SD.SHARDED_STATE_DICT), state_dict(ours, SD.SHARDED_STATE_DICT)
        ma, mb = {k: meta(v) for k, v in a.items()}, {k: meta(v) for k, v in b.items()}
        out[form] = {"keys": list(a) == list(b), "meta_equal": ma == mb,
                     "mismatch": {k: (ma[k], mb.get(k)) for k in ma if ma[k] != mb.get(k)},
                     "types": sorted({m[0] for m in mb.values()}), "diff": max_diff(a, b)}
        # In memory (no DCP) into a fresh model of the other implementation, same ranks.
        ref2, ours2 = wrapped("torch", "net", use_orig_params, **ref_kw), wrapped("fsdp2d", "net", use_orig_params,
                                                                                  **our_kw)
        load(ref2, SD.SHARDED_STATE_DICT, b)
        load(ours2, SD.SHARDED_STATE_DICT, a)
        out[form]["in_memory"] = equal(full(ref2), full(ours)) and equal(full(ours2), full(ref))
    return out


def _fresh_sharded(impl: str, kind: str, use_orig_params: bool, ranks: tuple, kw: dict) -> nn.Module | None:
    """A fresh model on ``ranks`` (a 2-rank subgroup, or all 4); None off them."""
    pg = subgroup(ranks) if len(ranks) < dist.get_world_size() else None
    if dist.get_rank() not in ranks:
        return None
    return wrapped(impl, kind, use_orig_params, **({"process_group": pg} if pg is not None else kw))


@quiet
def job_dcp(path: str, kind: str, use_orig_params: bool, saver: str, loaders: list, save_kw: str = "") -> dict:
    """``saver`` trains 2 steps and writes its SHARDED_STATE_DICT with DCP; each
    ``(impl, ranks)`` in ``loaders`` builds a fresh model on those ranks, loads it with
    DCP (over its own process group) and compares its FULL state dict with the saver's,
    bit for bit. ``save_kw="mesh"``: the saver is given ``device_mesh`` (DTensor values)."""
    kw = {"device_mesh": torch_mesh_1d()} if save_kw == "mesh" else {}
    model = wrapped(saver, kind, use_orig_params, **kw)
    train(model, kind)
    dcp.save(state_dict(model, SD.SHARDED_STATE_DICT), storage_writer=dcp.FileSystemWriter(path))
    want = full(model)
    out = {}
    for impl, ranks in loaders:
        ranks = tuple(ranks)
        fresh = _fresh_sharded(impl, kind, use_orig_params, ranks, {})
        if fresh is None:
            out[f"{impl}@{len(ranks)}"] = True
            continue
        sd = state_dict(fresh, SD.SHARDED_STATE_DICT)
        pg = subgroup(ranks) if len(ranks) < dist.get_world_size() else None
        dcp.load(sd, storage_reader=dcp.FileSystemReader(path), process_group=pg)
        load(fresh, SD.SHARDED_STATE_DICT, sd)
        out[f"{impl}@{len(ranks)}"] = equal(full(fresh), want)
    return out


# -- 3. optim_state_dict ----------------------------------------------------------------------
def _optim_sd(model: nn.Module, opt, kind: SD) -> dict:
    cls = type(model)
    with cls.state_dict_type(model, kind):
        return cls.optim_state_dict(model, opt)


def _osd_compare(a: dict, b: dict) -> dict:
    """Where two optim_state_dicts differ in structure (fqns, state names, scalars, value
    types and layouts, param groups), and their worst tensor difference."""
    bad = [] if a["param_groups"] == b["param_groups"] else ["param_groups"]
    if sorted(a["state"]) != sorted(b["state"]):
        bad.append(("fqns", sorted(a["state"]), sorted(b["state"])))
    worst = 0.0
    for fqn, sa in a["state"].items():
        sb = b["state"].get(fqn, {})
        if sorted(sa) != sorted(sb):
            bad.append((fqn, sorted(sa), sorted(sb)))
        for name, va in sa.items():
            vb = sb.get(name)
            if isinstance(va, torch.Tensor) and va.dim():
                if type(va) is not type(vb) or meta(va) != meta(vb):
                    bad.append((fqn, name, meta(va), vb if vb is None else meta(vb)))
                else:
                    worst = max(worst, max_diff({0: va}, {0: vb}))
            elif not torch.equal(torch.as_tensor(va), torch.as_tensor(vb)):
                bad.append((fqn, name, va, vb))
    return {"mismatch": bad, "diff": worst}


def _full_vs_sharded(full_osd: dict, sharded_osd: dict) -> float:
    """Worst difference between a FULL optim_state_dict's tensors and this rank's pieces
    of a SHARDED one (ShardedTensor values)."""
    worst = 0.0
    for fqn, st in sharded_osd["state"].items():
        for name, v in st.items():
            if isinstance(v, ShardedTensor) and v.local_shards():
                shard = v.local_shards()[0]
                start, rows = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
                got = full_osd["state"][fqn][name][start:start + rows]
                worst = max(worst, (got - shard.tensor).abs().max().item())
    return worst


def _load_optim(model: nn.Module, model_sd: dict, osd: dict | None, sd_kind: SD):
    """``model`` (fresh) holding ``model_sd`` (FULL) and an AdamW holding ``osd``
    (through FSDP.optim_state_dict_to_load under ``sd_kind``; None: a fresh AdamW)."""
    load(model, SD.FULL_STATE_DICT, model_sd)
    if osd is None:
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)  # lr 1e-2 comes from the saved groups
    cls = type(model)
    with cls.state_dict_type(model, sd_kind):
        opt.load_state_dict(cls.optim_state_dict_to_load(model, opt, osd))
    return model, opt


@quiet
def job_optim(kind: str, use_orig_params: bool, sd_kind: str) -> dict:
    """torch and fsdp2d train 2 steps: their optim_state_dicts agree; each one loads into
    a fresh model of the other implementation (model state too), and one more step on
    every model gives the same parameters.

    torch 2.13 on CPU, FULL_STATE_DICT with use_orig_params=True: torch's optim_state_dict
    returns exp_avg equal to exp_avg_sq (both hold exp_avg_sq), and its own save/load
    round trip then diverges. So the reference values are torch's SHARDED pieces, and the
    torch -> fsdp2d load runs only where torch's FULL dict agrees with them
    (``torch_full_ok``); fsdp2d's own FULL round trip covers that load path regardless."""
    sd_kind = SD[sd_kind]
    ref, ours = wrapped("torch", kind, use_orig_params), wrapped("fsdp2d", kind, use_orig_params)
    ref_opt, our_opt = train(ref, kind), train(ours, kind)
    a, b = _optim_sd(ref, ref_opt, sd_kind), _optim_sd(ours, our_opt, sd_kind)
    out = {"osd": _osd_compare(a, b)}
    if sd_kind == SD.FULL_STATE_DICT:
        truth = _optim_sd(ref, ref_opt, SD.SHARDED_STATE_DICT)
        out["fsdp2d_vs_truth"] = _full_vs_sharded(b, truth)
        out["torch_full_ok"] = _full_vs_sharded(a, truth) < 1e-6
        # rank0_only (the config, and torch's older full_optim_state_dict, whose default it is).
        with F1.FSDP.state_dict_type(ours, sd_kind, None, F1.FullOptimStateDictConfig(rank0_only=True)):
            r0 = F1.FSDP.optim_state_dict(ours, our_opt)
        older = F1.FSDP.full_optim_state_dict(ours, our_opt)
        same = [_osd_compare(d, b) == {"mismatch": [], "diff": 0.0} if dist.get_rank() == 0 else d == {}
                for d in (r0, older)]
    else:
        out["torch_full_ok"] = True
        same = [_osd_compare(F1.FSDP.sharded_optim_state_dict(ours, our_opt), b) == {"mismatch": [], "diff": 0.0}]
    out["rank0_only_and_older_api"] = all(same)
    a_model, b_model = full(ref), full(ours)
    models = {"torch<-fsdp2d": _load_optim(wrapped("torch", kind, use_orig_params), b_model, b, sd_kind),
              "fsdp2d<-fsdp2d": _load_optim(wrapped("fsdp2d", kind, use_orig_params), b_model, b, sd_kind)}
    if out["torch_full_ok"]:
        models["fsdp2d<-torch"] = _load_optim(wrapped("fsdp2d", kind, use_orig_params), a_model, a, sd_kind)
    out["lr_loaded"] = all(o.param_groups[0]["lr"] == 1e-2 for _, o in models.values())
    for m, o in [(ref, ref_opt), (ours, our_opt), *models.values()]:
        train(m, kind, steps=1, opt=o, start=2)
    want = full(ref)
    out["steps"] = {"fsdp2d": max_diff(want, full(ours))}
    out["steps"].update({name: max_diff(want, full(m)) for name, (m, _) in models.items()})
    # The control: the same step from the same weights with a fresh optimizer (what a
    # load that kept nothing would give) lands this far away.
    control, control_opt = _load_optim(wrapped("torch", kind, use_orig_params), a_model, None, sd_kind)
    train(control, kind, steps=1, opt=control_opt, start=2)
    out["no_state"] = max_diff(want, full(control))
    return out


# -- 4. summon_full_params ------------------------------------------------------------------
def _summoned(model: nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _edit(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


def _plus_one(sd: dict, params: set) -> dict:
    return {k: v + 1 if k in params else v for k, v in sd.items()}


@quiet
def job_summon(use_orig_params: bool) -> dict:
    """Trained Net under both: names and values inside summon_full_params; writeback
    True/False; rank0_only; writeback + rank0_only; offload_to_cpu (fsdp2d only: torch
    segfaults reading the offloaded parameters on CPU, see the module docstring)."""
    rank = dist.get_rank()
    ref, ours = wrapped("torch", "net", use_orig_params), wrapped("fsdp2d", "net", use_orig_params)
    train(ref, "net"), train(ours, "net")
    want = full(ref)
    out = {}
    for name, m in (("torch", ref), ("fsdp2d", ours)):
        cls, r = type(m), {}
        base = full(m)
        with cls.summon_full_params(m, writeback=False):
            inside = _summoned(m)
            _edit(m)
        r["names"] = list(inside)
        r["values"] = max_diff({k: want[k] for k in inside}, inside)
        r["writeback_false_kept"] = equal(full(m), base)
        with cls.summon_full_params(m, writeback=True):
            _edit(m)
        r["writeback_true"] = equal(full(m), _plus_one(base, set(inside)))
        load(m, SD.FULL_STATE_DICT, base)
        with cls.summon_full_params(m, writeback=False, rank0_only=True):
            r0 = _summoned(m)
            params = dict(m.named_parameters())
        # Rank 0 sees the full parameters. The others keep their shards: torch shows flat
        # local views (``_flat_param`` for use_orig_params=False), fsdp2d its sharded
        # DTensors (or the flat parameter).
        if rank == 0:
            r["rank0_only"] = max_diff({k: want[k] for k in r0}, r0) if list(r0) == list(inside) else list(r0)
        else:
            r["rank0_only"] = [(k, type(p).__name__, tuple(p.shape), tuple(getattr(p, "_local_tensor", p).shape))
                               for k, p in params.items()]
        r["rank0_writeback"] = capture_error(
            lambda: cls.summon_full_params(m, writeback=True, rank0_only=True).__enter__())
        r["unchanged"] = equal(full(m), base)
        out[name] = r

    def offloaded():
        with F1.FSDP.summon_full_params(ours, offload_to_cpu=True, writeback=False):
            got = _summoned(ours)
            on_cpu = all(p.device.type == "cpu" for p in ours.parameters())
        out["fsdp2d"]["offload"] = (on_cpu, max_diff({k: want[k] for k in got}, got))
    out["fsdp2d"]["offload_error"] = capture_error(offloaded)
    return out


@quiet
def job_with_grads(use_orig_params: bool) -> dict:
    """summon_full_params(with_grads=True) after one backward: the full gradients equal
    torch's (torch raises NotImplementedError for use_orig_params=False, so its
    reference runs with use_orig_params=True)."""
    ref, ours = wrapped("torch", "net", True), wrapped("fsdp2d", "net", use_orig_params)
    out = {}
    grads = {}
    for name, m in (("torch", ref), ("fsdp2d", ours)):
        backward(m, "net", 0)
        with type(m).summon_full_params(m, with_grads=True, writeback=False):
            grads[name] = {n: p.grad.clone() for n, p in m.named_parameters()}
    out["names"] = list(grads["torch"]) == list(grads["fsdp2d"])
    out["diff"] = max_diff(grads["torch"], grads["fsdp2d"])
    out["scale"] = max(g.abs().max().item() for g in grads["torch"].values())
    ref2 = wrapped("torch", "net", False)
    backward(ref2, "net", 0)
    out["torch_uop_false"] = capture_error(
        lambda: type(ref2).summon_full_params(ref2, with_grads=True).__enter__())
    return out


# -- 5. LOCAL_STATE_DICT ----------------------------------------------------------------------
@quiet
def job_local(kind: str, use_orig_params: bool) -> dict:
    """fsdp2d's LOCAL_STATE_DICT round trip into an identically wrapped fresh model, and
    the clear errors when the wrapping, the ranks or the implementation differ."""
    ours = wrapped("fsdp2d", kind, use_orig_params)
    train(ours, kind)
    want = full(ours)
    sd = state_dict(ours, SD.LOCAL_STATE_DICT)
    out = {"types": sorted({type(v).__name__ for v in sd.values()}),
           "flat_keys": sorted(k for k in sd if k.endswith("_flat_param"))}
    fresh = wrapped("fsdp2d", kind, use_orig_params)
    load(fresh, SD.LOCAL_STATE_DICT, sd)
    out["round_trip"] = equal(full(fresh), want)
    fresh = wrapped("fsdp2d", kind, use_orig_params)
    load(fresh, SD.LOCAL_STATE_DICT, dict(sd))  # no _metadata: the layout is not checked, the sizes are
    out["round_trip_plain_dict"] = equal(full(fresh), want)
    one_unit = F1.FSDP(build(kind), use_orig_params=use_orig_params)  # no auto-wrap policy
    out["other_wrapping"] = capture_error(lambda: load(one_unit, SD.LOCAL_STATE_DICT, sd))
    pair = _fresh_sharded("fsdp2d", kind, use_orig_params, (0, 1), {})
    out["other_ranks"] = capture_error(lambda: load(pair, SD.LOCAL_STATE_DICT, sd)) if pair is not None else None
    ref = wrapped("torch", kind, use_orig_params)
    train(ref, kind)
    theirs = state_dict(ref, SD.LOCAL_STATE_DICT)
    out["torch_flat_keys"] = sorted(k for k in theirs if k.endswith("_flat_param"))
    target = wrapped("fsdp2d", kind, use_orig_params)
    out["from_torch"] = capture_error(lambda: load(target, SD.LOCAL_STATE_DICT, theirs))
    out["from_torch_silent"] = out["from_torch"] is None and not equal(full(target), full(ref))
    return out


# -- 6. FSDP1 + TP ------------------------------------------------------------------------------
def _llama_2d(mesh) -> nn.Module:
    """torch's FSDP1 + TP recipe on fsdp2d: TP over mesh["tp"], then FSDP1 over mesh["dp"]."""
    model = fsdp2d.parallelize_module(build("llama"), mesh["tp"], llama_tp_plan())
    return wrapped("fsdp2d", "llama", True, model=model, device_mesh=mesh["dp"])


def _torch_llama_2d() -> nn.Module:
    """The same recipe with torch's own TP and FSDP1 (it runs on CPU: the model's
    attention sees plain local tensors, ``use_local_output=True``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    if "torch2x2" not in _GROUPS:
        _GROUPS["torch2x2"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh = _GROUPS["torch2x2"]
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate())}
    for i in range(2):
        plan.update({f"layers.{i}.{n}": ColwiseParallel() for n in
                     ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")})
        plan.update({f"layers.{i}.{n}": RowwiseParallel() for n in ("attention.wo", "feed_forward.w2")})
    model = parallelize_module(build("llama"), mesh["tp"], plan)
    return wrapped("torch", "llama", True, model=model, device_mesh=mesh["dp"])


def _whole(sd: dict) -> dict:
    """FSDP1 + TP FULL_STATE_DICT keeps TP parameters as DTensors on the tp mesh (torch's
    and fsdp2d's alike): compare whole tensors."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}


def _tp_optim(mesh, ours: nn.Module, ours_opt, ref: nn.Module, ref_opt, mine: dict, theirs: dict) -> dict:
    """SHARDED optim_state_dicts of the trained 2-D models (torch's: DTensors on its own
    mesh) into fresh fsdp2d 2-D models, in memory; then one more step on each: the worst
    difference from the model it came from (``no_state``: a fresh AdamW, the control)."""
    a, b = _optim_sd(ref, ref_opt, SD.SHARDED_STATE_DICT), _optim_sd(ours, ours_opt, SD.SHARDED_STATE_DICT)
    runs = {"torch->fsdp2d": (ref, _load_optim(_llama_2d(mesh), theirs, a, SD.SHARDED_STATE_DICT)),
            "fsdp2d->fsdp2d": (ours, _load_optim(_llama_2d(mesh), mine, b, SD.SHARDED_STATE_DICT)),
            "no_state": (ref, _load_optim(_llama_2d(mesh), theirs, None, SD.SHARDED_STATE_DICT))}
    data_rank = mesh.get_local_rank("dp")
    for m, o in ((ours, ours_opt), (ref, ref_opt), *(loaded for _, loaded in runs.values())):
        train(m, "llama", steps=1, opt=o, start=2, data_rank=data_rank)
    return {name: max_diff(_whole(full(src)), _whole(full(m))) for name, (src, (m, _)) in runs.items()}


def _dcp_into(model: nn.Module, path: str) -> dict:
    sd = state_dict(model, SD.SHARDED_STATE_DICT)
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
    load(model, SD.SHARDED_STATE_DICT, sd)
    return _whole(full(model))


@quiet
def job_tp(path: str) -> dict:
    """FSDP1 + TP on 2 (dp) x 2 (tp), fsdp2d's and torch's, trained alike: FULL state dicts
    agree; SHARDED values are DTensors; DCP checkpoints of either load into a fresh 2-D
    model of the other, and fsdp2d's into a 1-D (dp=4) FSDP1 model; torch's state dicts
    also load in memory (no DCP) into fsdp2d's 2-D and 1-D models; SHARDED optimizer
    state (torch's and fsdp2d's) loads into fsdp2d's 2-D model."""
    mesh = get_mesh((2, 2), ("dp", "tp"))
    ours, ref = _llama_2d(mesh), _torch_llama_2d()
    data_rank = mesh.get_local_rank("dp")
    ours_opt, ref_opt = train(ours, "llama", data_rank=data_rank), train(ref, "llama", data_rank=data_rank)
    mine, theirs = full(ours), full(ref)
    out = {"full_keys": list(mine) == list(theirs),
           "full_types": {k: (type(v).__name__, str(getattr(v, "placements", "")), tuple(v.shape))
                          for k, v in mine.items()},
           "torch_full_types": {k: (type(v).__name__, str(getattr(v, "placements", "")), tuple(v.shape))
                                for k, v in theirs.items()},
           "full_diff": max_diff(_whole(theirs), _whole(mine))}
    mine, theirs = _whole(mine), _whole(theirs)
    sd, tsd = state_dict(ours, SD.SHARDED_STATE_DICT), state_dict(ref, SD.SHARDED_STATE_DICT)
    out["sharded_keys"] = list(sd) == list(tsd)
    out["dtensor"] = all(isinstance(v, DTensor) for v in sd.values())
    out["placements"] = {k: (str(v.placements), v.device_mesh.mesh_dim_names, str(tsd[k].placements),
                             tsd[k].device_mesh.mesh_dim_names)
                         for k, v in sd.items() if k in ("tok_embeddings.weight", "layers.0.attention.wo.weight",
                                                          "norm.weight")}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(path, "fsdp2d")))
    dcp.save(tsd, storage_writer=dcp.FileSystemWriter(os.path.join(path, "torch")))
    out["fsdp2d->fsdp2d_2d"] = equal(_dcp_into(_llama_2d(mesh), os.path.join(path, "fsdp2d")), mine)
    out["fsdp2d->fsdp2d_1d"] = equal(_dcp_into(wrapped("fsdp2d", "llama", True), os.path.join(path, "fsdp2d")), mine)
    out["fsdp2d->torch_2d"] = equal(_dcp_into(_torch_llama_2d(), os.path.join(path, "fsdp2d")), mine)
    out["torch->fsdp2d_2d"] = equal(_dcp_into(_llama_2d(mesh), os.path.join(path, "torch")), theirs)
    for name, fresh, kind, value in (("2d_sharded", _llama_2d(mesh), SD.SHARDED_STATE_DICT, tsd),
                                     ("2d_full", _llama_2d(mesh), SD.FULL_STATE_DICT, full(ref)),
                                     ("1d_sharded", wrapped("fsdp2d", "llama", True), SD.SHARDED_STATE_DICT, tsd)):
        out[f"torch->fsdp2d_{name}_in_memory"] = capture_error(lambda: load(fresh, kind, value)) \
            or equal(_whole(full(fresh)), theirs)
    out["optim"] = _tp_optim(mesh, ours, ours_opt, ref, ref_opt, mine, theirs)
    return out
