"""``fsdp2d plan --search`` over pipeline meshes (``pp x dp x tp``): the candidates with
``parallel.pp > 1`` and their rows, from :mod:`fsdp2d.plan.pipeline`'s closed-form model.

A whole pipelined step is not dry-run (the schedule's fake-world dry run is not built), so these
candidates are not either: each is
configured and validated as the others (:func:`fsdp2d.plan.search.configure`), then
estimated analytically, and ranked among themselves by the same key
(:func:`fsdp2d.plan.search.rank_key`) in a list of their own. They are not merged into the
dry-run ranking: the analytic compute has no HBM-bound term, so its times are optimistic
against the measured roofline, and a merged order would favour the pipelines for that
reason alone.
"""

from __future__ import annotations

import dataclasses

from fsdp2d.train._rules import SINGLE_STAGE_SCHEDULES, divisors
from fsdp2d.train.config import ConfigError, JobConfig

from .estimate import GPU
from .pipeline import ModelCounts, pipeline_plan
from ._choice import MODES, Choice, configure, rank_key
from ._choice import tp_problems as _tp_problems

__all__ = ["PP_SCHEDULES", "pipeline_candidates", "pipeline_search", "format_pipeline_search"]

GiB = 2**30


PP_SCHEDULES = ("1F1B", "Interleaved1F1B")
"""The schedules the search tries for pp > 1: torchtitan's default and its interleaved one."""


def pipeline_candidates(cfg: JobConfig, world: int, gpus_per_node: int, global_batch: int
                        ) -> tuple[list[Choice], list[tuple[str, str]]]:
    """Every ``pp > 1`` configuration (plain FSDP inside each stage, no HSDP): ``pp`` a divisor
    of the world with at least one layer per stage, ``tp`` as :func:`candidates`, each
    schedule of :data:`PP_SCHEDULES` with enough layers, and each micro-batch that gives
    at least ``pp`` micro-batches per step (torch's schedules need as many)."""
    out, rejected = [], []
    n_layers = cfg.model.n_layers
    tps = [tp for tp in divisors(min(gpus_per_node, world)) if not _tp_problems(cfg, tp, world)]
    for pp in (d for d in divisors(world) if 2 <= d <= n_layers):
        for tp in (t for t in tps if world % (pp * t) == 0):
            dp = world // pp // tp
            if global_batch % dp:
                rejected.append((f"pp{pp}x{dp}x{tp}", f"global batch {global_batch} does not split over {dp} "
                                                      f"data-parallel ranks"))
                continue
            per_rank = global_batch // dp
            for schedule in PP_SCHEDULES:
                stages = 1 if schedule in SINGLE_STAGE_SCHEDULES else 2
                if pp * stages > n_layers:
                    continue
                for ac in MODES:
                    for mb in divisors(per_rank):
                        m = per_rank // mb
                        rounds = max(1, m // pp)
                        if m >= pp and (stages == 1 or m % rounds == 0):
                            out.append(Choice(1, dp, tp, ac, mb, m, "last", pp, schedule))  # (a pipeline syncs once)
    return out, rejected


def pipeline_search(cfg: JobConfig, world: int, gpu: GPU, gpus_per_node: int, global_batch: int,
                    flops_per_token: float) -> dict:
    """``{"candidates", "ranked", "rejected"}`` of the pipeline meshes (module doc); a row
    carries ``choice``, ``label``, ``peak``, ``headroom`` and the plan's ``estimate``."""
    choices, rejected = pipeline_candidates(cfg, world, gpus_per_node, global_batch)
    counts = ModelCounts.of(cfg) if choices else None
    ranked = []
    for c in choices:
        try:
            e = pipeline_plan(configure(cfg, c, global_batch), world, gpu, gpus_per_node, flops_per_token,
                              ranks=[], counts=counts)
        except ConfigError as exc:
            rejected.append((c.label(), str(exc)))
            continue
        if not e["fits"]:
            rejected.append((c.label(), f"analytic peak {e['peak'] / GiB:.1f} GiB > {gpu.hbm_bytes / GiB:.1f} GiB "
                                        f"(pipeline rank {e['heaviest_pp_rank']})"))
            continue
        ranked.append({"choice": dataclasses.asdict(c), "label": c.label(), "peak": e["peak"],
                       "headroom": gpu.hbm_bytes - e["peak"], "estimate": e})
    ranked.sort(key=rank_key)
    return {"candidates": len(choices), "ranked": ranked,
            "rejected": [{"label": label, "reason": why} for label, why in rejected]}


def format_pipeline_search(found: dict, limit: int = 10) -> list[str]:
    """The pipeline meshes' lines of ``--search``'s table."""
    lines = [f"  pipeline meshes (pp x dp x tp), {found['candidates']} candidates: ANALYTIC, not dry-run "
             f"(fsdp2d/plan/pipeline.py; its compute has no HBM term: compare these rows among themselves), "
             f"{len(found['ranked'])} fit",
             f"  {'#':>3} {'mesh':<27} {'ckpt':<9} {'mb':<7} {'tok/s/GPU':>9} {'MFU':>6} {'step s':>7} "
             f"{'peak GiB':>8} {'free GiB':>8}  bubble"]
    for i, row in enumerate(found["ranked"][:limit], 1):
        c, e = row["choice"], row["estimate"]
        mesh = f"pp{c['pp']}x{c['dp']}x{c['tp']} {c['schedule']}"
        lines.append(f"  {i:>3} {mesh:<27} {c['checkpointing']:<9} {c['micro_batch']}x{c['accum']:<5} "
                     f"{e['tokens_per_s_per_gpu']:>9.0f} {e['mfu'] * 100:>5.1f}% {e['step_s']:>7.3f} "
                     f"{row['peak'] / GiB:>8.2f} {row['headroom'] / GiB:>8.2f}  {e['bubble_fraction'] * 100:.1f}%")
    if len(found["ranked"]) > limit:
        lines.append(f"  ... {len(found['ranked']) - limit} more pipeline meshes fit (--json lists all)")
    return lines
