"""The pretraining loop, written against fsdp2d's public API only (as a user would).

config -> mesh -> model on the meta device -> TP plan -> activation checkpointing ->
``fully_shard`` per block and root -> ``to_empty`` + ``init_weights`` -> AdamW with
warmup and decay -> microbatches without gradient sync until the last -> global-norm
clipping -> metrics, evaluation and checkpoints. A resumed run loads model, optimizer,
data position and RNG state from the latest checkpoint and continues bit for bit.
With ``parallel.pp > 1`` a rank holds its pipeline stages instead of the whole model, and
a torch pipelining schedule runs the micro-batches (:mod:`fsdp2d.train.pipeline`).

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

import fsdp2d
from fsdp2d import checkpoint as ckpt
from fsdp2d.clip import clip_grad_norm_across_stages_
from fsdp2d.hf.export import export_hf
from fsdp2d.hf.weights import load_hf_into
from fsdp2d.models import GPT2, Llama, document_ids
from fsdp2d.mesh import axis_size
from fsdp2d.hf.weights import model_spec

from fsdp2d.data import DataStateError

from . import lock, preflight
from .config import ConfigError, JobConfig, save_config, validate
from .data import build_data
from .metrics import Metrics, Progress, allocator_metrics, device_peak, peak_memory_mib, throughput
from .optim import adamw_kind, build_optimizer
from .parallelize import (SAVED_OPS, _checkpoint_activations, _keep_matmuls, apply_parallelism,  # noqa: F401
                          parallelize_model, shard_groups, to_device)  # (imported from here by plan and tests)
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
        if self.pipe is not None:
            self.say(self.pipe.describe())
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
        # forward and backward of the accum_steps micro-batches: this rank's loss (their sum)
        total = self._accumulate(batches) if self.pipe is None else self.pipe.step(batches)
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

    def _accumulate(self, batches: Iterator) -> torch.Tensor:
        """Forward and backward of ``accum_steps`` micro-batches, each loss over
        ``accum_steps``; their sum, on the device."""
        accum = self.cfg.accum_steps
        total = torch.zeros((), device=self.cfg.parallel.device)
        for micro in range(accum):
            self.model.set_requires_gradient_sync(self.cfg.syncs_gradients(micro))
            x, y = next(batches)
            loss = self._loss(x, y) / accum
            with self._loss_context():
                loss.backward()
            total += loss.detach()
        return total

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
