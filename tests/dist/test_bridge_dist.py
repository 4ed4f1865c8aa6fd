"""fsdp2d.bridge on 4 gloo ranks: DTensorExtensions chunk / gather, DTensor round trips,
``to_dtensor`` / ``from_dtensor``.

One pool run per mesh does every case and returns plain data (tensors, layouts, boxes);
the driver checks them against ``torch.chunk`` of the same seeded full tensor (TP-major:
TP chunks the global tensor, FSDP chunks dim 0 of the TP shard), never against the
functions under test.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fsdp2d.placement import Box, Layout, Replicate, Shard

from .pool import get_mesh

MESHES = [((2, 2), ("dp", "tp")), ((1, 4), ("dp", "tp")), ((4, 1), ("dp", "tp")),
          ((2, 1, 2), ("replicate", "shard", "tp"))]
FIXED_SHAPES = [(7, 5), (9,), (3, 6), (0, 4), (8, 4), (1,), (2, 7), (5, 3, 2), (4, 0)]


def _shapes():
    """The fixed shapes plus a few seeded random ones (uneven and zero-size included)."""
    rng = random.Random(1234)
    extra = [tuple(rng.randint(0, 11) for _ in range(rng.randint(1, 3))) for _ in range(5)]
    return FIXED_SHAPES + extra


def _placements(shape):
    """TP placements to try: None (not TP-sharded), Shard(0), Shard(1) when ndim >= 2, Replicate."""
    return [None, Shard(0), Replicate()] + ([Shard(1)] if len(shape) >= 2 else [])


def _full(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


# ---------------------------------------------------------------------------------------
# independent references (driver side)
# ---------------------------------------------------------------------------------------
def nth_chunk(x, k, i, dim=0):
    pieces = torch.chunk(x, k, dim)
    return pieces[i] if i < len(pieces) else x.narrow(dim, 0, 0)


def tp_piece(full, placement, tp, tp_rank):
    return nth_chunk(full, tp, tp_rank, placement.dim) if isinstance(placement, Shard) else full


def tp_box(shape, placement, tp, tp_rank):
    """(offset, shape) of the TP shard, from torch.chunk of index ranges."""
    idx = [torch.arange(s) for s in shape]
    if isinstance(placement, Shard):
        idx[placement.dim] = nth_chunk(idx[placement.dim], tp, tp_rank)
    return Box(tuple(int(i[0]) if len(i) else None for i in idx), tuple(len(i) for i in idx))


def same_box(box, ref):
    """Boxes agree: same shape, same offset on every dim where the box is not empty."""
    return box.local_shape == ref.local_shape and all(
        o == r for o, r, n in zip(box.global_offset, ref.global_offset, ref.local_shape) if n)


def coords(rank, shape):
    return tuple(int(c) for c in np.unravel_index(rank, shape))


def _equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


# ---------------------------------------------------------------------------------------
# 1. chunk_dtensor / all_gather_dtensor / all_gather / gather_full, from LocalShard and DTensor
# ---------------------------------------------------------------------------------------
def _extension_job(shape, names, cases):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    from fsdp2d.bridge import DTensorExtensions, LocalShard, gather_full

    mesh = get_mesh(shape, names)
    tp_mesh = mesh["tp"]
    tp, tp_rank = tp_mesh.size(), tp_mesh.get_local_rank()
    torch_tp = tp_mesh  # fsdp2d meshes are torch's
    ext = DTensorExtensions()
    out = []
    for seed, (gshape, placement) in enumerate(cases):
        full = _full(gshape, seed)
        rec = {}
        if placement is None:
            src = full.clone()
        else:
            tp_layout = Layout(gshape, (tp,), ("tp",), (placement,), (tp_rank,))
            src = LocalShard(tp_layout.shard(full).clone(), tp_layout)
        chunked = ext.chunk_dtensor(src, dist.get_rank(), mesh)
        back = ext.all_gather_dtensor(chunked, mesh)
        rec["chunked"] = (chunked.tensor, chunked.layout)
        rec["back"] = (type(back).__name__, back.tensor, back.layout)
        rec["all_gather"] = ext.all_gather(chunked, mesh)
        rec["gather_full"] = gather_full(chunked.tensor, chunked.layout, mesh)
        rec["pre_load"] = ext.pre_load_state_dict_transform(chunked)[1]
        if placement is not None:  # the same from a torch DTensor on the 1-D TP mesh
            dt = distribute_tensor(full, torch_tp, [placement])
            local, extension = ext.pre_flatten_transform(dt)
            again = ext.post_unflatten_transform(local.clone(), extension)
            rec["dt_flat"] = (local, dt.to_local())
            rec["dt_again"] = (type(again) is DTensor, tuple(again.placements) == tuple(dt.placements),
                               again.device_mesh == dt.device_mesh, tuple(again.shape), again.stride(),
                               dt.stride(), again.full_tensor(), again.to_local())
            rec["dt_pre_load"] = ext.pre_load_state_dict_transform(dt)[1]
            chunked = ext.chunk_dtensor(dt, dist.get_rank(), mesh)
            back = ext.all_gather_dtensor(chunked, mesh)
            rec["dt_chunked"] = (chunked.tensor, chunked.layout)
            rec["dt_back"] = (back.tensor, back.layout)
            rec["dt_all_gather"] = ext.all_gather(chunked, mesh)
        out.append(rec)
    return out


def _extension_cases():
    return [(s, p) for s in _shapes() for p in _placements(s)]


@pytest.mark.parametrize("shape,names", MESHES, ids=lambda v: "x".join(map(str, v)) if
                         isinstance(v[0], int) else "-".join(v))
def test_chunk_and_gather(pool, shape, names):
    cases = _extension_cases()
    results = pool.run(_extension_job, shape, names, cases)
    fnames = names[:-1]
    tp = shape[-1]
    for rank, recs in enumerate(results):
        coord = coords(rank, shape)
        dp, dp_rank, tp_rank = shape[-2], coord[-2], coord[-1]
        for seed, ((gshape, placement), rec) in enumerate(zip(cases, recs)):
            where = (rank, gshape, placement)
            full = _full(gshape, seed)
            p = Replicate() if placement is None else placement
            tp_shard = tp_piece(full, p, tp, tp_rank)
            expected = nth_chunk(tp_shard, dp, dp_rank)  # TP-major: dim-0 chunk of the TP shard
            tbox = tp_box(gshape, p, tp, tp_rank)
            sub = nth_chunk(torch.arange(tbox.local_shape[0]), dp, dp_rank)
            ebox = Box((tbox.global_offset[0] + int(sub[0]) if len(sub) else None,) + tbox.global_offset[1:],
                       (len(sub),) + tbox.local_shape[1:])
            tp_layout = Layout(gshape, (tp,), ("tp",), (p,), (tp_rank,))
            sources = [("", rec["chunked"], rec["back"][1:])]
            if placement is not None:
                sources.append(("dt_", rec["dt_chunked"], rec["dt_back"]))
            for tag, (tensor, layout), (back_tensor, back_layout) in sources:
                assert _equal(tensor, expected), (tag, where)
                assert same_box(layout.box, ebox), (tag, where, layout.box, ebox)
                assert _equal(full[layout.box.slices()], tensor), (tag, where)
                assert layout.coordinate[:len(fnames)] == coord[:-1], (tag, where)
                if placement is None:
                    assert layout.axis_names == fnames, (tag, where)  # replicated over TP
                else:
                    assert layout.axis_names == names and layout.placements[-1] == placement, (tag, where)
                # all_gather_dtensor: the TP shard and its TP-only layout again
                assert _equal(back_tensor, tp_shard), (tag, where)
                assert back_layout == tp_layout, (tag, where, back_layout)
                assert _equal(rec[tag + "all_gather"], full), (tag, where)
            assert rec["back"][0] == "LocalShard", where
            assert _equal(rec["gather_full"], full), where
            assert rec["pre_load"] == ([rec["chunked"][1].box] if expected.numel() else []), where
            assert all(same_box(b, ebox) for b in rec["pre_load"]), where
            if placement is not None:
                local, dt_local = rec["dt_flat"]
                assert _equal(local, tp_shard) and _equal(dt_local, tp_shard), where
                is_dt, same_placements, same_mesh, gshape2, stride, dt_stride, again_full, again_local = rec["dt_again"]
                assert is_dt and same_placements and same_mesh, where
                assert gshape2 == gshape and stride == dt_stride, where
                assert _equal(again_full, full) and _equal(again_local, tp_shard), where
                boxes = rec["dt_pre_load"]
                assert len(boxes) == (1 if tp_shard.numel() else 0), where
                assert all(same_box(b, tbox) for b in boxes), (where, boxes, tbox)


# ---------------------------------------------------------------------------------------
# 2. to_dtensor -> full_tensor / from_dtensor, TP-only, FSDP-only and 2D TP-major layouts
# ---------------------------------------------------------------------------------------
def _dtensor_job(shape, names, cases):
    from torch.distributed.tensor import distribute_tensor

    from fsdp2d.bridge import from_dtensor, fsdp_layout, to_dtensor

    mesh = get_mesh(shape, names)
    fnames = names[:-1]
    out = []
    for seed, (kind, gshape, placement) in enumerate(cases):
        full = _full(gshape, seed)
        tp_mesh = mesh["tp"]
        tp_layout = Layout(gshape, (tp_mesh.size(),), ("tp",), (placement,), (tp_mesh.get_coordinate()[0],))
        if kind == "tp":
            sub, layout = tp_mesh, tp_layout
        elif kind == "fsdp":
            sub = mesh[fnames]
            layout = fsdp_layout(gshape, None, sub.shape, fnames, sub.get_coordinate())
        elif kind == "2d":
            sub = mesh
            layout = fsdp_layout(gshape, tp_layout, shape[:-1], fnames, mesh.get_coordinate()[:-1])
        else:  # "mesh_order": FSDP splits first, then TP, same dim: plain torch Shards
            sub = mesh
            layout = Layout(gshape, shape, names, (Replicate(),) * (len(shape) - 2) + (Shard(0), placement),
                            mesh.get_coordinate())
        local = layout.shard(full).clone()
        dt = to_dtensor(local, layout, sub)
        rec = {"placements": [repr(p) for p in dt.placements], "full": dt.full_tensor(),
               "local": dt.to_local(), "shape": tuple(dt.shape), "layout": layout}
        # what torch itself puts on this rank for those placements (src_data_rank=None: split
        # locally; torch's scatter of a _StridedShard needs an evenly divisible dim)
        rec["torch_local"] = distribute_tensor(full, dt.device_mesh, dt.placements, src_data_rank=None).to_local()
        rec["from"] = from_dtensor(dt)
        out.append(rec)
    return out


def _dtensor_cases():
    cases = []
    for s in _shapes():
        for p in [Shard(0), Replicate()] + ([Shard(1)] if len(s) >= 2 else []):
            cases += [("tp", s, p), ("2d", s, p)]
        cases += [("fsdp", s, Replicate()), ("mesh_order", s, Shard(0))]
    return cases


@pytest.mark.parametrize("shape,names", MESHES, ids=lambda v: "x".join(map(str, v)) if
                         isinstance(v[0], int) else "-".join(v))
def test_to_dtensor_and_back(pool, shape, names):
    cases = _dtensor_cases()
    results = pool.run(_dtensor_job, shape, names, cases)
    tp = shape[-1]
    for rank, recs in enumerate(results):
        coord = coords(rank, shape)
        for seed, ((kind, gshape, placement), rec) in enumerate(zip(cases, recs)):
            where = (rank, kind, gshape, placement, rec["placements"])
            full = _full(gshape, seed)
            # independent expectation of this rank's piece
            if kind == "tp":
                expected = tp_piece(full, placement, tp, coord[-1])
            elif kind == "fsdp":
                expected = nth_chunk(full, shape[-2], coord[-2])
            elif kind == "2d":
                expected = nth_chunk(tp_piece(full, placement, tp, coord[-1]), shape[-2], coord[-2])
            else:  # FSDP first, then TP on dim 0 of the FSDP chunk
                expected = nth_chunk(nth_chunk(full, shape[-2], coord[-2]), tp, coord[-1])
            assert _equal(rec["local"], expected), where
            assert rec["shape"] == gshape, where
            assert _equal(rec["full"], full), where  # torch reassembles the global tensor
            assert _equal(rec["torch_local"], expected), where  # torch's own placement semantics
            if kind == "2d" and placement == Shard(0):
                assert rec["placements"][-2].startswith("_StridedShard"), where
            local, layout = rec["from"]
            assert _equal(local, expected), where
            assert layout.box == rec["layout"].box or (
                layout.local_shape == rec["layout"].local_shape and 0 in layout.local_shape), where
            assert layout.global_shape == gshape and layout.coordinate == rec["layout"].coordinate, where
            # and the recovered layout puts every rank's piece in the same place
            for c in rec["layout"].coordinates():
                a, b = layout.at(c).box, rec["layout"].at(c).box
                assert a.local_shape == b.local_shape, (where, c)
                if a.numel():
                    assert a.global_offset == b.global_offset, (where, c)
