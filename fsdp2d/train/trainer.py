"""The pretraining loop, written against fsdp2d's public API only (as a user would).

config -> mesh -> model on the meta device -> TP plan -> activation checkpointing ->
``fully_shard`` per block and root -> ``to_empty`` + ``init_weights`` -> AdamW with
warmup and decay -> microbatches without gradient sync until the last -> global-norm
clipping -> metrics, evaluation and checkpoints. A resumed run loads model, optimizer,
data position and RNG state from the latest checkpoint and continues bit for bit.

**No host syncs in a step** (DESIGN item 9). Reading a device value (``.item()``) makes
the CPU wait for the GPU to finish everything queued, so the next step's kernels are not
queued while this one runs. A step keeps its loss (summed over the world by an all-reduce,
which does not wait) and its gradient norm on the device; the trainer reads them, all
steps since the last read at once, only at steps that log (``training.log_every``, the
last step, evaluations) or save a checkpoint, as torchtitan does. At those steps the read
comes before the optimizer step, so a non-finite loss there stops the run before the
update (and no checkpoint is ever saved after one); a non-finite loss at a step between
two reads is reported at the next read, naming its step, with the updates since taken.
Throughput and step time are the mean over the steps since the last read.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import math
import os
import time
from contextlib import nullcontext
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as recompute

import fsdp2d
from fsdp2d import checkpoint as ckpt
from fsdp2d.clip import clip_grad_norm_across_stages_
from fsdp2d.hf.export import export_hf
from fsdp2d.hf.weights import load_hf_into
from fsdp2d.models import GPT2, Llama, document_ids, gpt2_tp_plan, llama_tp_plan
from fsdp2d.mesh import axis_size
from fsdp2d.hf.weights import model_spec

from fsdp2d.data import DataStateError

from . import lock, preflight
from .config import ConfigError, JobConfig, save_config, validate
from .data import build_data
from .metrics import Metrics, Progress, allocator_metrics, device_peak, peak_memory_mib, throughput
from .optim import adamw_kind, build_optimizer
from .pipeline import Pipeline
from .writers import build_writers


class TrainingError(RuntimeError):
    """The run cannot go on (a NaN loss); the message says what was kept."""


def build_model(cfg: JobConfig, mesh: fsdp2d.DeviceMesh, say=lambda what: None) -> torch.nn.Module:
    """Meta-device model, parallelized, materialised with this rank's shards only
    (``say``: start-up progress, see :class:`~fsdp2d.train.metrics.Progress`)."""
    model = parallelize_model(cfg, mesh)
    say("model built on the meta device and sharded (TP plan, fully_shard)")
    model.to_empty(device=cfg.parallel.device)
    torch.manual_seed(cfg.training.seed)
    model.init_weights()
    if cfg.model.init_from:  # each rank reads only its own shards of the HF weights
        load_hf_into(model, cfg.model.init_from)
    return model


def parallelize_model(cfg: JobConfig, mesh: fsdp2d.DeviceMesh) -> torch.nn.Module:
    """The model on the meta device with the TP plan, activation checkpointing and
    ``fully_shard`` applied as ``cfg`` says (``fsdp2d plan`` builds with this too; one
    pipeline stage: :func:`fsdp2d.train.pipeline.parallelize_stage`)."""
    args = cfg.model.to_args()
    with torch.device("meta"):
        model = Llama(args) if cfg.model.name == "llama" else GPT2(args)
    return apply_parallelism(cfg, mesh, model)


def apply_parallelism(cfg: JobConfig, mesh: fsdp2d.DeviceMesh, model: torch.nn.Module) -> torch.nn.Module:
    """TP plan, activation checkpointing and ``fully_shard`` over the data axes (all but
    ``tp`` and ``pp``) on a meta-device model: the whole model, or a pipeline stage that
    holds only some of its pieces (the plan's entries for the missing ones are dropped)."""
    p = cfg.parallel
    if p.tp > 1:
        make_plan = llama_tp_plan if cfg.model.name == "llama" else gpt2_tp_plan
        plan = make_plan(sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel)
        plan = {k: v for k, v in plan.items() if getattr(model, k.split(".")[0], None) is not None}
        fsdp2d.parallelize_module(model, mesh["tp"], plan)
    blocks = model.blocks() if cfg.model.name == "llama" else list(model.h)
    if cfg.training.activation_checkpointing != "none":
        for block in blocks:
            _checkpoint_activations(block, cfg.training.activation_checkpointing)
    dp_axes = tuple(n for n in cfg.mesh_dim_names if n not in ("tp", "pp"))
    bf16 = cfg.training.mixed_precision == "bf16"
    mp = fsdp2d.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else fsdp2d.MixedPrecisionPolicy()
    shard_groups(model, blocks, mesh[dp_axes], mp, keep_unsharded=p.pp > 1)
    return model


def shard_groups(model: torch.nn.Module, blocks: list[torch.nn.Module], dp_mesh: fsdp2d.DeviceMesh,
                 mp: fsdp2d.MixedPrecisionPolicy, keep_unsharded: bool = False) -> None:
    """``fully_shard`` as torchtitan wraps: the embeddings in a group of their own, each
    block, the final norm and the output projection as one group, then the root (which
    holds whatever is left: nothing in fsdp2d's models). So the root's all-gather is not
    exposed at the start of forward, nor its reduce-scatter at the end of backward, and
    the output weight's gradient (the largest) is reduced as soon as backward leaves the
    head. The last block and the head are not resharded after forward: backward needs
    them first; with ``keep_unsharded`` (a pipeline stage) no group is, as torchtitan
    under pipelining: each micro-batch would all-gather again. A pipeline stage lacks the
    pieces (None) it does not hold. With tied embeddings (one tensor in both) the root
    keeps both ends."""
    first, last = ([model.tok_embeddings], [model.norm, model.output]) if isinstance(model, Llama) \
        else ([model.wte, model.wpe], [model.ln_f, model.lm_head])
    first, last = [m for m in first if m is not None], [m for m in last if m is not None]
    tied = model.args.tie_embeddings
    if not tied and first:
        fsdp2d.fully_shard(first if len(first) > 1 else first[0], mesh=dp_mesh, mp_policy=mp,
                           reshard_after_forward=not keep_unsharded)
    for i, block in enumerate(blocks):
        fsdp2d.fully_shard(block, mesh=dp_mesh, mp_policy=mp,
                           reshard_after_forward=i < len(blocks) - 1 and not keep_unsharded)
    if not tied and last:
        fsdp2d.fully_shard(last, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    fsdp2d.fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=not keep_unsharded)


_aten = torch.ops.aten
SAVED_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
})
"""The ops whose outputs selective activation checkpointing keeps for backward: the
matmuls and attention (the FLOPs); everything else in a block is recomputed."""


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing's per-op policy (see :data:`SAVED_OPS`)."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_matmuls)


def _checkpoint_activations(block: torch.nn.Module, mode: str = "full") -> None:
    """Recompute ``block``'s forward in backward instead of keeping its activations:
    all of it (``full``), or all but the outputs of :data:`SAVED_OPS` (``selective``)."""
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r}: use 'full' or 'selective' ('none': do not call)")
    inner = block.forward
    extra = {"context_fn": _selective_contexts} if mode == "selective" else {}

    def forward(*args, **kwargs):
        return recompute(inner, *args, use_reentrant=False, **extra, **kwargs)

    block.forward = forward


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without making the host wait: a copy from pageable memory to
    a GPU waits for everything queued before it, so the batch goes through pinned memory
    (a host-side copy) and then to the device with ``non_blocking`` (the caching host
    allocator keeps the pinned buffer until the copy is done). On the CPU, ``t`` itself."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _rng_state() -> str:
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def _set_rng_state(state: str) -> None:
    raw = torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8)
    torch.set_rng_state(raw)


def _sum_over_world(value: torch.Tensor) -> torch.Tensor:
    """Sum of a per-rank scalar as a (1,) float32 device tensor, unread (no host sync)."""
    t = value.detach().float().reshape(1).clone()
    dist.all_reduce(t)
    return t


def _mean_over_world(value: torch.Tensor, holders: int) -> float:
    """Mean of a per-rank scalar held by ``holders`` ranks (the others hold 0: the ranks
    without the last pipeline stage); TP ranks of one data slice hold equal values."""
    return _sum_over_world(value).item() / holders


class Trainer:
    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", cfg.world_size)))
        preflight.check_device(cfg)
        self.mesh = fsdp2d.init_device_mesh(cfg.parallel.device, cfg.mesh_shape, mesh_dim_names=cfg.mesh_dim_names)
        self.rank = dist.get_rank()
        self.say = Progress(enabled=self.rank == 0)
        self.say(f"mesh {' x '.join(f'{n}={s}' for n, s in zip(cfg.mesh_dim_names, cfg.mesh_shape))} "
                 f"({dist.get_world_size()} ranks, {dist.get_backend()})")
        self.data = self._preflight()
        self.say("data ready")
        self.pipe = Pipeline(cfg, self.mesh) if cfg.parallel.pp > 1 else None
        """This rank's pipeline stages and schedule (``parallel.pp > 1``), else None."""
        self.model = build_model(cfg, self.mesh, self.say) if self.pipe is None else self.pipe.model
        self.loss_holders = dist.get_world_size() // cfg.parallel.pp
        """Ranks whose step loss counts: those of the last pipeline stage (all at pp=1)."""
        self.stage_axis = "pp" if self.pipe is not None else None
        """Checkpoints hold every stage's tensors, each rank saving and loading its own."""
        self.say(f"weights on {cfg.parallel.device}" + (f", loaded from {cfg.model.init_from}"
                                                        if cfg.model.init_from else ", initialised"))
        self.opt = build_optimizer(self.model.parameters(), cfg)
        self.ckpts = ckpt.CheckpointManager(cfg.checkpoint_dir, keep_last=cfg.checkpoint.keep_last)
        self.step = 0
        self.document_ids_of = functools.partial(document_ids, eos_id=self.data.eos_id, bos_id=self.data.bos_id) \
            if cfg.data.document_mask else None
        """Document masking (``data.document_mask``): tokens (B, T) -> document ids (B, T) from
        the BOS/EOS the data layer closed each document with, passed to the model each
        micro-batch (train and eval); None: off."""
        self.unread: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, loss summed over the world, grad norm)
        writers = build_writers(cfg.metrics, cfg.run_dir, dataclasses.asdict(cfg)) if self.rank == 0 else []
        self.metrics = Metrics(cfg.run_dir, cfg.training.steps, enabled=self.rank == 0, writers=writers)
        with torch.device("meta"):
            meta = Llama(cfg.model.to_args()) if cfg.model.name == "llama" else GPT2(cfg.model.to_args())
        self.meta = meta  # the whole model's shape (a pipeline rank holds only its stages)
        self.flops_per_token = meta.flops_per_token(cfg.data.seq_len)
        self.num_params = meta.num_params()
        self.peak = device_peak(cfg.parallel.device, cfg.metrics.peak_flops)

    def _preflight(self):
        """This rank's data, once every rank found the run folder and the data fit to
        start (ConfigError on all ranks together otherwise; nothing written yet)."""
        cfg, data, error = self.cfg, None, ""
        dp_rank = 0
        for name in self.mesh.mesh_dim_names:
            if name not in ("tp", "pp"):  # the stages of one data slice read the same batches
                dp_rank = dp_rank * axis_size(self.mesh, name) + self.mesh.get_local_rank(name)
        try:
            if self.rank == 0:  # one run per run folder (lock.py), before anything reads or writes it
                lock.acquire(cfg.run_dir)
            preflight.check_run_folder(cfg)
            prepared = preflight.prepare_data(cfg, progress=self.rank == 0)
            data = build_data(cfg, dp_rank, cfg.dp_degree, prepared=prepared, warn=self._say)
            preflight.check_data(cfg, data)
        except (ValueError, OSError) as exc:  # ConfigError is a ValueError
            error = str(exc)
        try:
            preflight.agree(error)
        except ConfigError:
            lock.release(cfg.run_dir, undo=True)  # refused: the folder is as it was
            raise
        return data

    def close(self) -> None:
        """The run is over (done, refused or failed): another may use its folder."""
        lock.release(self.cfg.run_dir)

    def start(self) -> None:
        """The run starts: from here on it writes (the resolved config first)."""
        if self.rank == 0:
            if self.cfg.checkpoint.overwrite and not preflight.resuming(self.cfg):
                preflight.clear_earlier_run(self.cfg)
            save_config(self.cfg, self.cfg.run_dir / "config.toml")
            print(self._start_line(), flush=True)
            print(self.data.describe(), flush=True)
        if dist.get_world_size() > 1:
            dist.barrier()

    def _start_line(self) -> str:
        cfg, t = self.cfg, self.cfg.training
        mesh = " x ".join(f"{n}={s}" for n, s in zip(cfg.mesh_dim_names, cfg.mesh_shape))
        stop = min(t.steps, t.stop_at) if t.stop_at else t.steps
        return (f"fsdp2d train: {cfg.model.name} {self.num_params:,} parameters, mesh {mesh} "
                f"({dist.get_world_size()} ranks), AdamW ({adamw_kind(cfg.parallel.device)}), "
                f"steps {self.step + 1}-{stop} of {t.steps}, run folder {cfg.run_dir}")

    def _end_line(self, hf: str | None) -> str:
        latest, kept = self.ckpts.latest(), len(self.ckpts.steps())
        saved = f"latest checkpoint {latest} ({kept} kept)" if latest else "no checkpoint"
        export = hf or ("none (no checkpoint)" if self.cfg.checkpoint.export_hf else "off (checkpoint.export_hf)")
        return f"done: step {self.step} of {self.cfg.training.steps}; {saved}; HF export: {export}"

    def _say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    # -- resume ------------------------------------------------------------------------
    def maybe_resume(self) -> None:
        """Continue from the newest checkpoint that verifies, when asked to or after a
        torchrun restart; a corrupt newer one is skipped and logged (a crash loop under
        ``--max-restarts`` otherwise). CheckpointError if there are checkpoints and none
        loads (e.g. another model size); model and optimizer are then as built. A sound
        checkpoint whose data position this run cannot continue (the data or [data]
        changed) is a ConfigError saying so, and no older one is tried. Without a
        checkpoint to resume, ``checkpoint.init_from`` starts the run from its weights."""
        if not preflight.resuming(self.cfg):
            return self._init_from()
        failures = []
        for step in reversed(self.ckpts.steps()):
            path = self.ckpts.path(step)
            try:
                extra = ckpt.load(path, self.model, self.opt, stage_axis=self.stage_axis)  # all ranks fail together
                step, data_state, rng = int(extra["step"]), extra["data"], extra["rng"]
                self.data.load_state_dict(data_state)
                _set_rng_state(rng)
            except DataStateError as exc:  # the same on every rank: a pure function of config and state
                raise ConfigError(f"{path} is a sound checkpoint, but {exc}") from None
            except (KeyError, TypeError, ValueError, RuntimeError) as exc:  # (CheckpointError too)
                failures.append(f"{path}: {exc!r}" if isinstance(exc, KeyError) else f"{exc}")
                if self.rank == 0:
                    print(f"checkpoint {path} does not verify, trying an older one: {failures[-1]}", flush=True)
                continue
            self.step = step
            preflight.check_steps_left(self.cfg, self.step, path)
            self.say(f"resumed from {path} at step {self.step}")
            self.metrics.forget_after(self.step)
            return
        if failures:
            raise ckpt.CheckpointError(f"no checkpoint in {self.ckpts.folder} loads into this run; the newest "
                                       f"says: {failures[0]}")
        self.metrics.forget_after(0)  # no checkpoint: the run starts again from step 0
        self._init_from()

    def _init_from(self) -> None:
        """``checkpoint.init_from``: its weights (and optimizer state if asked), step 0, this run's data."""
        c = self.cfg.checkpoint
        if not c.init_from:
            return
        ckpt.load(c.init_from, self.model, self.opt if c.init_from_optimizer else None, stage_axis=self.stage_axis)
        self._say(f"initialised from {c.init_from} ({'weights and optimizer state' if c.init_from_optimizer else 'weights'}"
                  f"), step 0 with this run's data")

    def save(self) -> None:
        extra = {"step": self.step, "data": self.data.state_dict(), "rng": _rng_state(),
                 "model": model_spec(self.meta)}  # lets `export --format hf` write config.json
        extra.update(self.data.tokenizer.extra())  # what the tokens were made with: for `generate` and the HF export
        self.ckpts.save(self.step, self.model, self.opt, extra=extra, stage_axis=self.stage_axis)

    # -- one step ------------------------------------------------------------------------
    def _loss_context(self):
        return fsdp2d.loss_parallel() if self.cfg.parallel.loss_parallel and self.cfg.parallel.tp > 1 \
            else nullcontext()

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        device = torch.device(self.cfg.parallel.device)
        x, y = to_device(x, device), to_device(y, device)
        with self._loss_context():
            docs = {} if self.document_ids_of is None else {"document_ids": self.document_ids_of(x)}
            logits = self.model(x, **docs)
            if not self.cfg.parallel.loss_parallel:
                logits = logits.float()
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def train_step(self, batches: Iterator, read: bool = True) -> tuple[float, float] | None:
        """One optimizer step. With ``read``: the step's loss (mean over the world) and
        gradient norm, read from the device before the optimizer step together with
        those of the unread steps before it (:class:`TrainingError` if any loss is not
        finite); without: None, and nothing waits for the device (see the module doc)."""
        accum = self.cfg.accum_steps
        total = torch.zeros((), device=self.cfg.parallel.device)
        for micro in range(accum if self.pipe is None else 0):
            self.model.set_requires_gradient_sync(self.cfg.syncs_gradients(micro))
            x, y = next(batches)
            loss = self._loss(x, y) / accum
            with self._loss_context():
                loss.backward()
            total += loss.detach()
        if self.pipe is not None:  # the schedule runs the accum micro-batches
            total = self.pipe.step(batches)
        loss_sum = _sum_over_world(total)
        max_norm = self.cfg.optim.max_norm if self.cfg.optim.max_norm > 0 else float("inf")
        if self.pipe is None:
            grad_norm = fsdp2d.clip_grad_norm_(self.model.parameters(), max_norm)
        else:  # the norm over every stage
            grad_norm = clip_grad_norm_across_stages_(self.model.parameters(), max_norm, pp=self.cfg.parallel.pp)
        self.unread.append((self.step + 1, loss_sum, grad_norm))
        values = self._read() if read else None
        self.opt.step()
        self.opt.zero_grad()
        return values

    def _read(self) -> tuple[float, float]:
        """Loss and gradient norm of the newest unread step, all unread steps read in one
        host sync; TrainingError at the first non-finite loss among them."""
        steps = [step for step, _, _ in self.unread]
        rows = torch.stack([torch.cat((loss, norm.float().reshape(1))) for _, loss, norm in self.unread]).tolist()
        self.unread = []
        for step, (loss_sum, grad_norm) in zip(steps, rows):
            loss = loss_sum / self.loss_holders
            if not math.isfinite(loss):
                now = steps[-1]
                ran = f"step {step}" if now - step == 1 else f"steps {step} to {now - 1}"
                late = "" if step == now else (f", read at step {now} (losses are read only to log or save: "
                                               f"training.log_every); {ran} updated the weights with it")
                raise TrainingError(f"loss is {loss} at step {step}{late}; stopped before step {now}'s optimizer "
                                    f"step. Last good checkpoint: {self.ckpts.latest() or 'none'}. Lower optim.lr "
                                    f"or check the data")
        return loss, grad_norm

    @torch.no_grad()
    def evaluate(self) -> float:
        batches = iter(self.data.eval_batches())
        total = torch.zeros((), device=self.cfg.parallel.device)
        steps = self.cfg.training.eval_steps
        if self.pipe is not None:  # accum_steps eval batches per schedule run, each loss / accum_steps
            for _ in range(steps // self.cfg.accum_steps):
                total += self.pipe.evaluate(batches)
            return _mean_over_world(total / (steps // self.cfg.accum_steps), self.loss_holders)
        self.model.eval()
        for _ in range(steps):
            total += self._loss(*next(batches))
        self.model.train()
        return _mean_over_world(total / steps, self.loss_holders)

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> dict:
        cfg, t = self.cfg, self.cfg.training
        stop = min(t.steps, t.stop_at) if t.stop_at else t.steps
        tokens_per_step = t.global_batch * cfg.data.seq_len
        every = cfg.checkpoint.every
        record: dict = {}
        t0, step0 = time.perf_counter(), self.step  # since the last read
        first_step = self.step + 1
        while self.step < stop:
            step = self.step + 1
            lr = cfg.optim.lr_at(self.step, t.steps)
            for group in self.opt.param_groups:
                group["lr"] = lr
            evaluate = bool(t.eval_every) and step % t.eval_every == 0
            log = step % t.log_every == 0 or step == stop or evaluate
            save = (bool(every) and step % every == 0) or step == stop
            first = self.data.train.samples
            values = self.train_step(self.data.train, read=log or save)
            self.step = step
            if step == first_step:  # (on CUDA: once the host has queued it, unless it was read)
                self.say(f"step {step} done: start-up complete")
            if cfg.data.log_samples and self.rank == 0:
                self.data.log_samples(cfg.run_dir / "samples.jsonl", step, first, self.data.train.samples)
            if values is None:
                continue
            dt = (time.perf_counter() - t0) / (step - step0)
            record = {"step": step, "loss": values[0], "lr": lr, "grad_norm": values[1],
                      **throughput(tokens_per_step, dt, dist.get_world_size(), self.flops_per_token, self.peak),
                      "peak_mem_mib": peak_memory_mib(cfg.parallel.device), "step_time_s": dt,
                      **allocator_metrics(cfg.parallel.device),
                      **self.data.metrics()}  # samples_seen, tokens_seen, epoch, shares
            if evaluate:
                record["eval_loss"] = self.evaluate()
            if log:
                self.metrics.log(record)
            else:
                self.metrics.progress(record)
            if save:
                self.save()
            t0, step0 = time.perf_counter(), step
        self.metrics.close()
        hf = None
        if cfg.checkpoint.export_hf and self.rank == 0 and (last := self.ckpts.latest()) is not None:
            hf = cfg.run_dir / "hf"
            export_hf(last, hf, tokenizer=None if self.data.tokenizer.found else False)  # what transformers loads
        if self.rank == 0:
            print(self._end_line(hf), flush=True)
        self.close()
        return record
