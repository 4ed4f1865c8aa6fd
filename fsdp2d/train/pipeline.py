"""Pipeline parallelism in the trainer (``parallel.pp > 1``), through torch's pipelining.

The ``pp`` mesh axis (outermost) splits the model into ``pp * pp_stages_per_rank`` stages
(:func:`fsdp2d.models.stages.stage_layers`); a pipeline rank holds the stages
:func:`~fsdp2d.models.stages.stages_of_rank` gives it. Each stage is fsdp2d's Llama with
only its pieces: the embedding on the first, its layers in a ``ModuleDict`` keyed by their
indices in the whole model, the final norm and output on the last. So parameter names
are the whole model's (``layers.5.attention.wq.weight``) and checkpoints are the whole
model's, on any ``pp``. Each stage gets the TP plan, activation checkpointing and
``fully_shard`` over the other axes as ``pp=1`` does (without resharding after forward,
as torchtitan: each micro-batch would all-gather again), then ``to_empty`` and
``init_weights``, which seeds each layer on its own, so a stage's weights are those its
layers get in the whole model.

One optimizer step runs the per-rank batch as ``accum_steps`` micro-batches through a
``torch.distributed.pipelining`` schedule (``parallel.pp_schedule``), which reduce-
scatters each stage's gradients once, after its last micro-batch. The loss of a
micro-batch is its mean cross-entropy over ``accum_steps``, as ``pp=1`` scales it, so the
gradients equal ``pp=1``'s (``scale_grads=False``). The loss is on the ranks of the last
stage; the others report 0 and the trainer divides the world's sum by the ranks that
hold it.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

import fsdp2d
from fsdp2d.models import Llama
from fsdp2d.models.stages import stage_layers, stages_of_rank

from ._rules import V_SCHEDULES
from .config import JobConfig
from .parallelize import apply_parallelism, to_device

__all__ = ["stage_model", "parallelize_stage", "Pipeline"]


def stage_model(cfg: JobConfig, stage: int) -> Llama:
    """Pipeline stage ``stage`` of ``cfg``'s Llama on the meta device (see the module)."""
    n_stages = cfg.parallel.pp * cfg.pp_stages_per_rank
    with torch.device("meta"):
        model = Llama(cfg.model.to_args())
    layers = stage_layers(cfg.model.n_layers, n_stages)[stage]
    model.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
    if stage > 0:
        model.tok_embeddings = None
    if stage < n_stages - 1:
        model.norm = None
        model.output = None
    return model


def parallelize_stage(cfg: JobConfig, mesh: fsdp2d.DeviceMesh, stage: int) -> Llama:
    """Stage ``stage`` on the meta device with the TP plan, activation checkpointing and
    ``fully_shard`` over ``mesh``'s axes other than ``pp``, as ``parallelize_model``
    applies them at ``pp=1`` (``fsdp2d plan`` can build one stage with this)."""
    return apply_parallelism(cfg, mesh, stage_model(cfg, stage))


def _rank_view(cfg: JobConfig, stages: list[Llama]) -> Llama:
    """One Llama holding this rank's stages' pieces (shared, not copied), for the
    optimizer, clipping and checkpoints: its parameter names are the whole model's."""
    with torch.device("meta"):
        view = Llama(cfg.model.to_args())
    view.layers = nn.ModuleDict({k: v for s in stages for k, v in s.layers.items()})
    view.tok_embeddings = next((s.tok_embeddings for s in stages if s.tok_embeddings is not None), None)
    view.norm = next((s.norm for s in stages if s.norm is not None), None)
    view.output = next((s.output for s in stages if s.output is not None), None)
    return view


class Pipeline:
    """This rank's stages, built and initialised, and the schedule that runs them."""

    def __init__(self, cfg: JobConfig, mesh: fsdp2d.DeviceMesh) -> None:
        self.cfg = cfg
        p = cfg.parallel
        device = torch.device(p.device)
        n_stages = p.pp * cfg.pp_stages_per_rank
        ids = stages_of_rank(mesh.get_local_rank("pp"), p.pp, cfg.pp_stages_per_rank, p.pp_schedule in V_SCHEDULES)
        self.stages = [parallelize_stage(cfg, mesh, s) for s in ids]
        for s in self.stages:
            s.to_empty(device=device)
            torch.manual_seed(cfg.training.seed)  # each stage draws the base seed the whole model draws
            s.init_weights()
        self.model = self.stages[0] if len(self.stages) == 1 else _rank_view(cfg, self.stages)
        """This rank's parameters under the whole model's names (a stage, or a view of several)."""
        self.holds_loss = n_stages - 1 in ids
        group = mesh.get_group("pp")
        runs = [PipelineStage(m, s, n_stages, device, group=group) for m, s in zip(self.stages, ids)]
        cls = get_schedule_class(p.pp_schedule)
        accum = cfg.accum_steps
        self.schedule = cls(runs[0] if issubclass(cls, PipelineScheduleSingle) else runs, n_microbatches=accum,
                            loss_fn=self._loss, scale_grads=False)
        self.device = device
        self.ids = ids

    def describe(self) -> str:
        """One start-up line: the stages' layers, the schedule, the micro-batches, this rank's stages."""
        n_stages = self.cfg.parallel.pp * self.cfg.pp_stages_per_rank
        split = " | ".join(f"{r.start}-{r.stop - 1}" for r in stage_layers(self.cfg.model.n_layers, n_stages))
        return (f"pipeline: {n_stages} stages (layers {split}), {self.cfg.parallel.pp_schedule}, "
                f"{self.cfg.accum_steps} micro-batches per step; this rank holds stage "
                f"{', '.join(map(str, self.ids))}, built, sharded and initialised")

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss, scaled as ``pp=1`` scales it: its mean over ``accum_steps``."""
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) / self.cfg.accum_steps

    def _batch(self, batches: Iterator) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``accum_steps`` micro-batches as one per-rank batch (B, T) each: the
        schedule splits it back into the same micro-batches along dim 0."""
        xs, ys = zip(*(next(batches) for _ in range(self.cfg.accum_steps)))
        return to_device(torch.cat(xs), self.device), to_device(torch.cat(ys), self.device)

    def _total(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The step's loss on this rank, summed in micro-batch order as ``pp=1`` sums it
        (0 on ranks without the last stage)."""
        total = torch.zeros((), device=self.device)
        for loss in losses:
            total += loss.detach()
        return total

    def step(self, batches: Iterator) -> torch.Tensor:
        """Forward and backward of one optimizer step; this rank's loss (see :meth:`_total`)."""
        x, y = self._batch(batches)
        losses: list[torch.Tensor] = []
        self.schedule.step(x, target=y, losses=losses if self.holds_loss else None, return_outputs=False)
        return self._total(losses)

    @torch.no_grad()
    def evaluate(self, batches: Iterator) -> torch.Tensor:
        """The loss of ``accum_steps`` eval micro-batches (their mean), forward only."""
        x, y = self._batch(batches)
        losses: list[torch.Tensor] = []
        for s in self.stages:
            s.eval()
        try:
            self.schedule.eval(x, target=y, losses=losses if self.holds_loss else None, return_outputs=False)
        finally:
            for s in self.stages:
                s.train()
        return self._total(losses)
