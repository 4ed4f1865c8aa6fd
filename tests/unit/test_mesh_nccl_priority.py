"""fsdp2d.init_device_mesh gives NCCL's data-parallel axis groups high-priority streams
(issue 20 item 4), binds the default group to its device, splits axis groups from it
and reuses it for an axis that spans the world (issue 30 item 5): checked without NCCL
by recording what reaches ``dist.new_group``, ``split_group`` and ``init_process_group``."""

from __future__ import annotations

import copy
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
        monkeypatch.setattr(M, "_splits", lambda: False)  # no device bound (see test_bound_nccl_...)
        return calls

    return setup


def _groups(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> list:
    grid = torch.arange(8, dtype=torch.int).reshape(shape)
    return [M._axis_group(grid, axis, M._high_priority(device_type, names[axis]), names[axis])
            for axis in range(len(shape))]


def test_nccl_data_parallel_axes_get_high_priority_streams(world):
    calls = world("nccl")
    _groups("cuda", (4, 2), ("dp", "tp"))
    dp, tp = calls[:2], calls[2:]
    assert [r for r, _ in dp] == [[0, 2, 4, 6], [1, 3, 5, 7]] and len(tp) == 4
    assert all(o is not None and o.is_high_priority_stream for _, o in dp)
    assert all(o is None for _, o in tp)
    assert len({id(o) for _, o in dp}) == 2  # one options object per group (new_group writes into it)


def test_nccl_whole_world_data_parallel_axis_reuses_the_default_group(world):
    """A second world-sized communicator would cost NCCL buffers and a set-up; the default
    group made by fsdp2d has high-priority streams itself (test_cuda_default_group_...)."""
    calls = world("nccl")
    assert _groups("cuda", (8,), ("dp",)) == ["world"] and not calls
    tp, dp = _groups("cuda", (1, 8), ("tp", "dp"))
    assert dp == "world" and [r for r, _ in calls] == [[i] for i in range(8)]  # (tp: one rank per line)


def test_bound_nccl_splits_each_axis_once(world, monkeypatch):
    """With the default group bound to a device, each axis is one ``split_group`` of
    every line (not a new_group per line), data-parallel axes with high priority."""
    calls = world("nccl")
    splits = []
    parent = _Options(is_high_priority_stream=True)  # fsdp2d's default group (test_cuda_default_group_...)

    def split_group(parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None):
        assert timeout == timedelta(seconds=77)
        # what torch 2.13's split_group does with None: a deep copy of the parent's options
        effective = pg_options if pg_options is not None else copy.deepcopy(parent)
        splits.append((split_ranks, effective, group_desc))
        return f"split{len(splits)}"

    monkeypatch.setattr(M, "_splits", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "split_group", split_group, raising=False)
    assert _groups("cuda", (4, 2), ("dp", "tp")) == ["split1", "split2"] and not calls
    (dp_lines, dp_opts, dp_desc), (tp_lines, tp_opts, tp_desc) = splits
    assert dp_lines == [[0, 2, 4, 6], [1, 3, 5, 7]] and tp_lines == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # TP collectives are on the compute path: normal priority, not the default group's high one
    assert dp_opts.is_high_priority_stream and not tp_opts.is_high_priority_stream
    assert (dp_desc, tp_desc) == ("mesh_dp", "mesh_tp") and dp_opts._timeout == tp_opts._timeout == timedelta(seconds=77)


def test_cuda_default_group_is_bound_to_its_device_with_high_priority(monkeypatch):
    """``init_process_group(device_id=...)``: NCCL's eager init and communicator splitting."""
    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(kw, backend=backend))
    monkeypatch.setattr(dist, "ProcessGroupNCCL", type("PG", (), {"Options": _Options}), raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.setdefault("set_device", device))
    for k, v in {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    M._ensure_process_group("cuda", 8)
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 3) == seen["set_device"]
    assert seen["pg_options"].is_high_priority_stream


def test_abort_after_an_exception_destroy_after_a_clean_run(monkeypatch):
    """An unfinished collective makes destroying NCCL communicators wait (a hang at exit):
    after an exception or Ctrl-C the launcher aborts them."""
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: not calls)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda group=None: calls.append("abort"))
    M.shutdown(abort=True)
    M.shutdown(abort=True)  # nothing left: a no-op
    assert calls == ["abort"]
    calls.clear()
    M.shutdown(abort=False)
    assert calls == ["destroy"]


@pytest.mark.parametrize("backend,device", [("gloo", "cpu"), ("fake", "cuda")])
def test_other_backends_are_unchanged(world, backend, device):
    calls = world(backend)
    _groups(device, (2, 2, 2), ("replicate", "shard", "tp"))
    assert calls and all(o is None for _, o in calls)
    calls.clear()
    [group] = _groups(device, (8,), ("dp",))
    assert group == "world" and not calls  # the default group, reused
