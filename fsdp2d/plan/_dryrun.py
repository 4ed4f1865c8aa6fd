"""One rank of a real job, one real training step, nothing allocated.

:func:`dry_run` starts torch's fake process group as rank ``rank`` of ``world``, builds
the job's mesh and model exactly as ``fsdp2d train`` does
(:func:`fsdp2d.train.trainer.parallelize_model`: meta device, TP plan, activation
checkpointing, ``fully_shard`` per block and root) *outside* ``FakeTensorMode``, then
inside it materialises the shards (``to_empty``), runs one warm-up step (lazy set-up,
optimizer state) and one measured step under :class:`~fsdp2d.plan._probe.StepProbe`.

The measured step is the trainer's (``Trainer.train_step``): ``accum`` micro-batches
of ``micro_batch x seq_len`` tokens, gradient sync per ``training.grad_sync``, the
trainer's loss (vocab-parallel under ``parallel.loss_parallel``), global-norm clipping,
AdamW (``foreach`` on CUDA, torch's default there), ``zero_grad``. Micro-batches 2 to
``accum - 1`` are the same step after step (same ops, same live memory: the gradient
accumulators exist from the first one on), so at most three run: the first, one of the
middle ones and the last; the middle one's collectives and work count ``accum - 2``
times. The memory peak is exact either way. With more than one micro-batch, the step is
measured a second time in the other ``training.grad_sync`` mode (:func:`measure_modes`),
so the report shows what each accumulation mode costs, both measured.

AdamW steps the parameters' local shards (:class:`ShardOptimizer`). DTensor runs an
optimizer op as the same op on its operands' local tensors when, index by index, the
parameter, its gradient and its state share one spec, as they do here: the probe sees
those local ops either way (``tests/dist/test_plan.py`` checks every figure equal).
Through DTensor, each foreach op's sharding is propagated once per process for every
parameter (7 ops x 723 parameters for 70B: 12 s of CPU, 28 s for 405B), for no op.

Differences from the GPU job, stated in the output: the fake step runs on the CPU
device, so attention is torch's CPU flash kernel (same shapes and saved tensors as the
CUDA one: output and log-sum-exp), and the CUDA caching allocator's rounding, the CUDA
context and NCCL's buffers are not tensors and are not counted.
"""

from __future__ import annotations

import dataclasses
import gc
from contextlib import nullcontext
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import fsdp2d
from fsdp2d._dtensor import local_of
from fsdp2d.debug import init_fake_world
from fsdp2d.mesh import axis_size
from fsdp2d.train.config import JobConfig
from fsdp2d.train.optim import build_optimizer
from fsdp2d.train.trainer import parallelize_model

from ._probe import StepProbe

__all__ = ["dry_run", "measure_step", "measure_modes", "trainer_step", "warm_up", "axis_groups", "build_optimizer",
           "ShardOptimizer"]


def _loss_context(cfg: JobConfig):
    p = cfg.parallel
    return fsdp2d.loss_parallel() if p.loss_parallel and p.tp > 1 else nullcontext()


def _micro_step(model: torch.nn.Module, cfg: JobConfig, x: torch.Tensor, y: torch.Tensor,
                probe: StepProbe | None, m: int) -> None:
    """One micro-batch, as ``Trainer._loss`` + ``loss.backward()``."""
    if probe is not None:
        probe.phase = f"forward {m}"
    with _loss_context(cfg):
        logits = model(x)  # (b, T, V), vocab-sharded under loss_parallel
        if not cfg.parallel.loss_parallel:
            logits = logits.float()
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / cfg.accum_steps
        del logits
        if probe is not None:
            probe.phase = f"backward {m}"
        loss.backward()


def _accumulators(model: torch.nn.Module) -> list[torch.Tensor]:
    """The unsharded gradient accumulators fsdp2d keeps between no-sync micro-batches."""
    groups = [m._fsdp2d_fsdp.group for m in model.modules() if isinstance(m, fsdp2d.FSDPModule)]
    return [p.acc_grad for g in groups if g is not None for p in g.params if p.acc_grad is not None]


def _optimizer_step(params: list[torch.Tensor], opt: "torch.optim.Optimizer | ShardOptimizer", cfg: JobConfig) -> None:
    """The trainer's loss all-reduce (its logged mean loss), clipping and AdamW step."""
    loss = torch.zeros(1, device=params[0].device)
    dist.all_reduce(loss)
    max_norm = cfg.optim.max_norm if cfg.optim.max_norm > 0 else float("inf")
    fsdp2d.clip_grad_norm_(params, max_norm)
    opt.step()


def trainer_step(model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: JobConfig, x: torch.Tensor,
                 y: torch.Tensor, zero_grad: bool = True) -> None:
    """The trainer's step with every micro-batch, unmeasured (the checks' real run)."""
    accum = cfg.accum_steps
    for m in range(accum):
        model.set_requires_gradient_sync(cfg.syncs_gradients(m))
        _micro_step(model, cfg, x, y, None, m)
    _optimizer_step(list(model.parameters()), opt, cfg)
    if zero_grad:
        opt.zero_grad()


def _snapshot(probe: StepProbe) -> tuple:
    return ({k: list(v) for k, v in probe.collectives.items()}, len(probe.ops), probe.flops)


def _repeat(probe: StepProbe, before: tuple, after: tuple, times: int) -> None:
    """Count the work of the micro-batch between two snapshots ``times`` more times."""
    if times <= 0:
        return
    (c0, n0, f0), (c1, n1, f1) = before, after
    for key, (count, size) in c1.items():
        prev = c0.get(key, [0, 0])
        entry = probe.collectives.setdefault(key, [0, 0])
        entry[0] += (count - prev[0]) * times
        entry[1] += (size - prev[1]) * times
    probe.ops.extend((f, b, n * times) for f, b, n in probe.ops[n0:n1])  # counted, not copied: accum may be 10^6
    probe.flops += (f1 - f0) * times


def measure_step(model: torch.nn.Module, opt: "torch.optim.Optimizer | ShardOptimizer", cfg: JobConfig,
                 batch: tuple[torch.Tensor, torch.Tensor], axis_of_group: dict[str, str]) -> dict:
    """Run the trainer's step once under a :class:`StepProbe` and return its figures.
    Works on real and fake tensors (the checks run it on a real CPU job)."""
    x, y = batch
    gc.collect()
    probe = StepProbe(axis_of_group)
    params = list(model.parameters())
    probe.tag(params, "parameters")
    probe.tag(list(opt.state.values()), "optimizer")
    probe.tag(list(model.buffers()), "buffers")
    probe.tag((x, y), "batch")
    at_rest = probe.current
    accum = cfg.accum_steps
    with probe:
        for m in sorted({0, accum - 1}):
            model.set_requires_gradient_sync(cfg.syncs_gradients(m))
            before = _snapshot(probe)
            _micro_step(model, cfg, x, y, probe, m)
            if m == 0:  # micro-batches 1 .. accum - 2 repeat the first (see the module doc)
                _repeat(probe, before, _snapshot(probe), accum - 2)
            # unsharded accumulators after a no-sync micro-batch, sharded gradients after the last
            probe.tag(_accumulators(model), "gradients")
            probe.tag([p.grad for p in params if p.grad is not None], "gradients")
        probe.phase = "optimizer"
        _optimizer_step(params, opt, cfg)
        gradients = probe.live_bytes("gradients")
        probe.tag(list(opt.state.values()), "optimizer")
        opt.zero_grad()
    return _figures(probe, params, at_rest, gradients)


def _figures(probe: StepProbe, params: list[torch.Tensor], at_rest: int, gradients: int) -> dict:
    local = [p._local_tensor if hasattr(p, "_local_tensor") else p for p in params]
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in local}
    real = sum(t.numel() * t.element_size() for t in local)
    return {
        "parameters": sum(storages.values()), "padding": sum(storages.values()) - real,
        "gradients": gradients, "optimizer": probe.live_bytes("optimizer"),
        "at_rest": at_rest, "peak": probe.peak, "peak_breakdown": probe.breakdown(),
        "phase_peak": dict(probe.phase_peak),
        "collectives": {f"{a}/{k}": v for (a, k), v in sorted(probe.collectives.items())},
        "flops": probe.flops, "ops": probe.ops,
    }


class ShardOptimizer:
    """The trainer's optimizer (:func:`build_optimizer`) over the parameters' local
    shards (see the module doc), made at the first ``step``: FSDP's lazy set-up in the
    first forward moves every shard into its group's flat buffer. ``step`` hands it the
    gradients' local tensors; ``zero_grad`` drops the parameters' gradients as the
    trainer's does."""

    def __init__(self, model: torch.nn.Module, cfg: JobConfig) -> None:
        self.params, self.cfg = list(model.parameters()), cfg
        self.inner: torch.optim.Optimizer | None = None

    @property
    def state(self) -> dict:
        return {} if self.inner is None else self.inner.state

    def step(self) -> None:
        shards = [local_of(p) for p in self.params]
        if self.inner is None:
            self.inner = build_optimizer(shards, self.cfg)
        elif any(a is not b for a, b in zip(shards, self.inner.param_groups[0]["params"])):
            raise RuntimeError("a parameter's local tensor changed between two steps: the dry run's optimizer "
                               "would step the old one")
        for p, shard in zip(self.params, shards):
            shard.grad = None if p.grad is None else local_of(p.grad)
        self.inner.step()

    def zero_grad(self) -> None:
        if self.inner is not None:
            self.inner.zero_grad()
        for p in self.params:
            p.grad = None


def axis_groups(mesh: fsdp2d.DeviceMesh) -> dict[str, str]:
    """Process-group name -> mesh axis name; the whole world (e.g. the gradient-norm
    all-reduce) is ``world`` unless one axis spans it."""
    out = {dist.group.WORLD.group_name: "world"}
    out.update({mesh.get_group(n).group_name: n for n in mesh.mesh_dim_names if axis_size(mesh, n) > 1})
    return out


def warm_up(model: torch.nn.Module, opt: "torch.optim.Optimizer | ShardOptimizer", x: torch.Tensor) -> None:
    """Bring model and optimizer to their state between two training steps at the cost
    of a forward: the first forward's lazy set-up, every group resharded, AdamW's
    state created by a step on zero gradients (the state a real step creates)."""
    with torch.no_grad():
        model(x)
    for m in model.modules():
        if isinstance(m, fsdp2d.FSDPModule):
            m.reshard()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()


def _mode_figures(measured: dict) -> dict:
    """What one ``training.grad_sync`` mode costs: the step's peak, the gradients live at
    that peak (unsharded accumulators and sharded gradients), the phase of the peak and
    the collectives (``axis/kind``: [count, bytes])."""
    phase = max(measured["phase_peak"], key=measured["phase_peak"].get)
    return {"peak": measured["peak"], "gradients_at_peak": measured["peak_breakdown"].get("gradients", 0),
            "peak_phase": phase, "collectives": measured["collectives"]}


def measure_modes(model: torch.nn.Module, opt: "torch.optim.Optimizer | ShardOptimizer", cfg: JobConfig,
                  batch: tuple[torch.Tensor, torch.Tensor], axis_of_group: dict[str, str],
                  compare_modes: bool = True, progress: Callable[[str], None] | None = None) -> dict:
    """:func:`measure_step` in the config's ``training.grad_sync`` mode; with more than one
    micro-batch per step and ``compare_modes``, the same step again in the other mode
    (one more measured step on the model already built: the two figures are both
    measured, never derived). The result carries ``accumulation``: ``chosen``, and per
    mode :func:`_mode_figures`. ``progress`` gets a line before each measured step."""
    say = progress or (lambda line: None)
    chosen = cfg.training.grad_sync
    say(f"measuring the training step ({cfg.accum_steps} micro-batches, grad_sync {chosen})")
    out = measure_step(model, opt, cfg, batch, axis_of_group)
    modes = {chosen: _mode_figures(out)}
    if compare_modes and cfg.accum_steps > 1:
        other = "last" if chosen == "every" else "every"
        say(f"measuring the step again with grad_sync {other}")
        alt = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, grad_sync=other))
        modes[other] = _mode_figures(measure_step(model, opt, alt, batch, axis_of_group))
    out["accumulation"] = {"chosen": chosen, "accum_steps": cfg.accum_steps, "modes": modes}
    return out


def dry_run(cfg: JobConfig, world: int, rank: int, *, shard_optimizer: bool = True,
            compare_modes: bool = True, progress: Callable[[str], None] | None = None) -> dict:
    """Figures of rank ``rank``'s step in a job of ``world`` ranks (see module doc);
    ``shard_optimizer=False`` steps AdamW through DTensor instead (the checks compare);
    ``compare_modes=False`` skips measuring the other ``training.grad_sync`` mode
    (:func:`measure_modes`). ``progress`` gets a line as each stage starts (a dry run of
    70B at 1024 x 8 takes half a minute or more)."""
    say = progress or (lambda line: None)
    init_fake_world(rank, world)
    try:
        cpu = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, device="cpu"))
        mesh = fsdp2d.init_device_mesh("cpu", cfg.mesh_shape, mesh_dim_names=cfg.mesh_dim_names)
        model = parallelize_model(cpu, mesh)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            opt = ShardOptimizer(model, cfg) if shard_optimizer else build_optimizer(model.parameters(), cfg)
            x = torch.randint(0, cfg.model.vocab_size, (cfg.micro_batch, cfg.data.seq_len))
            y = torch.randint(0, cfg.model.vocab_size, (cfg.micro_batch, cfg.data.seq_len))
            say("model built and sharded; warm-up forward and optimizer step")
            warm_up(model, opt, x)
            # Python's cyclic collector would otherwise walk the model, torch's modules and
            # every live fake tensor again and again while the step allocates ~10^6 objects
            # (70B at 80 blocks: 10% of a dry run); a caller that froze (the search) keeps its own.
            frozen = gc.get_freeze_count() == 0
            if frozen:
                gc.collect()
                gc.freeze()
            try:
                out = measure_modes(model, opt, cfg, (x, y), axis_groups(mesh), compare_modes, say)
            finally:
                if frozen:
                    gc.unfreeze()
        out["coordinate"] = dict(zip(cfg.mesh_dim_names, mesh.get_coordinate()))
        out["axis_ranks"] = {n: mesh[n].mesh.flatten().tolist() for n in cfg.mesh_dim_names}
        out["axis_ranks"]["world"] = list(range(world))
        del model, opt
        return out
    finally:
        gc.collect()
        dist.destroy_process_group()
