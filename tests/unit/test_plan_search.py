"""``fsdp2d plan --search`` against direct dry runs of every candidate (tests/plan_small.toml
at 5 blocks on 2 ranks of one 2-GPU node, so the search's 2- and 3-block dry runs are extrapolated), on a
GPU made small enough that some candidates fail the bound, some the dry run."""

from __future__ import annotations

import dataclasses
import multiprocessing
import tomllib
from pathlib import Path

import pytest

from fsdp2d.plan import search as S
from fsdp2d.plan.estimate import GPUS
from fsdp2d.train.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "tests" / "plan_small.toml")
OVERRIDES = ["--model.n_layers=5", "--training.global_batch=2"]
WORLD, BATCH = 2, 2


def _direct(task):
    choice, cfg = task
    from fsdp2d.plan._dryrun import dry_run

    measured = dry_run(cfg, WORLD, 0)
    ops = measured.pop("ops")
    measured["compute_s"] = S.roofline_seconds(ops, GPUS["h100"])
    measured["roofline_ops"] = len(ops)
    return choice, measured


@pytest.fixture(scope="module")
def searched():
    """Every candidate dry-run directly at full depth, then the search on a GPU whose
    memory lies between the candidates' peaks."""
    base = load_config(CONFIG, OVERRIDES)
    choices, rejected = S.candidates(base, WORLD, WORLD, BATCH)
    assert len(choices) == 12 and rejected == []  # tp 1 (dp 2), 2 (dp 1; mb 1, 2); 3 modes; 2 grad_syncs
    configs = {c: S.configure(base, c, BATCH) for c in choices}
    # spawn, not fork: a fork of this process (gloo and OpenMP threads already running) crashed
    # in the child (a segfault clearing DTensor's sharding cache, a deadlock at start-up)
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        direct = dict(pool.map(_direct, list(configs.items())))
    peaks = sorted(m["peak"] for m in direct.values())
    small = dataclasses.replace(GPUS["h100"], name="test GPU", hbm_bytes=peaks[len(peaks) // 2])
    GPUS["test"] = small
    try:
        report = S.search(base, WORLD, "test", WORLD, BATCH)
    finally:
        del GPUS["test"]
    from fsdp2d.models import Llama
    import torch

    with torch.device("meta"):
        model = Llama(base.model.to_args())
    rows = {c: S._row(c, configs[c], direct[c], WORLD, WORLD, small, model.flops_per_token(base.data.seq_len))
            for c in choices}
    return base, configs, direct, rows, report, small


def test_ranking_is_consistent_with_direct_dry_runs(searched):
    base, configs, direct, rows, report, gpu = searched
    ranked = [S.Choice(**r["choice"]) for r in report["ranked"]]
    reasons = {r["label"]: r["reason"] for r in report["rejected"]}
    by_label = {c.label(): c for c in configs}
    assert len(ranked) + len(reasons) == len(configs)  # each candidate once
    # every ranked figure is the direct dry run's (the search's extrapolated from 2 and 3 blocks)
    for r, c in zip(report["ranked"], ranked):
        assert r["measured"] == {k: direct[c][k] for k in S._EXACT}, c.label()
        assert r["estimate"]["tokens_per_s_per_gpu"] == pytest.approx(
            rows[c]["estimate"]["tokens_per_s_per_gpu"], rel=1e-9)
    # the ranking is the direct dry runs' order (fitting ones only)
    fitting = [c for c in configs if direct[c]["peak"] <= gpu.hbm_bytes]
    skipped = {by_label[label]: why for label, why in reasons.items() if why.startswith("not dry-run")}
    expected = sorted((c for c in fitting if c not in skipped),
                      key=lambda c: S.rank_key(rows[c]))
    assert ranked == expected
    # nothing that fits is lost: a skipped candidate is never faster than the one named
    for c, why in skipped.items():
        better = by_label[why.split(": ", 1)[1].split(" fits", 1)[0]]
        assert S.dominates(better, c) and better in ranked
        assert rows[better]["estimate"]["tokens_per_s_per_gpu"] >= rows[c]["estimate"]["tokens_per_s_per_gpu"]
    # the rejected ones do not fit, and the bound never exceeds a measured peak
    for label, why in reasons.items():
        if label in by_label and not why.startswith("not dry-run"):
            assert direct[by_label[label]]["peak"] > gpu.hbm_bytes, (label, why)
    from fsdp2d.models import Llama
    import torch

    with torch.device("meta"):
        params = Llama(base.model.to_args()).num_params()
    for c in configs:
        assert S.memory_bound(configs[c], params)["bound"] <= direct[c]["peak"], c.label()
    assert any(why.startswith("dry-run peak") for why in reasons.values())
    assert skipped


def test_the_bound_prunes_before_any_dry_run():
    """A GPU below every candidate's bound: all rejected by it, nothing dry-run."""
    base = load_config(CONFIG, OVERRIDES)
    GPUS["test"] = dataclasses.replace(GPUS["h100"], name="test GPU", hbm_bytes=2**19)
    try:
        report = S.search(base, WORLD, "test", WORLD, BATCH)
    finally:
        del GPUS["test"]
    assert report["ranked"] == [] and report["dry_runs"] == 0 and "top" not in report
    assert len(report["rejected"]) == 12 and all(r["reason"].startswith("bound ") for r in report["rejected"])


def test_top_choice_equals_a_direct_plan(searched, tmp_path):
    """The top row is ``fsdp2d plan``'s report of its overlay, figure for figure."""
    from fsdp2d.plan.cli import plan, resolve

    base, configs, direct, rows, report, gpu = searched
    assert report["top"]["differences"] == {}
    overlay = tmp_path / "top.toml"
    overlay.write_text(S.overlay_toml(report))
    assert tomllib.loads(overlay.read_text()) == report["top"]["overlay"]
    cfg = resolve(CONFIG, OVERRIDES, WORLD, [str(overlay)])
    got = plan(cfg, WORLD, [0], "h100", WORLD)["ranks"][0]
    top = report["ranked"][0]
    for key in S._EXACT:
        if key != "collectives":
            assert got[key] == top["measured"][key], key
    assert {k: [v["count"], v["bytes"]] for k, v in got["collectives"].items()} == \
        {k: [v["count"], v["bytes"]] for k, v in top["collectives"].items()}


def test_search_refuses_models_its_bound_does_not_cover():
    """The memory bound's activation terms are Llama's (SwiGLU): a GPT-2 config is refused by name,
    before anything is built, instead of pruning with a bound that may exceed the real peak."""
    cfg = load_config(CONFIG, OVERRIDES + ["--model.name=gpt2", "--model.n_kv_heads=none"])
    with pytest.raises(ConfigError, match="model.name='gpt2'"):
        S.search(cfg, WORLD, "h100", WORLD, BATCH)


def test_search_lists_pipeline_meshes_apart(searched):
    """Issue 31: the search also ranks the pp x dp x tp meshes (here pp 2 x dp 1 x tp 1: 1F1B
    and Interleaved1F1B, each checkpointing mode, micro-batch 1 for the 2 micro-batches pp 2
    needs), from the analytic model, in a list of their own: the dry-run ranking is the one
    the test above checks."""
    from fsdp2d.plan._search_pp import format_pipeline_search

    base, configs, direct, rows, report, gpu = searched
    found = report["pipeline"]
    assert found["candidates"] == 6
    labels = {r["label"] for r in found["ranked"]} | {r["label"] for r in found["rejected"]}
    assert labels == {f"pp2x1x1 {s} {ac} mb1x2" for s in ("1F1B", "Interleaved1F1B") for ac in S.MODES}
    assert all(r["estimate"]["analytic"] and r["choice"]["pp"] == 2 for r in found["ranked"])
    assert [S.rank_key(r) for r in found["ranked"]] == sorted(S.rank_key(r) for r in found["ranked"])
    assert "ANALYTIC, not dry-run" in format_pipeline_search(found)[0]
