"""The emulated NCCL group without a GPU: its cost model is ``fsdp2d plan``'s, its stream
contract is NCCL's (checked with a recorder standing in for the CUDA streams), and it
registers as a backend that torch's functional collectives and fsdp2d's mesh accept.
Its values against real gloo collectives: tests/dist/test_emulated_pg.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from fsdp2d.plan.estimate import GPUS, comm_table
from fsdp2d.testing import emulated_pg as E


@pytest.fixture
def state():
    """STATE as a test leaves it is restored (it is process-wide)."""
    saved = dataclasses.replace(E.STATE)
    yield E.STATE
    for f in dataclasses.fields(E.STATE):
        setattr(E.STATE, f.name, getattr(saved, f.name))


def test_cost_is_the_plans_ring_model():
    gpu = GPUS["h100"]
    link = E.LinkModel(gpu.nvlink_bytes_per_s, gpu.network_bytes_per_s, gpus_per_node=8)
    dp, tp = list(range(0, 256, 8)), list(range(8))  # 70B: FSDP 32 across nodes, TP 8 inside one
    measured = {"collectives": {"dp/all_gather": [3, 6e9], "dp/reduce_scatter": [2, 4e9], "tp/all_reduce": [9, 5e8]}}
    plan = comm_table(measured, {"dp": dp, "tp": tp}, 8, gpu)
    assert plan["dp/all_gather"]["link"] == "network" and plan["tp/all_reduce"]["link"] == "nvlink"
    for key, ranks in (("dp/all_gather", dp), ("dp/reduce_scatter", dp), ("tp/all_reduce", tp)):
        kind, nbytes = key.split("/")[1], measured["collectives"][key][1]
        assert link.seconds(kind, nbytes, ranks) == pytest.approx(plan[key]["seconds"], rel=1e-12), key
    assert link.seconds("all_gather", 8e9, list(range(8))) == pytest.approx(7 / 8 * 8e9 / 450e9)
    assert link.seconds("all_reduce", 1e9, [0]) == 0.0  # one rank: nothing moves
    assert E.LinkModel(latency_s=1e-5).seconds("broadcast", 0, [0, 9]) == 1e-5


class Recorder:
    """Stands in for the CUDA streams: logs launches (cycles, tensors kept) and waits;
    the side stream's work (the values) runs at launch."""

    def __init__(self) -> None:
        self.log: list[tuple] = []

    def launch(self, device, cycles, fill, tensors):
        self.log.append(("launch", cycles, len(tensors)))
        fill()
        return len(self.log)  # the event

    def wait(self, device, event):
        self.log.append(("wait", event))

    def done(self, event):
        return False


def test_stream_contract_async_and_blocking(state):
    pg = E.EmulatedProcessGroup(3, 8, range(8))
    pg.streams, pg.stream_devices = Recorder(), ("cpu",)
    state.cycles_per_s, state.comm_time = 2e9, True
    state.reset()
    out, inp = torch.empty(8 * 1024), torch.arange(1024.0)
    work = dist.all_gather_single(out, inp, group=pg, async_op=True)
    cycles = int(7 / 8 * out.numel() * 4 / 450e9 * 2e9)
    assert pg.streams.log == [("launch", cycles, 2)]  # issued: nothing waits yet (NCCL's async op)
    assert not work.is_completed()
    work.wait()
    assert pg.streams.log[-1] == ("wait", 1)  # the current stream waits for the side stream's event
    assert torch.equal(out, inp.repeat(8))
    t = torch.ones(256)
    dist.all_reduce(t, group=pg)  # a blocking op: torch waits on the work at once
    assert pg.streams.log[2:] == [("launch", int(2 * 7 / 8 * 1024 / 450e9 * 2e9), 1), ("wait", 3)]
    assert torch.equal(t, torch.full((256,), 8.0))
    rs = torch.empty(128)
    dist.reduce_scatter_single(rs, torch.arange(1024.0), op=dist.ReduceOp.AVG, group=pg)
    assert torch.equal(rs, torch.arange(384.0, 512.0))  # this rank's (3rd) chunk, as the average
    state.comm_time = False  # the zero-time baseline: same launches, no sleep
    dist.all_reduce(t, group=pg)
    assert pg.streams.log[-2] == ("launch", 0, 1)
    assert state.stats[("", "all_gather")] == [1, 32768, pytest.approx(7 / 8 * 32768 / 450e9)]
    assert state.stats[("", "all_reduce")][:2] == [2, 2048]


def test_missing_calibration_fails_loudly(state):
    pg = E.EmulatedProcessGroup(0, 2, [0, 1])
    pg.streams, pg.stream_devices = Recorder(), ("cpu",)
    state.cycles_per_s, state.comm_time = None, True
    with pytest.raises(RuntimeError, match="calibrate_sleep"):
        dist.all_reduce(torch.ones(4), group=pg)


def test_unsupported_all_to_all_splits_fail_loudly():
    pg = E.EmulatedProcessGroup(0, 2, [0, 1])
    with pytest.raises(NotImplementedError, match="output splits"):
        dist.all_to_all_single(torch.empty(5), torch.arange(4.0), [3, 2], [2, 2], group=pg)


def test_registered_backend_carries_meshes_and_functional_collectives(state):
    import torch.distributed._functional_collectives as funcol
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fsdp2d

    E.register()
    dist.init_process_group(E.BACKEND, store=FakeStore(), rank=0, world_size=16)
    try:
        mesh = fsdp2d.init_device_mesh("cpu", (4, 4), mesh_dim_names=("dp", "tp"))
        tp = mesh.get_group("tp")
        assert dist.get_backend() == E.BACKEND and isinstance(tp, E.EmulatedProcessGroup)
        assert tp.ranks == [0, 1, 2, 3] and mesh.get_group("dp").ranks == [0, 4, 8, 12]
        x = torch.arange(3.0)
        assert torch.equal(funcol.wait_tensor(funcol.all_reduce(x, "sum", tp)), 4 * x)  # the C++ path in
        assert torch.equal(funcol.wait_tensor(funcol.all_gather_tensor(x, 0, (mesh, 0))), x.repeat(4))
    finally:
        dist.destroy_process_group()
