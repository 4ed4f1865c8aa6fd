"""PyTorch's own tutorials (pytorch/examples, unmodified in tests/clients/) as fsdp2d clients.

What runs is upstream's code: copies patched at run time, each patch asserted to apply
exactly once (tests/dist/_clients.py lists them: imports switched to fsdp2d, the lines any
CPU user must change, and the pool's process group). The same CPU patches run torch's own
path beside fsdp2d's, and the two are compared.
"""

from __future__ import annotations

import pytest
import torch

from . import _clients as C

# The FSDP2 tutorial's flags, each on and off at least once, in two modes of fresh +
# resume each (every extra mode costs two 10-step runs per side on this 2-core machine):
# the DTensor state-dict path with mixed precision and explicit prefetching, and the DCP
# state-dict API in plain fp32.
FSDP2_MODES = [
    {"name": "mp_prefetch", "mixed_precision": True, "explicit_prefetching": True},
    {"name": "dcp_api", "dcp_api": True},
]


def _run_fsdp2(pool, tmp_path, flavor: str, resume: bool) -> list[dict]:
    patches = ([C.FSDP2_IMPORTS] if flavor == "fsdp2d" else []) + [C.FSDP2_CPU, C.FSDP2_POOL]
    code = C.prepare("FSDP2", tmp_path / flavor / "code", *patches)
    return pool.run(C.run_fsdp2_tutorial, str(code), str(tmp_path / flavor / "runs"), FSDP2_MODES,
                    resume, timeout=900)


@pytest.mark.parametrize("folder,imports,others", [
    ("FSDP2", C.FSDP2_IMPORTS, (C.FSDP2_CPU, C.FSDP2_POOL)),
    ("tensor_parallelism", C.TP2D_IMPORTS, (C.TP2D_CPU, C.TP2D_STEPS)),
])
def test_fsdp2d_copy_differs_from_torch_copy_only_in_imports(folder, imports, others, tmp_path):
    """What runs on fsdp2d is what runs on torch except `from torch.distributed... import`
    lines switched to fsdp2d; every patch applies exactly once (asserted in prepare)."""
    ours = C.prepare(folder, tmp_path / "ours", imports, *others)
    theirs = C.prepare(folder, tmp_path / "theirs", *others)
    n_changed = 0
    for f in sorted(ours.glob("*.py")):
        a, b = f.read_text().splitlines(), (theirs / f.name).read_text().splitlines()
        assert len(a) == len(b), f.name
        for x, y in zip(a, b):
            if x != y:
                n_changed += 1
                assert x.startswith("from fsdp2d") and y.startswith("from torch.distributed"), (x, y)
    assert n_changed == sum(len(v) for v in imports.values())


def test_fsdp2_tutorial_on_fsdp2d_resumes_exactly_and_equals_torch(pool, tmp_path):
    """PyTorch's FSDP2 tutorial (distributed/FSDP2) on 4 ranks with fsdp2d's fully_shard.

    Per mode: a fresh run (meta init, to_empty, 10 Adam steps with torch's
    clip_grad_norm_, full-state save on rank 0), then a resumed run. Right after the
    tutorial's own load_model + load_optim, the full model and optimizer state equal the
    saved ones exactly, and each rank's local shards are its torch.chunk of the saved
    tensors. Both checkpoints (fresh and resumed) equal the ones torch's own FSDP2 writes
    from the same script, bit for bit (measured: fsdp2d reduces in the same order as
    torch's on 4 gloo ranks, so even the bf16 mixed-precision run is exact).
    """
    ours = _run_fsdp2(pool, tmp_path, "fsdp2d", resume=True)
    theirs = _run_fsdp2(pool, tmp_path, "torch", resume=True)
    for flavor, res in (("fsdp2d", ours), ("torch", theirs)):
        print(flavor, {m["name"]: [f"{r[m['name']]['wall_s']:.1f}/{r[m['name']]['cpu_s']:.1f}" for r in res]
                       for m in FSDP2_MODES})
    for mode in FSDP2_MODES:
        name = mode["name"]
        for rank, per_rank in enumerate(ours):
            assert per_rank[name]["local_diffs"] == [], (name, rank, per_rank[name]["local_diffs"])
        r = ours[0][name]
        assert r["resume_diffs"] == [], (name, r["resume_diffs"])
        assert r["n_model"] == r["n_optim_state"] == 125, r  # 10 blocks x 12 + 5 others
        assert theirs[0][name]["resume_diffs"] == [], ("torch", name, theirs[0][name]["resume_diffs"])
        assert len(r["checkpoints"]) == len(theirs[0][name]["checkpoints"]) == 2
        # Both checkpoints: the resumed run trains the parameters that load_model put in
        # place (load_state_dict(assign=True) / set_model_state_dict), not stale storage.
        for ours_ckpt, torch_ckpt in zip(r["checkpoints"], theirs[0][name]["checkpoints"]):
            for f in ("model_state_dict.pt", "optim_state_dict.pt"):
                a = torch.load(f"{ours_ckpt}/{f}", weights_only=True)
                b = torch.load(f"{torch_ckpt}/{f}", weights_only=True)
                assert C._equal(a, b, f) == [], (name, ours_ckpt, C._equal(a, b, f)[:5])


@pytest.fixture(scope="module")
def tp2d_torch(pool, tmp_path_factory):
    """The 2D tutorial on torch's own path (DTensor TP + FSDP1), CPU patches only."""
    code = C.prepare("tensor_parallelism", tmp_path_factory.mktemp("tp2d_torch"), C.TP2D_CPU, C.TP2D_STEPS)
    return pool.run(C.run_tp2d_tutorial, str(code), 1234, timeout=900)


def test_tp2d_tutorial_on_torch_runs_on_cpu(tp2d_torch):
    """The harness itself: torch's run reaches attention with q/k/v equal to one process's
    (this upstream version runs attention on local heads, plain tensors), and trains 3
    steps, the two TP ranks of a dp rank agreeing."""
    print("torch 2D wall/cpu s per rank:", [f"{r['wall_s']:.1f}/{r['cpu_s']:.1f}" for r in tp2d_torch])
    for rank, r in enumerate(tp2d_torch):
        assert "error" not in r, (rank, r["error"])
        assert r["qkv_max_diff"] == [0.0, 0.0, 0.0], (rank, r["qkv_max_diff"])
        assert len(r["losses"]) == 3
    assert tp2d_torch[0]["losses"] == tp2d_torch[1]["losses"]
    assert tp2d_torch[2]["losses"] == tp2d_torch[3]["losses"]


def test_tp2d_tutorial_on_fsdp2d_equals_torch(pool, tmp_path, tp2d_torch):
    """The 2D tutorial as stored (FSDP1 over TP) with its imports switched to fsdp2d, its
    ``FullyShardedDataParallel`` now fsdp2d.fsdp1's: q/k/v at the attention call equal
    one process's (exactly, as torch's), and the 3 losses equal torch's. The loss is
    the sum of 8x256x32000 logits (|loss| up to ~6e6): summed in another order it moves by
    an ulp or two of fp32 (1.2e-7 relative), so 1e-6 relative."""
    code = C.prepare("tensor_parallelism", tmp_path / "tp2d", C.TP2D_IMPORTS, C.TP2D_CPU, C.TP2D_STEPS)
    ours = pool.run(C.run_tp2d_tutorial, str(code), 1234, timeout=900)
    for rank, (r, t) in enumerate(zip(ours, tp2d_torch)):
        assert "error" not in r, (rank, r["error"])
        assert r["qkv_max_diff"] == [0.0, 0.0, 0.0], (rank, r["qkv_max_diff"])
        assert r["losses"] == pytest.approx(t["losses"], rel=1e-6, abs=0), rank


def test_tp2d_tutorial_with_fully_shard_on_fsdp2d_equals_torch(pool, tmp_path, tp2d_torch):
    """The 2D tutorial as upstream now writes it (FSDP2's fully_shard over TP instead of
    FSDP1: the two FSDP1 lines replaced, see _clients.TP2D_FULLY_SHARD), every other import
    switched to fsdp2d: q/k/v at the attention call equal one process's exactly, and the 3
    losses equal torch's run (FSDP1 + DTensor TP) within 1e-6 relative (sums of 8x256x32000
    logits in another order: an ulp or two of fp32)."""
    code = C.prepare("tensor_parallelism", tmp_path / "tp2d_fs", C.TP2D_FULLY_SHARD,
                     C.without_fsdp1(C.TP2D_IMPORTS), C.without_fsdp1(C.TP2D_CPU), C.TP2D_STEPS)
    ours = pool.run(C.run_tp2d_tutorial, str(code), 1234, timeout=900)
    for rank, (r, t) in enumerate(zip(ours, tp2d_torch)):
        assert "error" not in r, (rank, r["error"])
        assert r["qkv_max_diff"] == [0.0, 0.0, 0.0], (rank, r["qkv_max_diff"])
        assert r["losses"] == pytest.approx(t["losses"], rel=1e-6, abs=0), rank


def test_local_heads_attention_patch_on_torch_tp(pool):
    """The attention patch the 2D harness applies to both sides (tests/dist/_clients.py:
    local_heads_sdpa), on torch's own TP with DTensor q/k/v viewed with the global head
    count: output and input gradient equal one process's. 1e-6: the output projection's
    all-reduce sums 4 partial products in another order than one matmul (a few fp32 ulps
    of values of order 1)."""
    for dev in pool.run(C.check_local_heads_sdpa, 0):
        assert dev < 1e-6, dev
