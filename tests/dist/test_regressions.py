"""Regressions found in code review: each test reproduces a confirmed bug.

FSDP state after an exception in backward, unused and re-frozen parameters, parameters
replaced in place (``to_empty``/``.double()``), stale unsharded weights, uneven sequence
parallel, shared style objects, checkpoint error paths that used to hang, fp64 loss
parallel, a backward all-reduce that wrote into a gradient autograd shares.
"""

import copy
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fsdp2d
from fsdp2d import checkpoint as ckpt
from fsdp2d.bridge import gather_full

from ._ckpt import edit_manifest
from .pool import capture_error, get_mesh


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.unused = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _dp4():
    return get_mesh((4,), ("dp",))


def _sharded(blocks: bool = False):
    torch.manual_seed(0)
    ref = Toy()
    model = copy.deepcopy(ref)
    if blocks:
        for mod in (model.a, model.b):
            fsdp2d.fully_shard(mod, mesh=_dp4())
    fsdp2d.fully_shard(model, mesh=_dp4())
    return ref, model


def _full(model, which: str) -> dict:
    out = {}
    for fqn, p in fsdp2d.fsdp_params(model):
        t = p.sharded.detach() if which == "param" else p.sharded.grad
        out[fqn] = None if t is None else gather_full(t.contiguous(), p.layout, _dp4())
    return out


def job_fsdp_state() -> dict:
    torch.set_num_threads(1)
    res = {}
    # 1. an exception in backward must not leave later steps without gradients
    ref, model = _sharded(blocks=True)
    x = torch.randn(4, 8)
    y = model(x)
    y.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
    res["raised"] = capture_error(lambda: y.sum().backward()) is not None
    model.zero_grad()
    model(x).sum().backward()
    ref(x).sum().backward()
    grads = _full(model, "grad")
    res["after_exception"] = max((grads[k] - ref.get_parameter(k).grad).abs().max().item()
                                 for k in grads if "unused" not in k)
    # 2. a parameter without gradient keeps grad None, so weight decay does not move it
    ref, model = _sharded()
    model(x).sum().backward()
    before = _full(model, "param")["unused.weight"].clone()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    opt.step()
    res["unused_grad_none"] = model.unused.weight.grad is None
    res["unused_moved"] = (_full(model, "param")["unused.weight"] - before).abs().max().item()
    # 3. requires_grad changed after fully_shard is followed
    _, model = _sharded()
    model.a.weight.requires_grad_(False)
    model(x).sum().backward()
    res["frozen_after_has_grad"] = model.a.weight.grad is not None
    model.a.weight.requires_grad_(True)
    model.zero_grad()
    model(x).sum().backward()
    res["unfrozen_has_grad"] = model.a.weight.grad is not None
    # 4. storage replaced in place on the same Parameter objects
    ref, model = _sharded()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in (*model.parameters(), *ref.parameters()):
            t.fill_(0.5)
    res["to_empty_real"] = (model(x) - ref(x)).abs().max().item()
    ref, model = _sharded()
    model.double()
    ref.double()
    res["double"] = (model(x.double()) - ref(x.double())).abs().max().item()
    # 5. a grad-enabled forward without backward, then an optimizer step: no stale weights
    ref, model = _sharded()
    model(x)  # the root keeps its unsharded parameters
    with torch.no_grad():
        for t in (*model.parameters(), *ref.parameters()):
            t.add_(1.0)
    res["stale"] = (model(x) - ref(x)).abs().max().item()
    return res


def test_fsdp_state_machine_regressions(pool):
    for r in pool.run(job_fsdp_state):
        assert r["raised"] and r["after_exception"] < 1e-6, r
        assert r["unused_grad_none"] and r["unused_moved"] == 0.0, r
        assert not r["frozen_after_has_grad"] and r["unfrozen_has_grad"], r
        assert r["to_empty_real"] < 1e-6 and r["double"] < 1e-12 and r["stale"] < 1e-6, r


def job_tp() -> dict:
    torch.set_num_threads(1)
    from fsdp2d.models import Llama, LlamaArgs, llama_tp_plan

    res = {}
    tp = get_mesh((1, 4), ("dp", "tp"))["tp"]
    # 6. uneven sequence parallel: a clear error, not a gloo abort
    model = Llama(LlamaArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=64, max_seq_len=16))
    fsdp2d.parallelize_module(model, tp, llama_tp_plan(sequence_parallel=True))
    err = capture_error(lambda: model(torch.randint(0, 64, (2, 7))))
    res["sp_uneven"] = err
    # 7. a style object reused across calls is not changed by src_data_rank
    style = fsdp2d.ColwiseParallel()
    lin = nn.Linear(8, 8)
    fsdp2d.parallelize_module(lin, tp, style, src_data_rank=None)
    res["style_src"] = style.src_data_rank
    # 8. loss_parallel keeps fp64 logits in fp64
    torch.manual_seed(1)
    head = nn.Linear(6, 10, bias=False).double()
    ref = copy.deepcopy(head)
    fsdp2d.parallelize_module(head, tp, fsdp2d.ColwiseParallel(output_layouts=fsdp2d.Shard(-1)))
    h, y = torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 10, (5,))
    with fsdp2d.loss_parallel():
        loss = F.cross_entropy(head(h), y)
    res["fp64_loss"] = abs(loss.item() - F.cross_entropy(ref(h), y).item())
    return res


def job_shared_grad() -> dict:
    """copy_to_tp's backward all-reduce must not write into the incoming gradient:
    autograd hands the same tensor to every input of an add."""
    from fsdp2d.tensor_parallel import copy_to_tp

    res = {}
    for shape in ((2, 2), (1, 4)):  # TP of 2 (pairwise exchange) and of 4 (gloo all-reduce)
        group = get_mesh(shape, ("dp", "tp"))["tp"].get_group()
        x, w = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
        c = torch.tensor([1.0, 2.0, 3.0])
        u = w.exp()  # created first, so its backward runs after copy_to_tp's
        ((copy_to_tp(x, group=group) + u) * c).sum().backward()
        res[shape[1]] = (w.grad, x.grad)
    return res


def test_backward_all_reduce_leaves_shared_gradients_alone(pool):
    c = torch.tensor([1.0, 2.0, 3.0])
    for r in pool.run(job_shared_grad):
        for k, (w_grad, x_grad) in r.items():
            torch.testing.assert_close(w_grad, c * torch.e, rtol=1e-6, atol=0)  # not the summed gradient
            assert torch.equal(x_grad, c * k)


def test_tensor_parallel_regressions(pool):
    for r in pool.run(job_tp):
        assert r["sp_uneven"] is not None and r["sp_uneven"][0] == "ValueError", r
        assert "divisible by the TP degree" in r["sp_uneven"][1], r
        assert r["style_src"] == 0, r
        assert r["fp64_loss"] < 1e-12, r


def job_checkpoint_errors(root: str) -> dict:
    torch.set_num_threads(1)
    res = {}
    _, model = _sharded()
    # 9. save into a folder that cannot be created: an error on every rank, no hang
    blocker = Path(root) / "afile"
    if dist.get_rank() == 0:
        blocker.write_text("x")
    dist.barrier()
    res["save_fail"] = capture_error(lambda: ckpt.save(blocker / "c", model))
    # 10. rank 1's file places a box elsewhere than the index's layout: rank 1 alone
    # fails (each rank reads its own file), every rank raises, no hang
    path = Path(root) / "good"
    ckpt.save(path, model)
    if dist.get_rank() == 0:
        edit_manifest(path / "rank00001.safetensors",
                      lambda m: m["boxes"]["model/a.weight"]["offset"].__setitem__(0, 0))
    dist.barrier()
    res["load_fail"] = capture_error(lambda: ckpt.load(path, model))
    return res


def test_checkpoint_error_paths_do_not_hang(pool, tmp_path):
    for r in pool.run(job_checkpoint_errors, str(tmp_path), timeout=60):
        assert r["save_fail"] is not None and r["save_fail"][0] == "CheckpointError", r
        assert "cannot create" in r["save_fail"][1], r
        assert r["load_fail"] is not None and r["load_fail"][0] == "CheckpointError", r
        assert "rank00001.safetensors: 'model/a.weight' is the box at offset [0, 0]" in r["load_fail"][1], r


def job_bf16_accumulation() -> float:
    """bf16 params, fp32 reduce: 8 microbatches without sync must equal syncing every
    microbatch (each reduced in fp32, summed in fp32 .grad) up to fp32 rounding; bf16
    accumulation of the unsharded gradients would be off by ~1e-3 relative."""
    torch.set_num_threads(1)
    mp = fsdp2d.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    base = Toy()
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    for m in models:
        fsdp2d.fully_shard(m, mesh=_dp4(), mp_policy=mp)
    xs = torch.randn(8, 4, 8)
    accumulated, synced = models
    for i, x in enumerate(xs):
        accumulated.set_requires_gradient_sync(i == len(xs) - 1)
        accumulated(x).square().sum().backward()
        synced(x).square().sum().backward()
    a, b = _full(accumulated, "grad"), _full(synced, "grad")
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in a if "unused" not in k)


def test_no_sync_accumulation_in_reduce_dtype(pool):
    for err in pool.run(job_bf16_accumulation):
        assert err < 1e-5, err


class Side(Toy):
    def forward(self, x, use_side: bool = False):
        h = torch.relu(self.a(x))
        return self.b(h + self.unused(h)) if use_side else self.b(h)


def job_second_review(hsdp: bool) -> dict:
    torch.set_num_threads(1)
    mesh = get_mesh((2, 2), ("replicate", "shard")) if hsdp else _dp4()
    rank = dist.get_rank()
    res = {}
    # a parameter used on rank 0 only: every rank's shard updates (collective decision)
    torch.manual_seed(0)
    ref = Side()
    model = copy.deepcopy(ref)
    fsdp2d.fully_shard(model, mesh=mesh)
    xs = torch.randn(4, 2, 8)
    loss = model(xs[rank], use_side=rank == 0).sum()
    loss.backward()
    ref_loss = sum(ref(xs[r], use_side=r == 0).sum() for r in range(4)) / 4
    ref_loss.backward()
    for opt in (torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)):
        opt.step()
    full = {fqn: gather_full(p.sharded.detach().contiguous(), p.layout, mesh) for fqn, p in fsdp2d.fsdp_params(model)}
    res["partial_use"] = max((full[k] - ref.get_parameter(k)).abs().max().item() for k in full)
    return res


def test_parameter_used_on_some_ranks_updates_everywhere(pool):
    for hsdp in (False, True):
        for r in pool.run(job_second_review, hsdp):
            assert r["partial_use"] < 1e-6, (hsdp, r)


def job_fused_and_recover() -> dict:
    torch.set_num_threads(1)
    res = {}
    # fused AdamW does not bump version counters: no stale root weights after its step
    ref, model = _sharded()
    model.set_reshard_after_backward(False)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, fused=True) for m in (model, ref)]
    x = torch.randn(4, 8)
    worst = 0.0
    for _ in range(3):
        losses = []
        for m, opt in zip((model, ref), opts):
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]))
    res["fused"] = worst
    # an exception during an unsynced microbatch keeps the earlier microbatches (both
    # with and without mixed precision)
    for name, mp in (("fp32", fsdp2d.MixedPrecisionPolicy()),
                     ("mp", fsdp2d.MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float32))):
        torch.manual_seed(0)
        base = Toy()
        model, ref = copy.deepcopy(base), copy.deepcopy(base)
        fsdp2d.fully_shard(model, mesh=_dp4(), mp_policy=mp)
        xs = torch.randn(3, 4, 8)
        model.set_requires_gradient_sync(False)
        model(xs[0]).sum().backward()
        y = model(xs[1])
        y.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
        capture_error(lambda: y.sum().backward())
        model.set_requires_gradient_sync(True)
        model(xs[2]).sum().backward()
        for i in (0, 2):
            ref(xs[i]).sum().backward()
        grads = _full(model, "grad")
        res[name] = max((grads[k] - ref.get_parameter(k).grad).abs().max().item() for k in grads if "unused" not in k)
    return res


def test_fused_optimizer_and_recovery_during_accumulation(pool):
    for r in pool.run(job_fused_and_recover):
        assert r["fused"] < 1e-6, r
        assert r["fp32"] < 1e-5 and r["mp"] < 1e-5, r


def job_meta_init_with_empty_shards() -> dict:
    """dp=4, layers of 3 and 2 rows: rank 3 holds no row of any parameter. to_empty()
    swaps each DTensor parameter's contents in place, and an empty shard has data pointer
    0 on meta and on the CPU alike: the group must still notice and leave the meta device."""
    from fsdp2d._dtensor import local_of

    torch.set_num_threads(1)
    mesh = get_mesh((4,), ("dp",))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    for layer in model:
        fsdp2d.fully_shard(layer, mesh=mesh)
    fsdp2d.fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            local_of(p).fill_(0.5)
    out = model(torch.ones(2, 3))  # each of 3 inputs x 0.5 + 0.5 = 2.0, then 3 x 2.0 x 0.5 + 0.5
    return {"out": out.tolist(), "devices": sorted({local_of(p).device.type for p in model.parameters()})}


def test_meta_init_when_a_rank_holds_nothing(pool):
    for r in pool.run(job_meta_init_with_empty_shards):
        assert r == {"out": [[3.5, 3.5], [3.5, 3.5]], "devices": ["cpu"]}, r


def job_between_forward_and_backward() -> dict:
    """After a grad-enabled forward with no backward the root holds its unsharded copies:
    state_dict() must still give the DTensor shards, a load must land in them (not in the
    transient copies), and an optimizer built from model.parameters() there must refuse
    to step (found by review). Frozen parameters add no host read of the has-gradient
    flags (no .tolist(): a host sync on a GPU)."""
    from torch.distributed.tensor import DTensor

    from fsdp2d.debug import OpCounter
    from . import _parity as P

    torch.set_num_threads(1)
    model, ref = _dp4_llama()
    x, y = P.batch_for(0, P.Setup())
    model(x)  # no backward: the root stays unsharded
    out = {"all_dtensor": all(isinstance(v, DTensor) for v in model.state_dict().values())}
    model(x)
    halved = {k: v * 0.5 for k, v in ref.state_dict().items()}
    model.load_state_dict(halved)  # full tensors: each rank slices its box
    ref.load_state_dict(halved)
    losses = []
    for _ in range(2):
        a = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        a.backward()
        losses.append(abs(a.item() - F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).item()))
    out["loaded_loss_err"] = max(losses)
    model(x)
    out["optimizer_mid_step"] = capture_error(torch.optim.AdamW(model.parameters(), lr=1e-3).step)
    model, _ = _dp4_llama()
    for p in (model.tok_embeddings.weight, model.layers[0].attention.wq.weight):
        p.requires_grad_(False)
    reads = []
    tolist = torch.Tensor.tolist  # .tolist() does not dispatch: count its calls
    torch.Tensor.tolist = lambda t: (reads.append("tolist"), tolist(t))[1]
    try:
        with OpCounter() as ops:
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    finally:
        torch.Tensor.tolist = tolist
    out["host_reads"] = len(reads) + ops.ops["aten._local_scalar_dense"]
    out["frozen_grads"] = [model.tok_embeddings.weight.grad, model.layers[0].attention.wq.weight.grad]
    return out


def _dp4_llama():
    from . import _parity as P

    ref = P.build("llama")
    model = copy.deepcopy(ref)
    mesh = get_mesh((4,), ("dp",))
    for block in model.layers:
        fsdp2d.fully_shard(block, mesh=mesh)
    fsdp2d.fully_shard(model, mesh=mesh)
    return model, ref


def test_state_dict_and_optimizers_between_forward_and_backward(pool):
    for r in pool.run(job_between_forward_and_backward):
        assert r["all_dtensor"], r
        assert r["loaded_loss_err"] < 1e-5, r  # the loaded weights are the ones trained
        err = r["optimizer_mid_step"]
        assert err is not None and "unsharded copy" in err[1] and "tok_embeddings.weight" in err[1], err
        assert r["host_reads"] == 0, r
        assert r["frozen_grads"] == [None, None], r
