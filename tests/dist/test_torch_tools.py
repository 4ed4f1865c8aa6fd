"""torch's own tools on fsdp2d models: clip_grad_norm_, DCP state dicts, dcp.save/load,
and DCP checkpoints exchanged with torch's native 2D path (DTensor TP + FSDP2).

Parameters at rest are torch DTensors (DESIGN item 3), so these tools must give the
answers they give on torch's own models. Every comparison is against fsdp2d's own
gather (``fsdp2d.gather_full``, independent of torch's redistribution) or against the
single-process reference weights, and every one is exact (``torch.equal``) except the
norm, a float reduction in a different order: 1e-6 relative is ~10 ulps of fp32.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import _parity as P
from .pool import get_mesh

MESHES = {
    "2x2": ((2, 2), ("dp", "tp")),
    "dp4": ((4,), ("dp",)),
    "tp4": ((1, 4), ("dp", "tp")),
    "hsdp": ((2, 1, 2), ("replicate", "shard", "tp")),
    "4x1": ((4, 1), ("dp", "tp")),
}


def _build(kind: str, mesh_key: str):
    shape, names = MESHES[mesh_key]
    s = P.Setup(model=kind, mesh=shape, names=names)
    ref = P.build(kind)
    model = copy.deepcopy(ref)
    mesh, _ = P.parallelize(model, s)
    return s, mesh, ref, model


def _step(model, mesh, s, opt=None) -> None:
    idx, count = P.data_rank(mesh, s)
    x, y = P.batch_for(0, s)
    P.loss_of(model, x.chunk(count)[idx], y.chunk(count)[idx], s).backward()
    if opt is not None:
        opt.step()


def _full(t: torch.Tensor) -> torch.Tensor:
    from fsdp2d import gather_full
    from torch.distributed.tensor import DTensor

    return gather_full(t.detach()) if isinstance(t, DTensor) else t.detach()


def _same(a: dict, b: dict) -> list[str]:
    """Keys whose tensors differ (or are missing on one side)."""
    bad = sorted(set(a) ^ set(b))
    bad += [k for k in a if k in b and not torch.equal(a[k].cpu(), b[k].cpu())]
    return bad


def job_tools(kind: str, mesh_key: str, folder: str) -> dict:
    import fsdp2d
    import torch.distributed.checkpoint as dcp
    from fsdp2d._dtensor import local_of
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict)
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    s, mesh, ref, model = _build(kind, mesh_key)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    _step(model, mesh, s)
    out: dict = {"all_dtensor": all(isinstance(p, DTensor) for p in model.parameters())}
    before = {n: local_of(p.grad).clone() for n, p in model.named_parameters()}
    ours = fsdp2d.clip_grad_norm_(model.parameters(), float("inf")).item()  # leaves grads alone
    theirs = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    theirs = (theirs.full_tensor() if isinstance(theirs, DTensor) else theirs).item()
    out["clip_rel"] = abs(theirs - ours) / ours
    coef = min(1.0, 0.5 / (ours + 1e-6))
    out["clip_scaled"] = max((local_of(p.grad) - before[n] * coef).abs().max().item()
                             for n, p in model.named_parameters())
    opt.step()
    mine = {n: _full(p) for n, p in model.named_parameters()}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out["full_sd"] = _same(full, mine)
    offloaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out["full_sd_cpu_offload"] = _same(offloaded, mine) if dist.get_rank() == 0 else list(offloaded)  # rank 0 only
    out["sharded_sd"] = _same({k: v.full_tensor() for k, v in get_model_state_dict(model).items()}, mine)
    out["state_dict"] = _same({k: _full(v) for k, v in model.state_dict().items()}, mine)
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    names = dict(model.named_parameters())
    out["optim_sd"] = [f"{k}/{key}" for k, st in osd["state"].items() for key in ("exp_avg", "exp_avg_sq")
                       if not torch.equal(st[key], _full(opt.state[names[k]][key]))]
    # dcp.save of the sharded state, scramble the model, dcp.load + set_model_state_dict
    sd = get_model_state_dict(model)
    dcp.save(sd, checkpoint_id=os.path.join(folder, f"{kind}-{mesh_key}"))
    with torch.no_grad():
        for p in model.parameters():
            local_of(p).uniform_()
    sd = get_model_state_dict(model)
    dcp.load(sd, checkpoint_id=os.path.join(folder, f"{kind}-{mesh_key}"))
    set_model_state_dict(model, sd)
    out["dcp_roundtrip"] = _same({n: _full(p) for n, p in model.named_parameters()}, mine)
    # rank 0 holds the full state, broadcast into a fresh parallel model
    _, _, _, fresh = _build(kind, mesh_key)
    given = {k: v.clone() for k, v in full.items()} if dist.get_rank() == 0 else {}
    set_model_state_dict(fresh, given, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    out["broadcast_from_rank0"] = _same({n: _full(p) for n, p in fresh.named_parameters()}, mine)
    # plain full tensors through nn.Module.load_state_dict: each rank slices its box
    _, _, _, fresh = _build(kind, mesh_key)
    fresh.load_state_dict({k: v.clone() for k, v in full.items()})
    out["load_full_tensors"] = _same({n: _full(p) for n, p in fresh.named_parameters()}, mine)
    return out


CASES = [(k, m) for k in ("llama", "gpt2") for m in ("2x2", "dp4", "tp4", "hsdp")]


@pytest.mark.parametrize("kind,mesh_key", CASES, ids=[f"{k}-{m}" for k, m in CASES])
def test_torch_tools_on_fsdp2d_models(pool, tmp_path, kind, mesh_key):
    for r in pool.run(job_tools, kind, mesh_key, str(tmp_path)):
        assert r["all_dtensor"]
        assert r["clip_rel"] < 1e-6, r  # fp32 sums in another order: ~10 ulps
        assert r["clip_scaled"] < 1e-7, r  # torch scaled by the same factor
        for key in ("full_sd", "full_sd_cpu_offload", "sharded_sd", "state_dict", "optim_sd", "dcp_roundtrip",
                    "broadcast_from_rank0", "load_full_tensors"):
            assert r[key] == [], (key, r[key])


# ---------------------------------------------------------- torch's native 2D path <-> fsdp2d


def _torch_native(kind: str, mesh_key: str):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    sys_path_bench()
    from compare_torch import torch_plan

    shape, names = MESHES[mesh_key]
    tmesh = get_mesh(shape, names)
    model = P.build(kind)
    parallelize_module(model, tmesh["tp"], torch_plan(kind))
    for block in P.blocks(model):
        fully_shard(block, mesh=tmesh["dp"])
    fully_shard(model, mesh=tmesh["dp"])
    return model


def sys_path_bench() -> None:
    import sys

    bench = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)


def _trained_full(model, mesh, s) -> dict:
    """Train one step (so the checkpoint differs from the init) and return the full state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    _step(model, mesh, s, opt)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def job_save(impl: str, kind: str, folder: str) -> dict:
    """Save a one-step-trained model with DCP on 2x2: torch's native path or fsdp2d."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    torch.set_num_threads(1)
    if impl == "torch":
        s = P.Setup(model=kind, mesh=(2, 2))
        mesh = get_mesh((2, 2), ("dp", "tp"))
        model = _torch_native(kind, "2x2")
    else:
        s, mesh, _, model = _build(kind, "2x2")
    full = _trained_full(model, mesh, s)
    dcp.save(get_model_state_dict(model), checkpoint_id=folder)
    return {k: v.detach().clone() for k, v in full.items()}


def job_load(impl: str, kind: str, mesh_key: str, folder: str, expected: dict) -> list[str]:
    """Load a DCP checkpoint into torch's native model or fsdp2d's on ``mesh_key``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)

    torch.set_num_threads(1)
    model = _torch_native(kind, mesh_key) if impl == "torch" else _build(kind, mesh_key)[3]
    sd = get_model_state_dict(model)
    dcp.load(sd, checkpoint_id=folder)
    set_model_state_dict(model, sd)
    got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return _same(got, expected)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_dcp_checkpoints_cross_torch_native_and_fsdp2d(pool, tmp_path, kind):
    torch_ckpt, ours_ckpt = str(tmp_path / "torch"), str(tmp_path / "fsdp2d")
    expected_torch = pool.run(job_save, "torch", kind, torch_ckpt)[0]
    for mesh_key in ("2x2", "4x1", "tp4"):
        for bad in pool.run(job_load, "fsdp2d", kind, mesh_key, torch_ckpt, expected_torch):
            assert bad == [], (mesh_key, bad)
    expected_ours = pool.run(job_save, "fsdp2d", kind, ours_ckpt)[0]
    for bad in pool.run(job_load, "torch", kind, "2x2", ours_ckpt, expected_ours):
        assert bad == [], bad


def job_tp_only_clip() -> dict:
    """TP without fully_shard, as with torch: parameters no style touches stay plain, so
    torch's clip_grad_norm_ refuses the mix loudly; fsdp2d's gives the true norm."""
    import fsdp2d
    from .pool import capture_error

    torch.set_num_threads(1)
    s = P.Setup(model="llama", mesh=(1, 4), fsdp=False)
    ref = P.build("llama")
    model = copy.deepcopy(ref)
    mesh, _ = P.parallelize(model, s)
    x, y = P.batch_for(0, s)
    P.loss_of(model, x, y, s).backward()
    F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")).item()
    ours = fsdp2d.clip_grad_norm_(model.parameters(), float("inf")).item()
    return {"rel": abs(ours - ref_norm) / ref_norm,
            "torch": capture_error(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))}


def test_tp_only_model_torch_clip_refuses_mix_loudly(pool):
    for r in pool.run(job_tp_only_clip):
        assert r["rel"] < 1e-6, r
        assert r["torch"] is not None and "mixed torch.Tensor and DTensor" in r["torch"][1], r["torch"]
