"""transformers' ``generate()`` on an fsdp2d-sharded model with ranks that finish at
different lengths: no hang, and each rank's tokens equal one process's.

4 CPU ranks, tests/dist/_hf_generate.py says what runs. transformers turns ``synced_gpus`` on
by itself because fsdp2d sets ``_is_fsdp_managed_module`` (as torch's ``fully_shard`` does);
before it did, the rank that finished first left generate while the others waited in an
all-gather: a hang, which the pool's timeout (60 s, for a job that takes ~1 s) turns into a
failure that names the blocked ranks and their stacks.

Tokens are compared exactly: greedy decoding of an fp32 model whose sharded forward only
reorders sums (gathers are exact), so logits differ from one process's by ulps and an argmax
could flip only on a near-tie, which this seed does not have (a flip would fail loudly here,
not pass silently).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers is in the test extra: pip install -e '.[test]'")

from . import _hf_generate as G  # noqa: E402


def test_generate_with_ranks_finishing_at_different_lengths_does_not_hang(pool):
    res = pool.run(G.generate_ragged, timeout=60)
    print("new tokens per rank:", [len(r["tokens"]) for r in res], "forwards:", [r["forwards"] for r in res])
    for rank, r in enumerate(res):
        assert r["managed"], rank  # transformers' is_fsdp_managed_module: synced_gpus on
        assert r["tokens"] == r["ref_tokens"], (rank, r["tokens"], r["ref_tokens"])
        # EOS ends the sequence at STOP[rank] + 1 tokens; the last rank runs to max_new_tokens.
        assert len(r["tokens"]) == min(G.STOP[rank] + 1, G.MAX_NEW), (rank, r["tokens"])
        # synced: every rank ran forward as often as the longest one, finished or not.
        assert r["forwards"] == G.MAX_NEW, (rank, r["forwards"])
