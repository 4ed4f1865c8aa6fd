"""The launcher's cross-field rules: each check reads a :class:`~fsdp2d.train.config.JobConfig`
and appends what is wrong, with how to fix it, to ``errors``;
:func:`fsdp2d.train.config.validate` runs them and raises one ``ConfigError`` listing all.
Pure functions of the config (no import of it: ``config`` imports this module)."""

from __future__ import annotations

import math

__all__ = ["check_ranges", "check_mesh", "check_model", "check_batch", "check_pipeline", "pipeline_scope", "divisors", "error_text",
           "mesh_text", "MAX_WORLD", "MAX_BATCH", "SINGLE_STAGE_SCHEDULES", "V_SCHEDULES", "ROUND_SCHEDULES",
           "SPLIT_BACKWARD_SCHEDULES"]

# Upper bounds far above any job run today (the largest clusters hold ~10^5 GPUs; Llama 3
# 405B's batch was 2048 x 8192 tokens) and far below sizes whose mesh, candidate lists or
# error messages would take minutes to build (fsdp2d plan, plan --search, train).
MAX_WORLD = 2**20
"""GPUs in one job: ``pp * hsdp_replicate * dp * tp`` (and ``fsdp2d plan --world-size``)."""
MAX_BATCH = 2**24
"""Sequences per optimizer step (``training.global_batch``, ``training.micro_batch``)."""
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
"""``parallel.pp_schedule`` values that run one stage per pipeline rank."""
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""``parallel.pp_schedule`` values that run exactly two stages per rank, in a V."""
ROUND_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")
"""Schedules that run the micro-batches in rounds of ``pp`` (torch refuses a count that is
not a multiple of ``max(1, m // pp)``)."""
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Schedules that split backward into an input and a weight step (the zero-bubble ones)."""


def error_text(errors: list[str]) -> str:
    """The message of a ``ConfigError`` listing ``errors``: one line for one problem."""
    if len(errors) == 1:
        return f"invalid config: {errors[0]}"
    return "invalid config:\n  - " + "\n  - ".join(errors)


def divisors(n: int) -> list[int]:
    """The divisors of ``n >= 1``, ascending, in O(sqrt n) steps (``n`` may be large:
    a per-rank batch, a world size)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def _divisors(n: int, most: int = 16) -> str:
    """``n``'s divisors as text; beyond ``most`` of them, the smallest and largest few."""
    ds = divisors(n)
    shown = ds if len(ds) <= most else ds[:most - 4] + ["..."] + ds[-4:]
    return ", ".join(str(d) for d in shown)


def check_ranges(cfg: "JobConfig", errors: list[str]) -> None:
    """Per-field bounds: (value, ok, what it must be)."""
    m, p, d, o, t, c = cfg.model, cfg.parallel, cfg.data, cfg.optim, cfg.training, cfg.checkpoint
    rules = [
        # Upper bounds far above any released model (405B: dim 16384, 126 layers) and far
        # below sizes whose meta model alone would take minutes to build (plan, train).
        ("model.dim", m.dim, 1 <= m.dim <= 2**18, f"in [1, {2**18}]"),
        ("model.n_layers", m.n_layers, 1 <= m.n_layers <= 4096, "in [1, 4096]"),
        ("model.n_heads", m.n_heads, 1 <= m.n_heads <= 2**14, f"in [1, {2**14}]"),
        ("model.vocab_size", m.vocab_size, 1 <= m.vocab_size <= 2**24, f"in [1, {2**24}]"),
        ("model.max_seq_len", m.max_seq_len, 1 <= m.max_seq_len <= 2**24, f"in [1, {2**24}]"),
        ("parallel.dp", p.dp, 1 <= p.dp <= MAX_WORLD, f"in [1, {MAX_WORLD}]"),
        ("parallel.tp", p.tp, 1 <= p.tp <= MAX_WORLD, f"in [1, {MAX_WORLD}]"),
        ("parallel.hsdp_replicate", p.hsdp_replicate, 1 <= p.hsdp_replicate <= MAX_WORLD, f"in [1, {MAX_WORLD}]"),
        ("parallel.pp", p.pp, 1 <= p.pp <= MAX_WORLD, f"in [1, {MAX_WORLD}]"),
        ("data.seq_len", d.seq_len, d.seq_len >= 1, ">= 1"),
        ("data.eval_fraction", d.eval_fraction, 0.0 <= d.eval_fraction < 1.0, "in [0, 1)"),
        ("optim.lr", o.lr, o.lr > 0, "> 0"),
        ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0"),
        ("optim.betas", o.betas, all(0.0 <= b < 1.0 for b in o.betas), "each in [0, 1)"),
        ("optim.eps", o.eps, o.eps > 0, "> 0"),
        ("optim.min_lr_ratio", o.min_lr_ratio, 0.0 <= o.min_lr_ratio <= 1.0, "in [0, 1]"),
        ("optim.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, ">= 0"),
        ("training.steps", t.steps, t.steps >= 1, ">= 1"),
        ("training.global_batch", t.global_batch, 1 <= t.global_batch <= MAX_BATCH, f"in [1, {MAX_BATCH}]"),
        ("training.micro_batch", t.micro_batch, t.micro_batch is None or 1 <= t.micro_batch <= MAX_BATCH,
         f"in [1, {MAX_BATCH}] (or none)"),
        ("training.eval_every", t.eval_every, t.eval_every >= 0, ">= 0 (0 = never)"),
        ("training.eval_steps", t.eval_steps, t.eval_steps >= 1, ">= 1"),
        ("training.log_every", t.log_every, t.log_every >= 1, ">= 1"),
        ("checkpoint.every", c.every, c.every >= 0, ">= 0 (0 = never)"),
        ("checkpoint.keep_last", c.keep_last, c.keep_last >= 0, ">= 0 (0 = keep all)"),
    ]
    for i, src in enumerate(d.sources):
        rules.append((f"data.sources[{i}].weight", src.weight, src.weight > 0 and math.isfinite(src.weight), "> 0"))
        rules.append((f"data.sources[{i}].path", repr(src.path), bool(src.path), "a file or folder"))
    if d.sources and d.path != "stdlib":
        rules.append(("data.path", repr(d.path), False, "unset when [[data.sources]] lists the sources (use one or the other)"))
    if d.workers is not None:
        rules.append(("data.workers", d.workers, d.workers >= 0, ">= 0 (or none)"))
    if m.n_kv_heads is not None:
        rules.append(("model.n_kv_heads", m.n_kv_heads, m.n_kv_heads >= 1, ">= 1 (or none)"))
    if p.nproc is not None:
        rules.append(("parallel.nproc", p.nproc, p.nproc >= 1, ">= 1 (or none)"))
    if cfg.metrics.peak_flops is not None:
        rules.append(("metrics.peak_flops", cfg.metrics.peak_flops, cfg.metrics.peak_flops > 0,
                      "> 0 (or none)"))
    if p.pp_stages_per_rank is not None:
        rules.append(("parallel.pp_stages_per_rank", p.pp_stages_per_rank, p.pp_stages_per_rank >= 1, ">= 1 (or none)"))
    errors.extend(f"{name}={value} must be {need}" for name, value, ok, need in rules if not ok)
    if all(1 <= n <= MAX_WORLD for n in (p.dp, p.tp, p.hsdp_replicate, p.pp)) and cfg.world_size > MAX_WORLD:
        errors.append(f"the mesh {mesh_text(cfg)} GPUs must be at most {MAX_WORLD}: lower parallel.dp")


def mesh_text(cfg: "JobConfig") -> str:
    """``hsdp_replicate * dp * tp = 1 * 4 * 2 = 8`` (``pp * ...`` first when pp > 1)."""
    p = cfg.parallel
    names, sizes = ["hsdp_replicate", "dp", "tp"], [p.hsdp_replicate, p.dp, p.tp]
    if p.pp > 1:
        names, sizes = ["pp", *names], [p.pp, *sizes]
    return f"{' * '.join(names)} = {' * '.join(map(str, sizes))} = {cfg.world_size}"


def check_pipeline(cfg: "JobConfig", errors: list[str]) -> None:
    """The stages a schedule needs, and enough layers to give each one."""
    p = cfg.parallel
    if p.pp == 1:
        return
    stages = cfg.pp_stages_per_rank
    if p.pp_schedule in SINGLE_STAGE_SCHEDULES and stages != 1:
        errors.append(f"parallel.pp_schedule={p.pp_schedule!r} runs one stage per rank, not "
                      f"parallel.pp_stages_per_rank={stages}: use Interleaved1F1B or LoopedBFS for more")
    elif p.pp_schedule in V_SCHEDULES and stages != 2:
        errors.append(f"parallel.pp_schedule={p.pp_schedule!r} runs exactly 2 stages per rank (a V), not "
                      f"parallel.pp_stages_per_rank={stages}: set it to 2 (or none)")
    elif p.pp_schedule not in SINGLE_STAGE_SCHEDULES and stages < 2:
        errors.append(f"parallel.pp_schedule={p.pp_schedule!r} needs at least 2 stages per rank, not "
                      f"parallel.pp_stages_per_rank={stages}: set 2 or more (or none), or use 1F1B")
    if p.pp * stages > cfg.model.n_layers:
        errors.append(f"parallel.pp * stages per rank = {p.pp} * {stages} = {p.pp * stages} stages need at least "
                      f"as many layers, not model.n_layers={cfg.model.n_layers}: lower parallel.pp or add layers")
        return
    t = cfg.training
    if t.global_batch % cfg.dp_degree or (t.micro_batch and (t.global_batch // cfg.dp_degree) % t.micro_batch):
        return  # (check_batch says what is wrong with the batch; the micro-batches are not whole)
    m = cfg.accum_steps  # the micro-batches the schedule pipelines per step
    if m < p.pp:
        errors.append(f"parallel.pp={p.pp} needs at least {p.pp} micro-batches per step (torch's schedules), not "
                      f"{m} (the per-rank batch over training.micro_batch): lower training.micro_batch or raise "
                      f"training.global_batch")
    elif p.pp_schedule in ROUND_SCHEDULES and m % max(1, m // p.pp):
        rounds = m // p.pp
        errors.append(f"parallel.pp_schedule={p.pp_schedule!r} needs the {m} micro-batches per step to be a "
                      f"multiple of their rounds ({rounds} of pp={p.pp}): choose training.micro_batch so that "
                      f"the micro-batches per step are a multiple of {p.pp}")


def pipeline_scope(cfg: "JobConfig") -> list[str]:
    """What the trainer's pipeline does not run yet, one line each (empty at pp=1): the
    trainer refuses these (:func:`fsdp2d.train.config.validate`), ``fsdp2d plan`` plans them
    and says the trainer would refuse them."""
    if cfg.parallel.pp == 1:
        return []
    p, t, pp = cfg.parallel, cfg.training, f"parallel.pp={cfg.parallel.pp}"
    refused = [
        (cfg.model.name != "llama", f"model.name={cfg.model.name!r}: the trainer pipelines llama only",
         "use model.name='llama'"),
        (bool(cfg.model.init_from), f"model.init_from={cfg.model.init_from!r}: HF weights are not loaded into "
         f"pipeline stages yet", "convert them once at parallel.pp=1 (checkpoint.init_from reads any pp)"),
        (cfg.data.document_mask, "data.document_mask=true: document ids do not travel between pipeline stages",
         "set data.document_mask=false"),
        (p.tp > 1 and p.loss_parallel, "parallel.loss_parallel=true: the last stage's loss runs outside "
         "loss_parallel", "set parallel.loss_parallel=false"),
        (p.tp > 1 and p.sequence_parallel, "parallel.sequence_parallel=true: not tested between pipeline stages",
         "set parallel.sequence_parallel=false"),
        (cfg.accum_steps > 1 and t.grad_sync == "every", "training.grad_sync='every': the schedule reduce-scatters "
         "each stage's gradients once, after its last micro-batch", "set training.grad_sync='last'"),
        (t.eval_every > 0 and t.eval_steps % cfg.accum_steps != 0,
         f"training.eval_steps={t.eval_steps}: the pipeline evaluates {cfg.accum_steps} micro-batches "
         f"(accum_steps) per run", f"use a multiple of {cfg.accum_steps}"),
        (t.eval_every > 0 and p.pp_schedule in V_SCHEDULES, f"parallel.pp_schedule={p.pp_schedule!r} and "
         f"training.eval_every={t.eval_every}: torch's schedule.eval fails on the V-shaped schedules "
         f"(torch 2.13: 'can't steal_bwd_input')", "set training.eval_every=0, use Interleaved1F1B,"),
        (p.pp_schedule in SPLIT_BACKWARD_SCHEDULES and t.activation_checkpointing == "selective",
         f"parallel.pp_schedule={p.pp_schedule!r} and training.activation_checkpointing='selective': the split "
         f"backward runs backward twice through a region selective checkpointing lets run once (torch 2.13)",
         "use activation_checkpointing 'full' or 'none', or the 1F1B/Interleaved1F1B schedules,"),
        (p.pp_schedule == "DualPipeV" and cfg.accum_steps < 2 * p.pp, f"parallel.pp_schedule='DualPipeV' with "
         f"{cfg.accum_steps} micro-batches per step (accum_steps): it needs at least one per stage, "
         f"{2 * p.pp}", "lower training.micro_batch"),
    ]
    return [f"{pp} with {what}: {fix} or parallel.pp=1" for bad, what, fix in refused if bad]


def check_mesh(cfg: "JobConfig", world_size: int | None, errors: list[str]) -> None:
    p = cfg.parallel
    mesh = mesh_text(cfg)
    if p.nproc is not None and p.nproc != cfg.world_size:
        errors.append(f"parallel.nproc={p.nproc} but the mesh needs {mesh} processes: "
                      f"set parallel.nproc={cfg.world_size} (or none) or change the mesh")
    if world_size is None or world_size == cfg.world_size:
        return
    other = p.pp * p.hsdp_replicate * p.tp
    fix = (f"set parallel.dp={world_size // other}" if world_size % other == 0 else
           f"choose parallel.tp (and dp) whose product with pp * hsdp_replicate is {world_size}")
    errors.append(f"parallel mesh {mesh} does not match the world size {world_size}: "
                  f"{fix}, or launch {cfg.world_size} processes")


def check_model(cfg: "JobConfig", errors: list[str]) -> None:
    m, tp = cfg.model, cfg.parallel.tp
    kv = m.n_kv_heads if m.n_kv_heads is not None else m.n_heads
    if min(m.dim, m.n_heads, kv, tp) < 1:
        return  # reported by check_ranges
    if m.dim % m.n_heads:
        errors.append(f"model.dim={m.dim} must be divisible by model.n_heads={m.n_heads} "
                      f"(head_dim = dim / n_heads)")
    elif m.name == "llama" and (m.dim // m.n_heads) % 2:
        errors.append(f"model head_dim = dim / n_heads = {m.dim // m.n_heads} must be even "
                      f"for RoPE: change model.dim or model.n_heads")
    if m.name == "gpt2" and kv != m.n_heads:
        errors.append(f"model.n_kv_heads={kv}: gpt2 has no grouped-query attention; "
                      f"remove it or set it to n_heads={m.n_heads}")
    elif m.n_heads % kv:
        errors.append(f"model.n_heads={m.n_heads} must be a multiple of model.n_kv_heads={kv}")
    for name, heads in (("n_heads", m.n_heads), ("n_kv_heads", kv)):
        if heads % tp:
            errors.append(f"parallel.tp={tp} must divide model.{name}={heads} (each TP rank "
                          f"holds whole heads): use tp in {{{_divisors(math.gcd(m.n_heads, kv))}}}")
    if m.name == "gpt2" and cfg.data.document_mask:
        errors.append("data.document_mask=true: gpt2's learned positions cannot restart per document "
                      "(fsdp2d's GPT2 refuses document_ids); use model.name='llama' or data.document_mask=false")
    # Only a format that is surely raw text: with "auto" the path may be a token store of any
    # vocabulary (the data layer checks the tokenizer it actually uses, before anything is built).
    raw = any((s.format or cfg.data.format) in ("text", "jsonl", "parquet", "arrow") for s in cfg.data.sources) \
        if cfg.data.sources else cfg.data.format in ("text", "jsonl", "parquet", "arrow")
    if raw and cfg.data.tokenizer == "bytes" and m.vocab_size < 256:
        errors.append(f"model.vocab_size={m.vocab_size} is too small for the byte tokenizer: "
                      f"set it to 256 or more")
    if cfg.data.seq_len > m.max_seq_len:
        errors.append(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}: "
                      f"lower data.seq_len or raise model.max_seq_len")
    if cfg.parallel.sequence_parallel and cfg.data.seq_len % tp:
        errors.append(f"data.seq_len={cfg.data.seq_len} must be divisible by parallel.tp={tp} "
                      f"under sequence_parallel (each TP rank holds seq_len / tp positions)")


def check_batch(cfg: "JobConfig", errors: list[str]) -> None:
    t, ranks = cfg.training, cfg.dp_degree
    if not 1 <= t.global_batch <= MAX_BATCH or not 1 <= ranks <= MAX_WORLD:
        return  # reported by check_ranges
    if t.global_batch % ranks:
        lo = max(ranks, t.global_batch // ranks * ranks)
        errors.append(f"training.global_batch={t.global_batch} does not split over {ranks} "
                      f"data-parallel ranks (hsdp_replicate * dp): use a multiple of {ranks}, "
                      f"e.g. {lo} or {lo + ranks}")
        return
    per_rank = t.global_batch // ranks
    if t.micro_batch is not None and t.micro_batch >= 1 and per_rank % t.micro_batch:
        errors.append(f"training.micro_batch={t.micro_batch} must divide the per-rank batch "
                      f"{per_rank} (= global_batch / {ranks} data-parallel ranks): use one of "
                      f"{{{_divisors(per_rank)}}}")
    if t.eval_every > 0 and cfg.data.eval_fraction == 0:
        errors.append("training.eval_every > 0 needs held-out data: set data.eval_fraction > 0 "
                      "(e.g. 0.01) or training.eval_every=0")
