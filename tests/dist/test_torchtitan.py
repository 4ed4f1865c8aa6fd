"""torchtitan 0.3.0's own llama3 ``parallelize_llama`` with fsdp2d's ``fully_shard`` swapped in.

On 4 CPU ranks as torchtitan's 2x2 (dp_shard=2, tp=2) meshes: torchtitan's TP (its
``Module.parallelize``, sequence parallel on) and its ``apply_fsdp_to_decoder``, once with
torch's FSDP2 and once with fsdp2d's (the names ``torchtitan.distributed.fsdp`` imported
from ``torch.distributed.fsdp`` switched to fsdp2d's), 5 AdamW steps each on the same data,
and a one-process run of the same model. tests/dist/_torchtitan.py lists the CPU
workarounds, the same on both sides.

Tolerances (fp32): losses within 1e-6 relative (a mean over 8x16 tokens summed in another
order: a few ulps); parameters within 1e-5 absolute after 5 steps (AdamW eps=1e-6 bounds
the amplification of near-zero gradient elements, tests/dist/_parity.py: EPS). Measured:
fsdp2d's losses and final parameters equal torch's bit for bit, even and uneven shapes
(tests/dist/_torchtitan.py: SHAPES); against one process, losses within 9.5e-7 (of ~5) and
parameters within 2.6e-6. Switching ``fully_shard`` alone,
not ``FSDPModule``, would leave torchtitan's ``disable_fsdp_gradient_division`` (an
``isinstance`` on torch's class) skipping fsdp2d's modules: gradients averaged instead of
summed, parameters off by 1.8e-2, which this test catches.

Opt-in: torchtitan is not in the test extra (it imports triton and, through its trainer,
datasets/torchdata/wandb). Install it with::

    pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 && pip install tyro==1.0.17

(``pip install -e '.[torchtitan]'`` installs it with all its declared dependencies, which
pull no torch but ~40 packages). Without it this test is skipped, naming what is missing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

from . import _torchtitan as T

VERSION = "0.3.0"
LOSS_TOL, PARAM_TOL = 1e-6, 1e-5


def _missing() -> str | None:
    """Why the test cannot run here, or None (checked without importing torchtitan)."""
    absent = [m for m in ("torchtitan", "spmd_types", "tyro") if importlib.util.find_spec(m) is None]
    if absent:
        return (f"torchtitan {VERSION} not installed (missing {', '.join(absent)}): pip install --no-deps "
                f"torchtitan=={VERSION} spmd_types==0.2.3 && pip install tyro==1.0.17")
    found = importlib.metadata.version("torchtitan")
    if found != VERSION:
        return f"written against torchtitan {VERSION}'s llama3 layout; found {found}"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


@pytest.mark.parametrize("shape", list(T.SHAPES))
def test_torchtitan_parallelize_llama_with_fsdp2d_fully_shard_equals_torch(pool, shape):
    theirs = pool.run(T.train, "torch", shape, timeout=300)
    ours = pool.run(T.train, "fsdp2d", shape, timeout=300)
    ref = pool.run(T.reference, shape, timeout=300)[0]
    # torchtitan's grouping: tok_embeddings, [norm, lm_head] as one group, each block, the root.
    groups = ["FSDPEmbedding", "FSDPLinear", "FSDPLlama3Model", "FSDPLlama3TransformerBlock",
              "FSDPLlama3TransformerBlock", "FSDPRMSNorm"]
    print("max |loss diff| fsdp2d-torch:", max(abs(a - b) for a, b in zip(theirs[0]["losses"], ours[0]["losses"])),
          "fsdp2d-one process:", max(abs(a - b) for a, b in zip(ref["losses"], ours[0]["losses"])),
          "max |param diff| fsdp2d-torch:", max((ours[0]["params"][n] - p).abs().max().item()
                                                for n, p in theirs[0]["params"].items()),
          "fsdp2d-one process:", max((ours[0]["params"][n] - p).abs().max().item()
                                     for n, p in ref["params"].items()))
    for rank, (t, o) in enumerate(zip(theirs, ours)):
        assert t["types"] == ["torch"] and o["types"] == ["fsdp2d"], (t["types"], o["types"])
        assert o["fsdp_modules"] == groups, o["fsdp_modules"]
        assert o["divide_factors"] == [1.0], o["divide_factors"]
        for step, (a, b, c) in enumerate(zip(t["losses"], o["losses"], ref["losses"], strict=True)):
            assert abs(a - b) <= LOSS_TOL * abs(a), (rank, step, a, b)
            assert abs(c - b) <= LOSS_TOL * abs(c), (rank, step, "vs one process", c, b)
        assert t["params"].keys() == o["params"].keys() == ref["params"].keys()
        for name, p in t["params"].items():
            err = (o["params"][name] - p).abs().max().item()
            assert err < PARAM_TOL, (rank, name, err)
            err = (o["params"][name] - ref["params"][name]).abs().max().item()
            assert err < PARAM_TOL, (rank, name, "vs one process", err)
