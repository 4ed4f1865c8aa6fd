"""``fsdp2d train`` with pipeline parallelism (``parallel.pp``), end to end on 4 gloo ranks.

The reference is ``pp=1`` on a dp=2 x tp=2 mesh: the same global batch (8 sequences, 2 per
micro-batch) and the same data slices as the pipelined runs (dp=2), so evaluations read
the same batches too. The pipelined runs split 4 layers over pp=2: 1F1B (one stage per
rank) and Interleaved1F1B (two per rank, looped). Each must give the reference's losses,
gradient norms and evaluation losses. The 1F1B run stops after its step-2 checkpoint and
is resumed at ``pp=1``: steps 3 and 4 must be the reference's too (weights, AdamW
moments, data position and learning-rate step all came through the stage-split
checkpoint; the bitwise round trip is tests/dist/test_train_pipeline_stages.py).

Tolerance: relative 1e-6. The runs do the same fp32 arithmetic except the order of some
sums (the TP all-reduces at pp=1, the micro-batch losses summed by the schedule, the
gradient norm's squares summed over stages); over 4 AdamW steps the largest difference
measured was 9e-8 relative.
"""

import math

import pytest

from .test_train import _train
from fsdp2d.train.plot import read_metrics

PIPE = ["--model.n_layers=4", "--training.steps=4", "--training.micro_batch=2", "--training.grad_sync=last",
        "--training.eval_every=2", "--training.eval_steps=2", "--checkpoint.every=2"]
REF = ["--parallel.dp=2", "--parallel.tp=2"]
PP = ["--parallel.pp=2", "--parallel.dp=2", "--parallel.tp=1"]
REL = 1e-6


def _records(run) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run)}


def _close(got: dict[int, dict], want: dict[int, dict], steps) -> None:
    for step in steps:
        for key in ("loss", "grad_norm", "eval_loss"):
            if key in want[step] or key in got[step]:
                assert math.isclose(got[step][key], want[step][key], rel_tol=REL), (step, key, got[step], want[step])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    proc = _train(runs, "ref", *PIPE, *REF)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return runs, _records(runs / "ref")


@pytest.mark.dist
def test_1f1b_matches_pp1_and_its_checkpoint_resumes_at_pp1(reference):
    runs, want = reference
    first = _train(runs, "split", *PIPE, *PP, "--parallel.pp_schedule=1F1B", "--training.stop_at=2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "mesh pp=2 x dp=2 x tp=1" in first.stdout
    assert "pipeline: 2 stages (layers 0-1 | 2-3), 1F1B, 2 micro-batches per step; this rank holds stage 0" \
        in first.stdout
    _close(_records(runs / "split"), want, [1, 2])
    second = _train(runs, "split", *PIPE, *REF, "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "mesh dp=2 x tp=2" in second.stdout
    got = _records(runs / "split")
    assert sorted(got) == [1, 2, 3, 4]
    _close(got, want, [3, 4])


@pytest.mark.dist
def test_interleaved_1f1b_two_stages_per_rank_matches_pp1(reference):
    runs, want = reference
    proc = _train(runs, "looped", *PIPE, *PP, "--parallel.pp_schedule=Interleaved1F1B")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 stages (layers 0-0 | 1-1 | 2-2 | 3-3), Interleaved1F1B" in proc.stdout
    assert "this rank holds stage 0, 2" in proc.stdout  # looped: rank 0 holds stages 0 and 0 + pp
    got = _records(runs / "looped")
    assert sorted(got) == [1, 2, 3, 4] and "eval_loss" in got[2] and "eval_loss" in got[4]
    _close(got, want, [1, 2, 3, 4])
