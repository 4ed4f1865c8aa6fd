"""``fsdp2d plan --search``: which mesh, checkpointing and micro-batch for this model on N GPUs.

    fsdp2d plan --search --config C --world-size N [--gpu h100|h200|a100] [--json] [--write-overlay FILE]

**Candidates.** Every configuration of the job on ``N`` GPUs that the launcher accepts:

* ``tp`` in the divisors of ``gcd(n_heads, n_kv_heads, gpus per node)`` (TP stays inside
  a node); ``tp > 1`` turns on sequence parallel and the vocab-parallel loss;
* ``hsdp_replicate x dp x tp = N``: plain FSDP (replicate 1), and every HSDP replicate
  size whose shard group (``dp x tp`` GPUs) is whole nodes: HSDP's point is to keep the
  sharding collectives inside a node group and send only the gradient all-reduce across
  groups (a shard group of part of a node leaves that node's NVLink to the replicas);
* activation checkpointing ``none`` / ``selective`` / ``full``;
* the global batch: the config's tokens per GPU kept (``global_batch x N / the config's
  world size``; ``--training.global_batch`` fixes it); each ``micro_batch`` dividing the
  per-rank batch (the rest is gradient accumulation), and with accumulation both
  ``grad_sync`` modes.

Configurations the batch cannot split over, or a ``tp`` the heads or the node cannot
take, are listed as rejected with the reason.

**Pipeline meshes** (``pp x dp x tp``, ``pp > 1``) are candidates too, in a list of their own:
:mod:`fsdp2d.plan._search_pp` enumerates them and estimates each with
:mod:`fsdp2d.plan.pipeline`'s closed-form model (no dry run: fsdp2d's trainer does not run
pipelines yet), ranked among themselves by :func:`rank_key`.

**Pruning** by a closed-form lower bound of the peak (bytes per rank, :func:`memory_bound`),
before any dry run: with ``P`` parameters, ``S = dp x tp`` ranks sharding them, ``L``
blocks of micro-batch ``b`` x ``T`` tokens, ``a`` bytes per activation element (2 under
bf16, else 4)::

    states      = 16 P / S                     fp32 parameters, gradients, AdamW's two moments
    activations = L b T a (d / s + k)          at the end of the last micro-batch's forward
                    s = tp under sequence parallel, else 1
                    k = 0 (full: the block's input only), (q + 2 kv + 3 f) / tp (none: the
                        attention's inputs and SwiGLU's saved tensors, at least),
                        (2 q + 2 kv + 2 f) / tp + 2 d (selective: the matmul and attention
                        outputs); d, q, kv, f the model, query, key/value and SwiGLU widths
    logits      = b T V a / tp                 vocab-parallel loss (tp > 1), else
                  2 b T V c                    the logits and their log-softmax (c = 4 bytes,
                                               2 for bf16 logits kept by loss_parallel)
    accumulators = 4 P / tp (grad_sync last) or 4 P / S (every), with accumulation; else 0
    bound = max(states, 12 P / S + activations + logits + accumulators)

Every term is storage the step must hold at that moment, so a configuration over the
GPU's memory by the bound cannot fit; the rest is decided by the dry run.

**Dry runs, shared work.** The survivors are dry-run (rank 0, :func:`fsdp2d.plan.dry_run`:
the same machinery as ``fsdp2d plan``) with 2 and with 3 transformer blocks, in forked
processes, one per CPU; such a dry run costs a fraction of the full depth's. From 2
blocks on, every figure of a step is affine in the number of blocks (each block is the
same module with the same FSDP group, the same activations and collectives): each figure
at ``L`` blocks is ``f(3) + (L - 3) (f(3) - f(2))``. (Not from 1 block: with one, backward
has no next block to prefetch, and the peak is off the line.) Configurations that share a
mesh share more: a candidate is dry-run only if none that is never slower than it
(:func:`dominates`: a larger micro-batch, less recomputation) fits; the others are listed
with the one that fits. The ranking is by estimated tokens/s/GPU
(:mod:`fsdp2d.plan.estimate`'s roofline), ties by memory headroom; configurations whose
extrapolated peak is over the GPU's memory are rejected with it.

**The top choice, directly.** The top-ranked configuration is then dry-run at its full
depth, as ``fsdp2d plan --rank 0`` would: its row shows those figures, and the search
checks that the extrapolated ones equal them (memory to the byte, collectives in count
and bytes, FLOPs; compute time to 1e-9 relative, a sum of the same terms in another
order). A difference is printed (``extrapolation: DIFFERS``) and in the JSON, never hidden.
``--write-overlay FILE`` writes the top choice as a TOML overlay (a new file, checked
before the search: see ``fsdp2d.plan.cli.check_overlay_path``):
``fsdp2d train --config C --config-overlay FILE`` (and ``fsdp2d plan``) take it. The base
config is validated at the search's world (:func:`search_config`), and the world must be
whole nodes (``fsdp2d.plan.cli.check_nodes``), as for ``fsdp2d plan`` of the overlay.

(Longer than the package's ~400-line aim: the enumeration, the bound, the sharing of
dry runs and the ranking are one argument whose steps this docstring proves; a quarter
of the file is that proof.)
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import multiprocessing
import os
import time
from dataclasses import dataclass
from typing import Any

from fsdp2d.train._rules import MAX_WORLD, SINGLE_STAGE_SCHEDULES, check_ranges, divisors, error_text
from fsdp2d.train.config import ConfigError, JobConfig, validate

from ._choice import MODES, Choice, activation_bytes, configure, logit_bytes, rank_key
from ._choice import tp_problems as _tp_problems
from .estimate import GPUS, GPU, comm_table, estimate, op_count, roofline_seconds

__all__ = ["Choice", "candidates", "memory_bound", "search", "format_search", "overlay_toml", "check_searchable",
           "search_config", "search_batch"]

GiB = 2**30
# The figures extrapolated from two depths, and equal to a direct dry run's. Not the
# peak of each phase (``fsdp2d plan`` names the phase of the peak): a phase's peak is the
# largest of several moments of it, and which one is largest can change with the depth.
_EXACT = ("parameters", "padding", "gradients", "optimizer", "at_rest", "peak", "peak_breakdown", "collectives",
          "flops")
# The two depths the search dry-runs; every figure is affine in the depth (module doc).
DEPTHS = (2, 3)


def check_searchable(cfg: JobConfig) -> None:
    """ConfigError for a model :func:`memory_bound` does not cover."""
    if cfg.model.name != "llama":  # memory_bound's activation terms are SwiGLU's (3 ffn tensors)
        raise ConfigError(f"fsdp2d plan --search bounds memory for Llama models only (model.name="
                          f"{cfg.model.name!r}): plan each configuration with fsdp2d plan instead")


def search_config(cfg: JobConfig, world: int | None, overrides: list[str]) -> tuple[JobConfig, int, int]:
    """(the search's base config, the world size, the global batch) for ``cfg`` on
    ``world`` GPUs (None: the config's), validated there: the mesh, the micro-batch and the
    process count are the search's to choose, so the config's own (for another world,
    another batch) are set aside and every other field is checked on one rank with the
    search's batch; each candidate is then validated on its mesh (:func:`configure`).
    Raises ConfigError (every problem at once, as :func:`validate`)."""
    errors: list[str] = []
    check_ranges(cfg, errors)  # the config's own mesh and batch, which the batch scales from
    if errors:
        raise ConfigError(error_text(errors))
    world = cfg.world_size if world is None else world
    if not 1 <= world <= MAX_WORLD:
        raise ConfigError(f"world size {world} must be in [1, {MAX_WORLD}]")
    base = copy.deepcopy(cfg)
    base.training.micro_batch = None  # a given one may not divide another per-rank batch
    base.training.global_batch = search_batch(cfg, world, overrides)
    base.parallel.nproc = None
    one = copy.deepcopy(base)
    one.parallel.dp = one.parallel.tp = one.parallel.hsdp_replicate = one.parallel.pp = 1
    validate(one, trainer=False)
    return base, world, base.training.global_batch


def search_batch(cfg: JobConfig, world: int, overrides: list[str]) -> int:
    """The global batch the search keeps (module doc)."""
    if any(o.startswith("--training.global_batch") for o in overrides):
        return cfg.training.global_batch
    scaled = cfg.training.global_batch * world
    if scaled % cfg.world_size:
        raise ConfigError(f"the config's {cfg.training.global_batch} sequences on {cfg.world_size} GPUs do not "
                          f"scale to a whole number on {world}: give --training.global_batch")
    return scaled // cfg.world_size


def candidates(cfg: JobConfig, world: int, gpus_per_node: int, global_batch: int
               ) -> tuple[list[Choice], list[tuple[str, str]]]:
    """Every legal configuration, and (label, reason) for each family that is not."""
    out, rejected = [], []
    for tp in divisors(min(gpus_per_node, world)):
        why = _tp_problems(cfg, tp, world)
        if why:
            rejected.append((f"tp={tp}", "; ".join(why)))
            continue
        for replicate in divisors(world // tp):
            dp = world // tp // replicate
            ranks = replicate * dp
            if replicate > 1 and (dp * tp) % gpus_per_node:
                continue  # HSDP shards within whole nodes and replicates across them (module doc)
            if global_batch % ranks:
                rejected.append((f"{replicate}x{dp}x{tp}" if replicate > 1 else f"{dp}x{tp}",
                                 f"global batch {global_batch} does not split over {ranks} data-parallel ranks"))
                continue
            per_rank = global_batch // ranks
            for ac in MODES:
                for mb in divisors(per_rank):
                    accum = per_rank // mb
                    for sync in ("last", "every") if accum > 1 else (cfg.training.grad_sync,):
                        out.append(Choice(replicate, dp, tp, ac, mb, accum, sync))
    return out, rejected


def memory_bound(cfg: JobConfig, params: int) -> dict[str, float]:
    """The closed-form lower bound of a rank's peak (module doc), with its terms."""
    p, t = cfg.parallel, cfg.training
    shards = p.dp * p.tp
    states = 16 * params / shards
    acts = activation_bytes(cfg, cfg.model.n_layers)
    logits = logit_bytes(cfg)
    acc = 0.0
    if cfg.accum_steps > 1:
        acc = 4 * params / (p.tp if t.grad_sync == "last" else shards)
    total = max(states, 12 * params / shards + acts + logits + acc)
    return {"states": states, "activations": acts, "logits": logits, "accumulators": acc, "bound": total}


# ----------------------------------------------------------------------------- dry runs

def _dry(task: tuple) -> tuple:
    """One dry run (in a forked worker): the figures without the op list, the roofline
    compute seconds instead, and the error text if it failed."""
    from ._dryrun import dry_run

    key, cfg, world, gpu = task
    t0 = time.perf_counter()
    try:
        measured = dry_run(cfg, world, 0, compare_modes=False)  # each mode is a candidate of its own
    except Exception as exc:  # reported as the candidate's rejection, with its type
        return key, None, f"dry run failed: {type(exc).__name__}: {exc}", time.perf_counter() - t0
    ops = measured.pop("ops")
    measured["compute_s"] = roofline_seconds(ops, gpu)
    measured["roofline_ops"] = op_count(ops)
    return key, measured, None, time.perf_counter() - t0


def dominates(a: Choice, b: Choice) -> bool:
    """Whether ``a`` is never slower than ``b`` under the roofline, by construction: the
    same mesh, a micro-batch at least as large (the same FLOPs; a weight read, an FSDP
    all-gather and a reduce-scatter per micro-batch, so no more bytes or collectives),
    no more recomputation (none < selective < full: the same ops plus recomputed ones,
    and under sequence parallel replayed TP all-gathers), and the same accumulation mode
    unless ``a`` has no accumulation."""
    return (a != b and (a.pp, a.replicate, a.dp, a.tp) == (b.pp, b.replicate, b.dp, b.tp) and a.micro_batch >= b.micro_batch
            and MODES.index(a.checkpointing) <= MODES.index(b.checkpointing)
            and (a.accum == 1 or a.grad_sync == b.grad_sync))


def _affine(a: Any, b: Any, steps: int) -> Any:
    """``b + steps * (b - a)`` leaf by leaf (numbers, dicts, lists of numbers)."""
    if isinstance(a, dict):
        return {k: _affine(a.get(k, 0), b[k], steps) for k in b}
    if isinstance(a, list):
        return [_affine(x, y, steps) for x, y in zip(a, b)]
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return b + steps * (b - a)
    return b


def extrapolate(one: dict, two: dict, layers: int) -> dict:
    """The figures at ``layers`` blocks from those at :data:`DEPTHS` (module doc)."""
    out = {k: _affine(one[k], two[k], layers - DEPTHS[1]) for k in _EXACT + ("compute_s", "roofline_ops")}
    out["coordinate"], out["axis_ranks"] = two["coordinate"], two["axis_ranks"]
    # The peak is the largest of several moments, each affine in the depth; the one that
    # is largest at 2 and 3 blocks need not be at L (the optimizer step's parameters,
    # gradients and AdamW state grow faster than one micro-batch's activations): the
    # largest of the phases' extrapolated peaks. The breakdown is then unknown (None).
    phases = _affine(one["phase_peak"], two["phase_peak"], layers - DEPTHS[1])
    top = max(phases.values())
    if top > out["peak"]:
        out["peak"], out["peak_breakdown"] = top, None
    return out


def _differences(extrapolated: dict, direct: dict) -> dict:
    """Figures where the extrapolation and the direct dry run disagree (module doc)."""
    out = {k: {"extrapolated": extrapolated[k], "direct": direct[k]} for k in _EXACT
           if extrapolated[k] != direct[k]}
    if not math.isclose(extrapolated["compute_s"], direct["compute_s"], rel_tol=1e-9):
        out["compute_s"] = {"extrapolated": extrapolated["compute_s"], "direct": direct["compute_s"]}
    return out


def _row(choice: Choice, cfg: JobConfig, measured: dict, world: int, gpus_per_node: int, gpu: GPU,
         flops_per_token: float) -> dict:
    tokens = cfg.training.global_batch * cfg.data.seq_len / world
    comm = comm_table(measured, measured["axis_ranks"], gpus_per_node, gpu)
    est = estimate(measured, comm, gpu, tokens, flops_per_token, measured["compute_s"])
    return {"choice": dataclasses.asdict(choice), "label": choice.label(), "peak": measured["peak"],
            "headroom": gpu.hbm_bytes - measured["peak"], "estimate": est, "collectives": comm,
            "measured": {k: measured[k] for k in _EXACT}}


def search(cfg: JobConfig, world: int, gpu_name: str, gpus_per_node: int, global_batch: int,
           progress=None) -> dict:
    """The ranked configurations of ``cfg``'s model on ``world`` GPUs (module doc); the
    JSON report. ``progress`` gets one line per stage."""
    check_searchable(cfg)
    import torch

    from fsdp2d.models import Llama

    say = progress or (lambda line: None)
    t0 = time.perf_counter()
    gpu = GPUS[gpu_name]
    with torch.device("meta"):
        model = Llama(cfg.model.to_args())
    params, flops_per_token = model.num_params(), model.flops_per_token(cfg.data.seq_len)
    del model
    choices, rejected = candidates(cfg, world, gpus_per_node, global_batch)
    survivors, configs, bounds = [], {}, {}
    for c in choices:
        full = configure(cfg, c, global_batch)
        b = memory_bound(full, params)
        if b["bound"] > gpu.hbm_bytes:
            rejected.append((c.label(), f"bound {b['bound'] / GiB:.1f} GiB > {gpu.hbm_bytes / GiB:.1f} GiB "
                                        f"(states {b['states'] / GiB:.1f}, activations {b['activations'] / GiB:.1f}, "
                                        f"logits {b['logits'] / GiB:.1f}, accumulators "
                                        f"{b['accumulators'] / GiB:.1f})"))
            continue
        survivors.append(c)
        configs[c] = full
        bounds[c] = b["bound"]
    say(f"{len(choices)} candidates, {len(choices) - len(survivors)} over the memory bound; the other "
        f"{len(survivors)} dry-run at {DEPTHS} blocks unless a faster one fits")
    depth = cfg.model.n_layers
    results, ranked, fitting, violations = {}, [], [], []
    # Waves: a candidate is dry-run once every candidate that dominates it has been, and
    # only if none of those fits (``dominates`` is transitive, so checking the ones that
    # fit suffices); the rest are reported with the one that is never slower.
    # (a candidate's level is above every one of its dominators')
    level = {c: sum(d > c.micro_batch for d in divisors(c.micro_batch * c.accum)) + MODES.index(c.checkpointing)
             for c in survivors}
    gc.collect()
    gc.freeze()  # the dry runs' gc.collect calls skip the objects alive now (torch's modules)
    workers = min(len(survivors), len(os.sched_getaffinity(0)))
    pool = multiprocessing.get_context("fork").Pool(workers) if workers > 1 else None
    try:
        for wave in sorted(set(level.values())):
            todo = []
            for c in (c for c in survivors if level[c] == wave):
                better = next((f for f in fitting if dominates(f, c)), None)
                if better is not None:
                    rejected.append((c.label(), f"not dry-run: {better.label()} fits and is never slower "
                                                f"(larger micro-batch or less recomputation)"))
                else:
                    todo.append(c)
            tasks = [((c, n), configure(cfg, c, global_batch, n), world, gpu) for c in todo for n in DEPTHS]
            done = pool.imap_unordered(_dry, tasks) if pool is not None else map(_dry, tasks)
            results.update({r[0]: r[1:] for r in done})
            for c in todo:
                (one, err1, _), (two, err2, _) = results[(c, DEPTHS[0])], results[(c, DEPTHS[1])]
                if err1 or err2:
                    rejected.append((c.label(), err1 or err2))
                    continue
                measured = extrapolate(one, two, depth)
                if measured["peak"] < bounds[c]:  # the bound must be a lower bound: say so if not
                    violations.append({"label": c.label(), "bound": bounds[c], "peak": measured["peak"]})
                row = _row(c, configs[c], measured, world, gpus_per_node, gpu, flops_per_token)
                if not row["estimate"]["fits"]:
                    rejected.append((c.label(), f"dry-run peak {measured['peak'] / GiB:.1f} GiB > "
                                                f"{gpu.hbm_bytes / GiB:.1f} GiB"))
                    continue
                fitting.append(c)
                ranked.append(row)
            say(f"  wave {wave}: {len(todo)} dry-run, {len(ranked)} fit so far")
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        gc.unfreeze()
    dry_s = sum(r[2] for r in results.values())
    ranked.sort(key=rank_key)
    report = {"world_size": world, "gpu": gpu_name, "gpu_figures": vars(gpu), "gpus_per_node": gpus_per_node,
              "global_batch": global_batch, "seq_len": cfg.data.seq_len, "model_params": params,
              "n_layers": depth, "candidates": len(choices), "dry_runs": len(results), "dry_run_cpu_s": dry_s,
              "ranked": ranked, "rejected": [{"label": label, "reason": why} for label, why in rejected],
              "bound_violations": violations}
    while ranked:  # the top, dry-run at its full depth; one that does not fit there is not recommended
        choice = Choice(**ranked[0]["choice"])
        say(f"top choice {choice.label()}: dry run at its full depth ({depth} blocks)")
        _, direct, err, seconds = _dry(((choice, depth), configs[choice], world, gpu))
        if err:
            raise RuntimeError(f"the top choice {choice.label()} failed its direct dry run: {err}")
        extrapolated = extrapolate(results[(choice, DEPTHS[0])][0], results[(choice, DEPTHS[1])][0], depth)
        row = _row(choice, configs[choice], direct, world, gpus_per_node, gpu, flops_per_token)
        if not row["estimate"]["fits"]:
            ranked.pop(0)
            report["rejected"].append({"label": choice.label(), "reason": (
                f"direct dry run at full depth: peak {direct['peak'] / GiB:.1f} GiB > {gpu.hbm_bytes / GiB:.1f} GiB "
                f"(extrapolated {extrapolated['peak'] / GiB:.1f})")})
            continue
        ranked[0] = row
        report["top"] = {"label": choice.label(), "overlay": choice.fields(global_batch, cfg),
                         "direct_dry_run_s": seconds, "differences": _differences(extrapolated, direct)}
        break
    from ._search_pp import pipeline_search  # (it imports this module)

    say("pipeline meshes (pp > 1): the analytic model, no dry runs")
    report["pipeline"] = pipeline_search(cfg, world, gpu, gpus_per_node, global_batch, flops_per_token)
    report["wall_s"] = time.perf_counter() - t0
    return report


# ----------------------------------------------------------------------------- output

def overlay_toml(report: dict) -> str:
    """The top choice as a TOML overlay (``--config-overlay``)."""
    from fsdp2d.train.config import _toml_value

    top = report["top"]
    lines = [f"# fsdp2d plan --search: top choice on {report['world_size']} x {report['gpu']} ({top['label']})"]
    for section, table in top["overlay"].items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def _comm(row: dict) -> str:
    by_axis = row["estimate"]["comm_s_by_axis"]
    return " ".join(f"{a}:{s * 1e3:.0f}" for a, s in by_axis.items() if s > 0) or "-"


def format_search(report: dict, config: str, limit: int = 20) -> str:
    gpu = report["gpu_figures"]
    lines = [
        f"fsdp2d plan --search: {config} on {report['world_size']} x {gpu['name']}, {report['n_layers']} blocks, "
        f"{report['model_params'] / 1e9:.2f}B parameters, global batch {report['global_batch']} x "
        f"{report['seq_len']} tokens",
        f"  {report['candidates']} candidates, {report['dry_runs']} dry runs at {DEPTHS} blocks "
        f"({report['dry_run_cpu_s']:.0f} CPU s) + the top choice at full depth; {report['wall_s']:.0f} s wall",
        "  mesh = [replicate x] dp x tp; mb = micro-batch x accumulation; comm = ms per step per axis "
        "(FSDP overlapped, TP exposed)",
        f"  {'#':>3} {'mesh':<10} {'ckpt':<9} {'mb':<7} {'sync':<5} {'tok/s/GPU':>9} {'MFU':>6} {'step s':>7} "
        f"{'peak GiB':>8} {'free GiB':>8}  comm ms",
    ]
    for i, row in enumerate(report["ranked"][:limit], 1):
        c, e = row["choice"], row["estimate"]
        mesh = f"{c['replicate']}x{c['dp']}x{c['tp']}" if c["replicate"] > 1 else f"{c['dp']}x{c['tp']}"
        sync = c["grad_sync"] if c["accum"] > 1 else "-"
        lines.append(f"  {i:>3} {mesh:<10} {c['checkpointing']:<9} {c['micro_batch']}x{c['accum']:<5} {sync:<5} "
                     f"{e['tokens_per_s_per_gpu']:>9.0f} {e['mfu'] * 100:>5.1f}% {e['step_s']:>7.3f} "
                     f"{row['peak'] / GiB:>8.2f} {row['headroom'] / GiB:>8.2f}  {_comm(row)}")
    if len(report["ranked"]) > limit:
        lines.append(f"  ... {len(report['ranked']) - limit} more fit (--json lists all)")
    top = report.get("top")
    if top:
        diff = top["differences"]
        verdict = "equal to the extrapolated ones (memory to the byte, collectives, FLOPs)" if not diff else \
            f"extrapolation: DIFFERS in {', '.join(diff)} (the row shows the direct figures)"
        lines.append(f"  top choice {top['label']}: figures of a direct dry run at full depth "
                     f"({top['direct_dry_run_s']:.0f} s), {verdict}")
    if "pipeline" in report:
        from ._search_pp import format_pipeline_search

        lines += format_pipeline_search(report["pipeline"])
    dominated: dict[str, int] = {}
    shown = []
    for r in report["rejected"]:
        if r["reason"].startswith("not dry-run: "):
            better = r["reason"].split(": ", 1)[1].split(" fits", 1)[0]
            dominated[better] = dominated.get(better, 0) + 1
        else:
            shown.append(r)
    for v in report["bound_violations"]:
        lines.append(f"  WARNING: {v['label']}: dry-run peak {v['peak']} bytes below the memory bound {v['bound']:.0f}: "
                     f"the bound is wrong for it, and what it pruned may fit")
    lines.append(f"  rejected ({len(shown)}):")
    lines += [f"    {r['label']:<28} {r['reason']}" for r in shown]
    if dominated:
        lines.append(f"  not dry-run ({sum(dominated.values())}): a configuration that fits is never slower "
                     f"(same mesh, larger micro-batch or less recomputation; --json lists them)")
        lines += [f"    {n:>3} under {better}" for better, n in dominated.items()]
    return "\n".join(lines)

