"""fully_shard (alone, HSDP, and over TP) against a single-process reference.

Each run trains 10 AdamW steps (lr 1e-2, weight decay 0.1) on the same global batch as
the reference. Tolerances (fp32): loss within 1e-6 relative (fp32 epsilon 1.2e-7; FSDP
changes only the order of gradient sums: the dp average is a reduce-scatter, TP adds
its all-reduces), final full parameters within 2e-5 absolute. 10 Adam steps of size ~lr
move each weight by ~0.1, and a rounding of ~1e-7 relative in the update direction stays
well under 1e-5; but an element whose gradient is a sum of nearly cancelling terms (a
rare token's embedding row) carries an *absolute* rounding of ~1e-9 that Adam divides by
its eps (1e-6): up to lr * 1e-9 / 1e-6 = 1e-5 per step. Measured worst: 1.10e-5 (GPT-2
wte.weight on 2x2, Intel Xeon dev machine, fsdp2d before and after the torch-vocabulary
change alike; every other tensor under 2.5e-6).
"""

import pytest
import torch

from . import _parity as P

LOSS_TOL, PARAM_TOL = 1e-6, 2e-5

CASES = {
    "llama-2x2": P.Setup(model="llama", mesh=(2, 2), steps=10),
    "gpt2-2x2": P.Setup(model="gpt2", mesh=(2, 2), steps=10),
    "llama-2x2-sp": P.Setup(model="llama", mesh=(2, 2), steps=10, sequence_parallel=True, loss_parallel=True),
    "llama-dp4": P.Setup(model="llama", mesh=(4,), names=("dp",), steps=10),
    "gpt2-hsdp-2x2": P.Setup(model="gpt2", mesh=(2, 2), names=("replicate", "shard"), steps=10),
    "llama-hsdp-2x1x2-tp": P.Setup(model="llama", mesh=(2, 1, 2), names=("replicate", "shard", "tp"), steps=10),
    "llama-2x2-accum4": P.Setup(model="llama", mesh=(2, 2), steps=10, batch=16, microbatches=4),
    "llama-2x2-accum4-sync-every": P.Setup(model="llama", mesh=(2, 2), steps=10, batch=16, microbatches=4,
                                           sync_every=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fsdp_matches_single_process(pool, name):
    results = pool.run(P.run, CASES[name])
    for rank, r in enumerate(results):
        assert r["loss"] < LOSS_TOL, f"rank {rank}: loss rel error {r['loss']:.2e}; losses {r['losses']}"
        assert r["param_abs"] < PARAM_TOL, f"rank {rank}: final parameter abs error {r['param_abs']:.2e}"
        # Zero-gradient tensors (GPT-2's key bias) move by Adam-normalised noise: at most
        # ~lr per step, so 10 steps at lr 1e-2 stay within 0.1 (here ~6e-5).
        assert r["param_abs_zero_grad"] < 0.1


@pytest.mark.parametrize("sync_every", [False, True])
def test_accumulation_memory_and_reduce_scatters(pool, sync_every):
    """Gradient accumulation over 4 microbatches: syncing on the last one only holds a
    full-size (TP-local) accumulator per parameter between microbatches, one
    reduce-scatter per group per step; syncing every microbatch holds none (gradients
    stay sharded) for 4 reduce-scatters per group per step. Both equal one process."""
    s = P.Setup(model="llama", mesh=(2, 2), steps=2, batch=16, microbatches=4, sync_every=sync_every)
    groups, params = 3, 2 * 9 + 3  # 2 blocks and the root; 9 parameters per block, 3 outside
    for rank, r in enumerate(pool.run(P.run, s)):
        assert r["loss"] < LOSS_TOL, f"rank {rank}: loss rel error {r['loss']:.2e}"
        assert r["unsharded_accumulators"] == (0 if sync_every else params), r["unsharded_accumulators"]
        assert r["reduce_scatters"] == s.steps * groups * (4 if sync_every else 1), r["reduce_scatters"]


def test_bf16_params_fp32_reduce(pool):
    """bf16 all-gather and compute, fp32 gradient reduce-scatter, fp32 master shards.

    Tolerance: bf16 has 8 mantissa bits (relative step 2^-8 = 3.9e-3); the forward runs
    in bf16 while the reference runs in fp32, so the loss may differ by ~1e-2 relative
    (a few bf16 roundings accumulated over 2 blocks). The run must still track the
    reference: loss within 2e-2 relative at every step, parameters within 5e-2.
    """
    setup = P.Setup(model="llama", mesh=(2, 2), steps=5, param_dtype=torch.bfloat16)
    for rank, r in enumerate(pool.run(P.run, setup)):
        assert r["loss"] < 2e-2, f"rank {rank}: loss rel error {r['loss']:.2e}; losses {r['losses']}"
        assert r["param_abs"] < 5e-2, f"rank {rank}: param abs error {r['param_abs']:.2e}"


@pytest.mark.parametrize("mesh,names", [((2, 2), ("dp", "tp")), ((4,), ("dp",))], ids=["2x2", "dp4"])
def test_tied_embedding_and_head(pool, mesh, names):
    """GPT-2 with ``lm_head.weight is wte.weight``: TP shards the tensor once (both styles
    give it Shard(0) over the vocab), fully_shard on the root owns it once, both modules
    compute with the same unsharded tensor and its gradient sums both uses. Same
    tolerances as above, over 5 AdamW steps; the tie still holds at the end."""
    setup = P.Setup(model="gpt2", mesh=mesh, names=names, steps=5, tied=True)
    for rank, r in enumerate(pool.run(P.run, setup)):
        assert r["tied"], f"rank {rank}: lm_head.weight is no longer wte.weight"
        assert r["loss"] < LOSS_TOL, f"rank {rank}: loss rel error {r['loss']:.2e}; losses {r['losses']}"
        assert r["param_abs"] < PARAM_TOL, f"rank {rank}: final parameter abs error {r['param_abs']:.2e}"
