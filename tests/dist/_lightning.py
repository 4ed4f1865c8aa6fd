"""Lightning Fabric's ``ModelParallelStrategy`` driving fsdp2d: jobs that run on every pool rank.

Fabric normally launches its own processes. In the pool the default gloo group already
exists and each worker has ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE`` set,
so Lightning picks its own ``LightningEnvironment`` (``LOCAL_RANK`` set: processes created
externally, no launcher) and its ``_init_dist_connection`` keeps the existing group. Nothing
of Lightning is patched: ``ModelParallelStrategy.setup_environment`` builds its own 2-D torch
mesh ``("data_parallel", "tensor_parallel")`` and hands it to the parallelize hook, which
calls fsdp2d's ``parallelize_module`` (``llama_tp_plan()``: its ``ColwiseParallel`` /
``RowwiseParallel`` styles, replicated logits) on
``mesh["tensor_parallel"]`` and fsdp2d's ``fully_shard`` on ``mesh["data_parallel"]``.
``accelerator="cpu"`` is accepted by the strategy as it is (gloo backend).
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from . import _parity as P

DP, TP = 2, 2
STEPS, LR, MAX_NORM = 4, 1e-2, 0.5


def parallelize(model: torch.nn.Module, device_mesh) -> torch.nn.Module:
    """Fabric's parallelize hook: TP, then FSDP per block and root, on Lightning's mesh."""
    import fsdp2d
    from fsdp2d.models import llama_tp_plan  # fsdp2d's ColwiseParallel / RowwiseParallel per layer
    from fsdp2d.tensor_parallel import parallelize_module

    parallelize_module(model, device_mesh["tensor_parallel"], llama_tp_plan())
    dp_mesh = device_mesh["data_parallel"]
    for block in model.layers:
        fsdp2d.fully_shard(block, mesh=dp_mesh)
    fsdp2d.fully_shard(model, mesh=dp_mesh)
    return model


def _fabric(full_state_dict: bool):
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=DP, tensor_parallel_size=TP,
                                     save_distributed_checkpoint=not full_state_dict)
    fabric = Fabric(accelerator="cpu", devices=DP * TP, strategy=strategy)
    fabric.launch()  # no launcher (processes exist): runs setup_environment, builds the mesh
    return fabric


def _full(model, which: str = "param") -> dict[str, torch.Tensor]:
    """Full parameters (or gradients) by the user's names (``.module``: under Fabric's wrapper)."""
    with torch.no_grad():
        return {n: (p if which == "param" else p.grad).full_tensor().clone()
                for n, p in model.module.named_parameters()}


def _optim_full(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(model.module, opt.optimizer, options=StateDictOptions(full_state_dict=True))
    return {f"{n}.{k}": v.clone() for n, st in sd["state"].items() for k, v in st.items()}


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, eps=P.EPS, weight_decay=0.1, foreach=True)


def train_clip_save_load(ckpt: str, full_state_dict: bool) -> dict:
    """Fabric trains the Llama on its 2x2 mesh beside a one-process reference; then
    ``fabric.save`` / ``fabric.load`` into a freshly set-up model and optimizer, as a DCP
    folder (Lightning's default) or, with ``full_state_dict``, one full file."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    fabric = _fabric(full_state_dict)
    mesh = fabric.strategy.device_mesh
    out: dict = {"mesh": (tuple(mesh.mesh_dim_names), tuple(mesh.shape)),
                 "sampler": fabric.strategy.distributed_sampler_kwargs}  # Lightning's own data rank
    t1 = time.perf_counter()
    model, opt = _train(fabric, out)
    t2 = time.perf_counter()
    _save_load_resume(fabric, model, opt, ckpt, out)
    out["times"] = [t1 - t0, t2 - t1, time.perf_counter() - t2]
    return out


def _train(fabric, out: dict):
    """STEPS AdamW steps with ``fabric.clip_gradients``, beside one process on the whole batch."""
    model = P.build("llama")
    ref = copy.deepcopy(model)
    model = fabric.setup(model)
    opt, ref_opt = fabric.setup_optimizers(_adamw(model.parameters())), _adamw(ref.parameters())
    out["all_dtensor"] = all(isinstance(p, DTensor) for p in model.parameters())
    part = _part(out["sampler"])
    for key in ("losses", "ref_losses", "norms", "ref_norms", "grad_errs"):
        out[key] = []
    for step in range(STEPS):
        x, y = P.batch_for(step, P.Setup(batch=8))
        loss = F.cross_entropy(model(x[part]).flatten(0, 1), y[part].flatten())
        fabric.backward(loss)
        norm = fabric.clip_gradients(model, opt, max_norm=MAX_NORM)
        ref_loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        grads = _full(model, "grad")  # the clipped gradients, against one process's
        out["grad_errs"].append(max((grads[n] - q.grad).abs().max().item() for n, q in ref.named_parameters()))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        out["losses"].append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        out["ref_losses"].append(ref_loss.item())
        out["norms"].append(norm.full_tensor().item() if isinstance(norm, DTensor) else norm.item())
        out["ref_norms"].append(ref_norm.item())
    full = _full(model)
    out["param_errs"] = {n: (full[n] - q.detach()).abs().max().item() for n, q in ref.named_parameters()}
    return model, opt


def _save_load_resume(fabric, model, opt, ckpt: str, out: dict) -> None:
    """``fabric.save``, ``fabric.load`` into a fresh model + optimizer (other weights), compare
    exactly; then one more step on each pair must agree bit for bit."""
    saved, saved_opt = _full(model), _optim_full(model, opt)
    fabric.save(ckpt, {"model": model, "optimizer": opt, "step": STEPS})
    torch.manual_seed(999)
    fresh = fabric.setup(_reinit(P.build("llama")))
    fresh_opt = fabric.setup_optimizers(_adamw(fresh.parameters()))
    state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    before = _full(fresh)
    fabric.load(ckpt, state)
    loaded, loaded_opt = _full(fresh), _optim_full(fresh, fresh_opt)
    out["fresh_differed"] = any(not torch.equal(before[n], saved[n]) for n in saved)
    out["load_param_diffs"] = [n for n in saved if not torch.equal(saved[n], loaded[n])]
    out["load_optim_diffs"] = sorted(k for k in saved_opt.keys() | loaded_opt.keys()
                                     if k not in saved_opt or k not in loaded_opt
                                     or not torch.equal(saved_opt[k], loaded_opt[k]))
    out["n_optim"], out["step"] = len(saved_opt), state["step"]
    x, y = P.batch_for(STEPS, P.Setup(batch=8))
    part = _part(out["sampler"])
    for m, o in ((model, opt), (fresh, fresh_opt)):
        fabric.backward(F.cross_entropy(m(x[part]).flatten(0, 1), y[part].flatten()))
        o.step()
        o.zero_grad()
    a, b = _full(model), _full(fresh)
    out["resume_diffs"] = [n for n in a if not torch.equal(a[n], b[n])]


def _part(sampler: dict) -> slice:
    """This data-parallel rank's rows of the global batch of 8."""
    n = 8 // sampler["num_replicas"]
    return slice(sampler["rank"] * n, (sampler["rank"] + 1) * n)


def _reinit(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def accumulate() -> dict:
    """Two micro-batches per step under ``fabric.no_backward_sync`` (skip the sync on the
    first), against one process on the whole batch; reduce-scatters counted per step."""
    import fsdp2d
    from fsdp2d.debug import CollectiveCounter

    torch.set_num_threads(1)
    fabric = _fabric(full_state_dict=False)
    model = P.build("llama")
    ref = copy.deepcopy(model)
    model = fabric.setup(model)
    dp_group = fabric.strategy.device_mesh["data_parallel"].get_group()
    part = _part(fabric.strategy.distributed_sampler_kwargs)
    x, y = P.batch_for(0, P.Setup(batch=8))
    xs, ys = x[part], y[part]
    with CollectiveCounter() as counter:
        for m, rows in enumerate((slice(0, 2), slice(2, 4))):
            with fabric.no_backward_sync(model, enabled=m == 0):
                fabric.backward(F.cross_entropy(model(xs[rows]).flatten(0, 1), ys[rows].flatten()) / 2)
    F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
    grads = _full(model, "grad")
    return {"grad_err": max((grads[n] - q.grad).abs().max().item() for n, q in ref.named_parameters()),
            "reduce_scatters": counter.count(dp_group, "reduce_scatter"),
            "groups": sum(isinstance(mod, fsdp2d.FSDPModule) for mod in model.modules())}
