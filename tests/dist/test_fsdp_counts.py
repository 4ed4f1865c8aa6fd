"""FSDP's collectives per step, and its per-rank memory for parameters and AdamW state.

Counting: ``fsdp2d.debug.CollectiveCounter`` sees every c10d op (gloo's pairwise
exchanges counted as the collective they implement); only the data-parallel group's
are FSDP's (TP's own collectives run on the TP group). Per training step with L blocks + the root:
forward L+1 all-gathers, backward L (the blocks reshard after forward; the root keeps
its parameters, as torch's FSDP2 does), and L+1 reduce-scatters.
"""

import copy

import torch
import torch.nn.functional as F

import fsdp2d
from fsdp2d._dtensor import local_of
from fsdp2d.debug import CollectiveCounter
from fsdp2d.models import Llama, LlamaArgs, llama_tp_plan

from .pool import get_mesh


def _model_2d(reshard_after_forward: bool = True):
    mesh = get_mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    model = Llama(LlamaArgs.debug())
    fsdp2d.parallelize_module(model, mesh["tp"], llama_tp_plan())
    for block in model.layers:
        fsdp2d.fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
    fsdp2d.fully_shard(model, mesh=mesh["dp"])
    return mesh, model


def job_count_collectives(reshard_after_forward: bool):
    torch.set_num_threads(1)
    mesh, model = _model_2d(reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 16))
    per_step = []
    for _ in range(3):  # step 0 records the forward order; later steps prefetch
        dp = mesh["dp"].get_group()
        with CollectiveCounter() as fwd:
            loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        with CollectiveCounter() as bwd:
            loss.backward()
        opt.step()
        opt.zero_grad()
        per_step.append({
            "fwd_ag": fwd.count(dp, "all_gather"),
            "bwd_ag": bwd.count(dp, "all_gather"),
            "rs": fwd.count(dp, "reduce_scatter") + bwd.count(dp, "reduce_scatter"),
            "other": sorted(k for _, k in fwd.counts.keys() | bwd.counts.keys()
                            if k not in ("all_gather", "reduce_scatter", "all_reduce")),
        })
    return per_step


def test_one_all_gather_per_group_per_pass(pool):
    layers = LlamaArgs.debug().n_layers
    for step in pool.run(job_count_collectives, True)[0]:
        assert step == {"fwd_ag": layers + 1, "bwd_ag": layers, "rs": layers + 1, "other": []}, step


def test_no_backward_all_gather_without_reshard(pool):
    layers = LlamaArgs.debug().n_layers
    for step in pool.run(job_count_collectives, False)[0]:
        assert step == {"fwd_ag": layers + 1, "bwd_ag": 0, "rs": layers + 1, "other": []}, step


def job_memory():
    torch.set_num_threads(1)
    mesh, model = _model_2d()
    full = Llama(LlamaArgs.debug())
    n_total = sum(p.numel() for p in full.parameters())
    # Parameters that TP replicates (norm weights) are held by every TP rank.
    tp_replicated = sum(p.numel() for n, p in full.named_parameters() if "norm" in n)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 16))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    nbytes = 0
    L = local_of  # at rest parameters, gradients and AdamW state are DTensors: count their shards
    for p in model.parameters():
        nbytes += L(p).numel() * p.element_size() + L(p.grad).numel() * p.grad.element_size()
        state = opt.state[p]
        nbytes += sum(L(state[k]).numel() * state[k].element_size() for k in ("exp_avg", "exp_avg_sq"))
    local = sum(L(p).numel() for p in model.parameters())
    groups = [m._fsdp2d_fsdp.group for m in model.modules() if isinstance(m, fsdp2d.FSDPModule)]
    padding = sum(g.total for g in groups) - local
    dp, tp = mesh["dp"].size(), mesh["tp"].size()
    ideal = (n_total - tp_replicated) / (dp * tp) + tp_replicated / dp
    return {"bytes": nbytes, "local": local, "ideal": ideal, "padding": padding,
            "n_total": n_total, "dp": dp, "tp": tp}


def test_memory_is_16_bytes_per_local_parameter(pool):
    for rank, r in enumerate(pool.run(job_memory)):
        print(f"rank {rank}: params+grads+AdamW = {r['bytes']} B = 16 x {r['local']} local elements; "
              f"N={r['n_total']}, N/(dp*tp) = {r['n_total'] / (r['dp'] * r['tp']):.0f}, "
              f"exact share with TP-replicated norms = {r['ideal']:.0f}; flat-buffer padding "
              f"{r['padding']} ({100 * r['padding'] / r['local']:.2f}%)")
        assert r["bytes"] == 16 * r["local"]
        assert r["local"] == r["ideal"]  # debug Llama sizes split evenly over 2 x 2
        assert r["padding"] < 0.01 * r["local"]


def job_count_tp_all_reduces():
    torch.set_num_threads(1)
    mesh, model = _model_2d()
    x = torch.randint(0, 256, (2, 16))
    counts = []
    for _ in range(2):
        tp = mesh["tp"].get_group()
        with CollectiveCounter() as fwd:
            loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        with CollectiveCounter() as bwd:
            loss.backward()
        counts.append((fwd.count(tp, "all_reduce"), bwd.count(tp, "all_reduce")))
    return counts


def test_column_wise_layers_sharing_an_input_share_one_backward_all_reduce(pool):
    """Per block, forward all-reduces the two row-wise outputs (wo, w2); backward
    all-reduces the input gradient of attention (shared by wq, wk, wv) and of the MLP
    (shared by w1, w3) once each; plus the vocab-parallel embedding in forward and the
    output layer's input in backward. torch's native path does one backward all-reduce
    per column-wise layer: 5 per block instead of 2."""
    layers = LlamaArgs.debug().n_layers
    for fwd, bwd in pool.run(job_count_tp_all_reduces)[0]:
        assert (fwd, bwd) == (2 * layers + 1, 2 * layers + 1), (fwd, bwd)


def job_count_divisions():
    """Division ops in a backward, with the default average and with
    ``set_gradient_divide_factor(1.0)`` (a sum)."""
    from fsdp2d.debug import OpCounter

    torch.set_num_threads(1)
    mesh, model = _model_2d()
    x = torch.randint(0, 256, (2, 16))
    counts = []
    for factor in (None, 1.0):
        if factor is not None:
            for m in model.modules():
                if isinstance(m, fsdp2d.FSDPModule):
                    m.set_gradient_divide_factor(factor)
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        with OpCounter() as ops:
            loss.backward()
        counts.append(ops.ops["aten.div_"])
        model.zero_grad()
    return counts


def test_no_division_at_factor_one(pool):
    """Issue 30 item 4: gloo's pairwise reduce-scatter divides as it finishes (one div_
    per group; NCCL divides inside the collective, see tests/test_scale.py), and a factor
    of 1 divides nothing."""
    groups = LlamaArgs.debug().n_layers + 1
    for default, one in pool.run(job_count_divisions):
        assert (default, one) == (groups, 0)
