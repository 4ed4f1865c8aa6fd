"""fsdp2d.init_device_mesh gives NCCL's data-parallel axis groups high-priority streams
(issue 20 item 4): checked without NCCL by recording what reaches ``dist.new_group``."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fsdp2d import mesh as M


class _Options:  # stands in for ProcessGroupNCCL.Options (absent from CPU wheels)
    def __init__(self, is_high_priority_stream: bool = False) -> None:
        self.is_high_priority_stream = is_high_priority_stream


@pytest.fixture
def world(monkeypatch):
    """A fake 8-rank world as rank 0 with the given backend; returns the new_group calls."""
    calls: list[tuple[list[int], object]] = []

    def new_group(ranks, timeout=None, pg_options=None):
        assert timeout == timedelta(seconds=77)  # the default group's
        assert pg_options is None or pg_options._timeout == timeout  # (new_group warns otherwise)
        calls.append((ranks, pg_options))
        return f"group{len(calls)}"

    def setup(backend: str):
        monkeypatch.setattr(dist, "get_rank", lambda: 0)
        monkeypatch.setattr(dist, "get_world_size", lambda: 8)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
        monkeypatch.setattr(dist, "new_group", new_group)
        monkeypatch.setattr(dist, "ProcessGroupNCCL", type("PG", (), {"Options": _Options}), raising=False)
        monkeypatch.setattr(M, "group_timeout", lambda group=None: timedelta(seconds=77))
        monkeypatch.setattr(type(dist.group), "WORLD", property(lambda cls: "world"))
        return calls

    return setup


def _groups(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> list:
    grid = torch.arange(8, dtype=torch.int).reshape(shape)
    return [M._new_axis_groups(grid, axis, M._high_priority(device_type, names[axis])) for axis in range(len(shape))]


def test_nccl_data_parallel_axes_get_high_priority_streams(world):
    calls = world("nccl")
    _groups("cuda", (4, 2), ("dp", "tp"))
    dp, tp = calls[:2], calls[2:]
    assert [r for r, _ in dp] == [[0, 2, 4, 6], [1, 3, 5, 7]] and len(tp) == 4
    assert all(o is not None and o.is_high_priority_stream for _, o in dp)
    assert all(o is None for _, o in tp)
    assert len({id(o) for _, o in dp}) == 2  # one options object per group (new_group writes into it)


def test_nccl_whole_world_data_parallel_axis_is_a_group_of_its_own(world):
    calls = world("nccl")
    [group] = _groups("cuda", (8,), ("dp",))
    assert group == "group1" and calls[0][0] == list(range(8)) and calls[0][1].is_high_priority_stream


@pytest.mark.parametrize("backend,device", [("gloo", "cpu"), ("fake", "cuda")])
def test_other_backends_are_unchanged(world, backend, device):
    calls = world(backend)
    _groups(device, (2, 2, 2), ("replicate", "shard", "tp"))
    assert calls and all(o is None for _, o in calls)
    calls.clear()
    [group] = _groups(device, (8,), ("dp",))
    assert group == "world" and not calls  # the default group, reused
