"""Document masking on the 2 x 2 mesh (dp x tp, fully_shard per block and root), with and
without sequence parallelism, with activation checkpointing: 3 AdamW steps of the masked
parallel model equal a single-process copy that runs each document alone (issue 29). The
same for transformers' own Llama under fsdp2d.hf.tp_plan and fully_shard, masked through
fsdp2d.hf.document_inputs.

Under sequence parallelism the blocks see (B, T/tp, C) between them, but the model is given
the full (B, T) tokens and ids on every TP rank (the embedding reduce-scatters), and
attention runs on the all-gathered sequence: the mask and positions are the whole row's.

Tolerances as tests/dist/test_fsdp_parity.py (fp32): losses relative 1e-6 (TP and FSDP
reorder sums; the mask changes only which keys add exactly 0), gradients relative 1e-5
(the per-document reference also sums over documents rather than the packed row), final
parameters absolute 2e-5 (Adam's amplification of near-zero gradients, see _parity.EPS).
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from fsdp2d.models import document_ids
from fsdp2d.train.trainer import _checkpoint_activations

from .. import documents as D
from . import _parity as P
from ._hf import hf_model


def job_document_mask(sequence_parallel: bool, checkpointing: str) -> dict:
    torch.set_num_threads(1)
    s = P.Setup(model="llama", mesh=(2, 2), sequence_parallel=sequence_parallel)
    ref = P.build("llama")
    model = copy.deepcopy(ref)
    if checkpointing != "none":
        for block in model.layers:
            _checkpoint_activations(block, checkpointing)
    mesh, _ = P.parallelize(model, s)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=P.EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=P.EPS)
    idx, count = P.data_rank(mesh, s)
    worst = {"loss": 0.0, "grad": 0.0}
    for step in range(3):
        x, y = D.packed_batch(step, s.batch, P.SEQ, P.VOCAB)
        ids = document_ids(x, eos_id=D.EOS)
        ref_loss = F.cross_entropy(D.per_document(ref, x, ids).flatten(0, 1), y.flatten())
        ref_loss.backward()
        xs, ys, ids_s = x.chunk(count)[idx], y.chunk(count)[idx], ids.chunk(count)[idx]
        loss = F.cross_entropy(model(xs, document_ids=ids_s).flatten(0, 1), ys.flatten())
        loss.backward()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)  # each dp slice's loss once per TP rank
        total /= torch.distributed.get_world_size()
        worst["loss"] = max(worst["loss"], abs(total.item() - ref_loss.item()) / ref_loss.item())
        grads = P.full_tensors(model, mesh, "grad")
        diff = torch.stack([(grads[n] - p.grad).norm() for n, p in ref.named_parameters()]).norm()
        whole = torch.stack([p.grad.norm() for p in ref.parameters()]).norm()
        worst["grad"] = max(worst["grad"], (diff / whole).item())
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    params = P.full_tensors(model, mesh, "param")
    worst["param_abs"] = max((params[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return worst


@pytest.mark.parametrize("sp,checkpointing", [(False, "full"), (True, "selective")])
def test_document_mask_on_2x2_equals_each_document_alone(pool, sp, checkpointing):
    for rank, r in enumerate(pool.run(job_document_mask, sp, checkpointing)):
        assert r["loss"] < 1e-6 and r["grad"] < 1e-5 and r["param_abs"] < 2e-5, (rank, r)


def job_hf_document_mask() -> dict:
    import fsdp2d
    import fsdp2d.hf

    torch.set_num_threads(1)
    ref = hf_model("llama")
    model = copy.deepcopy(ref)
    mesh = P.get_mesh((2, 2), ("dp", "tp"))
    fsdp2d.parallelize_module(model, mesh["tp"], fsdp2d.hf.tp_plan(model))
    for block in model.model.layers:
        fsdp2d.fully_shard(block, mesh=mesh["dp"])
    fsdp2d.fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=P.EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=P.EPS)
    idx, count = P.data_rank(mesh, P.Setup(mesh=(2, 2)))
    worst = {"loss": 0.0}
    for step in range(3):
        x, y = D.packed_batch(step, 8, P.SEQ, P.VOCAB)
        ids = document_ids(x, eos_id=D.EOS)
        ref_loss = F.cross_entropy(D.per_document(lambda t: ref(input_ids=t).logits, x, ids).flatten(0, 1), y.flatten())
        ref_loss.backward()
        xs, ys, ids_s = x.chunk(count)[idx], y.chunk(count)[idx], ids.chunk(count)[idx]
        logits = model(input_ids=xs, **fsdp2d.hf.document_inputs(model, ids_s)).logits
        loss = F.cross_entropy(logits.flatten(0, 1), ys.flatten())
        loss.backward()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        total /= torch.distributed.get_world_size()
        worst["loss"] = max(worst["loss"], abs(total.item() - ref_loss.item()) / ref_loss.item())
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    params = P.full_tensors(model, mesh, "param")
    worst["param_abs"] = max((params[n].reshape(p.shape) - p.detach()).abs().max().item()
                             for n, p in ref.named_parameters())
    return worst


def test_transformers_document_mask_on_2x2_equals_each_document_alone(pool):
    pytest.importorskip("transformers")
    for rank, r in enumerate(pool.run(job_hf_document_mask)):
        assert r["loss"] < 1e-6 and r["param_abs"] < 2e-5, (rank, r)
