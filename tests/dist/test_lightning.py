"""Lightning Fabric's ``ModelParallelStrategy`` with fsdp2d in its parallelize hook.

4 CPU ranks: the pool's gloo group, Lightning's own environment detection and its own
2x2 mesh ``("data_parallel", "tensor_parallel")`` (tests/dist/_lightning.py says how Fabric
runs inside the pool without patches). The hook calls
``fsdp2d.tensor_parallel.parallelize_module`` (``ColwiseParallel``/``RowwiseParallel``) on
``mesh["tensor_parallel"]``, then ``fsdp2d.fully_shard`` per block and root on
``mesh["data_parallel"]``. Judged against one process: the same Llama (same seed), the same
global batch of 8 (each data-parallel rank takes the rows Lightning's
``distributed_sampler_kwargs`` give it), 4 AdamW steps, each with ``fabric.clip_gradients``.

Tolerances (fp32): the loss is a mean over 8x8 tokens that the parallel run sums in
another order (TP's all-reduce of partial matmuls, the mean of two data-parallel means):
a few fp32 ulps, so 1e-6 relative. Gradients differ from one process's by such ulps too;
AdamW with eps=1e-6 (tests/dist/_parity.py: EPS) bounds how much a near-zero gradient
element's rounding moves its weight, so after 4 steps of lr 1e-2 parameters agree within
1e-5 absolute (measured 9.4e-7). The gradient norm is a sum of squares over 4 ranks' local
shards against one ``clip_grad_norm_``: 1e-6 relative, like the loss. The clipped gradients
(total norm 0.5, so every element under 0.5, whose fp32 ulp is 6e-8) agree within 1e-6
absolute (measured 3e-8).

The lightning-fabric distribution (``lightning_fabric``) is the same code as ``lightning.fabric``
without the umbrella package's torchmetrics import (~12 s per rank here, it imports
transformers and matplotlib); see the test extra in pyproject.toml.
"""

from __future__ import annotations

import pytest

pytest.importorskip("lightning_fabric", reason="lightning-fabric is in the test extra: pip install -e '.[test]'")

from . import _lightning as L  # noqa: E402

LOSS_TOL, NORM_TOL, GRAD_TOL, PARAM_TOL = 1e-6, 1e-6, 1e-6, 1e-5


@pytest.mark.parametrize("full_state_dict", [False, True], ids=["dcp", "full"])
def test_fabric_model_parallel_trains_clips_and_checkpoints_as_one_process(pool, tmp_path, full_state_dict):
    res = pool.run(L.train_clip_save_load, str(tmp_path / "ckpt"), full_state_dict, timeout=300)
    print("fabric / train / save+load+resume s:", [f"{t:.1f}" for t in res[0]["times"]])
    for rank, r in enumerate(res):
        # Lightning's mesh and data split, and fsdp2d's parameters on it.
        assert r["mesh"] == (("data_parallel", "tensor_parallel"), (L.DP, L.TP)), r["mesh"]
        assert r["sampler"] == {"num_replicas": L.DP, "rank": rank // L.TP}, (rank, r["sampler"])
        assert r["all_dtensor"], rank
        for step, (a, b) in enumerate(zip(r["losses"], r["ref_losses"], strict=True)):
            assert abs(a - b) <= LOSS_TOL * abs(b), (rank, step, a, b)
        for step, (a, b) in enumerate(zip(r["norms"], r["ref_norms"], strict=True)):
            assert b > L.MAX_NORM, (step, b)  # clipping really scales the gradients
            assert abs(a - b) <= NORM_TOL * b, (rank, step, a, b)
        for step, err in enumerate(r["grad_errs"]):
            assert err < GRAD_TOL, (rank, step, err)
        for name, err in r["param_errs"].items():
            assert err < PARAM_TOL, (rank, name, err)
        # fabric.save -> fabric.load into a fresh model and optimizer: exact.
        assert r["fresh_differed"], rank
        assert r["load_param_diffs"] == [], (rank, r["load_param_diffs"])
        assert r["n_optim"] == 3 * len(r["param_errs"])  # step, exp_avg, exp_avg_sq per parameter
        assert r["load_optim_diffs"] == [], (rank, r["load_optim_diffs"])
        assert r["step"] == L.STEPS, r["step"]
        assert r["resume_diffs"] == [], (rank, r["resume_diffs"])


def test_fabric_no_backward_sync_accumulates_correctly(pool):
    """``fabric.no_backward_sync`` over two micro-batches gives one process's gradients
    (1e-6, fp32 sums in another order) with one reduce-scatter per group, counted: the
    skipped micro-batch communicates nothing. Lightning's strategy switches the sync off
    only on modules that are torch's ``FSDPModule`` (an ``isinstance`` in its
    ``_FSDPNoSync``), which fsdp2d's modules are (a subclass); before they were, each group
    reduce-scattered every micro-batch (2 per group here)."""
    for rank, r in enumerate(pool.run(L.accumulate, timeout=300)):
        assert r["grad_err"] < GRAD_TOL, (rank, r["grad_err"])
        assert r["reduce_scatters"] == r["groups"], (rank, r)
