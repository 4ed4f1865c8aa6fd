"""``fsdp2d plan`` and ``--search`` with pipeline parallelism (``parallel.pp > 1``): the
closed-form model of fsdp2d/plan/pipeline.py, piece by piece (no dry run, no process group)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.pipelining.schedules import _get_warmup_ops

from fsdp2d.models.stages import stage_layers
from fsdp2d.plan import search as S
from fsdp2d.plan._search_pp import pipeline_candidates
from fsdp2d.plan.cli import main, resolve
from fsdp2d.plan.estimate import GPUS
from fsdp2d.plan.pipeline import ModelCounts, Pipeline, bubble, in_flight, pipeline_plan, rank_memory
from fsdp2d.train.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "llama3_405b_512gpu.toml")
# torchtitan's 3D run of Llama 3.1 405B (docs/performance.md, Table 5): 512 H100, FSDP 8, TP 8,
# PP 8, local batch 32 (global 256), seq 8192, full activation checkpointing; micro-batch 1
# (torchtitan's default pipeline_parallel_microbatch_size)
TITAN = ["--parallel.pp=8", "--parallel.dp=8", "--parallel.tp=8", "--training.global_batch=256",
         "--training.micro_batch=1"]
H100 = GPUS["h100"]


def _cfg(*extra: str):
    return resolve(CONFIG, [*TITAN, *extra], None)


@pytest.fixture(scope="module")
def counts():
    return ModelCounts.of(_cfg())


def test_pp1_bound_is_the_search_formula():
    """The search's bound (pp = 1) keeps its formula: the terms split out for the pipeline
    model give the same bytes as written in search.py's docstring."""
    cfg = load_config(CONFIG, [])
    m, p = cfg.model, cfg.parallel
    tokens, a = cfg.micro_batch * cfg.data.seq_len, 2
    acts = m.n_layers * tokens * a * (m.dim / p.tp + 0)  # full checkpointing: the block inputs, sequence-sharded
    logits = tokens * m.vocab_size * a / p.tp  # vocab-parallel loss
    b = S.memory_bound(cfg, 10**9)
    assert b["activations"] == acts and b["logits"] == logits
    assert b["bound"] == max(16e9 / (p.dp * p.tp), 12e9 / (p.dp * p.tp) + acts + logits)


def test_a_stage_holds_its_layers_and_its_ends(counts):
    """pp = 2 halves a stage's layers: each pipeline rank's parameters are its
    ``stage_layers`` blocks, the embedding on the first and norm + output on the last;
    states are sharded over the non-pp axes only, and the two ranks add up to the model."""
    cfg = _cfg("--parallel.pp=2", "--parallel.dp=32")
    first, last = stage_layers(126, 2)
    r0, r1 = rank_memory(cfg, counts, 0), rank_memory(cfg, counts, 1)
    assert r0["parameters"] == len(first) * counts.per_layer + counts.embedding
    assert r1["parameters"] == len(last) * counts.per_layer + counts.head
    assert r0["parameters"] + r1["parameters"] == 126 * counts.per_layer + counts.embedding + counts.head
    assert r0["states"] == 16 * r0["parameters"] / (32 * 8)
    assert r0["unsharded_held"] == (4 + 2) * r0["parameters"] / 8  # bf16 copies + fp32 accumulators, TP-local
    assert r1["logits"] > 0 == r0["logits"]
    assert r0["peak"] == r0["states"] + r0["unsharded_held"] + r0["activations"] + r0["logits"]


def test_gpipe_holds_more_activations_than_1f1b(counts):
    """GPipe keeps every micro-batch's activations until its backward; 1F1B at most pp."""
    gpipe, one = _cfg("--parallel.pp_schedule=GPipe"), _cfg()
    assert in_flight(Pipeline.of(gpipe), 0) == 32 and in_flight(Pipeline.of(one), 0) == 8
    assert [in_flight(Pipeline.of(one), r) for r in range(8)] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert rank_memory(gpipe, counts, 0)["activations"] == 4 * rank_memory(one, counts, 0)["activations"]


@pytest.mark.parametrize("schedule,factor", [("Interleaved1F1B", 2), ("InterleavedZeroBubble", 1)])
@pytest.mark.parametrize("pp,v,m", [(8, 2, 32), (4, 3, 8), (8, 2, 8), (2, 4, 6)])
def test_interleaved_chunks_in_flight_follow_torchs_warmup(schedule, factor, pp, v, m):
    """The interleaved schedules hold torch's warm-up forwards plus one (the zero-bubble one
    ``pp`` more chunks of deferred weight gradients), per rank."""
    pipe = Pipeline(pp, schedule, v, m)
    per_round = m // max(1, m // pp)
    for r in range(pp):
        held = min(_get_warmup_ops(r, v, per_round, pp, m, multiply_factor=factor) + 1, v * m)
        assert in_flight(pipe, r) == held + (pp if schedule == "InterleavedZeroBubble" else 0)


def test_bubble_shrinks_with_microbatches_and_interleaving():
    def fraction(pipe):
        return bubble(pipe) / (pipe.microbatches + bubble(pipe))

    assert bubble(Pipeline(8, "1F1B", 1, 32)) == bubble(Pipeline(8, "GPipe", 1, 32)) == 7
    assert fraction(Pipeline(8, "1F1B", 1, 64)) < fraction(Pipeline(8, "1F1B", 1, 32))
    assert bubble(Pipeline(8, "Interleaved1F1B", 2, 32)) == 7 / 2
    assert bubble(Pipeline(8, "Interleaved1F1B", 4, 32)) == 7 / 4
    assert bubble(Pipeline(8, "ZBVZeroBubble", 2, 32)) == 0


def test_torchtitan_405b_mesh_plans(counts):
    """torchtitan's PP 8 x FSDP 8 x TP 8 is accepted; the step is the slowest rank's
    micro-batch x (32 + 7) plus the exposed reduce-scatter, the P2P message one
    sequence-sharded activation."""
    cfg = _cfg()
    assert cfg.mesh_dim_names == ("pp", "dp", "tp") and cfg.world_size == 512
    e = pipeline_plan(cfg, 512, H100, 8, 1.0, counts=counts)
    assert e["microbatches"] == 32 and e["bubble_microbatches"] == 7
    assert e["step_s"] == max(e["per_microbatch_s"] * 39, e["fsdp_all_gather_s"]) + e["fsdp_reduce_scatter_s"]
    row = e["pp_ranks"][0]
    assert row["p2p_bytes"] == 1 * 8192 // 8 * 16384 * 2 and row["links"] == {"pp": "network", "dp": "network"}
    assert e["fits"] and e["heaviest_pp_rank"] in e["pp_ranks"]


SMALL = str(ROOT / "tests" / "plan_small.toml")
SMALL_PP = ["--parallel.pp=2", "--parallel.dp=1", "--model.n_layers=4", "--training.global_batch=4",
            "--training.micro_batch=1", "--training.activation_checkpointing=full"]


def test_a_stage_keeps_its_pieces_under_their_names():
    """The dry-run stage holds its layers (FQNs of the whole model) and only its ends."""
    import torch

    from fsdp2d.models import Llama
    from fsdp2d.plan._stage import Stage

    cfg = resolve(SMALL, SMALL_PP, None)
    with torch.device("meta"):
        model = Llama(cfg.model.to_args())
    first, last = stage_layers(4, 2)
    heads = {n.split(".")[0] + "." + n.split(".")[1] for n, _ in Stage(model, last, False, True, 32).named_parameters()}
    assert heads == {"layers.2", "layers.3", "norm.weight", "output.weight"}
    names = {n for n, _ in Stage(model, first, True, False, 32).named_parameters()}
    assert {n.split(".")[0] for n in names} == {"tok_embeddings", "layers"} and "layers.1.attention.wq.weight" in names


@pytest.mark.parametrize("tp", [1, 2])
def test_stage_dry_run_checks_the_models_states(tp):
    """A stage dry-run on the fake process group: its fp32 parameters, gradients and AdamW
    state are the model's ``16 P / (dp x tp)`` (the step counters aside), and one more
    micro-batch in flight holds at least the model's activations (it also holds the stage's
    output)."""
    from fsdp2d.plan._stage import stage_dry_run
    from fsdp2d.plan.pipeline import stage_figures

    cfg = resolve(SMALL, [*SMALL_PP, f"--parallel.tp={tp}"], None)
    counts = ModelCounts.of(cfg)
    for stage in (0, 1):
        m = stage_dry_run(cfg, cfg.world_size, stage * cfg.world_size // 2, stage)
        f = stage_figures(cfg, counts, stage, chunks=2)
        if tp == 1:  # nothing padded
            assert m["parameters"] == 4 * f["parameters"]
        # 1e-2: at tp=2 the SwiGLU's 53 rows per TP shard are padded (0.4% here); at tp=1 only
        # AdamW's step counters differ (76 bytes)
        assert m["parameters"] + m["gradients"] + m["optimizer"] == pytest.approx(f["states"], rel=1e-2)
        assert m["chunk"] >= f["chunk"] > 0
        assert m["micro_batch_ops"] and all(k.startswith("tp/") for k in m["micro_batch_collectives"])


def test_plan_cli_prints_the_pipeline_and_its_stage_checks(capsys, monkeypatch):
    import fsdp2d.plan._stage as stage

    monkeypatch.setattr(stage.os, "sched_getaffinity", lambda pid: {0})  # in this process, no fork
    assert main(["--config", SMALL, *SMALL_PP, "--parallel.tp=2"]) == 0
    out = capsys.readouterr().out
    assert "mesh pp=2 x dp=1 x tp=2" in out and "ANALYTIC: plan does not dry-run a whole pipelined step" in out
    assert "pipeline rank 0: stages [0]" in out and "pipeline rank 1: stages [1]" in out
    assert "dry run of stage 0 (2 blocks) as rank 0" in out and "dry run of stage 1 (2 blocks) as rank 2" in out


def test_plan_cli_accepts_torchtitans_405b_mesh(capsys, monkeypatch):
    """torchtitan's PP 8 x FSDP 8 x TP 8 runs through ``fsdp2d plan`` (the stage dry runs
    replaced by a stub here: they take seconds each at 405B)."""
    import fsdp2d.plan._stage as stage

    monkeypatch.setattr(stage, "check_stages", lambda cfg, world, ranks, gpu, gpn: [])
    assert main(["--config", CONFIG, *TITAN]) == 0
    out = capsys.readouterr().out
    assert "mesh pp=8 x dp=8 x tp=8" in out and "pipeline rank 7: stages [7] (15 blocks, norm+output)" in out
    assert "tokens/s/GPU" in out and "fits: heaviest pipeline rank" in out


def test_search_lists_pipeline_meshes():
    base = resolve(CONFIG, [], None)
    choices, _ = pipeline_candidates(base, 512, 8, 256)
    titan = S.Choice(1, 8, 8, "full", 1, 32, "last", 8, "1F1B")  # (a pipeline syncs once a step)
    assert titan in choices and S.Choice(1, 8, 8, "full", 1, 32, "last", 8, "Interleaved1F1B") in choices
    assert all(c.pp >= 2 and c.accum >= c.pp and c.pp * c.dp * c.tp == 512 for c in choices)
    assert S.configure(base, titan, 256).mesh_shape == (8, 8, 8)
    # every candidate is one the trainer runs (review: all 198 were refused: sequence and
    # loss parallel, grad_sync='every', eval_steps not whole steps of micro-batches)
    from fsdp2d.train.config import validate

    for c in choices:
        validate(S.configure(base, c, 256))


@pytest.mark.parametrize("args,words", [
    (["--parallel.pp=127", "--world-size", "8128"], "parallel.pp * stages per rank = 127 * 1 = 127 stages"),
    (["--world-size", "100"], "not divisible by pp * hsdp_replicate * tp = 8 * 1 * 8 = 64"),
    (["--training.micro_batch=16"], "parallel.pp=8 needs at least 8 micro-batches per step"),
])
def test_bad_pipelines_are_refused_in_one_line(capsys, args, words):
    assert main(["--config", CONFIG, *TITAN, *args]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err
