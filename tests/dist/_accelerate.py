"""accelerate's FSDP2 ``prepare`` of a model fsdp2d already sharded: jobs for the pool.

The user's script: build accelerate's ``Accelerator`` with its FSDP2 plugin
(``FullyShardedDataParallelPlugin(fsdp_version=2)``) and a ``ParallelismConfig``, so
accelerate builds its own torch mesh (``dp_shard``, or ``dp_replicate`` x ``dp_shard`` for
HSDP, plus the flattened ``dp_shard_cp`` it shards over); shard the model with
``fsdp2d.fully_shard`` per block and root on ``mesh[accelerator.parallelism_config.fsdp_dim_names]``
(the sub-mesh accelerate's own ``fsdp2_prepare_model`` would use); then
``accelerator.prepare(model, optimizer)``, ``accelerator.backward``,
``accelerator.clip_grad_norm_``. accelerate's ``fsdp2_prepare_model`` returns a model that is
``isinstance(..., torch.distributed.fsdp.FSDPModule)`` as it is: fsdp2d's class is a subclass,
so no torch ``fully_shard`` is applied on top (counted by wrapping torch's function).

One CPU workaround: accelerate turns the FSDP plugin on only for accelerator devices (the
branch of ``AcceleratorState.__init__`` that sets ``distributed_type = FSDP`` lists GPU-like
types, not ``MULTI_CPU``; ``ParallelismConfig`` then refuses ``MULTI_CPU``), so on CPU the job
builds accelerate's ``AcceleratorState`` first and does what that branch does
(``distributed_type = DistributedType.FSDP``, ``fsdp_plugin = plugin``); ``Accelerator`` then
finds the state initialised and goes on as on a GPU. Everything else is
accelerate's own code: its state reads the pool's ``RANK``/``WORLD_SIZE`` and keeps the
existing gloo group; its state is reset after each job (accelerate keeps it in class-level
singletons).
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from . import _parity as P

STEPS, LR, MAX_NORM, BATCH = 4, 1e-2, 0.5, 8


def _accelerator(hsdp: bool):
    """accelerate's Accelerator for FSDP2 on its own mesh (4 ranks: dp_shard=4, or 2x2 HSDP)."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, TorchDynamoPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2) if hsdp else ParallelismConfig(dp_shard_size=4)
    # The CPU workaround (module docstring): accelerate's state first, given what its FSDP
    # branch gives it on a GPU; the Accelerator below then finds it initialised and uses it.
    state = AcceleratorState(cpu=True, fsdp_plugin=plugin, parallelism_config=config, mixed_precision="no",
                             dynamo_plugin=TorchDynamoPlugin(), _from_accelerator=True)
    state.distributed_type, state.fsdp_plugin = DistributedType.FSDP, plugin
    PartialState().distributed_type = DistributedType.FSDP  # AcceleratorState() copies it from there
    acc = Accelerator(cpu=True, fsdp_plugin=plugin, parallelism_config=config)
    assert acc.is_fsdp2 and acc.state.parallelism_config is config
    return acc


@contextlib.contextmanager
def _reset_after():
    """accelerate keeps its state in class-level dicts; clear them (not the process group)."""
    from accelerate.state import AcceleratorState, GradientState

    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@contextlib.contextmanager
def _count_torch_fully_shard(calls: list):
    """Record every call of torch's ``fully_shard`` (accelerate imports it from
    ``torch.distributed.fsdp`` inside ``fsdp2_prepare_model``)."""
    import torch.distributed.fsdp as tfsdp

    orig = tfsdp.fully_shard

    def counting(module, *args, **kwargs):
        calls.append(type(module).__name__)
        return orig(module, *args, **kwargs)

    tfsdp.fully_shard = counting
    try:
        yield
    finally:
        tfsdp.fully_shard = orig


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (torch's ``full_tensor`` of fsdp2d's DTensors)."""
    with torch.no_grad():
        return {n: p.full_tensor().clone() for n, p in model.named_parameters()}


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, eps=P.EPS, weight_decay=0.1, foreach=True)


def prepare_and_train(hsdp: bool) -> dict:
    """fsdp2d shards the Llama on accelerate's mesh; ``accelerator.prepare``; STEPS AdamW steps
    with ``accelerator.clip_grad_norm_``, beside one process on the whole batch."""
    import fsdp2d

    torch.set_num_threads(1)
    with _reset_after():
        acc = _accelerator(hsdp)
        mesh = acc.torch_device_mesh
        fsdp_mesh = mesh[tuple(acc.parallelism_config.fsdp_dim_names)]
        model = P.build("llama")
        ref = copy.deepcopy(model)
        for block in model.layers:
            fsdp2d.fully_shard(block, mesh=fsdp_mesh)
        fsdp2d.fully_shard(model, mesh=fsdp_mesh)
        params_before = [(n, id(p)) for n, p in model.named_parameters()]
        calls: list = []
        with _count_torch_fully_shard(calls):
            prepared, opt = acc.prepare(model, _adamw(model.parameters()))
        out = {"mesh": (tuple(mesh.mesh_dim_names), tuple(mesh.shape)),
               "fsdp_mesh": (tuple(fsdp_mesh.mesh_dim_names), tuple(fsdp_mesh.shape)),
               "torch_fully_shard_calls": calls, "same_model": prepared is model,
               "same_params": [(n, id(p)) for n, p in prepared.named_parameters()] == params_before,
               "opt_params_are_model_params": [id(p) for g in opt.param_groups for p in g["params"]]
               == [id(p) for p in model.parameters()],
               "classes": sorted({type(m).__mro__[1].__module__ for m in prepared.modules()
                                  if isinstance(m, torch.distributed.fsdp.FSDPModule)})}
        out.update(_train(acc, prepared, opt, ref))
    return out


def _train(acc, model, opt, ref) -> dict:
    """STEPS steps of the prepared model on this rank's rows, of ``ref`` on the whole batch."""
    ref_opt = _adamw(ref.parameters())
    # This rank's rows: accelerate's data-parallel rank and size (its mesh's "dp" axis).
    rank, n = acc.torch_device_mesh["dp"].get_local_rank(), acc.torch_device_mesh["dp"].size()
    rows = slice(rank * BATCH // n, (rank + 1) * BATCH // n)
    out: dict = {"losses": [], "ref_losses": [], "norms": [], "ref_norms": []}
    for step in range(STEPS):
        x, y = P.batch_for(step, P.Setup(batch=BATCH))
        loss = F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten())
        acc.backward(loss)
        norm = acc.clip_grad_norm_(model.parameters(), MAX_NORM)
        ref_loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        ref_loss.backward()
        out["ref_norms"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item())
        out["norms"].append(norm.full_tensor().item() if isinstance(norm, DTensor) else norm.item())
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        out["losses"].append(acc.reduce(loss.detach(), reduction="mean").item())
        out["ref_losses"].append(ref_loss.item())
    full = _full(model)
    out["param_errs"] = {n: (full[n] - q.detach()).abs().max().item() for n, q in ref.named_parameters()}
    return out
