"""Property tests for ``fsdp2d.placement``: pure index math, no process group.

Every test checks the layout code against an independent computation: ``torch.chunk``
applied to index ranges, brute-force element counting, or explicit element sets.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fsdp2d.placement import Box, Layout, Partial, Replicate, Shard, chunk_range


# ---------------------------------------------------------------------------------------
# helpers (independent reference implementations)
# ---------------------------------------------------------------------------------------
def reference_indices(global_shape, mesh_shape, placements, coordinate, split_order):
    """Per tensor dim, the global indices held by ``coordinate``, computed with torch.chunk.

    ``placements`` are the raw (possibly negative-dim) placements; the axes split in
    ``split_order`` (None: mesh-axis order), each chunking what the previous left.
    """
    ndim = len(global_shape)
    idx = [torch.arange(s) for s in global_shape]
    order = range(len(mesh_shape)) if split_order is None else split_order
    for axis in order:
        p = placements[axis]
        if isinstance(p, Shard):
            d = p.dim + ndim if p.dim < 0 else p.dim
            pieces = torch.chunk(idx[d], mesh_shape[axis])
            c = coordinate[axis]
            # torch.chunk may return fewer chunks than asked: the missing ones are empty.
            idx[d] = pieces[c] if c < len(pieces) else idx[d][:0]
    return idx


def box_elements(box: Box) -> set[tuple[int, ...]]:
    return set(itertools.product(*(range(o, o + n) for o, n in zip(box.global_offset, box.local_shape))))


def unravel(rank: int, mesh_shape) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(rank, mesh_shape))


# ---------------------------------------------------------------------------------------
# 1. chunk_range agrees with torch.chunk
# ---------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(size=st.integers(0, 40), num_chunks=st.integers(1, 12))
@example(size=0, num_chunks=1)
@example(size=0, num_chunks=5)
@example(size=1, num_chunks=4)
@example(size=5, num_chunks=4)  # torch.chunk returns only 3 chunks
@example(size=7, num_chunks=7)
def test_chunk_range_matches_torch_chunk(size, num_chunks):
    chunks = torch.arange(size).chunk(num_chunks)
    assert len(chunks) <= num_chunks
    expected_next = 0
    for i in range(num_chunks):
        off, n = chunk_range(size, num_chunks, i)
        assert n >= 0 and 0 <= off <= size and off + n <= size
        if i < len(chunks):
            assert n == chunks[i].numel()
            assert list(range(off, off + n)) == chunks[i].tolist()
        else:
            # chunks torch.chunk does not return are empty, at the end
            assert n == 0
            assert off == size
        if n:
            assert off == expected_next  # chunks are in order and back to back
        expected_next = off + n
    assert sum(chunk_range(size, num_chunks, i)[1] for i in range(num_chunks)) == size


@pytest.mark.parametrize(
    "size,num_chunks,expected",
    [
        (10, 2, [(0, 5), (5, 5)]),
        (7, 2, [(0, 4), (4, 3)]),
        (5, 4, [(0, 2), (2, 2), (4, 1), (5, 0)]),
        (1, 3, [(0, 1), (1, 0), (1, 0)]),
        (0, 3, [(0, 0), (0, 0), (0, 0)]),
    ],
)
def test_chunk_range_examples(size, num_chunks, expected):
    assert [chunk_range(size, num_chunks, i) for i in range(num_chunks)] == expected


@pytest.mark.parametrize("num_chunks,index", [(0, 0), (2, 2), (2, -1), (-1, 0)])
def test_chunk_range_bad_index(num_chunks, index):
    with pytest.raises(ValueError, match="out of range"):
        chunk_range(5, num_chunks, index)


# ---------------------------------------------------------------------------------------
# 2. random layouts: tiling, replicas, ownership, shard -> gather
# ---------------------------------------------------------------------------------------
@st.composite
def layout_params(draw):
    global_shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=4)))
    ndim = len(global_shape)
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    n = len(mesh_shape)
    others = [st.just(Replicate()), st.just(Partial())]
    if ndim:
        shard = st.integers(-ndim, ndim - 1).map(Shard)
        placement = st.one_of(shard, shard, *others)  # weight Shard (several axes, one dim)
    else:
        placement = st.one_of(*others)
    placements = tuple(draw(st.lists(placement, min_size=n, max_size=n)))
    split_order = draw(st.one_of(st.none(), st.permutations(range(n)).map(tuple)))
    return global_shape, mesh_shape, placements, split_order


def make_layout(global_shape, mesh_shape, placements, split_order, coordinate=None):
    n = len(mesh_shape)
    names = tuple(f"ax{i}" for i in range(n))
    coordinate = (0,) * n if coordinate is None else coordinate
    return Layout(global_shape, mesh_shape, names, placements, coordinate, split_order)


SETTINGS = settings(max_examples=150, deadline=None)
# hand-picked corner cases, run on every test below
CORNERS = [
    ((), (2, 3), (Replicate(), Partial()), None),  # 0-dim tensor
    ((1,), (3,), (Shard(0),), None),  # more ranks than elements
    ((0, 4), (2, 2), (Shard(0), Shard(-1)), None),  # zero-size dim
    ((7, 3), (2, 2), (Shard(0), Shard(0)), (1, 0)),  # uneven, TP-major on one dim
    ((5,), (2, 2, 2), (Shard(0), Shard(-1), Shard(0)), (2, 0, 1)),  # 3 axes, 1 dim
    ((6, 5), (2, 3, 2), (Partial(), Shard(1), Replicate()), (1, 2, 0)),
]


def with_corners(f):
    for c in CORNERS:
        f = example(params=c)(f)
    return f


@SETTINGS
@given(params=layout_params())
@with_corners
def test_boxes_match_torch_chunk_reference(params):
    global_shape, mesh_shape, placements, split_order = params
    base = make_layout(*params)
    coords = list(base.coordinates())
    # coordinates(): every coordinate once, in row-major rank order
    assert coords == [unravel(r, mesh_shape) for r in range(math.prod(mesh_shape))]
    for coord in coords:
        lay = base.at(coord)
        assert lay.coordinate == coord
        idx = reference_indices(global_shape, mesh_shape, placements, coord, split_order)
        assert lay.box == Box(lay.global_offset, lay.local_shape)
        assert len(lay.local_shape) == len(lay.global_offset) == len(global_shape)
        assert lay.local_shape == tuple(len(i) for i in idx)
        for d, i in enumerate(idx):
            if len(i):
                assert lay.global_offset[d] == int(i[0])
                assert i.tolist() == list(range(int(i[0]), int(i[0]) + len(i)))  # contiguous
            assert 0 <= lay.global_offset[d] <= global_shape[d] - lay.local_shape[d]
        assert lay.box.numel() == math.prod(len(i) for i in idx)


@SETTINGS
@given(params=layout_params())
@with_corners
def test_boxes_tile_and_replica_owners(params):
    global_shape, mesh_shape, placements, split_order = params
    base = make_layout(*params)
    non_shard_axes = [a for a, p in enumerate(placements) if not isinstance(p, Shard)]
    groups: dict[Box, list[tuple[int, ...]]] = {}
    owner_cover = torch.zeros(global_shape, dtype=torch.int64)
    for coord in base.coordinates():
        lay = base.at(coord)
        groups.setdefault(lay.box, []).append(coord)
        # ranks that differ only along non-Shard axes hold the same box
        for a in non_shard_axes:
            for v in range(mesh_shape[a]):
                other = coord[:a] + (v,) + coord[a + 1:]
                assert base.at(other).box == lay.box
        if lay.is_replica_owner():
            owner_cover[lay.box.slices()] += 1

    # the distinct boxes tile the tensor: every element in exactly one of them
    cover = torch.zeros(global_shape, dtype=torch.int64)
    for box in groups:
        cover[box.slices()] += 1
    assert bool((cover == 1).all())
    # and writing once per owner also covers every element exactly once
    assert bool((owner_cover == 1).all())

    non_empty = [b for b in groups if b.numel() > 0]
    assert sum(b.numel() for b in non_empty) == math.prod(global_shape)
    for b1, b2 in itertools.combinations(non_empty, 2):
        assert b1.intersect(b2) is None
    # exactly one replica owner per distinct (non-empty) box
    for box in non_empty:
        owners = [c for c in groups[box] if base.at(c).is_replica_owner()]
        assert len(owners) == 1, (box, groups[box], owners)
        # ... and every rank holding that box is a replica of the owner along non-Shard axes
        assert len(groups[box]) == math.prod(mesh_shape[a] for a in non_shard_axes)


@st.composite
def target_boxes(draw, global_shape):
    """Any box inside ``global_shape`` (empty ones included)."""
    offset, shape = [], []
    for size in global_shape:
        o = draw(st.integers(0, size))
        offset.append(o)
        shape.append(draw(st.integers(0, size - o)))
    return Box(tuple(offset), tuple(shape))


@st.composite
def layout_and_target(draw):
    params = draw(layout_params())
    return params, draw(target_boxes(params[0]))


@SETTINGS
@given(case=layout_and_target())
def test_owners_intersecting_is_the_brute_force_filter(case):
    """``owners_intersecting`` (what a checkpoint reader computes from a saved layout,
    without enumerating the mesh) equals filtering every coordinate: replica owners
    with a non-empty box that overlaps the target, boxes from ``at``."""
    params, target = case
    base = make_layout(*params)
    for t in (target, Box((0,) * len(params[0]), params[0])):  # and the whole tensor
        want = []
        for coord in base.coordinates():
            lay = base.at(coord)
            inter = lay.box.intersect(t)
            if lay.is_replica_owner() and lay.box.numel() and inter is not None and inter.numel():
                want.append((coord, lay.box))
        assert sorted(base.owners_intersecting(t)) == sorted(want), t


def test_owners_intersecting_does_not_walk_the_mesh():
    """A mesh of 2**40 x 8 ranks (never enumerable): a reader of 3 rows gets the 2
    boxes that hold them, from the TP-major split (TP splits first, then dp)."""
    lay = Layout((4096, 16), (2**40, 8), ("dp", "tp"), (Shard(0), Shard(0)), (0, 0), (1, 0))
    got = list(lay.owners_intersecting(Box((511, 3), (2, 5))))
    assert got == [((511, 0), Box((511, 0), (1, 16))), ((0, 1), Box((512, 0), (1, 16)))]
    assert got == [(c, lay.at(c).box) for c, _ in got]


@pytest.mark.parametrize("params", CORNERS)
def test_owners_intersecting_corners(params):
    test_owners_intersecting_is_the_brute_force_filter.hypothesis.inner_test(
        case=(params, Box((0,) * len(params[0]), params[0])))


@SETTINGS
@given(params=layout_params())
@with_corners
def test_shard_then_gather_is_identity(params):
    global_shape, mesh_shape, placements, split_order = params
    base = make_layout(*params)
    full = torch.arange(math.prod(global_shape), dtype=torch.int64).reshape(global_shape) + 1
    partial_axes = [a for a, p in enumerate(placements) if isinstance(p, Partial)]
    n_replicas = math.prod(mesh_shape[a] for a, p in enumerate(placements) if isinstance(p, Replicate))

    gathered = torch.full(global_shape, -1, dtype=torch.int64)  # sentinel: never written
    summed = torch.zeros(global_shape, dtype=torch.int64)
    for coord in base.coordinates():
        lay = base.at(coord)
        local = lay.shard(full)
        idx = reference_indices(global_shape, mesh_shape, placements, coord, split_order)
        assert tuple(local.shape) == lay.local_shape
        if all(coord[a] == 0 for a in partial_axes):
            # a replica or Partial-0 rank holds the true values of its box
            ref = full
            for d, i in enumerate(idx):
                ref = ref.index_select(d, i)
            assert torch.equal(local, ref)
        if lay.is_replica_owner():
            gathered[lay.box.slices()] = local
        summed[lay.box.slices()] += local

        # Partial: the sum over the Partial axes of the shards equals the full piece
        if partial_axes and all(coord[a] == 0 for a in partial_axes):
            total = torch.zeros(lay.local_shape, dtype=torch.int64)
            for pc in itertools.product(*(range(mesh_shape[a]) for a in partial_axes)):
                other = list(coord)
                for a, v in zip(partial_axes, pc):
                    other[a] = v
                olay = base.at(tuple(other))
                assert olay.box == lay.box
                total += olay.shard(full)
            assert torch.equal(total, full[lay.box.slices()])

    assert torch.equal(gathered, full)
    # every rank's shard summed into place: Partial axes add up to one copy,
    # Replicate axes contribute one copy per rank
    assert torch.equal(summed, full * n_replicas)


# ---------------------------------------------------------------------------------------
# 3. specific examples
# ---------------------------------------------------------------------------------------
def test_docstring_example():
    lay = Layout((10, 6), (2, 2), ("dp", "tp"), (Shard(0), Shard(1)), (1, 0))
    assert lay.global_offset == (5, 0)
    assert lay.local_shape == (5, 3)
    assert lay.box == Box((5, 0), (5, 3))
    assert lay.split_order == (0, 1)
    assert [lay.at(c).box for c in lay.coordinates()] == [
        Box((0, 0), (5, 3)), Box((0, 3), (5, 3)), Box((5, 0), (5, 3)), Box((5, 3), (5, 3)),
    ]


def test_tp_major_2d_same_dim():
    lay = Layout((8, 4), (2, 2), ("dp", "tp"), (Shard(0), Shard(0)), (1, 0), split_order=(1, 0))
    # tp splits rows 0-3 / 4-7, then dp splits the tp piece
    assert lay.global_offset == (2, 0)
    assert lay.local_shape == (2, 4)
    expected_rows = {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}
    full = torch.arange(32).reshape(8, 4)
    for coord, rows in expected_rows.items():
        sub = lay.at(coord)
        assert sub.box == Box((rows[0], 0), (len(rows), 4))
        local = sub.shard(full)
        assert local.is_contiguous()
        assert torch.equal(local, full[rows])
        assert local.data_ptr() == full[rows[0]].data_ptr()  # a view, not a copy
    # default (mesh-axis, dp-major) order differs: dp=1, tp=0 holds rows 4-5
    dp_major = Layout((8, 4), (2, 2), ("dp", "tp"), (Shard(0), Shard(0)), (1, 0))
    assert dp_major.box == Box((4, 0), (2, 4))


@pytest.mark.parametrize("rows,dp,tp", [(7, 2, 2), (7, 4, 2), (5, 3, 2), (3, 2, 4), (9, 2, 3)])
def test_tp_major_uneven_matches_chunk_twice(rows, dp, tp):
    lay = Layout((rows, 3), (dp, tp), ("dp", "tp"), (Shard(0), Shard(0)), (0, 0), split_order=(1, 0))
    rows_idx = torch.arange(rows)
    tp_chunks = list(torch.chunk(rows_idx, tp))
    tp_chunks += [rows_idx[:0]] * (tp - len(tp_chunks))
    for t in range(tp):
        dp_chunks = list(torch.chunk(tp_chunks[t], dp))
        dp_chunks += [rows_idx[:0]] * (dp - len(dp_chunks))
        for d in range(dp):
            box = lay.at((d, t)).box
            expected = dp_chunks[d].tolist()
            assert box.local_shape == (len(expected), 3)
            if expected:
                assert box.global_offset == (expected[0], 0)
                assert expected == list(range(expected[0], expected[0] + len(expected)))


def test_uneven_tp_major_explicit():
    # 7 rows: tp -> [0..3], [4..6]; dp splits each: [0,1],[2,3] and [4,5],[6]
    lay = Layout((7,), (2, 2), ("dp", "tp"), (Shard(0), Shard(0)), (0, 0), split_order=(1, 0))
    got = {c: (lay.at(c).global_offset[0], lay.at(c).local_shape[0]) for c in lay.coordinates()}
    assert got == {(0, 0): (0, 2), (1, 0): (2, 2), (0, 1): (4, 2), (1, 1): (6, 1)}


def test_negative_dim_is_normalised():
    lay = Layout((4, 6), (3,), ("tp",), (Shard(-1),), (2,))
    assert lay.placements == (Shard(1),)
    assert lay.box == Box((0, 4), (4, 2))


def test_replica_owner_examples():
    lay = Layout((4,), (2, 2, 2), ("a", "b", "c"), (Replicate(), Shard(0), Partial()), (0, 1, 0))
    assert lay.is_replica_owner()
    assert not lay.at((1, 1, 0)).is_replica_owner()
    assert not lay.at((0, 1, 1)).is_replica_owner()
    assert lay.at((0, 0, 0)).is_replica_owner()


# ---------------------------------------------------------------------------------------
# 4. errors
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mesh_shape,names,placements,coordinate",
    [
        ((2, 2), ("a", "b"), (Shard(0),), (0, 0)),  # too few placements
        ((2, 2), ("a", "b"), (Shard(0), Replicate(), Replicate()), (0, 0)),  # too many
        ((2, 2), ("a", "b"), (Shard(0), Replicate()), (0,)),  # short coordinate
        ((2, 2), ("a", "b"), (Shard(0), Replicate()), (0, 0, 0)),  # long coordinate
        ((2, 2), ("a",), (Shard(0), Replicate()), (0, 0)),  # short axis names
        ((2,), ("a", "b"), (Shard(0), Replicate()), (0, 0)),  # short mesh shape
    ],
)
def test_mismatched_lengths(mesh_shape, names, placements, coordinate):
    with pytest.raises(ValueError, match="per mesh axis"):
        Layout((4, 4), mesh_shape, names, placements, coordinate)


@pytest.mark.parametrize("coordinate", [(2, 0), (0, 3), (-1, 0), (0, -1)])
def test_coordinate_out_of_range(coordinate):
    with pytest.raises(ValueError, match="coordinate"):
        Layout((4, 4), (2, 3), ("dp", "tp"), (Shard(0), Shard(1)), coordinate)


@pytest.mark.parametrize("shape,dim", [((4,), 1), ((4,), -2), ((), 0), ((), -1), ((2, 3), 2), ((2, 3), -3)])
def test_shard_dim_out_of_range(shape, dim):
    with pytest.raises(ValueError, match=rf"Shard\({dim}\)"):
        Layout(shape, (2,), ("tp",), (Shard(dim),), (0,))


@pytest.mark.parametrize("split_order", [(0, 0), (0,), (0, 1, 2), (1, 2), (-1, 0)])
def test_split_order_not_permutation(split_order):
    with pytest.raises(ValueError, match="split_order"):
        Layout((4, 4), (2, 2), ("dp", "tp"), (Shard(0), Shard(0)), (0, 0), split_order=split_order)


@pytest.mark.parametrize("bad", ["shard", Shard, None, 0])
def test_non_placement_is_type_error(bad):
    with pytest.raises(TypeError, match="placement"):
        Layout((4,), (2,), ("tp",), (bad,), (0,))


@pytest.mark.parametrize("shape", [(4, 5), (4,), (4, 4, 1), (), (5, 4)])
def test_shard_of_wrong_shape(shape):
    lay = Layout((4, 4), (2,), ("tp",), (Shard(0),), (1,))
    with pytest.raises(ValueError, match="shape"):
        lay.shard(torch.zeros(shape))


def test_axis_lookup():
    lay = Layout((4, 4), (2, 2), ("dp", "tp"), (Shard(0), Shard(1)), (0, 0))
    assert lay.axis("tp") == 1 and lay.axis("dp") == 0
    with pytest.raises(KeyError, match="pp"):
        lay.axis("pp")


# ---------------------------------------------------------------------------------------
# 5. Box.intersect against brute-force element sets
# ---------------------------------------------------------------------------------------
@st.composite
def box_pairs(draw):
    ndim = draw(st.integers(0, 3))

    def box():
        offset = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
        return Box(offset, shape)

    return box(), box()


@settings(max_examples=300, deadline=None)
@given(pair=box_pairs())
@example(pair=(Box((), ()), Box((), ())))
@example(pair=(Box((0,), (3,)), Box((3,), (2,))))  # touching, not overlapping
@example(pair=(Box((2,), (0,)), Box((0,), (5,))))  # empty box inside another
@example(pair=(Box((0, 0), (4, 4)), Box((1, 5), (2, 2))))  # overlap in one dim only
def test_box_intersect_brute_force(pair):
    a, b = pair
    expected = box_elements(a) & box_elements(b)
    for got in (a.intersect(b), b.intersect(a)):
        if not expected:
            assert got is None
        else:
            assert got is not None
            assert box_elements(got) == expected
            assert got.numel() == len(expected)
    # numel and slices agree with the element set
    assert a.numel() == len(box_elements(a))
    t = torch.zeros([12] * len(a.global_offset), dtype=torch.int64)
    t[a.slices()] += 1
    assert {tuple(i) for i in t.nonzero().tolist()} == box_elements(a)


def test_splits_like_ignores_order_of_axes_that_do_not_split():
    """A ``Replicate`` axis's place in ``split_order`` moves no box (torch's ``zeros_like``
    of an fsdp2d parameter states mesh order); the order of two axes that split the same
    dim does, and so do placements."""
    tp_first = Layout((16, 8), (2, 2, 2), ("tp", "rep", "dp"), (Shard(0), Replicate(), Shard(0)), (1, 0, 1), (0, 2, 1))
    mesh_order = Layout((16, 8), (2, 2, 2), ("tp", "rep", "dp"), (Shard(0), Replicate(), Shard(0)), (1, 0, 1))
    dp_first = Layout((16, 8), (2, 2, 2), ("tp", "rep", "dp"), (Shard(0), Replicate(), Shard(0)), (1, 0, 1), (2, 1, 0)).at((1, 0, 0))
    assert tp_first.splits_like(mesh_order) and tp_first.box == mesh_order.box
    assert not tp_first.at((1, 0, 0)).splits_like(dp_first) and tp_first.at((1, 0, 0)).box != dp_first.box
    other = Layout((16, 8), (2, 2, 2), ("tp", "rep", "dp"), (Shard(0), Replicate(), Shard(1)), (1, 0, 1))
    assert not mesh_order.splits_like(other)
