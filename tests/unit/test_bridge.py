"""Property tests for ``fsdp2d.bridge`` index math: pure, in-process, no process group.

``fsdp_layout`` composes FSDP's dim-0 chunking over a TP layout, TP-major: TP splits
the global tensor first (``torch.chunk`` along its dim), FSDP then chunks *the TP shard*
along dim 0 (and replicates over an HSDP ``replicate`` axis). Every expectation below
is computed independently with ``torch.chunk`` on index ranges or on the data itself,
never with the function under test. The DTensorExtensions operations that need no
process group (``chunk_tensor``, ``chunk_dtensor`` given a mesh-like object,
``pre_load_state_dict_transform``, flatten/unflatten of a ``LocalShard``) and the torch
placements ``to_dtensor`` picks (simulated with torch's own split functions) are
tested the same way.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fsdp2d.bridge import DTensorExtensions, LocalShard, fsdp_layout, to_dtensor
from fsdp2d.bridge.extensions import _torch_placements
from fsdp2d.placement import Box, Layout, Replicate, Shard, chunk_range


# ---------------------------------------------------------------------------------------
# independent references (torch.chunk)
# ---------------------------------------------------------------------------------------
def nth_chunk(x: torch.Tensor, k: int, i: int, dim: int = 0) -> torch.Tensor:
    """The ``i``-th of ``k`` torch.chunk pieces along ``dim`` (empty past the last one)."""
    pieces = torch.chunk(x, k, dim)
    return pieces[i] if i < len(pieces) else x.narrow(dim, 0, 0)


def reference_piece(full, tp_placement, tp, tp_rank, dp, dp_rank):
    """TP-major: torch.chunk the global tensor over TP, then dim 0 of that over FSDP."""
    x = full
    if isinstance(tp_placement, Shard):
        x = nth_chunk(x, tp, tp_rank, tp_placement.dim)
    return nth_chunk(x, dp, dp_rank, 0)


def reference_indices(shape, tp_placement, tp, tp_rank, dp, dp_rank):
    """Per-dim global indices held, by the same torch.chunk recipe on index ranges."""
    idx = [torch.arange(s) for s in shape]
    if isinstance(tp_placement, Shard):
        d = tp_placement.dim
        idx[d] = nth_chunk(idx[d], tp, tp_rank)
    idx[0] = nth_chunk(idx[0], dp, dp_rank)
    return idx


class FakeMesh:
    """Just what ``chunk_dtensor`` / ``to_dtensor`` read of an fsdp2d DeviceMesh."""

    def __init__(self, shape, names, coordinate):
        self.shape, self.mesh_dim_names, self._coord = tuple(shape), tuple(names), tuple(coordinate)

    def get_coordinate(self):
        return self._coord


def fsdp_mesh(hsdp: bool, sizes):
    return ((sizes[0], sizes[1]), ("replicate", "shard")) if hsdp else ((sizes[1],), ("dp",))


# ---------------------------------------------------------------------------------------
# random cases: global shape, TP placement (or no TP), dp / HSDP mesh, tp size
# ---------------------------------------------------------------------------------------
@st.composite
def bridge_cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    options = [Shard(0), Replicate(), None] + ([Shard(1)] if ndim >= 2 else [])
    tp_placement = draw(st.sampled_from(options))  # None: the parameter is not TP-sharded
    tp = draw(st.integers(1, 4))
    hsdp = draw(st.booleans())
    sizes = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    return shape, tp_placement, tp, hsdp, sizes


CORNERS = [
    ((7, 5), Shard(0), 2, False, (1, 2)),  # uneven on both axes of dim 0
    ((7, 5), Shard(1), 2, False, (1, 3)),
    ((9,), Shard(0), 4, False, (1, 2)),  # 1-D bias, TP leaves an empty shard
    ((9,), Replicate(), 2, True, (2, 4)),
    ((3, 6), Shard(0), 4, True, (2, 2)),  # more TP ranks than rows
    ((0, 4), Shard(0), 2, False, (1, 2)),  # zero-size dim
    ((0, 4), Shard(1), 3, True, (3, 2)),
    ((4, 0, 3), Shard(1), 2, False, (1, 3)),
    ((7, 3), Shard(0), 2, False, (1, 3)),  # TP-major != torch's _StridedShard here
    ((5,), None, 3, True, (2, 4)),
    ((1,), Shard(0), 4, True, (4, 4)),
]
SETTINGS = settings(max_examples=60, deadline=None)


def with_corners(**extra):
    """Run the hand-picked CORNERS (plus fixed ``extra`` arguments) on every test."""
    def deco(f):
        for c in CORNERS:
            f = example(case=c, **extra)(f)
        return f
    return deco


def layouts_of(case):
    """Yield (fsdp coordinate, tp coordinate, tp_layout, layout) for every mesh coordinate."""
    shape, tp_placement, tp, hsdp, sizes = case
    fshape, fnames = fsdp_mesh(hsdp, sizes)
    for fcoord in itertools.product(*map(range, fshape)):
        for j in range(tp if tp_placement is not None else 1):
            tp_layout = None
            if tp_placement is not None:
                tp_layout = Layout(shape, (tp,), ("tp",), (tp_placement,), (j,))
            yield fcoord, j, tp_layout, fsdp_layout(shape, tp_layout, fshape, fnames, fcoord)


@SETTINGS
@given(case=bridge_cases())
@with_corners()
def test_boxes_tile_the_global_tensor(case):
    """(a) distinct boxes tile exactly; every rank's box is covered as often as it is replicated."""
    shape, tp_placement, tp, hsdp, sizes = case
    fshape, _ = fsdp_mesh(hsdp, sizes)
    distinct: set[Box] = set()
    every = torch.zeros(shape, dtype=torch.int64)
    for _, _, _, lay in layouts_of(case):
        distinct.add(lay.box)
        every[lay.box.slices()] += 1
    cover = torch.zeros(shape, dtype=torch.int64)
    for box in distinct:
        cover[box.slices()] += 1
    assert bool((cover == 1).all()), cover
    # replicas: the HSDP replicate axis, and the TP axis when TP replicates
    copies = (fshape[0] if hsdp else 1) * (tp if isinstance(tp_placement, Replicate) else 1)
    assert bool((every == copies).all()), (every, copies)
    assert sum(b.numel() for b in distinct) == math.prod(shape)


@SETTINGS
@given(case=bridge_cases())
@with_corners()
def test_box_is_fsdp_chunk_of_tp_box(case):
    """(b) TP-major: the box is rows chunk_range(tp_rows, dp, dp_rank) of the TP box."""
    shape, tp_placement, tp, hsdp, sizes = case
    fshape, fnames = fsdp_mesh(hsdp, sizes)
    dp = fshape[-1]
    for fcoord, j, tp_layout, lay in layouts_of(case):
        # the layout: FSDP axes then the TP axis, TP splitting first
        tp_names = ("tp",) if tp_layout is not None else ()
        assert lay.axis_names == fnames + tp_names
        assert lay.coordinate == fcoord + ((j,) if tp_layout is not None else ())
        if tp_layout is not None:
            assert lay.split_order[0] == len(fnames)  # the TP axis splits first
        # independent reference: torch.chunk on index ranges
        idx = reference_indices(shape, tp_placement, tp, j, dp, fcoord[-1])
        assert lay.local_shape == tuple(len(i) for i in idx)
        for d, i in enumerate(idx):
            if len(i):
                assert lay.global_offset[d] == int(i[0])
                assert i.tolist() == list(range(int(i[0]), int(i[0]) + len(i)))  # contiguous
        # ... and literally rows chunk_range(tp_local_rows, dp, dp_rank) of the TP box
        tp_box = tp_layout.box if tp_layout is not None else Box((0,) * len(shape), shape)
        start, n = chunk_range(tp_box.local_shape[0], dp, fcoord[-1])
        assert lay.local_shape == (n,) + tp_box.local_shape[1:]
        if lay.box.numel():
            assert lay.global_offset == (tp_box.global_offset[0] + start,) + tp_box.global_offset[1:]


@SETTINGS
@given(case=bridge_cases(), seed=st.integers(0, 2**16))
@with_corners(seed=0)
@example(case=((7, 5), Shard(0), 2, True, (2, 2)), seed=0)
def test_chunk_then_gather_identity(case, seed):
    """(c) each piece is the dim-0 chunk of the TP shard; the pieces rebuild the tensor.

    Also runs ``chunk_dtensor`` (a LocalShard or plain tensor in, on a mesh-like object),
    which needs no process group, and checks it against the same reference."""
    shape, tp_placement, tp, hsdp, sizes = case
    fshape, fnames = fsdp_mesh(hsdp, sizes)
    dp = fshape[-1]
    g = torch.Generator().manual_seed(seed)
    full = torch.randperm(math.prod(shape), generator=g).reshape(shape).float()  # distinct values
    rebuilt = torch.full(shape, -1.0)
    ext = DTensorExtensions()
    for fcoord, j, tp_layout, lay in layouts_of(case):
        ref = reference_piece(full, tp_placement, tp, j, dp, fcoord[-1])
        piece = lay.shard(full)
        assert torch.equal(piece, ref)
        rebuilt[lay.box.slices()] = piece

        if tp_layout is None:
            mesh = FakeMesh(fshape + (tp,), fnames + ("tp",), fcoord + (0,))
            chunked = ext.chunk_dtensor(full, 0, mesh)
            assert chunked.layout.axis_names == fnames  # replicated over TP: no TP axis
        else:
            tp_shard = LocalShard(nth_chunk(full, tp, j, tp_placement.dim) if isinstance(tp_placement, Shard)
                                  else full, tp_layout)
            mesh = FakeMesh(fshape + (tp,), fnames + ("tp",), fcoord + (j,))
            chunked = ext.chunk_dtensor(tp_shard, 0, mesh)
            assert chunked.layout.axis_names == fnames + ("tp",)
            assert chunked.layout.placements[-1] == tp_placement
        assert isinstance(chunked, LocalShard)
        assert torch.equal(chunked.tensor, ref)
        assert chunked.layout.box == lay.box
    assert torch.equal(rebuilt, full)


# ---------------------------------------------------------------------------------------
# (d) fsdp_layout errors
# ---------------------------------------------------------------------------------------
def test_fsdp_layout_example_from_docstring():
    tp_layout = Layout((8, 4), (2,), ("tp",), (Shard(0),), (0,))
    lay = fsdp_layout((8, 4), tp_layout, (2,), ("dp",), (1,))
    assert lay.global_offset == (2, 0) and lay.local_shape == (2, 4)


@pytest.mark.parametrize("fshape,fnames", [((2,), ("tp",)), ((2, 2), ("replicate", "tp")),
                                           ((2, 2), ("tp", "shard"))])
def test_fsdp_layout_rejects_fsdp_axis_named_like_tp(fshape, fnames):
    tp_layout = Layout((8, 4), (2,), ("tp",), (Shard(0),), (0,))
    with pytest.raises(ValueError, match="share axis"):
        fsdp_layout((8, 4), tp_layout, fshape, fnames, (0,) * len(fshape))


@pytest.mark.parametrize("fshape,fnames", [((2, 2, 1), ("a", "b", "c")), ((1, 1, 1, 1), ("a", "b", "c", "d")),
                                           ((), ())])
@pytest.mark.parametrize("with_tp", [False, True])
def test_fsdp_layout_rejects_wrong_number_of_fsdp_axes(fshape, fnames, with_tp):
    tp_layout = Layout((8, 4), (2,), ("tp",), (Shard(1),), (1,)) if with_tp else None
    with pytest.raises(ValueError, match="1 axis .shard. or 2"):
        fsdp_layout((8, 4), tp_layout, fshape, fnames, (0,) * len(fshape))


def test_fsdp_layout_rejects_mismatched_tp_global_shape():
    tp_layout = Layout((8, 4), (2,), ("tp",), (Shard(0),), (0,))
    with pytest.raises(ValueError, match="global shape"):
        fsdp_layout((8, 5), tp_layout, (2,), ("dp",), (0,))


# ---------------------------------------------------------------------------------------
# LocalShard, chunk_tensor, pre_load_state_dict_transform, flatten / unflatten
# ---------------------------------------------------------------------------------------
def test_local_shard_validates_shape():
    lay = Layout((7, 5), (2,), ("tp",), (Shard(0),), (1,))  # rows 4..6
    assert LocalShard(torch.zeros(3, 5), lay).layout is lay
    for bad in [(4, 5), (3, 4), (3,), (3, 5, 1), (15,)]:
        with pytest.raises(ValueError, match=r"local tensor shape .* != layout local shape \(3, 5\)"):
            LocalShard(torch.zeros(bad), lay)
    empty = Layout((1, 5), (2,), ("tp",), (Shard(0),), (1,))  # no rows left for rank 1
    assert LocalShard(torch.zeros(0, 5), empty).tensor.shape == (0, 5)
    with pytest.raises(ValueError):
        LocalShard(torch.zeros(1, 5), empty)


@settings(max_examples=80, deadline=None)
@given(shape=st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple), world_size=st.integers(1, 5),
       data=st.data())
@example(shape=(9,), world_size=4, data=None)
@example(shape=(0, 4), world_size=3, data=None)
def test_chunk_tensor_is_torch_chunk_of_dim0(shape, world_size, data):
    ext = DTensorExtensions()
    full = torch.randn(shape, requires_grad=True)
    before = full.detach().clone()
    rebuilt = torch.full(shape, float("nan"))
    ranks = range(world_size) if data is None else [data.draw(st.integers(0, world_size - 1))]
    for rank in ranks:
        out = ext.chunk_tensor(full, rank, world_size, 8, None)  # (num_devices_per_node, pg): ignored
        ref = nth_chunk(full.detach(), world_size, rank)
        assert isinstance(out, LocalShard)
        assert torch.equal(out.tensor, ref) and not out.tensor.requires_grad
        lay = out.layout
        assert (lay.mesh_shape, lay.placements, lay.coordinate) == ((world_size,), (Shard(0),), (rank,))
        assert lay.global_shape == shape and lay.local_shape == tuple(ref.shape)
        rebuilt[lay.box.slices()] = out.tensor
        if out.tensor.numel():  # a copy, not a view of the caller's tensor
            out.tensor.add_(1)
            assert torch.equal(full.detach(), before)
    if data is None:
        assert torch.equal(rebuilt, full.detach())


def test_pre_load_state_dict_transform_of_local_shard():
    ext = DTensorExtensions()
    full = torch.arange(35.0).reshape(7, 5)
    for j, (off, n) in enumerate([(0, 4), (4, 3)]):
        lay = Layout((7, 5), (2,), ("tp",), (Shard(0),), (j,))
        shard = LocalShard(full[off:off + n].clone(), lay)
        local, boxes = ext.pre_load_state_dict_transform(shard)
        assert local is shard.tensor
        assert boxes == [Box((off, 0), (n, 5))]
        assert torch.equal(full[boxes[0].slices()], local)
    # 2D: FSDP chunk of a TP shard; a rank whose chunk is empty reports no box
    tp_layout = Layout((3, 4), (2,), ("tp",), (Shard(0),), (1,))  # row 2
    for dp_rank, expected in [(0, [Box((2, 0), (1, 4))]), (1, [])]:
        lay = fsdp_layout((3, 4), tp_layout, (2,), ("dp",), (dp_rank,))
        local, boxes = ext.pre_load_state_dict_transform(LocalShard(full[:3, :4][lay.box.slices()], lay))
        assert boxes == expected and tuple(local.shape) == ((1, 4) if expected else (0, 4))
    # a plain tensor is one box at the origin
    t = torch.ones(2, 3)
    local, boxes = ext.pre_load_state_dict_transform(t)
    assert local is t and boxes == [Box((0, 0), (2, 3))]


def test_flatten_unflatten_round_trips_local_shard_and_plain_tensor():
    ext = DTensorExtensions()
    lay = Layout((7, 5), (2,), ("tp",), (Shard(1),), (1,))  # columns 3..4
    shard = LocalShard(torch.randn(7, 2), lay)
    local, extension = ext.pre_flatten_transform(shard)
    assert local is shard.tensor and extension is not None
    new = torch.randn(7, 2)
    back = ext.post_unflatten_transform(new, extension)
    assert isinstance(back, LocalShard) and back.tensor is new and back.layout == lay
    t = torch.randn(3)
    local, extension = ext.pre_flatten_transform(t)
    assert local is t and extension is None
    assert ext.post_unflatten_transform(t, extension) is t


# ---------------------------------------------------------------------------------------
# to_dtensor's torch placements, simulated with torch's own split functions
# ---------------------------------------------------------------------------------------
def torch_local(full, placements, mesh_shape, coord):
    """What torch's DTensor puts on ``coord``: its placements split left to right in mesh
    order (as ``distribute_tensor`` does), each with the placement's own ``_split_tensor``."""
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    x = full
    for p, k, c in zip(placements, mesh_shape, coord):
        if isinstance(p, (TShard, _StridedShard)):
            x = p._split_tensor(x, k, with_padding=False)[0][c]
    return x


@settings(max_examples=80, deadline=None)
@given(case=bridge_cases())
@with_corners()
@example(case=((8, 3), Shard(0), 2, True, (2, 2)))  # even: _StridedShard on the shard axis
def test_to_dtensor_placements_match_torch_or_raise(case):
    """``to_dtensor`` maps a layout to torch placements whose data layout is the same on
    every rank, or raises NotImplementedError exactly when torch's _StridedShard (the only
    way torch spells a TP-major split of one dim) puts different rows on some rank."""
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    shape, tp_placement, tp, hsdp, sizes = case
    full = torch.arange(float(math.prod(shape))).reshape(shape)
    fshape, _ = fsdp_mesh(hsdp, sizes)
    base_layout = next(layouts_of(case))[3]
    mesh_shape = base_layout.mesh_shape
    # what the seed (torch/distributed/tensor/parallel/fsdp.py + FSDP2) would use for
    # TP-major on dim 0: _StridedShard(0, split_factor=tp) on the FSDP shard axis
    strided = isinstance(tp_placement, Shard) and tp_placement.dim == 0
    exact = True
    if strided:
        cand = [TReplicate()] * (len(fshape) - 1) + [_StridedShard(0, split_factor=tp), TShard(0)]
        exact = all(torch.equal(torch_local(full, cand, mesh_shape, lay.coordinate), lay.shard(full))
                    for *_, lay in layouts_of(case))
    for *_, lay in layouts_of(case):
        mesh = FakeMesh(lay.mesh_shape, lay.axis_names, lay.coordinate)
        if not exact:
            with pytest.raises(NotImplementedError, match="_StridedShard"):
                _torch_placements(lay)
            with pytest.raises(NotImplementedError, match="_StridedShard"):
                to_dtensor(lay.shard(full), lay, mesh)
            continue
        placements = _torch_placements(lay)
        assert any(isinstance(p, _StridedShard) for p in placements) == strided
        assert torch.equal(torch_local(full, placements, lay.mesh_shape, lay.coordinate), lay.shard(full))


def test_to_dtensor_raises_for_inexpressible_uneven_tp_major():
    """7 rows, TP=2 then FSDP=3: TP-major gives (dp=2, tp=1) row 6; _StridedShard would put
    row 6 on (dp=2, tp=0). Not expressible: NotImplementedError, never a wrong DTensor."""
    tp_layout = Layout((7, 3), (2,), ("tp",), (Shard(0),), (1,))
    lay = fsdp_layout((7, 3), tp_layout, (3,), ("dp",), (2,))
    assert lay.box == Box((6, 0), (1, 3))
    with pytest.raises(NotImplementedError, match="uneven"):
        to_dtensor(torch.zeros(1, 3), lay, FakeMesh((3, 2), ("dp", "tp"), (2, 1)))
    # the even case of the same shape of mesh is fine
    tp_layout = Layout((12, 3), (2,), ("tp",), (Shard(0),), (1,))
    lay = fsdp_layout((12, 3), tp_layout, (3,), ("dp",), (2,))
    assert [type(p).__name__ for p in _torch_placements(lay)] == ["_StridedShard", "Shard"]


def test_to_dtensor_rejects_mesh_that_does_not_match_layout():
    lay = Layout((8, 4), (2, 2), ("dp", "tp"), (Shard(0), Shard(1)), (0, 1))
    with pytest.raises(ValueError, match="axes"):
        to_dtensor(torch.zeros(4, 2), lay, FakeMesh((2, 2), ("tp", "dp"), (0, 1)))
    with pytest.raises(ValueError, match="shape"):
        to_dtensor(torch.zeros(4, 2), lay, FakeMesh((1, 4), ("dp", "tp"), (0, 1)))
    with pytest.raises(ValueError, match="coordinate"):
        to_dtensor(torch.zeros(4, 2), lay, FakeMesh((2, 2), ("dp", "tp"), (1, 1)))
