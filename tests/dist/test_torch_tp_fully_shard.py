"""``fsdp2d.fully_shard`` over tensor parallelism that *torch* applied (DESIGN item 2).

torchtitan, transformers' ``tp_plan`` and users' own scripts shard with torch's
``parallelize_module`` / ``distribute_tensor`` and then call ``fully_shard``. Here the same
model, mesh and data go through torch's TP followed by either torch's FSDP2 or fsdp2d's
``fully_shard`` (imports switched, nothing else), on the meshes torch builds, and
training must agree: losses within 1e-6 relative and final parameters within 1e-5
absolute after 5 AdamW steps (fp32; both sides compute the same TP forward on DTensors,
FSDP only changes the order of the data-parallel gradient sum: a reduce-scatter on both,
and Adam's eps=1e-6 bounds the amplification of near-zero gradients, see _parity.EPS).

Cases: Llama and GPT-2, 2x2 (dp, tp) and HSDP 2x1x2 (replicate, shard, tp), even sizes
and uneven ones (vocab 97, ffn hidden 44: rows split 49/48 over tp, then unevenly over
dp), and the ``nn.Embedding(8, 4)`` case where the TP-local shape happens to equal the
data-parallel shard a layout-by-shape reader would expect.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from . import _parity as P
from .pool import capture_error, get_mesh

STEPS, LR = 5, 1e-2
LOSS_TOL, PARAM_TOL = 1e-6, 1e-5
MESHES = {"2x2": ((2, 2), ("dp", "tp")), "hsdp-2x1x2": ((2, 1, 2), ("replicate", "shard", "tp"))}


def _build(kind: str, uneven: bool) -> torch.nn.Module:
    from fsdp2d.models import GPT2, GPT2Args, Llama, LlamaArgs

    if not uneven:
        return P.build(kind)
    torch.manual_seed(1234)
    if kind == "llama":
        return Llama(LlamaArgs(dim=32, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=97,
                               ffn_dim_multiplier=1.03, multiple_of=4, max_seq_len=P.SEQ))
    return GPT2(GPT2Args(n_layer=2, n_head=4, n_embd=32, vocab_size=97, block_size=P.SEQ))


def _train(impl: str, kind: str, mesh_key: str, uneven: bool) -> dict:
    """torch TP, then ``impl``'s fully_shard per block and root; 5 AdamW steps."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    import fsdp2d

    from .test_torch_tools import sys_path_bench

    sys_path_bench()
    from compare_torch import torch_plan

    torch.set_num_threads(1)
    shape, names = MESHES[mesh_key]
    mesh = get_mesh(shape, names)
    dp_names = tuple(n for n in names if n != "tp")
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = fsdp2d.fully_shard
    model = _build(kind, uneven)
    parallelize_module(model, mesh["tp"], torch_plan(kind))
    for block in P.blocks(model):
        fully_shard(block, mesh=mesh[dp_names])
    fully_shard(model, mesh=mesh[dp_names])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=P.EPS, weight_decay=0.1, foreach=True)
    idx, count = P.data_rank(mesh, P.Setup(mesh=shape, names=names))
    losses = []
    for step in range(STEPS):
        x, y = P.batch_for(step, P.Setup(batch=8))
        x, y = x.chunk(count)[idx], y.chunk(count)[idx]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    with torch.no_grad():
        params = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}
    placements = {n: tuple(map(repr, p.placements)) for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "placements": placements}


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("mesh_key", list(MESHES))
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_fully_shard_over_torch_tp_equals_torch_fsdp2(pool, kind, mesh_key, uneven):
    theirs = pool.run(_train, "torch", kind, mesh_key, uneven)
    ours = pool.run(_train, "fsdp2d", kind, mesh_key, uneven)
    for rank, (t, o) in enumerate(zip(theirs, ours)):
        for step, (a, b) in enumerate(zip(t["losses"], o["losses"])):
            assert abs(a - b) <= LOSS_TOL * abs(a), (rank, step, a, b)
        assert t["params"].keys() == o["params"].keys()
        for name, ref in t["params"].items():
            err = (o["params"][name] - ref).abs().max().item()
            assert err < PARAM_TOL, (rank, name, err)


def _embedding_case() -> dict:
    """nn.Embedding(8, 4) row-sharded by torch's TP on tp=2 (local (4, 4)), then
    fsdp2d.fully_shard on dp=2, whose shard of a plain (8, 4) would also be (4, 4)."""
    import torch.nn as nn
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    import fsdp2d

    mesh = get_mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    emb = nn.Embedding(8, 4)
    full = emb.weight.detach().clone()
    parallelize_module(emb, mesh["tp"], RowwiseParallel(input_layouts=Replicate()))
    fsdp2d.fully_shard(emb, mesh=mesh["dp"])
    ids = torch.arange(8).reshape(2, 4)
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    with torch.no_grad():
        out = emb(ids)
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        # torch's RowwiseParallel output is an AsyncCollectiveTensor: its all-reduce is
        # waited for at the first op on it, and pickling (the pool sending it back) is
        # none, so without this the driver could compare a sum still in flight (seen
        # once in CI under load 8)
        out = out.wait() if isinstance(out, AsyncCollectiveTensor) else out
        got = emb.weight.full_tensor()
    return {"full": got, "expected": full, "out": out, "ref_out": full[ids],
            "placements": tuple(map(repr, emb.weight.placements)), "local": tuple(emb.weight.to_local().shape)}


def test_embedding_rows_are_never_read_from_the_local_shape(pool):
    for rank, r in enumerate(pool.run(_embedding_case)):
        assert torch.equal(r["full"], r["expected"]), rank
        assert torch.equal(r["out"], r["ref_out"]), rank
        assert r["local"] == (2, 4), r  # 8 rows: TP gives 4, FSDP 2 of those


def _refusals() -> dict:
    """Placements fsdp2d cannot re-chunk are refused naming the parameter; torch meshes
    from another root are refused naming both."""
    import torch.nn as nn
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    import fsdp2d

    mesh = get_mesh((2, 2), ("dp", "tp"))
    out = {}
    m = nn.Linear(4, 4)
    m.weight = nn.Parameter(DTensor.from_local(m.weight.detach(), mesh["tp"], [Partial()], run_check=False))
    out["partial"] = capture_error(lambda: fsdp2d.fully_shard(m, mesh=mesh["dp"]))
    m = nn.Linear(4, 4)
    m.weight = nn.Parameter(distribute_tensor(m.weight.detach(), mesh["tp"], [Shard(0)]))
    out["tp_axis"] = capture_error(lambda: fsdp2d.fully_shard(m, mesh=mesh["tp"]))
    out["module_list"] = capture_error(lambda: fsdp2d.fully_shard(nn.ModuleList([nn.Linear(2, 2)]),
                                                                  mesh=mesh["dp"]))
    out["pg"] = capture_error(lambda: fsdp2d.fully_shard(nn.Linear(2, 2), mesh=mesh["dp"].get_group()))
    return out


def test_unsupported_tp_layouts_are_refused_by_name(pool):
    for r in pool.run(_refusals):
        kind, msg = r["partial"]
        assert kind == "ValueError" and "'weight'" in msg and "Partial" in msg, msg
        kind, msg = r["tp_axis"]
        assert kind == "ValueError" and "'tp'" in msg and "tensor-parallel axis" in msg, msg
        kind, msg = r["module_list"]
        assert kind == "ValueError" and "ModuleList" in msg, msg
        kind, msg = r["pg"]
        assert kind == "TypeError" and "DeviceMesh" in msg, msg


def _list_group() -> dict:
    """fully_shard([norm, output]) as torchtitan does: one group, one all-gather per forward;
    the model trains as one process."""
    import copy

    import fsdp2d
    from fsdp2d.debug import CollectiveCounter

    mesh = get_mesh((4,), ("dp",))
    model = P.build("llama")
    ref = copy.deepcopy(model)
    for block in model.layers:
        fsdp2d.fully_shard(block, mesh=mesh)
    fsdp2d.fully_shard([model.norm, model.output], mesh=mesh)
    fsdp2d.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=P.EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=P.EPS)
    rank = mesh.get_local_rank()
    errs = []
    for step in range(3):
        x, y = P.batch_for(step, P.Setup(batch=8))
        with CollectiveCounter() as counter:
            loss = F.cross_entropy(model(x.chunk(4)[rank]).flatten(0, 1), y.chunk(4)[rank].flatten())
            loss.backward()
        ref_loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    with torch.no_grad():
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            errs.append((n, (p.full_tensor() - q).abs().max().item()))
    return {"errs": errs, "gathers": counter.count(mesh.get_group(), "all_gather"),
            "is_fsdp": [isinstance(m, fsdp2d.FSDPModule) for m in (model.norm, model.output)],
            "same_state": model.norm._fsdp2d_fsdp is model.output._fsdp2d_fsdp}


def test_fully_shard_takes_a_list_of_modules_as_one_group(pool):
    for r in pool.run(_list_group):
        assert r["is_fsdp"] == [True, True] and r["same_state"]
        for name, err in r["errs"]:
            assert err < PARAM_TOL, (name, err)
        # groups: root (embedding), 2 blocks, [norm, output]; forward gathers each once (4);
        # backward re-gathers the three that resharded after forward (the root keeps its
        # parameters). Two separate groups for norm and output would make it 9.
        assert r["gathers"] == 7, r["gathers"]
