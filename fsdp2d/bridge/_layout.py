"""The 2D layout: FSDP's dim-0 chunking composed over a TP layout, TP-major.

TP splits the global tensor first (its placement on the TP axis); FSDP then chunks the
TP-local shard along dim 0 over its shard axis (and replicates over a ``replicate``
axis for HSDP). The result is one :class:`~fsdp2d.placement.Layout` over the axes
``(*fsdp_axes, tp_axis)`` whose ``split_order`` applies the TP axis first, so each
rank's box is one contiguous hyper-rectangle of the global tensor.
"""

from __future__ import annotations

from typing import Sequence

from ..placement import Layout, Placement, Replicate, Shard


def fsdp_layout(global_shape: Sequence[int], tp_layout: Layout | None, fsdp_mesh_shape: Sequence[int],
                fsdp_axis_names: Sequence[str], fsdp_coordinate: Sequence[int]) -> Layout:
    """The layout of one FSDP shard of a (possibly TP-sharded) parameter.

    Args:
        global_shape: the parameter's global shape (before any sharding).
        tp_layout: its TP layout (1-D, from ``parallelize_module``) or None.
        fsdp_mesh_shape / fsdp_axis_names / fsdp_coordinate: the FSDP mesh: one axis
            (``dp``: shard) or two (``replicate``, ``shard``: HSDP).

    Example: a (8, 4) weight, ``Shard(0)`` on tp=2, FSDP dp=2: the rank at (dp=1, tp=0)
    holds rows 2..3 (TP gives it rows 0..3, FSDP the second half of those).
    """
    if len(fsdp_mesh_shape) not in (1, 2):
        raise ValueError(f"an FSDP mesh has 1 axis (shard) or 2 (replicate, shard), got {tuple(fsdp_axis_names)}")
    fsdp_placements: list[Placement] = [Replicate()] * (len(fsdp_mesh_shape) - 1) + [Shard(0)]
    shape, names = tuple(fsdp_mesh_shape), tuple(fsdp_axis_names)
    placements, coord = tuple(fsdp_placements), tuple(fsdp_coordinate)
    n = len(shape)
    if tp_layout is None:
        return Layout(tuple(global_shape), shape, names, placements, coord)
    if tuple(tp_layout.global_shape) != tuple(global_shape):
        raise ValueError(f"TP layout global shape {tp_layout.global_shape} != parameter shape {tuple(global_shape)}")
    clash = set(names) & set(tp_layout.axis_names)
    if clash:
        raise ValueError(f"the FSDP mesh and the TP mesh share axis {sorted(clash)}; shard FSDP over the data axis")
    # TP axes split first (TP-major), then the FSDP shard axis, replicate last (no-op).
    order = tuple(range(n, n + len(tp_layout.mesh_shape))) + tuple(range(n - 1, -1, -1))
    return Layout(tuple(global_shape), shape + tp_layout.mesh_shape, names + tp_layout.axis_names,
                  placements + tp_layout.placements, coord + tp_layout.coordinate, order)
