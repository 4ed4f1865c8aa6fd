"""One pipeline stage, dry-run: the check of :mod:`fsdp2d.plan.pipeline`'s closed-form model.

``fsdp2d plan`` with ``parallel.pp > 1`` does not dry-run a whole pipelined step (the trainer
runs it; the schedule's fake-world dry run is not built). What it can measure is one stage: :func:`build_stage` builds
the full Llama on the meta device, keeps the layers :func:`fsdp2d.models.stages.stage_layers`
gives the stage (FQNs kept: ``layers.15...`` stays ``layers.15``), the embedding on stage 0 and
the final norm and output on the last, and applies the trainer's TP plan (the entries for the
pieces it holds), activation checkpointing and ``fully_shard`` on the non-pp submesh, as
torchtitan shards a stage under pipelining (``reshard_after_forward=False``: each group is
gathered once per step). (When the trainer gains its own stage builder, this one gives way.)

:func:`stage_dry_run` then runs, under the fake process group and ``FakeTensorMode``, what the
schedule runs on it with two micro-batches in flight: forward 0, forward 1, backward 0 (no
gradient sync, no reshard: torch's pipelining), backward 1 (sync and reshard: its
``perform_reduce_grad``), the optimizer step. Measured: the sharded states, the peak, the bytes
one more micro-batch in flight adds (live after forward 1 minus after forward 0), and the
work (roofline ops, collectives) of one steady-state micro-batch (forward 1 + backward 0).
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import fsdp2d
from fsdp2d.debug import init_fake_world
from fsdp2d.models import Llama
from fsdp2d.models.stages import stage_layers
from fsdp2d.models.tp_plans import llama_tp_plan
from fsdp2d.train.config import JobConfig
from fsdp2d.train.trainer import _checkpoint_activations

from ._dryrun import ShardOptimizer, _loss_context, _snapshot, axis_groups, warm_up
from ._probe import StepProbe
from .estimate import GPU
from .pipeline import format_checks  # (the check lines live with the rest of the table)

__all__ = ["Stage", "build_stage", "stage_dry_run", "check_stages", "format_checks"]


class Stage(nn.Module):
    """The pieces of a :class:`~fsdp2d.models.Llama` one pipeline stage holds, under their
    names in the whole model; the forward of those pieces (tokens in on stage 0, the
    hidden state ``(B, T, C)``, or its sequence shard, otherwise; logits out on the last)."""

    def __init__(self, model: Llama, layers: range, first: bool, last: bool, seq_len: int) -> None:
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope_cache", model.rope_cache, persistent=False)
        self.seq_len = seq_len  # the whole sequence: under sequence parallel the input is a shard of it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rope = self.rope_cache[: self.seq_len]  # (T, 2, D/2)
        h = x if self.tok_embeddings is None else self.tok_embeddings(x)  # (B, T, C)
        for layer in self.layers.values():
            h = layer(h, rope)
        return h if self.output is None else self.output(self.norm(h))


def build_stage(cfg: JobConfig, mesh: fsdp2d.DeviceMesh, stage: int) -> Stage:
    """Stage ``stage`` of ``cfg``'s pipeline on ``mesh`` (the non-pp submesh), on the meta
    device, parallelized as the module doc says."""
    p = cfg.parallel
    n_stages = p.pp * cfg.pp_stages_per_rank
    with torch.device("meta"):
        model = Llama(cfg.model.to_args())
    s = Stage(model, stage_layers(cfg.model.n_layers, n_stages)[stage], stage == 0, stage == n_stages - 1,
              cfg.data.seq_len)
    del model
    if p.tp > 1:
        held = {name for name, child in s.named_children() if child is not None}
        plan = llama_tp_plan(sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel)
        fsdp2d.parallelize_module(s, mesh["tp"], {k: v for k, v in plan.items() if k.split(".")[0] in held})
    blocks = list(s.layers.values())
    if cfg.training.activation_checkpointing != "none":
        for block in blocks:
            _checkpoint_activations(block, cfg.training.activation_checkpointing)
    dp_mesh = mesh[tuple(n for n in mesh.mesh_dim_names if n != "tp")]
    bf16 = cfg.training.mixed_precision == "bf16"
    mp = fsdp2d.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else fsdp2d.MixedPrecisionPolicy()
    groups = [m for m in ([s.tok_embeddings], *([b] for b in blocks), [s.norm, s.output]) if m[0] is not None]
    for group in groups:
        fsdp2d.fully_shard(group if len(group) > 1 else group[0], mesh=dp_mesh, mp_policy=mp,
                           reshard_after_forward=False)
    fsdp2d.fully_shard(s, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    return s


def _input(cfg: JobConfig, stage: Stage) -> torch.Tensor:
    """What the stage receives per micro-batch: tokens, or the previous stage's output."""
    b, T = cfg.micro_batch, cfg.data.seq_len
    if stage.tok_embeddings is not None:
        return torch.randint(0, cfg.model.vocab_size, (b, T))
    p = cfg.parallel
    local = T // p.tp if p.tp > 1 and p.sequence_parallel else T
    dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else torch.float32
    return torch.randn(b, local, cfg.model.dim, dtype=dtype, requires_grad=True)


def _forward(stage: Stage, cfg: JobConfig, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The stage's output, or on the last stage its loss."""
    with _loss_context(cfg):
        out = stage(x)
        if stage.output is None:
            return out
        logits = out if cfg.parallel.loss_parallel else out.float()
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()) / cfg.accum_steps


def _backward(cfg: JobConfig, out: torch.Tensor) -> None:
    with _loss_context(cfg):
        out.backward(None if out.dim() == 0 else torch.ones_like(out))  # the gradient the next stage sends


def _difference(a: tuple, b: tuple, ops: list) -> tuple[dict, list]:
    (c0, n0, _), (c1, n1, _) = a, b
    comm = {f"{k[0]}/{k[1]}": [v[0] - c0.get(k, [0, 0])[0], v[1] - c0.get(k, [0, 0])[1]] for k, v in c1.items()}
    return {k: v for k, v in comm.items() if v[0]}, ops[n0:n1]


def stage_dry_run(cfg: JobConfig, world: int, rank: int, stage: int) -> dict:
    """Rank ``rank``'s figures for pipeline stage ``stage`` (module doc). Keys: ``parameters``,
    ``gradients``, ``optimizer`` (bytes, sharded), ``peak`` (two micro-batches in flight),
    ``chunk`` (bytes one more in flight adds), ``micro_batch_ops`` and ``micro_batch_collectives``
    (``axis/kind``: [count, bytes]) of one steady-state micro-batch, ``step_collectives``."""
    init_fake_world(rank, world)
    try:
        mesh = fsdp2d.init_device_mesh("cpu", cfg.mesh_shape, mesh_dim_names=cfg.mesh_dim_names)
        sub = mesh[tuple(n for n in cfg.mesh_dim_names if n != "pp")]
        cpu = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, device="cpu"))
        s = build_stage(cpu, sub, stage)
        with FakeTensorMode(allow_non_fake_inputs=True):
            s.to_empty(device="cpu")
            opt = ShardOptimizer(s, cfg)
            x = _input(cfg, s)
            y = torch.randint(0, cfg.model.vocab_size, (cfg.micro_batch, cfg.data.seq_len))
            warm_up(s, opt, x)
            out = _measure(s, opt, cfg, x, y, axis_groups(sub))
        del s, opt
        return out
    finally:
        gc.collect()
        dist.destroy_process_group()


def _measure(s: Stage, opt: ShardOptimizer, cfg: JobConfig, x: torch.Tensor, y: torch.Tensor,
             axes: dict[str, str]) -> dict:
    probe = StepProbe(axes)
    params = list(s.parameters())
    probe.tag(params, "parameters")
    probe.tag(list(opt.state.values()), "optimizer")
    probe.tag((x, y), "batch")
    with probe:
        out0 = _forward(s, cfg, x, y)
        after0 = probe.current
        mid0 = _snapshot(probe)
        out1 = _forward(s, cfg, x, y)
        chunk = probe.current - after0
        s.set_requires_gradient_sync(False)
        s.set_reshard_after_backward(False)
        _backward(cfg, out0)
        mid1 = _snapshot(probe)
        s.set_requires_gradient_sync(True)
        s.set_reshard_after_backward(True)
        _backward(cfg, out1)
        del out0, out1
        probe.tag([p.grad for p in params if p.grad is not None], "gradients")
        gradients = probe.live_bytes("gradients")
        opt.step()
        probe.tag(list(opt.state.values()), "optimizer")
        opt.zero_grad()
    comm, ops = _difference(mid0, mid1, probe.ops)
    local = [p._local_tensor if hasattr(p, "_local_tensor") else p for p in params]
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in local}
    return {"parameters": sum(storages.values()), "gradients": gradients,
            "optimizer": probe.live_bytes("optimizer"), "peak": probe.peak, "chunk": chunk,
            "micro_batch_ops": ops, "micro_batch_collectives": comm,
            "step_collectives": {f"{a}/{k}": v for (a, k), v in sorted(probe.collectives.items())}}


def _timed(task: tuple) -> tuple[dict, float]:
    t0 = time.perf_counter()
    out = stage_dry_run(*task)
    return out, time.perf_counter() - t0


def check_stages(cfg: JobConfig, world: int, ranks: list[int], gpu: "GPU", gpus_per_node: int) -> list[dict]:
    """For each of ``ranks`` (global), its pipeline rank's largest stage dry-run (in forked
    processes, one per CPU) beside :mod:`fsdp2d.plan.pipeline`'s figures for it with the same
    two micro-batches in flight."""
    from .estimate import roofline_seconds
    from .pipeline import ModelCounts, Pipeline, rank_stages, stage_figures, stage_seconds

    pipe, counts, per_pp = Pipeline.of(cfg), ModelCounts.of(cfg), world // cfg.parallel.pp
    picks = {}
    for rank in ranks:  # one dry run per pipeline rank: the others of its stage are the same shapes
        stage = max(rank_stages(cfg, pipe, rank // per_pp), key=lambda s: (len(s[1]), -s[0]))[0]
        picks.setdefault(rank // per_pp, (rank, stage))
    tasks = [(cfg, world, rank, stage) for rank, stage in picks.values()]
    workers = min(len(tasks), len(os.sched_getaffinity(0)))
    if workers > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            done = pool.map(_timed, tasks)
    else:
        done = [_timed(t) for t in tasks]
    n_stages = pipe.pp * pipe.stages
    out = []
    for (_, _, rank, stage), (measured, seconds) in zip(tasks, done):
        model = stage_figures(cfg, counts, stage, chunks=2)
        compute, _ = stage_seconds(cfg, counts, model["layers"], stage == 0, stage == n_stages - 1, gpu,
                                   gpus_per_node)
        ops = measured.pop("micro_batch_ops")
        out.append({"rank": rank, "stage": stage, "dry_run_s": seconds, "measured": measured, "model": model,
                    "measured_compute_s": roofline_seconds(ops, gpu), "model_compute_s": compute})
    return out
