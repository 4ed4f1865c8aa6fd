"""The pieces ``--search`` and its pipeline candidates (:mod:`._search_pp`) share: a
candidate (:class:`Choice`) and how it configures a job, the tensor-parallel degrees a
model takes, the ranking, and the search's activation terms (module doc of
:mod:`fsdp2d.plan.search`). Its own module so that the pipeline search and model
(:mod:`.pipeline`) import them without importing the search."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from fsdp2d.train._rules import SINGLE_STAGE_SCHEDULES
from fsdp2d.train.config import JobConfig, validate

__all__ = ["MODES", "Choice", "configure", "rank_key", "activation_bytes", "logit_bytes", "tp_problems"]

MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Choice:
    """One configuration of the job: the fields the search sets."""
    replicate: int
    dp: int
    tp: int
    checkpointing: str
    micro_batch: int
    accum: int
    grad_sync: str
    pp: int = 1
    schedule: str = "1F1B"
    """``parallel.pp_schedule`` (pp > 1 only)."""

    def label(self) -> str:
        mesh = f"{self.replicate}x{self.dp}x{self.tp}" if self.replicate > 1 else f"{self.dp}x{self.tp}"
        if self.pp > 1:
            mesh = f"pp{self.pp}x{mesh} {self.schedule}"
        sync = f" {self.grad_sync}" if self.accum > 1 and self.pp == 1 else ""  # a pipeline syncs once a step
        return f"{mesh} {self.checkpointing} mb{self.micro_batch}x{self.accum}{sync}"

    def fields(self, global_batch: int, base: JobConfig) -> dict[str, dict[str, Any]]:
        """The config fields this choice sets, as ``{section: {key: value}}``."""
        # (the trainer's pipeline runs neither sequence nor loss parallel: pipeline_scope)
        sp = self.pp == 1 and (self.tp > 1 or base.parallel.sequence_parallel)
        lp = self.pp == 1 and (self.tp > 1 or base.parallel.loss_parallel)
        mesh = {"hsdp_replicate": self.replicate, "dp": self.dp, "tp": self.tp}
        if self.pp > 1 or base.parallel.pp > 1:
            stages = 1 if self.schedule in SINGLE_STAGE_SCHEDULES else 2
            mesh.update(pp=self.pp, pp_schedule=self.schedule, pp_stages_per_rank=stages)
        if base.parallel.nproc is not None:  # a config that names its process count keeps it equal to the mesh
            mesh["nproc"] = self.pp * self.replicate * self.dp * self.tp
        training = {"global_batch": global_batch, "micro_batch": self.micro_batch,
                    "activation_checkpointing": self.checkpointing, "grad_sync": self.grad_sync}
        if self.pp > 1 and base.training.eval_every > 0:  # a pipeline evaluates whole steps of micro-batches
            training["eval_steps"] = -(-base.training.eval_steps // self.accum) * self.accum
        return {"parallel": {**mesh, "sequence_parallel": sp, "loss_parallel": lp}, "training": training}


def configure(base: JobConfig, choice: Choice, global_batch: int, n_layers: int | None = None) -> JobConfig:
    """``base`` with ``choice`` applied (and ``n_layers`` blocks), validated."""
    cfg = copy.deepcopy(base)
    for section, table in choice.fields(global_batch, base).items():
        for key, value in table.items():
            setattr(getattr(cfg, section), key, value)
    if n_layers is not None:
        cfg.model.n_layers = n_layers
    validate(cfg, world_size=cfg.world_size, trainer=False)
    return cfg


def activation_bytes(cfg: JobConfig, layers: int) -> float:
    """The activations ``layers`` blocks keep for backward from one micro-batch (module
    doc's term; ``fsdp2d.plan.pipeline`` counts a stage's with it)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    a = 2 if t.mixed_precision == "bf16" else 4
    d, f = m.dim, m.to_args().ffn_hidden_dim
    head = m.dim // m.n_heads
    q, kv = m.n_heads * head, (m.n_kv_heads or m.n_heads) * head
    s = p.tp if p.sequence_parallel else 1
    k = {"full": 0, "none": (q + 2 * kv + 3 * f) / p.tp,
         "selective": (2 * q + 2 * kv + 2 * f) / p.tp + 2 * d}[t.activation_checkpointing]
    tokens = cfg.micro_batch * cfg.data.seq_len
    return layers * tokens * a * (d / s + k)


def logit_bytes(cfg: JobConfig) -> float:
    """One micro-batch's logits (and log-softmax) at the loss (module doc's term)."""
    m, p = cfg.model, cfg.parallel
    a = 2 if cfg.training.mixed_precision == "bf16" else 4
    tokens = cfg.micro_batch * cfg.data.seq_len
    if p.loss_parallel and p.tp > 1:
        return tokens * m.vocab_size * a / p.tp
    return 2 * tokens * m.vocab_size * (2 if p.loss_parallel and a == 2 else 4)


def tp_problems(cfg: JobConfig, tp: int, world: int) -> list[str]:
    """Why ``tp`` cannot split the model on ``world`` GPUs (empty: it can)."""
    m = cfg.model
    kv = m.n_kv_heads or m.n_heads
    why = [f"does not divide model.{name}={n}" for name, n in (("n_heads", m.n_heads), ("n_kv_heads", kv)) if n % tp]
    if world % tp:
        why.append(f"does not divide the world size {world}")
    if m.name == "llama" and tp > 1 and cfg.data.seq_len % tp:
        why.append(f"does not divide data.seq_len={cfg.data.seq_len} (sequence parallel)")
    return why


def rank_key(row: dict) -> tuple:
    """Faster first; ties go to less recomputation, then the larger micro-batch (what
    ``dominates`` prefers: a candidate skipped for a never-slower one could otherwise win a
    tie it never ran, e.g. full against none when FSDP communication bounds both), then
    memory headroom."""
    c = row["choice"]
    return (-row["estimate"]["tokens_per_s_per_gpu"], MODES.index(c["checkpointing"]), -c["micro_batch"],
            -row["headroom"])
