"""accelerate's ``Accelerator.prepare`` of a model fsdp2d sharded, on accelerate's own mesh.

4 CPU ranks; tests/dist/_accelerate.py says what runs (accelerate's FSDP2 plugin, its
``ParallelismConfig`` mesh, one documented CPU workaround). accelerate asks
``isinstance(model, torch.distributed.fsdp.FSDPModule)`` before applying torch's
``fully_shard``; fsdp2d's modules are (a subclass), so ``prepare`` keeps fsdp2d's sharding:
torch's ``fully_shard`` is called 0 times (counted), the model, its parameters and the
optimizer's are the ones fsdp2d built. Before fsdp2d's class was torch's, accelerate applied
torch's ``fully_shard`` on top, which failed.

Judged against one process: the same Llama (same seed), the same global batch of 8 split
over accelerate's data-parallel ranks (its mesh's flattened ``dp`` axis), 4 AdamW steps, each
with ``accelerator.clip_grad_norm_``. Tolerances (fp32), as tests/dist/test_lightning.py:
the loss is a mean over 8x8 tokens summed in another order (the mean of the data-parallel
ranks' means): a few ulps, 1e-6 relative; the gradient norm is a sum of squares of local
shards against one ``clip_grad_norm_``: 1e-6 relative; after 4 steps of lr 1e-2 with AdamW
eps=1e-6 (tests/dist/_parity.py: EPS bounds how far a near-zero gradient element's rounding
moves its weight) parameters agree within 1e-5 absolute.

accelerate 1.15.0 is in the test extra (pinned; it needs torch>=2.0, so it pulls no other
torch, and adds only psutil to what the extra already installs).
"""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate", reason="accelerate is in the test extra: pip install -e '.[test]'")

from . import _accelerate as A  # noqa: E402

LOSS_TOL, NORM_TOL, PARAM_TOL = 1e-6, 1e-6, 1e-5


@pytest.mark.parametrize("hsdp", [False, True], ids=["dp_shard4", "hsdp2x2"])
def test_accelerate_prepare_keeps_fsdp2d_sharding_and_trains_as_one_process(pool, hsdp):
    res = pool.run(A.prepare_and_train, hsdp, timeout=300)
    print("max |loss diff|:", max(abs(a - b) for a, b in zip(res[0]["losses"], res[0]["ref_losses"])),
          "max |param diff|:", max(res[0]["param_errs"].values()))
    mesh = (("dp_replicate", "dp_shard"), (2, 2)) if hsdp else (("dp_shard",), (4,))
    fsdp_mesh = (("dp_replicate", "dp_shard_cp"), (2, 2)) if hsdp else (("dp_shard_cp",), (4,))
    for rank, r in enumerate(res):
        # accelerate's own mesh, and the sub-mesh its fsdp2_prepare_model would shard over.
        assert r["mesh"] == mesh and r["fsdp_mesh"] == fsdp_mesh, (rank, r["mesh"], r["fsdp_mesh"])
        # prepare saw fsdp2d's model as sharded: no torch fully_shard on top, nothing replaced.
        assert r["torch_fully_shard_calls"] == [], (rank, r["torch_fully_shard_calls"])
        assert r["same_model"] and r["same_params"] and r["opt_params_are_model_params"], rank
        assert r["classes"] == ["fsdp2d.fsdp._module"], (rank, r["classes"])
        for step, (a, b) in enumerate(zip(r["losses"], r["ref_losses"], strict=True)):
            assert abs(a - b) <= LOSS_TOL * abs(b), (rank, step, a, b)
        for step, (a, b) in enumerate(zip(r["norms"], r["ref_norms"], strict=True)):
            assert b > A.MAX_NORM, (step, b)  # clipping really scales the gradients
            assert abs(a - b) <= NORM_TOL * b, (rank, step, a, b)
        for name, err in r["param_errs"].items():
            assert err < PARAM_TOL, (rank, name, err)
