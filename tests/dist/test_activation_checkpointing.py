"""Activation checkpointing composed with TP and FSDP recomputes exactly what it dropped:
the same losses, gradients and (after 3 AdamW steps) parameters as without it (fp32,
2 x 2, with and without sequence parallel), full and selective (the matmul and attention
outputs kept, the rest recomputed). Recompute replays TP collectives and FSDP hooks must
not reshard mid-backward."""

import copy

import pytest
import torch
import torch.nn.functional as F

from fsdp2d.train.trainer import _checkpoint_activations

from . import _parity as P


def job_ac_matches(sequence_parallel: bool, mode: str) -> list[tuple[float, float, float]]:
    torch.set_num_threads(1)
    s = P.Setup(model="llama", mesh=(2, 2), sequence_parallel=sequence_parallel)
    base = P.build("llama")
    plain, ac = copy.deepcopy(base), copy.deepcopy(base)
    for block in ac.layers:
        _checkpoint_activations(block, mode)
    mesh, _ = P.parallelize(plain, s)
    P.parallelize(ac, s)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=P.EPS) for m in (plain, ac)]
    idx, count = P.data_rank(mesh, s)
    out = []
    for step in range(3):
        x, y = P.batch_for(step, s)
        x, y = x.chunk(count)[idx], y.chunk(count)[idx]
        losses = []
        for model, opt in zip((plain, ac), opts):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            losses.append(loss.item())
        g_plain = P.full_tensors(plain, mesh, "grad")
        g_ac = P.full_tensors(ac, mesh, "grad")
        grad_err = max(((g_plain[n] - g_ac[n]).abs().max()).item() for n in g_plain)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        out.append((losses[0], losses[1], grad_err))
    p_plain, p_ac = P.full_tensors(plain, mesh, "param"), P.full_tensors(ac, mesh, "param")
    out.append((0.0, 0.0, max(((p_plain[n] - p_ac[n]).abs().max()).item() for n in p_plain)))
    return out


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("sp", [False, True])
def test_activation_checkpointing_changes_nothing(pool, sp, mode):
    for rank_result in pool.run(job_ac_matches, sp, mode):
        for plain, ac, err in rank_result:  # per step: losses, gradients; last row: final parameters
            # Recompute runs the same kernels on the same inputs (selective: fewer of
            # them, the kept outputs are the first run's): bitwise equal on CPU, well
            # inside the 1e-6.
            assert plain == ac and err == 0.0, rank_result


def test_selective_policy_keeps_matmuls_only():
    """The selective policy keeps exactly the matmul and attention outputs."""
    from torch.utils.checkpoint import CheckpointPolicy

    from fsdp2d.train.trainer import _keep_matmuls

    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default,
               aten._scaled_dot_product_flash_attention.default):
        assert _keep_matmuls(None, op) == CheckpointPolicy.MUST_SAVE, op
    for op in (aten.mul.Tensor, aten.add.Tensor, aten.silu.default, aten.rsqrt.default, aten.mean.dim):
        assert _keep_matmuls(None, op) == CheckpointPolicy.PREFER_RECOMPUTE, op


# A real CPU step of a small Llama on the 2 x 2 mesh (fp32, sequence parallel), big enough
# that activations dominate: 4 blocks, dim 128, 256 tokens x 4 sequences per rank.
MEMORY_JOB = ["--model.dim=128", "--model.n_layers=4", "--model.n_heads=4", "--model.n_kv_heads=2",
              "--model.max_seq_len=256", "--data.seq_len=256", "--training.global_batch=8",
              "--training.micro_batch=4", "--training.mixed_precision=none"]


def job_peak_memory(modes: list[str]) -> dict[str, dict]:
    """Peak live tensor storage of one real training step per checkpointing mode
    (``measure_step`` on real tensors: the storages alive after every op)."""
    from pathlib import Path

    from fsdp2d.plan._dryrun import axis_groups, build_optimizer, measure_step, trainer_step
    from fsdp2d.plan.cli import resolve
    from fsdp2d.train.trainer import build_model

    from .pool import get_mesh

    torch.set_num_threads(1)
    config = str(Path(__file__).resolve().parents[1] / "plan_small.toml")
    out = {}
    for mode in modes:
        cfg = resolve(config, [*MEMORY_JOB, f"--training.activation_checkpointing={mode}"], 4)
        mesh = get_mesh(cfg.mesh_shape, cfg.mesh_dim_names)
        model = build_model(cfg, mesh)
        opt = build_optimizer(model.parameters(), cfg)
        g = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, cfg.model.vocab_size, (cfg.micro_batch, cfg.data.seq_len), generator=g)
                for _ in range(2))
        trainer_step(model, opt, cfg, x, y)  # warm-up: optimizer state exists from here on
        m = measure_step(model, opt, cfg, (x, y), axis_groups(mesh))
        out[mode] = {"peak": m["peak"], "at_peak": m["peak_breakdown"], "flops": m["flops"]}
        del model, opt
    return out


def test_selective_memory_lies_between_none_and_full(pool):
    """Measured on a real CPU step: full keeps least, none most, selective in between
    (it keeps the matmul outputs), and selective recomputes no matmul (its FLOPs equal
    none's; full's are larger by the forward's)."""
    results = pool.run(job_peak_memory, ["none", "selective", "full"])
    for rank, r in enumerate(results):
        print(f"rank {rank}: " + ", ".join(f"{m} peak {v['peak'] / 2**20:.2f} MiB ({v['flops'] / 1e9:.3f} GFLOP)"
                                           for m, v in r.items()))
        assert r["none"]["peak"] > r["selective"]["peak"] > r["full"]["peak"], r
        assert r["selective"]["flops"] == r["none"]["flops"] < r["full"]["flops"], r
