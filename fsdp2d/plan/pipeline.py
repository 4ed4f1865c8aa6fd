"""``fsdp2d plan`` with pipeline parallelism (``parallel.pp > 1``): a closed-form model of one
pipeline rank, checked by a dry run of single stages.

plan does not dry-run a whole pipelined step (the trainer runs it, ``fsdp2d.train.pipeline``;
the schedule's fake-world dry run is not built): a ``pp > 1`` plan's memory and step are **analytic**, and its output says so. Every
input is a count (the model's parameters per layer and at the ends, from the meta model; the
schedule's micro-batches in flight, from torch's own schedule arithmetic) or a figure of
:data:`fsdp2d.plan.estimate.GPUS`. ``fsdp2d plan`` then dry-runs the largest stage of each
pipeline rank it shows (and of the heaviest one) with two micro-batches in flight
(:mod:`fsdp2d.plan._stage`) and prints the measured states, peak, bytes per micro-batch in
flight and compute beside this model's figures for the same stage.

**Which layers.** Stage ``s`` holds ``stage_layers(n_layers, pp * stages_per_rank)[s]``
(:mod:`fsdp2d.models.stages`, the trainer's rule), plus the token embedding on stage 0 and
the final norm and output projection on the last; pipeline rank ``r`` holds
``stages_of_rank(r, ...)``. Each stage is sharded over the other axes (``dp x tp`` ranks).

**Memory of pipeline rank r** (bytes; ``P`` the parameters of its stages, ``S = dp x tp``,
``a`` bytes per activation element and per unsharded parameter, 2 under bf16 else 4):

* states ``16 P / S``: fp32 parameters, gradients and AdamW's two moments, sharded;
* held for the step ``(4 + a) P / tp``: torch's pipelining runs every backward with
  ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)`` and reduces
  once after the last (``perform_reduce_grad``), so from the first backward on a stage keeps
  its unsharded parameters and fp32 gradient accumulators;
* activations: ``in flight x`` one micro-batch's saved activations of the rank's largest
  stage (:func:`fsdp2d.plan.search.activation_bytes`, the search's per-block term: the
  block inputs under full checkpointing, more without);
* logits of one micro-batch on the rank holding the last stage (the search's term).

No transients (one block's all-gather buffer, the backward's temporaries): a lower-bound-like
figure, as the search's bound.

**Micro-batches in flight** (activations held at the peak), ``m`` micro-batches per step,
rank ``r``, ``v`` stages per rank, as torch's schedules order them:
GPipe ``m``; 1F1B ``min(m, pp - r)``; Interleaved1F1B (and InterleavedZeroBubble)
torch's warm-up ``(v - 1) m_round + f (pp - 1 - r)`` plus one (``f`` 2, and 1 for the
zero-bubble one; ``m_round = m / max(1, m // pp)``), at most ``v m``, in chunks of one stage;
LoopedBFS ``v m`` (all forwards first); the V schedules (ZBVZeroBubble, DualPipeV) ``2 pp``
chunks, at most ``2 m``. The zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble,
DualPipeV) split backward into an input-gradient step and a deferred weight-gradient step that
keeps its inputs: counted simply as ``pp`` more chunks held (a whole chunk's activations each,
an over-count: the weight step needs only the matmul inputs).

**Step time.** Per micro-batch and stage: the FLOPs of its layers (``6 P_stage + 12 L H
d_head T`` per token, the model's formula, times 4/3 under full checkpointing, which runs
each forward again) over ``tp`` at the GPU's peak (no HBM term: compare pp rows among
themselves, not with the dry-run rows), TP's collectives (sequence parallel: per block two
all-gathers and two reduce-scatters of ``b T d`` each way and again in the recomputed forward;
without: two all-reduces), and the P2P receive of the activation (forward) and of its
gradient (backward), ``b T / s x d x a`` bytes over the pp axis's link, exposed. The slowest
pipeline rank sets the pace: ``pipeline = per micro-batch x (m + bubble)``, ``bubble = (pp -
1) / v`` micro-batches for GPipe, 1F1B, Interleaved1F1B and LoopedBFS (``(pp - 1) / m`` of the
step, divided by the stages per rank) and 0 for the zero-bubble schedules (the ideal).
FSDP runs once per step per stage (the all-gather of its bf16 parameters, overlapped with the
pipeline; the reduce-scatter of its fp32 gradients after the last backward, exposed):
``step = max(pipeline, all-gather) + reduce-scatter``.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp2d.models.stages import stage_layers, stages_of_rank
from fsdp2d.train._rules import SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES
from fsdp2d.train.config import ConfigError, JobConfig

from .estimate import GPU, wire_factor

__all__ = ["Pipeline", "ModelCounts", "in_flight", "bubble", "rank_memory", "stage_figures", "rank_stages",
           "rank_estimate", "pipeline_plan", "format_pipeline", "check_pipeline_plan", "stage_seconds"]


@dataclass(frozen=True)
class Pipeline:
    """The pipeline of a job: ``pp`` ranks, ``stages`` per rank, ``microbatches`` per step."""
    pp: int
    schedule: str
    stages: int
    microbatches: int

    @classmethod
    def of(cls, cfg: JobConfig) -> "Pipeline":
        return cls(cfg.parallel.pp, cfg.parallel.pp_schedule, cfg.pp_stages_per_rank, cfg.accum_steps)


@dataclass(frozen=True)
class ModelCounts:
    """Parameters per block, of the embedding and of the head (final norm + output)."""
    per_layer: int
    embedding: int
    head: int

    @classmethod
    def of(cls, cfg: JobConfig) -> "ModelCounts":
        import torch

        from fsdp2d.models import Llama

        args = cfg.model.to_args()
        args.n_layers = 1  # every block has the same parameters
        with torch.device("meta"):
            m = Llama(args)
        count = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
        return cls(count(m.layers[0]), count(m.tok_embeddings), count(m.norm) + count(m.output))


def check_pipeline_plan(cfg: JobConfig) -> None:
    """What the analytic pipeline model covers, and what torch's schedules accept, in one
    line each (ConfigError)."""
    p = cfg.parallel
    if cfg.model.name != "llama":
        raise ConfigError(f"fsdp2d plan models parallel.pp > 1 for Llama only (model.name={cfg.model.name!r}): "
                          f"set parallel.pp=1")
    if getattr(cfg.model.to_args(), "tie_embeddings", False):
        raise ConfigError("tied embeddings (a model.init_from whose config ties them) with parallel.pp > 1: the "
                          "embedding (stage 0) and the output (the last stage) cannot share one tensor: use a model "
                          "without tied embeddings or parallel.pp=1")
    # (the micro-batches a schedule needs: fsdp2d.train._rules.check_pipeline, in validate)


def in_flight(pipe: Pipeline, pp_rank: int) -> int:
    """Micro-batch chunks (one stage's activations of one micro-batch) pipeline rank
    ``pp_rank`` holds at its peak (module doc)."""
    pp, v, m, name = pipe.pp, pipe.stages, pipe.microbatches, pipe.schedule
    if name == "GPipe":
        return m
    if name == "1F1B":
        return min(m, pp - pp_rank)
    if name == "LoopedBFS":
        return v * m
    if name in V_SCHEDULES:
        chunks = min(2 * m, 2 * pp)
    else:  # Interleaved1F1B, InterleavedZeroBubble: torch's _get_warmup_ops, then one more forward
        per_round = m // max(1, m // pp)
        factor = 1 if name == "InterleavedZeroBubble" else 2
        chunks = min(v * m, (v - 1) * per_round + factor * (pp - 1 - pp_rank) + 1)
    if name in SPLIT_BACKWARD_SCHEDULES:
        chunks += pp  # deferred weight-gradient steps keep their inputs (module doc)
    return chunks


def bubble(pipe: Pipeline) -> float:
    """Idle micro-batch slots per step on the slowest rank (module doc)."""
    if pipe.schedule in SPLIT_BACKWARD_SCHEDULES:
        return 0.0
    return (pipe.pp - 1) / pipe.stages


def rank_stages(cfg: JobConfig, pipe: Pipeline, pp_rank: int) -> list[tuple[int, range]]:
    split = stage_layers(cfg.model.n_layers, pipe.pp * pipe.stages)
    ids = stages_of_rank(pp_rank, pipe.pp, pipe.stages, pipe.schedule in V_SCHEDULES)
    return [(s, split[s]) for s in ids]


def _stage_params(counts: ModelCounts, stage: int, layers: int, n_stages: int) -> int:
    return layers * counts.per_layer + (stage == 0) * counts.embedding + (stage == n_stages - 1) * counts.head


def stage_figures(cfg: JobConfig, counts: ModelCounts, stage: int, chunks: int) -> dict:
    """The model's bytes for one stage with ``chunks`` micro-batches in flight (what
    :func:`fsdp2d.plan._stage.stage_dry_run` measures, to check them)."""
    from ._choice import activation_bytes, logit_bytes

    p = cfg.parallel
    n_stages = p.pp * cfg.pp_stages_per_rank
    layers = len(stage_layers(cfg.model.n_layers, n_stages)[stage])
    params = _stage_params(counts, stage, layers, n_stages)
    a = 2 if cfg.training.mixed_precision == "bf16" else 4
    states, held = 16 * params / (p.dp * p.tp), (4 + a) * params / p.tp
    chunk = activation_bytes(cfg, layers)
    logits = logit_bytes(cfg) if stage == n_stages - 1 else 0.0
    return {"layers": layers, "parameters": params, "states": states, "unsharded_held": held, "chunk": chunk,
            "logits": logits, "peak": states + held + chunks * chunk + logits}


def rank_memory(cfg: JobConfig, counts: ModelCounts, pp_rank: int) -> dict:
    """Bytes of pipeline rank ``pp_rank``'s peak, by term (module doc)."""
    from ._choice import activation_bytes, logit_bytes

    p, pipe = cfg.parallel, Pipeline.of(cfg)
    stages = rank_stages(cfg, pipe, pp_rank)
    n_stages = pipe.pp * pipe.stages
    params = sum(_stage_params(counts, s, len(layers), n_stages) for s, layers in stages)
    a = 2 if cfg.training.mixed_precision == "bf16" else 4
    states = 16 * params / (p.dp * p.tp)
    held = (4 + a) * params / p.tp
    chunks = in_flight(pipe, pp_rank)
    acts = chunks * activation_bytes(cfg, max(len(layers) for _, layers in stages))
    logits = logit_bytes(cfg) if any(s == n_stages - 1 for s, _ in stages) else 0.0
    return {"stages": [s for s, _ in stages], "layers": [len(layers) for _, layers in stages], "parameters": params,
            "states": states, "unsharded_held": held, "in_flight": chunks, "activations": acts, "logits": logits,
            "peak": states + held + acts + logits}


def _link(stride: int, size: int, gpus_per_node: int, gpu: GPU) -> tuple[str, float]:
    """An axis of ``size`` ranks ``stride`` apart stays in a node when it spans at most one."""
    inside = size <= 1 or (stride * size <= gpus_per_node and gpus_per_node % (stride * size) == 0)
    return ("nvlink", gpu.nvlink_bytes_per_s) if inside else ("network", gpu.network_bytes_per_s)


def stage_seconds(cfg: JobConfig, counts: ModelCounts, layers: int, first: bool, last: bool, gpu: GPU,
                   gpus_per_node: int) -> tuple[float, float]:
    """(compute, TP communication) seconds of one micro-batch's forward and backward of a stage."""
    m, p = cfg.model, cfg.parallel
    tokens = cfg.micro_batch * cfg.data.seq_len
    head = m.dim // m.n_heads
    dense = layers * counts.per_layer + (counts.head if last else 0)  # the embedding is a lookup, no matmul
    flops = tokens * (6 * dense + 12 * layers * m.n_heads * head * cfg.data.seq_len)
    full = cfg.training.activation_checkpointing == "full"
    compute = flops * (4 / 3 if full else 1) / p.tp / gpu.bf16_flops
    a = 2 if cfg.training.mixed_precision == "bf16" else 4
    stream = tokens * m.dim * a  # (b, T, d): what each TP collective moves, logically
    _, bw = _link(1, p.tp, gpus_per_node, gpu)
    passes = 3 if full else 2  # forward, backward, the recomputed forward
    if p.sequence_parallel:
        per_block = 4 * passes * wire_factor("all_gather", p.tp)  # 2 all-gathers + 2 reduce-scatters a pass
    else:
        per_block = 2 * passes * wire_factor("all_reduce", p.tp)
    ends = 2 * (first + last) * wire_factor("all_gather", p.tp)  # embedding / head: one each way
    return compute, stream * (layers * per_block + ends) / bw


def rank_estimate(cfg: JobConfig, counts: ModelCounts, pp_rank: int, gpu: GPU, gpus_per_node: int) -> dict:
    """Pipeline rank ``pp_rank``'s own per-micro-batch seconds and its once-per-step FSDP."""
    p, pipe = cfg.parallel, Pipeline.of(cfg)
    n_stages = pipe.pp * pipe.stages
    mem = rank_memory(cfg, counts, pp_rank)
    compute = tp = 0.0
    for s, layers in rank_stages(cfg, pipe, pp_rank):
        c, t = stage_seconds(cfg, counts, len(layers), s == 0, s == n_stages - 1, gpu, gpus_per_node)
        compute, tp = compute + c, tp + t
    a = 2 if cfg.training.mixed_precision == "bf16" else 4
    s_ = p.tp if p.sequence_parallel else 1
    message = cfg.micro_batch * cfg.data.seq_len // s_ * cfg.model.dim * a  # one activation (or its gradient)
    pp_link, pp_bw = _link(p.hsdp_replicate * p.dp * p.tp, p.pp, gpus_per_node, gpu)
    p2p = pipe.stages * 2 * message / pp_bw  # receive the input, then its gradient, per stage
    dp_link, dp_bw = _link(p.tp, p.dp, gpus_per_node, gpu)
    local = mem["parameters"] / p.tp  # the TP-local parameters FSDP gathers
    gather = local * a * wire_factor("all_gather", p.dp) / dp_bw
    reduce = local * 4 * wire_factor("reduce_scatter", p.dp) / dp_bw
    return {"memory": mem, "compute_s_per_microbatch": compute, "tp_s_per_microbatch": tp,
            "p2p_s_per_microbatch": p2p, "p2p_bytes": message, "links": {"pp": pp_link, "dp": dp_link},
            "fsdp_all_gather_s": gather, "fsdp_reduce_scatter_s": reduce}


def pipeline_plan(cfg: JobConfig, world: int, gpu: GPU, gpus_per_node: int, flops_per_token: float,
                  ranks: list[int] | None = None, counts: ModelCounts | None = None) -> dict:
    """The analytic plan of a ``pp > 1`` job: per pipeline rank its memory and seconds, and the
    step the slowest rank sets (module doc). ``ranks`` (global) pick the rows shown; every
    pipeline rank is computed (the pace and the heaviest rank need all)."""
    check_pipeline_plan(cfg)
    counts, pipe = counts or ModelCounts.of(cfg), Pipeline.of(cfg)
    per_pp = world // pipe.pp
    rows = [rank_estimate(cfg, counts, r, gpu, gpus_per_node) for r in range(pipe.pp)]
    per_mb = max(r["compute_s_per_microbatch"] + r["tp_s_per_microbatch"] + r["p2p_s_per_microbatch"] for r in rows)
    pipeline_s = per_mb * (pipe.microbatches + bubble(pipe))
    gather = max(r["fsdp_all_gather_s"] for r in rows)
    reduce = max(r["fsdp_reduce_scatter_s"] for r in rows)
    step = max(pipeline_s, gather) + reduce
    tokens_per_gpu = cfg.training.global_batch * cfg.data.seq_len / world
    tps = tokens_per_gpu / step
    heaviest = max(range(pipe.pp), key=lambda r: rows[r]["memory"]["peak"])
    shown = sorted({r // per_pp for r in (ranks if ranks is not None else [0, world - 1])})
    return {"analytic": True, "schedule": pipe.schedule, "stages_per_rank": pipe.stages,
            "microbatches": pipe.microbatches, "bubble_microbatches": bubble(pipe),
            "bubble_fraction": bubble(pipe) / (pipe.microbatches + bubble(pipe)),
            "per_microbatch_s": per_mb, "pipeline_s": pipeline_s, "fsdp_all_gather_s": gather,
            "fsdp_reduce_scatter_s": reduce, "step_s": step, "tokens_per_s_per_gpu": tps,
            "mfu": flops_per_token * tps / gpu.bf16_flops, "heaviest_pp_rank": heaviest,
            "peak": rows[heaviest]["memory"]["peak"], "hbm_bytes": gpu.hbm_bytes,
            "fits": rows[heaviest]["memory"]["peak"] <= gpu.hbm_bytes,
            "pp_ranks": {r: rows[r] for r in sorted(set(shown) | {heaviest})}}


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def format_pipeline(report: dict) -> str:
    """The ``pp > 1`` part of ``fsdp2d plan``'s table."""
    e, gpu = report["pipeline"], report["gpu_figures"]
    lines = [f"pipeline: {e['schedule']}, {e['stages_per_rank']} stage(s) per rank, {e['microbatches']} micro-batches "
             f"per step, bubble {e['bubble_microbatches']:.2f} micro-batches ({e['bubble_fraction'] * 100:.1f}% of the "
             f"step)",
             "  ANALYTIC: plan does not dry-run a whole pipelined step, so the figures below are "
             "fsdp2d/plan/pipeline.py's closed-form model (no transients counted); the dry runs of single "
             "stages at the end check its pieces"]
    lines += [f"  fsdp2d train would refuse this configuration: {why}" for why in report.get("trainer_refuses", [])]
    for r, row in e["pp_ranks"].items():
        m = row["memory"]
        lines += [
            f"  pipeline rank {r}: stages {m['stages']} ({'+'.join(map(str, m['layers']))} blocks"
            f"{', embedding' if 0 in m['stages'] else ''}"
            f"{', norm+output' if report['pp'] * e['stages_per_rank'] - 1 in m['stages'] else ''}), "
            f"{m['parameters'] / 1e9:.2f}B parameters{' (heaviest)' if r == e['heaviest_pp_rank'] else ''}",
            f"    memory GiB: states {_gib(m['states'])} + unsharded parameters and gradient accumulators "
            f"{_gib(m['unsharded_held'])} + activations {_gib(m['activations'])} ({m['in_flight']} chunks in flight)"
            f" + logits {_gib(m['logits'])} = {_gib(m['peak'])}",
            f"    per micro-batch: compute {row['compute_s_per_microbatch'] * 1e3:.1f} ms, TP "
            f"{row['tp_s_per_microbatch'] * 1e3:.1f} ms, P2P {row['p2p_s_per_microbatch'] * 1e3:.2f} ms "
            f"({row['p2p_bytes'] / 2**20:.1f} MiB each way over {row['links']['pp']}); FSDP once per step: "
            f"all-gather {row['fsdp_all_gather_s'] * 1e3:.0f} ms, reduce-scatter {row['fsdp_reduce_scatter_s'] * 1e3:.0f}"
            f" ms ({row['links']['dp']})",
        ]
    lines.append(f"  estimate on {gpu['name']}: step {e['step_s']:.3f} s (pipeline {e['pipeline_s']:.3f} s = "
                 f"{e['per_microbatch_s'] * 1e3:.1f} ms x ({e['microbatches']} + {e['bubble_microbatches']:.2f}); "
                 f"FSDP all-gather overlapped, reduce-scatter exposed), {e['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, "
                 f"MFU {e['mfu'] * 100:.1f}%")
    peak, hbm = e["peak"], e["hbm_bytes"]
    lines.append(f"    {'fits' if e['fits'] else 'does not fit'}: heaviest pipeline rank {e['heaviest_pp_rank']} "
                 f"{_gib(peak)} of {_gib(hbm)} GiB" + ("" if e["fits"] else f" ({_gib(peak - hbm)} GiB over)"))
    if "checks" in e:
        lines += format_checks(e["checks"])
    return "\n".join(lines)


def format_checks(checks: list[dict]) -> list[str]:
    """The dry-run check lines of ``fsdp2d plan``'s pipeline table."""
    gib = 2**30
    lines = []
    for c in checks:
        m, e = c["measured"], c["model"]
        states = m["parameters"] + m["gradients"] + m["optimizer"]
        comm = "; ".join(f"{k} {n} x {b / gib:.2f} GiB" for k, (n, b) in m["micro_batch_collectives"].items())
        lines += [f"  dry run of stage {c['stage']} ({e['layers']} blocks) as rank {c['rank']}, two micro-batches in "
                  f"flight ({c['dry_run_s']:.1f} s): measured / model",
                  f"    states {states / gib:.2f} / {e['states'] / gib:.2f} GiB; peak {m['peak'] / gib:.2f} / "
                  f"{e['peak'] / gib:.2f} GiB; one more micro-batch in flight {m['chunk'] / gib:.3f} / "
                  f"{e['chunk'] / gib:.3f} GiB",
                  f"    one micro-batch: compute {c['measured_compute_s'] * 1e3:.1f} ms (roofline of the measured ops) / "
                  f"{c['model_compute_s'] * 1e3:.1f} ms (FLOPs at peak); collectives {comm or 'none'}"]
    return lines
