"""torch's own serialisation and copying on fsdp2d models (4 gloo ranks, 2x2 and dp=4).

``torch.save``/``torch.load`` of ``model.state_dict()``, of single parameters, their
gradients and the optimizer's state must round-trip exactly on every rank (DTensors
back with the same placements, mesh axes and local values; gradients and AdamW moments
too), as they do on torch's own FSDP2 + TP models; ``copy.deepcopy`` of a fully sharded
model raises torch's clear error (FSDP2's own words), never a storage error.
"""

from __future__ import annotations

import io

import pytest
import torch

from . import _parity as P
from .pool import capture_error

CASES = {"2x2": P.Setup(model="llama", mesh=(2, 2)), "dp4": P.Setup(model="gpt2", mesh=(4,), names=("dp",)),
         "tp-only": P.Setup(model="llama", mesh=(1, 4), fsdp=False)}


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _same(a, b) -> bool:
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor) != isinstance(b, DTensor):
        return False
    if isinstance(a, DTensor):
        return (a.placements == b.placements and a.device_mesh.mesh_dim_names == b.device_mesh.mesh_dim_names
                and tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype
                and torch.equal(a.to_local(), b.to_local()))
    return torch.equal(a, b)


def _job(case: str) -> dict:
    import torch.nn.functional as F

    torch.set_num_threads(1)
    s = CASES[case]
    model = P.build(s.model)
    P.parallelize(model, s)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # a TP-only model mixes plain and DTensor
    x, y = P.batch_for(0, s)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    opt.step()
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()  # gradients to save
    out = {}
    sd = model.state_dict()
    back = _roundtrip(sd)
    out["state_dict"] = sd.keys() == back.keys() and all(_same(sd[k], back[k]) for k in sd)
    name, p = next((n, p) for n, p in model.named_parameters() if p.grad is not None)
    out["param"] = _same(p.detach(), _roundtrip(p).detach())
    out["grad"] = _same(p.grad, _roundtrip(p.grad))
    osd = opt.state_dict()
    oback = _roundtrip(osd)
    out["optim"] = all(_same(v, oback["state"][i][k]) for i, st in osd["state"].items() for k, v in st.items())
    # loading the round-tripped state dict gives the same model
    model.load_state_dict(back)
    out["reload"] = all(_same(v, model.state_dict()[k]) for k, v in sd.items())
    err = capture_error(lambda: __import__("copy").deepcopy(model))
    out["deepcopy"] = err
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_torch_save_load_and_deepcopy(pool, case):
    for rank, r in enumerate(pool.run(_job, case)):
        for key in ("state_dict", "param", "grad", "optim", "reload"):
            assert r[key] is True, (rank, key)
        if CASES[case].fsdp:
            kind, msg = r["deepcopy"]
            assert kind == "AssertionError" and "FSDP does not support deepcopy" in msg, r["deepcopy"]
        else:  # a TP-only model copies as torch's TP models do
            assert r["deepcopy"] is None, r["deepcopy"]
