"""``fsdp2d.testing.strategies``: what each strategy draws, and ``roundtrip`` catching a
layout whose boxes do not tile the tensor."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp2d import Layout, Partial, Replicate, Shard
from fsdp2d.testing import strategies

SETTINGS = settings(max_examples=60, deadline=None)


@SETTINGS
@given(strategies.meshes(max_ranks=8))
def test_meshes_fit_max_ranks_and_name_every_axis(mesh):
    shape, names = mesh
    assert 1 <= math.prod(shape) <= 8 and len(shape) == len(names) == len(set(names))
    assert names in {("dp",), ("tp",), ("dp", "tp"), ("rep", "shard", "tp")}


@SETTINGS
@given(st.integers(0, 3).flatmap(lambda nd: st.tuples(st.just(nd), strategies.placements(nd, 3))))
def test_placements_are_torchs_and_in_range(case):
    ndim, chosen = case
    assert len(chosen) == 3
    for p in chosen:
        assert isinstance(p, (Shard, Replicate, Partial))
        if isinstance(p, Shard):
            assert -ndim <= p.dim < ndim


@SETTINGS
@given(strategies.layouts(max_ranks=8, max_ndim=3))
def test_every_drawn_layout_roundtrips(layout):
    full = torch.arange(math.prod(layout.global_shape), dtype=torch.float64).reshape(layout.global_shape)
    assert torch.equal(strategies.roundtrip(full, layout), full)


def test_roundtrip_rejects_a_layout_whose_boxes_overlap():
    """A layout that puts two ranks' shards on the same rows: roundtrip must say so."""
    class Overlapping(Layout):
        def at(self, coordinate):
            return Layout(self.global_shape, self.mesh_shape, self.axis_names, self.placements, (0,))

    bad = Overlapping((6, 2), (2,), ("dp",), (Shard(0),), (0,))
    with pytest.raises(AssertionError, match="do not tile the tensor once"):
        strategies.roundtrip(torch.zeros(6, 2), bad)


def test_plans_only_use_linear_layers_with_replicated_boundaries():
    from fsdp2d.tensor_parallel import ColwiseParallel, RowwiseParallel

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    drawn = []

    @settings(max_examples=30, deadline=None)
    @given(strategies.plans(model))
    def collect(plan):
        drawn.append(plan)

    collect()
    assert all(set(p) <= {"0", "2"} for p in drawn) and any(p for p in drawn)
    for plan in drawn:
        for style in plan.values():
            if isinstance(style, ColwiseParallel):
                assert style.output_layout == Replicate()
            else:
                assert isinstance(style, RowwiseParallel) and style.input_layout == Replicate()
