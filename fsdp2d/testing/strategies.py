"""Hypothesis strategies for meshes, placements, layouts and TP plans, and
:func:`roundtrip`, which shards a tensor on every coordinate of a layout and gathers it.

Example::

    from hypothesis import given
    from fsdp2d.testing import strategies

    @given(strategies.layouts(max_ranks=8, max_ndim=3))
    def test_my_layouts_tile(layout):
        full = torch.randn(layout.global_shape)
        assert torch.equal(strategies.roundtrip(full, layout), full)

Placements are torch's (``fsdp2d.Shard is torch.distributed.tensor.Shard``).
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from ..placement import Layout, Partial, Replicate, Shard

_AXIS_NAMES = {1: [("dp",), ("tp",)], 2: [("dp", "tp")], 3: [("rep", "shard", "tp")]}


@st.composite
def meshes(draw, max_ranks: int = 8) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(shape, axis_names)`` of a mesh of at most ``max_ranks`` ranks: 1-D ``("dp",)`` or
    ``("tp",)``, 2-D ``("dp", "tp")``, or HSDP ``("rep", "shard", "tp")``."""
    if max_ranks < 1:
        raise ValueError(f"meshes: max_ranks must be >= 1, got {max_ranks}")
    ndim = draw(st.integers(1, 3))
    shape: list[int] = []
    for _ in range(ndim):
        room = max_ranks // max(1, math.prod(shape))
        shape.append(draw(st.integers(1, max(1, room))))
    return tuple(shape), draw(st.sampled_from(_AXIS_NAMES[ndim]))


def placements(ndim: int, n_axes: int, partial: bool = True) -> st.SearchStrategy:
    """One placement per mesh axis for a tensor of ``ndim`` dims: ``Shard(d)`` (negative
    dims too), ``Replicate()``, and ``Partial()`` unless ``partial=False``."""
    if ndim < 0 or n_axes < 1:
        raise ValueError(f"placements: need ndim >= 0 and n_axes >= 1, got {ndim}, {n_axes}")
    options = [st.just(Replicate())] + ([st.just(Partial())] if partial else [])
    if ndim:
        shard = st.integers(-ndim, ndim - 1).map(Shard)
        options = [shard, shard] + options  # weighted towards Shard, several axes on one dim
    return st.lists(st.one_of(*options), min_size=n_axes, max_size=n_axes).map(tuple)


@st.composite
def layouts(draw, max_ranks: int = 8, max_ndim: int = 3, partial: bool = True) -> Layout:
    """An fsdp2d :class:`Layout` over a random mesh (:func:`meshes`) of a tensor of up to
    ``max_ndim`` dims with random, often uneven and sometimes zero, sizes, a random split
    order, seen from a random coordinate."""
    shape, names = draw(meshes(max_ranks))
    ndim = draw(st.integers(0, max_ndim))
    global_shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    chosen = draw(placements(ndim, len(shape), partial))
    order = draw(st.permutations(range(len(shape))).map(tuple))
    coordinate = tuple(draw(st.integers(0, s - 1)) for s in shape)
    return Layout(global_shape, shape, names, chosen, coordinate, order)


@st.composite
def plans(draw, model: torch.nn.Module, min_size: int = 0) -> dict:
    """A random TP plan over ``model``'s ``nn.Linear`` layers that is correct for any
    model: each chosen layer gets ``ColwiseParallel(output_layouts=Replicate())`` or
    ``RowwiseParallel(input_layouts=Replicate())``, both of which take and give a
    replicated activation, so the model computes what it computed alone."""
    from ..tensor_parallel import ColwiseParallel, RowwiseParallel

    linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name]
    if len(linears) < min_size:
        raise ValueError(f"plans: the model has {len(linears)} nn.Linear layers, fewer than min_size={min_size}")
    chosen = draw(st.lists(st.sampled_from(linears), min_size=min_size, unique=True)) if linears else []
    styles = [lambda: ColwiseParallel(output_layouts=Replicate()), lambda: RowwiseParallel(input_layouts=Replicate())]
    return {name: draw(st.sampled_from(styles))() for name in sorted(chosen)}


def roundtrip(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Shard ``tensor`` on every coordinate of ``layout``'s mesh, check that each shard is
    the box the layout names and that the boxes of the replica owners tile the tensor
    exactly once (``Partial`` axes: the shards sum to the box), then gather and return
    the result (equal to ``tensor``). Raises ``AssertionError`` naming the coordinate."""
    if tuple(tensor.shape) != layout.global_shape:
        raise ValueError(f"roundtrip: tensor of shape {tuple(tensor.shape)} for a layout of global shape "
                         f"{layout.global_shape}")
    gathered = torch.zeros_like(tensor)
    covered = torch.zeros(tensor.shape, dtype=torch.int64)
    partial_axes = [a for a, p in enumerate(layout.placements) if isinstance(p, Partial)]
    sums: dict = {}
    for coord in layout.coordinates():
        lay = layout.at(coord)
        local = lay.shard(tensor)
        if tuple(local.shape) != lay.local_shape:
            raise AssertionError(f"roundtrip: the shard at {coord} has shape {tuple(local.shape)}, "
                                 f"its layout says {lay.local_shape}")
        key = tuple(c for a, c in enumerate(coord) if a not in partial_axes)
        sums[key] = local.clone() if key not in sums else sums[key] + local
        if lay.is_replica_owner():
            covered[lay.box.slices()] += 1
    for coord in layout.coordinates():
        lay = layout.at(coord)
        if lay.is_replica_owner():
            key = tuple(c for a, c in enumerate(coord) if a not in partial_axes)
            gathered[lay.box.slices()] = sums[key]
    if tensor.numel() and not bool((covered == 1).all()):
        raise AssertionError(f"roundtrip: the replica owners' boxes of {layout} do not tile the tensor once "
                             f"(coverage from {int(covered.min())} to {int(covered.max())})")
    if not torch.equal(gathered, tensor):
        raise AssertionError(f"roundtrip: gathering the shards of {layout} does not give the tensor back")
    return gathered
