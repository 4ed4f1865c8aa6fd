"""CPU offload: sharded gradients copied to the host without blocking are waited for
once, at the end of backward, before an optimizer can read them (CUDA runs).

This machine has no GPU, so the offload path is forced on CPU groups (``_offloading``)
and the event is a fake that records when it is made and waited on: per backward, one
event per group whose new gradients were copied, each waited for before ``backward()``
returns; an accumulation into existing gradients copies blocking (the CPU add reads the
copy at once) and records none. The numbers must equal the plain path's."""

import copy

import torch
import torch.nn.functional as F

import fsdp2d
from fsdp2d.fsdp import _grads

from . import _parity as P


class FakeEvent:
    log: list[str] = []

    def __init__(self) -> None:
        FakeEvent.log.append("record")

    def synchronize(self) -> None:
        FakeEvent.log.append("wait")


def job_offload_event() -> dict:
    torch.set_num_threads(1)
    s = P.Setup(model="llama", mesh=(4,), names=("dp",))
    plain = P.build("llama")
    offloaded = copy.deepcopy(plain)
    for model in (plain, offloaded):
        P.parallelize(model, s)
    groups = [m._fsdp2d_fsdp.group for m in offloaded.modules() if isinstance(m, fsdp2d.FSDPModule)]
    for g in groups:
        g._offloading = lambda device: True
    real, _grads._record_event = _grads._record_event, lambda device: FakeEvent()
    logs = []
    try:
        x, y = P.batch_for(0, s)
        for _ in range(2):  # the second backward accumulates into the first one's .grad
            for model in (plain, offloaded):
                F.cross_entropy(model(x[:2]).flatten(0, 1), y[:2].flatten()).backward()
            logs.append(FakeEvent.log[:])
            FakeEvent.log.clear()
    finally:
        _grads._record_event = real
    grads = [(a.grad - b.grad).abs().max().item() for a, b in zip(plain.parameters(), offloaded.parameters())]
    return {"logs": logs, "groups": len(groups), "grad_err": max(grads),
            "pending": [g.fqn for g in groups if g.offload_event is not None]}


def test_offloaded_gradients_waited_once_at_end_of_backward(pool):
    for r in pool.run(job_offload_event):
        n = r["groups"]
        # Events are recorded as groups finish their reduce-scatters, all waited for by the
        # end-of-backward callback (so every record precedes every wait).
        assert r["logs"][0] == ["record"] * n + ["wait"] * n, r["logs"]
        assert r["logs"][1] == [], r["logs"]  # accumulation: blocking copies, no event
        assert r["pending"] == []
        assert r["grad_err"] == 0.0
