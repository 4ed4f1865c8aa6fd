"""``fsdp2d plan``: will this job fit, and how fast will it be, before getting the GPUs.

    fsdp2d plan --config configs/llama3_70b_64gpu.toml --nodes 1024 --gpus-per-node 8 --gpu h100
    fsdp2d plan --config CONFIG [--config-overlay FILE] [--world-size W | --nodes N --gpus-per-node G]
                [--gpu h100|h200|a100] [--rank R] [--json] [--section.key=value ...]
    fsdp2d plan --search --config CONFIG --world-size W [--gpu ...] [--json] [--write-overlay FILE [--force]]

Runs rank 0 and the last rank (or ``--rank R``) of the job with
:func:`fsdp2d.plan.dry_run` (fake process group + ``FakeTensorMode``: the real mesh, TP
plan, ``fully_shard``, activation checkpointing and training step, no weights
allocated), side by side in forked processes, one per CPU (a single rank, or a single
CPU: in this process), each printing a line as a stage starts, then prints per rank the
measured memory, padding and collectives per mesh axis, and the roofline estimate of
:mod:`fsdp2d.plan.estimate` for the GPU. ``--search`` ranks every configuration of the model on the world size instead
(:mod:`fsdp2d.plan.search`). With ``parallel.pp > 1`` the memory and step are
:mod:`fsdp2d.plan.pipeline`'s closed-form model (no fake-world dry run of a whole pipelined step is built),
checked by a dry run of the largest stage of each pipeline rank shown
(:mod:`fsdp2d.plan._stage`).

A world size other than the config's changes the FSDP degree (``parallel.dp``; ``pp *
hsdp_replicate * tp`` stay) and keeps
the per-rank batch (``training.global_batch`` scales with the data-parallel ranks)
unless ``--training.global_batch`` is given. Errors (a world size the parallel dims do
not divide or that is not whole nodes, more than 2^20 GPUs, an unknown GPU, a rank outside
the world, a ``--write-overlay`` file that exists or is the config) exit with code 2 and
one message, before any dry run or search.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Callable

from fsdp2d.train._rules import MAX_WORLD, pipeline_scope
from fsdp2d.train.config import ConfigError, JobConfig, load_config, validate

from ._format import format_header, format_ranks
from .estimate import GPUS, comm_table, estimate, op_count, roofline_seconds

__all__ = ["main", "plan", "resolve"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="fsdp2d plan", description=__doc__.split("\n\n")[0],
        usage="fsdp2d plan --config CONFIG [options] [--section.key=value ...]",
        epilog="Any --section.key=value overrides that config field, as with fsdp2d train (e.g. "
               "--parallel.tp=8 --training.global_batch=1024 --model.n_layers=40); fsdp2d train --help lists "
               "the fields.")
    ap.add_argument("--config", required=True, help="a TOML preset (configs/*.toml)")
    ap.add_argument("--world-size", type=int, help="GPUs in the job (default: the config's mesh)")
    ap.add_argument("--nodes", type=int, help="nodes (with --gpus-per-node; instead of --world-size)")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    ap.add_argument("--gpu", default="h100", help=f"one of {', '.join(GPUS)} (default h100)")
    ap.add_argument("--rank", type=int, action="append", help="rank to run (repeatable; default 0 and the last)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--config-overlay", action="append", default=[], metavar="FILE",
                    help="a partial config applied over --config (repeatable), e.g. from --write-overlay")
    ap.add_argument("--search", action="store_true",
                    help="rank every mesh / checkpointing / micro-batch for this model on the world size "
                         "(see fsdp2d/plan/search.py)")
    ap.add_argument("--write-overlay", metavar="FILE", help="with --search: write the top choice as a TOML "
                                                            "overlay for --config-overlay (a new file)")
    ap.add_argument("--force", action="store_true", help="with --write-overlay: replace an existing FILE "
                                                         "(never the --config or an overlay file)")
    return ap


def resolve(config: str, overrides: list[str], world: int | None, overlays: list[str] = ()) -> JobConfig:
    """The config at ``world`` GPUs (see the module doc), validated."""
    cfg = load_config(config, overrides, overlays)
    p = cfg.parallel
    if world is not None and world != cfg.world_size and min(p.dp, p.tp, p.hsdp_replicate) >= 1:
        other = p.pp * p.hsdp_replicate * p.tp
        if world % other:
            axes = ("pp * " if p.pp > 1 else "") + "hsdp_replicate * tp"
            sizes = (f"{p.pp} * " if p.pp > 1 else "") + f"{p.hsdp_replicate} * {p.tp}"
            raise ConfigError(f"world size {world} is not divisible by {axes} = {sizes} = {other}: choose a "
                              f"multiple of {other} or change --parallel.tp")
        per_rank = cfg.training.global_batch // cfg.dp_degree
        p.dp = world // other
        if not any(o.startswith("--training.global_batch") for o in overrides):
            cfg.training.global_batch = per_rank * cfg.dp_degree
    validate(cfg, world_size=cfg.world_size, trainer=False)
    return cfg


def _world(args: argparse.Namespace) -> int | None:
    for flag, value in (("--world-size", args.world_size), ("--nodes", args.nodes),
                        ("--gpus-per-node", args.gpus_per_node)):
        if value is not None and not 1 <= value <= MAX_WORLD:
            raise ConfigError(f"{flag}={value} must be in [1, {MAX_WORLD}]")
    if args.nodes is not None:
        if args.world_size is not None:
            raise ConfigError("give --world-size or --nodes (with --gpus-per-node), not both")
        if args.nodes * args.gpus_per_node > MAX_WORLD:
            raise ConfigError(f"--nodes {args.nodes} x --gpus-per-node {args.gpus_per_node} = "
                              f"{args.nodes * args.gpus_per_node} GPUs must be at most {MAX_WORLD}")
        return args.nodes * args.gpus_per_node
    return args.world_size


def check_nodes(world: int, gpus_per_node: int) -> None:
    """A job fills whole nodes (or part of one): the check ``fsdp2d plan`` and
    ``--search`` share, so the search never ranks a world the plan of its overlay refuses."""
    if world % gpus_per_node and world > gpus_per_node:
        below, above = world // gpus_per_node * gpus_per_node, -(-world // gpus_per_node) * gpus_per_node
        raise ConfigError(f"world size {world} is not a whole number of nodes of {gpus_per_node} GPUs: use "
                          f"{below} or {above} GPUs, or give --gpus-per-node (one that divides {world})")


def _say(rank: int, start: float, line: str) -> None:
    print(f"  rank {rank}, {time.perf_counter() - start:.0f} s: {line}", flush=True)


def _timed_dry_run(cfg: JobConfig, world: int, rank: int, verbose: bool = False) -> tuple[dict, float]:
    from fsdp2d.plan._dryrun import dry_run

    t0 = time.perf_counter()
    progress = functools.partial(_say, rank, t0) if verbose else None
    measured = dry_run(cfg, world, rank, progress=progress)
    if progress is not None:
        progress("dry run done")
    return measured, time.perf_counter() - t0


def _dry_runs(cfg: JobConfig, world: int, ranks: list[int], verbose: bool = False) -> list[tuple[dict, float]]:
    """``dry_run`` of each rank and its seconds, in forked processes one per CPU (a dry
    run is single-threaded Python: two ranks on two CPUs take the time of one); with
    ``verbose``, each prints a progress line per stage."""
    workers = min(len(ranks), len(os.sched_getaffinity(0)))
    if workers <= 1:
        return [_timed_dry_run(cfg, world, rank, verbose) for rank in ranks]
    # fork: nothing to import again, and this process has no process group or threads yet
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.starmap(_timed_dry_run, [(cfg, world, rank, verbose) for rank in ranks])


def plan(cfg: JobConfig, world: int, ranks: list[int], gpu_name: str, gpus_per_node: int,
         on_header: Callable[[dict], None] | None = None) -> dict:
    """Dry-run ``ranks`` and estimate them on ``gpu_name``; the JSON report.
    ``on_header`` gets the report without its ranks before the dry runs start (they
    take minutes at scale: ``fsdp2d plan`` prints the header then, and each dry run
    prints a progress line per stage)."""
    from fsdp2d.models import GPT2, Llama

    import torch

    gpu = GPUS[gpu_name]
    with torch.device("meta"):
        model = Llama(cfg.model.to_args()) if cfg.model.name == "llama" else GPT2(cfg.model.to_args())
    flops_per_token = model.flops_per_token(cfg.data.seq_len)
    tokens_per_gpu = cfg.training.global_batch * cfg.data.seq_len / world
    report = {"config": cfg.to_dict(), "world_size": world, "gpus_per_node": gpus_per_node, "gpu": gpu_name,
              "gpu_figures": vars(gpu), "mesh": dict(zip(cfg.mesh_dim_names, cfg.mesh_shape)),
              "model_params": model.num_params(), "flops_per_token": flops_per_token,
              "tokens_per_gpu_per_step": tokens_per_gpu,
              "micro_batch": cfg.micro_batch, "accum_steps": cfg.accum_steps, "ranks": []}
    if cfg.parallel.pp > 1:  # analytic, with stage dry runs (pipeline.py)
        from .pipeline import pipeline_plan

        report["pp"] = cfg.parallel.pp
        report["trainer_refuses"] = pipeline_scope(cfg)
        e = report["pipeline"] = pipeline_plan(cfg, world, gpu, gpus_per_node, flops_per_token, ranks)
        checked = sorted({*ranks, e["heaviest_pp_rank"] * (world // cfg.parallel.pp)})  # and the heaviest's
        if on_header is not None:
            on_header(report)
            print(f"  dry-running the largest stage of pipeline ranks "
                  f"{sorted({r // (world // cfg.parallel.pp) for r in checked})} ...", flush=True)
        from ._stage import check_stages

        e["checks"] = check_stages(cfg, world, checked, gpu, gpus_per_node)
        return report
    if on_header is not None:
        on_header(report)
    for rank, (measured, seconds) in zip(ranks, _dry_runs(cfg, world, ranks, verbose=on_header is not None)):
        ops = measured.pop("ops")
        compute = roofline_seconds(ops, gpu)
        axis_ranks = measured.pop("axis_ranks")
        comm = comm_table(measured, axis_ranks, gpus_per_node, gpu)
        est = estimate(measured, comm, gpu, tokens_per_gpu, flops_per_token, compute)
        for mode in measured.get("accumulation", {}).get("modes", {}).values():  # each grad_sync mode's step
            mode["estimate"] = estimate(mode, comm_table(mode, axis_ranks, gpus_per_node, gpu), gpu,
                                        tokens_per_gpu, flops_per_token, compute)
        report["ranks"].append({"rank": rank, **measured, "collectives": comm, "estimate": est,
                                "roofline_ops": op_count(ops), "dry_run_s": seconds})
    return report


def _search(args: argparse.Namespace, overrides: list[str]) -> int:
    from .search import check_searchable, format_search, overlay_toml, search, search_config

    try:
        world = _world(args)
        if args.write_overlay:  # before minutes of search, not after
            check_overlay_path(args.write_overlay, [args.config, *args.config_overlay], args.force)
        cfg = load_config(args.config, overrides, args.config_overlay)
        check_searchable(cfg)
        if args.gpu not in GPUS:
            raise ConfigError(f"--gpu {args.gpu!r} is not in the table: use one of {', '.join(GPUS)}")
        if args.rank:
            raise ConfigError("--search dry-runs rank 0 of each configuration: leave out --rank")
        cfg, world, batch = search_config(cfg, world, overrides)
        check_nodes(world, args.gpus_per_node)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    say = None if args.json else (lambda line: print(line, flush=True))
    report = search(cfg, world, args.gpu, min(args.gpus_per_node, world), batch, say)
    print(json.dumps(report) if args.json else format_search(report, args.config))
    if args.write_overlay:
        if "top" not in report:
            print("no configuration fits: no overlay written", file=sys.stderr)
            return 1
        try:
            write_new(args.write_overlay, overlay_toml(report), args.force)
        except OSError as exc:
            print(f"cannot write the overlay: {exc}", file=sys.stderr)
            return 1
        if not args.json:
            rest = "".join(f" {o}" for o in overrides)
            print(f"wrote the top choice to {args.write_overlay}: fsdp2d train --config {args.config}"
                  f"{''.join(f' --config-overlay {o}' for o in args.config_overlay)} "
                  f"--config-overlay {args.write_overlay}{rest}")
    return 0


def check_overlay_path(path: str, inputs: list[str], force: bool) -> None:
    """``--write-overlay``'s file: in a folder that exists and is writable, not a folder,
    not a file the search reads (``--config``, ``--config-overlay``: it would replace the
    user's config with 12 lines), and new unless ``--force``."""
    target = Path(path)
    if any(target.resolve() == Path(i).resolve() for i in inputs):
        raise ConfigError(f"--write-overlay {path} is a config file this search reads: write the overlay to a "
                          f"new file (e.g. top.toml) and give both with --config-overlay")
    if target.is_dir():
        raise ConfigError(f"--write-overlay {path} is a folder: give a file name, e.g. {target / 'top.toml'}")
    if target.exists() and not force:
        raise ConfigError(f"--write-overlay {path} exists: choose a new file name, or add --force to replace it")
    folder = target.parent
    if not folder.is_dir():
        raise ConfigError(f"--write-overlay {path}: folder {folder} does not exist: create it or write elsewhere")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"--write-overlay {path}: folder {folder} is not writable: write elsewhere")


def write_new(path: str, text: str, replace: bool) -> None:
    """Write ``text`` to ``path`` whole: with ``replace`` through a temporary file renamed
    over it; otherwise only if no file appeared there since :func:`check_overlay_path`
    (``FileExistsError``), and removed again if the write fails."""
    target = Path(path)
    if replace:
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(text)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        return
    with open(target, "x") as f:
        try:
            f.write(text)
            f.flush()
        except BaseException:
            target.unlink(missing_ok=True)
            raise


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.search:
        return _search(args, overrides)
    if args.write_overlay or args.force:
        print(f"config error: {'--write-overlay' if args.write_overlay else '--force'} goes with --search",
              file=sys.stderr)
        return 2
    try:
        world = _world(args)
        cfg = resolve(args.config, overrides, world, args.config_overlay)
        world = cfg.world_size
        if args.gpu not in GPUS:
            raise ConfigError(f"--gpu {args.gpu!r} is not in the table: use one of {', '.join(GPUS)}")
        check_nodes(world, args.gpus_per_node)
        ranks = args.rank or sorted({0, world - 1})
        bad = [r for r in ranks if not 0 <= r < world]
        if bad:
            raise ConfigError(f"--rank {bad[0]} is outside the world of {world} ranks (0 .. {world - 1})")
    except (ConfigError, FileNotFoundError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    def header(report: dict) -> None:
        print(format_header(report, args.config), flush=True)

    try:
        report = plan(cfg, world, ranks, args.gpu, min(args.gpus_per_node, world), None if args.json else header)
    except ConfigError as exc:  # what the pipeline model (pp > 1) does not cover
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if "pipeline" in report:
        from .pipeline import format_pipeline

        print(json.dumps(report) if args.json else format_pipeline(report))
        return 0
    print(json.dumps(report) if args.json else format_ranks(report))
    return 0
