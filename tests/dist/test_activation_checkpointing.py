"""Activation checkpointing composed with TP and FSDP recomputes exactly what it dropped:
the same losses and gradients as without it (fp32, 2 x 2, with and without sequence
parallel). Recompute replays TP collectives and FSDP hooks must not reshard mid-backward."""

import copy

import pytest
import torch
import torch.nn.functional as F

from fsdp2d.train.trainer import _checkpoint_activations

from . import _parity as P


def job_ac_matches(sequence_parallel: bool) -> list[tuple[float, float, float]]:
    torch.set_num_threads(1)
    s = P.Setup(model="llama", mesh=(2, 2), sequence_parallel=sequence_parallel)
    base = P.build("llama")
    plain, ac = copy.deepcopy(base), copy.deepcopy(base)
    for block in ac.layers:
        _checkpoint_activations(block)
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
    return out


@pytest.mark.parametrize("sp", [False, True])
def test_activation_checkpointing_changes_nothing(pool, sp):
    for rank_result in pool.run(job_ac_matches, sp):
        for plain, ac, grad_err in rank_result:
            # Recompute runs the same kernels on the same inputs: bitwise equal on CPU.
            assert plain == ac and grad_err == 0.0, rank_result
