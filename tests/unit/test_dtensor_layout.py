"""fsdp2d's 2D boxes are exactly what torch's DTensor placements say, even and uneven.

Parameters at rest are DTensors on the ``(tp, [replicate,] shard)`` torch mesh with one
plain placement per axis (``fsdp2d._dtensor``). torch computes a rank's box from those
placements left to right (``_compute_local_shape_and_global_offset``, what DCP,
``full_tensor`` and ``distribute_tensor`` use); fsdp2d computes it TP-major in its
``Layout``. Exhaustively over small sizes, both agree on every rank: no layout exists
that torch would misread. (torch's own FSDP2 + TP encodes the same split with
``_StridedShard`` on a ``(dp, tp)`` mesh, whose uneven boxes differ: shown at the end.)
"""

from __future__ import annotations

import itertools

from torch.distributed.tensor import Replicate as TReplicate, Shard as TShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp2d.bridge._layout import fsdp_layout
from fsdp2d.placement import Layout, Replicate, Shard


def _torch_box(layout: Layout, coordinate) -> tuple:
    placements = list(layout.placements)  # fsdp2d's placements are torch's
    shape, offset = _compute_local_shape_and_global_offset(layout.global_shape, layout.mesh_shape,
                                                           list(coordinate), placements)
    return tuple(offset), tuple(shape)


def _same_box(layout: Layout, torch_box: tuple) -> bool:
    offset, shape = torch_box
    ours = layout.box
    if 0 in ours.local_shape:  # empty boxes: only the (empty) size matters
        return 0 in shape and shape == ours.local_shape
    return (offset, shape) == (ours.global_offset, ours.local_shape)


def _param_layouts(global_shape, tp_placement, tp, fsdp_shape, fsdp_names):
    """Every rank's layout of a parameter as fully_shard builds it: TP first, then FSDP."""
    for tp_rank in range(tp):
        tp_layout = Layout(global_shape, (tp,), ("tp",), (tp_placement,), (tp_rank,))
        for coord in itertools.product(*(range(s) for s in fsdp_shape)):
            lay = fsdp_layout(global_shape, tp_layout, fsdp_shape, fsdp_names, coord)
            yield lay.reorder(("tp", *fsdp_names))


def test_torch_reads_every_2d_box_exactly():
    checked = 0
    for rows, tp, dp in itertools.product(range(0, 23), (1, 2, 3, 4), (1, 2, 3, 5, 8)):
        for tp_placement in (Shard(0), Shard(1), Replicate()):
            for lay in _param_layouts((rows, 3), tp_placement, tp, (dp,), ("dp",)):
                assert _same_box(lay, _torch_box(lay, lay.coordinate)), (rows, tp, dp, tp_placement, lay)
                checked += 1
    assert checked > 1000


def test_torch_reads_every_hsdp_box_exactly():
    for rows, tp, rep, shard in itertools.product(range(0, 15), (1, 2, 3), (1, 2), (1, 3, 4)):
        for lay in _param_layouts((rows, 2), Shard(0), tp, (rep, shard), ("replicate", "shard")):
            assert _same_box(lay, _torch_box(lay, lay.coordinate)), (rows, tp, rep, shard, lay)


def test_strided_shard_on_a_dp_tp_mesh_misreads_uneven_boxes():
    """Why fsdp2d does not use torch FSDP2's encoding: 9 rows, tp=2, dp=4, the rank at
    (dp=3, tp=0) holds no row (TP rank 0 has rows 0-4, split 2,2,1,0), but
    ``[_StridedShard(0, split_factor=2), Shard(0)]`` on (dp, tp) gives it one."""
    placements = [_StridedShard(0, split_factor=2), TShard(0)]
    shape, _ = _compute_local_shape_and_global_offset((9, 3), (4, 2), [3, 0], placements)
    ours = fsdp_layout((9, 3), Layout((9, 3), (2,), ("tp",), (Shard(0),), (0,)), (4,), ("dp",), (3,))
    assert ours.local_shape == (0, 3) and shape[0] == 1
    assert Replicate is TReplicate  # one vocabulary: fsdp2d.Replicate is torch's
