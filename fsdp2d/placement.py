"""Placements and the frozen ``Layout`` of a sharded tensor: pure index math.

A tensor spread over a device mesh is described per mesh *axis* by one of torch's
placements (``torch.distributed.tensor``; ``fsdp2d.Shard`` *is* torch's ``Shard``):
``Shard(dim)`` splits tensor *dim* across the axis, ``Replicate()`` keeps a full copy on
every rank of the axis, ``Partial()`` holds a summand of the true value. A ``Layout``
adds the global shape, the mesh shape and the coordinate of one rank, and answers
which box of the global tensor that rank holds (``global_offset``, ``local_shape``).

Uneven sizes follow ``torch.chunk``: a dim of size ``n`` split ``k`` ways gives chunks of
``ceil(n / k)``; trailing ranks get smaller or empty chunks. When several axes shard the
same dim, they split in ``split_order`` (default: mesh-axis order), each one splitting
the piece left by the previous: fsdp2d's 2D layouts are TP-major (TP splits the global
tensor, FSDP splits the TP shard), so every box is one contiguous hyper-rectangle.

Nothing here touches a process group: these functions are the single source of truth
for layouts, shared by tensor parallelism, FSDP, the bridge and checkpoints.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
# torch's own placement classes (DESIGN item 2): fsdp2d has no look-alikes, so a
# placement built by torch, torchtitan or a user's script is the same object here.
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["Placement", "Shard", "Replicate", "Partial", "Layout", "chunk_range", "Box", "check_placement"]


def check_placement(p: object, where: str = "placement") -> Placement:
    """``p`` if it is one of the placements a :class:`Layout` describes exactly:
    ``Shard(dim)``, ``Replicate()`` or ``Partial("sum")``. Anything else raises naming
    it: torch's ``_StridedShard`` (an interleaved split; a Layout's split order says the
    same thing, see ``fsdp2d.bridge.from_dtensor``), a ``Partial`` that averages or takes
    a max (its summands are not a sum), ``_MaskPartial`` (vocab-parallel embedding
    internals), or a non-placement."""
    if type(p) in (Shard, Replicate):
        return p  # type: ignore[return-value]
    if type(p) is Partial and p.reduce_op == "sum":
        return p  # type: ignore[return-value]
    if isinstance(p, Partial):
        raise ValueError(f"{where} {p!r}: only Partial('sum') describes a sum of summands fsdp2d can reduce; "
                         f"redistribute to Replicate() first")
    raise TypeError(f"{where} {p!r} is not Shard(dim), Replicate() or Partial(): torch's "
                    f"torch.distributed.tensor placements are expected (fsdp2d.Shard is torch's Shard)")


def chunk_range(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``(offset, length)`` of chunk ``index`` when ``size`` is split ``num_chunks`` ways.

    Matches ``torch.chunk``: chunks of ``ceil(size / num_chunks)``, the last non-empty one
    may be shorter, and chunks past the end are empty (offset clamped to ``size``).
    """
    if num_chunks < 1 or not 0 <= index < num_chunks:
        raise ValueError(f"chunk index {index} out of range for {num_chunks} chunks")
    step = -(-size // num_chunks) if size else 0
    start = min(index * step, size)
    return start, min(step, size - start)


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle of a global tensor: where a local shard sits."""

    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.global_offset, self.local_shape))

    def numel(self) -> int:
        return math.prod(self.local_shape)

    def intersect(self, other: "Box") -> "Box | None":
        """The overlap of two boxes, or None when they do not overlap (or it is empty)."""
        lo = tuple(max(a, b) for a, b in zip(self.global_offset, other.global_offset))
        hi = tuple(
            min(a + n, b + m)
            for a, n, b, m in zip(
                self.global_offset, self.local_shape, other.global_offset, other.local_shape
            )
        )
        if any(h <= l for l, h in zip(lo, hi)) and lo:
            return None
        return Box(lo, tuple(h - l for l, h in zip(lo, hi)))


@dataclass(frozen=True)
class Layout:
    """Where one rank's local shard sits in a tensor spread over a mesh.

    Fields:
        global_shape: shape of the whole (logical) tensor.
        mesh_shape: size of each mesh axis.
        axis_names: name of each mesh axis (``("dp", "tp")``).
        placements: one placement per mesh axis.
        coordinate: this rank's index along each mesh axis.
        split_order: mesh axes in the order their ``Shard`` placements split; the first
            splits the global tensor, each later one splits the piece left before it.
            Default (None): mesh-axis order.

    Example::

        >>> lay = Layout((10, 6), (2, 2), ("dp", "tp"), (Shard(0), Shard(1)), (1, 0))
        >>> lay.global_offset, lay.local_shape
        ((5, 0), (5, 3))
    """

    global_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    placements: tuple[Placement, ...]
    coordinate: tuple[int, ...]
    split_order: tuple[int, ...] | None = None
    _box: Box = field(init=False, repr=False, compare=False)
    _pieces: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("global_shape", tuple(int(s) for s in self.global_shape))
        set_("mesh_shape", tuple(int(s) for s in self.mesh_shape))
        set_("axis_names", tuple(self.axis_names))
        set_("coordinate", tuple(int(c) for c in self.coordinate))
        set_("placements", tuple(self._normalise(p) for p in self.placements))
        n = len(self.mesh_shape)
        if not len(self.axis_names) == len(self.placements) == len(self.coordinate) == n:
            raise ValueError(
                f"Layout needs one axis name, placement and coordinate per mesh axis "
                f"(mesh_shape={self.mesh_shape}, axis_names={self.axis_names}, "
                f"placements={self.placements}, coordinate={self.coordinate})"
            )
        for axis, (c, s) in enumerate(zip(self.coordinate, self.mesh_shape)):
            if not 0 <= c < s:
                raise ValueError(f"coordinate {c} outside mesh axis {self.axis_names[axis]!r} of size {s}")
        order = tuple(range(n)) if self.split_order is None else tuple(self.split_order)
        if sorted(order) != list(range(n)):
            raise ValueError(f"split_order {order} must be a permutation of the mesh axes 0..{n - 1}")
        set_("split_order", order)
        box, pieces = self._split()
        set_("_box", box)
        set_("_pieces", pieces)

    def _normalise(self, p: Placement) -> Placement:
        p = check_placement(p)
        if isinstance(p, Shard):
            ndim = len(self.global_shape)
            if not -ndim <= p.dim < ndim:
                raise ValueError(f"Shard({p.dim}) is out of range for a tensor of shape {self.global_shape}")
            return Shard(p.dim % ndim)
        return p

    def _split(self) -> tuple[Box, tuple[tuple[int, ...], ...]]:
        """Apply the splits in ``split_order``: this rank's box, and for every mesh axis
        the shape of the piece that axis's split divides."""
        offset = [0] * len(self.global_shape)
        shape = list(self.global_shape)
        pieces: list[tuple[int, ...]] = [()] * len(self.mesh_shape)
        for axis in self.split_order:
            pieces[axis] = tuple(shape)
            p = self.placements[axis]
            if isinstance(p, Shard):
                start, length = chunk_range(shape[p.dim], self.mesh_shape[axis], self.coordinate[axis])
                offset[p.dim] += start
                shape[p.dim] = length
        return Box(tuple(offset), tuple(shape)), tuple(pieces)

    # -- the box of this rank ------------------------------------------------------
    @property
    def box(self) -> Box:
        return self._box

    @property
    def global_offset(self) -> tuple[int, ...]:
        return self._box.global_offset

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self._box.local_shape

    def piece_before(self, axis: int) -> tuple[int, ...]:
        """Shape of the piece that mesh axis ``axis`` splits (the global shape for the
        first axis in ``split_order``; gathering over ``axis`` restores this shape)."""
        return self._pieces[axis]

    def splits_like(self, other: "Layout") -> bool:
        """Whether ``other`` puts every rank's box where this layout does: equal but for
        ``split_order`` outside what matters (the order of the axes that shard the same
        tensor dim). A DTensor torch made (``zeros_like`` of a parameter) states its split
        in mesh order, fsdp2d's own may list a ``Replicate`` axis elsewhere."""
        return (self.global_shape, self.mesh_shape, self.axis_names, self.placements, self.coordinate) == \
            (other.global_shape, other.mesh_shape, other.axis_names, other.placements, other.coordinate) and \
            self._dim_orders() == other._dim_orders()

    def _dim_orders(self) -> dict[int, list[int]]:
        """For each sharded tensor dim, the mesh axes that split it, in split order."""
        out: dict[int, list[int]] = {}
        for axis in self.split_order:
            p = self.placements[axis]
            if isinstance(p, Shard) and self.mesh_shape[axis] > 1:
                out.setdefault(p.dim, []).append(axis)
        return out

    # -- other ranks -----------------------------------------------------------------
    def at(self, coordinate: Sequence[int]) -> "Layout":
        """The same layout seen from another mesh coordinate."""
        return Layout(self.global_shape, self.mesh_shape, self.axis_names, self.placements,
                      tuple(coordinate), self.split_order)

    def reorder(self, axis_names: Sequence[str]) -> "Layout":
        """The same boxes described over the mesh axes in another order (every axis named
        once); the split order follows the axes, so each rank's box is unchanged."""
        if sorted(axis_names) != sorted(self.axis_names):
            raise ValueError(f"reorder: {tuple(axis_names)} is not a permutation of {self.axis_names}")
        perm = [self.axis(n) for n in axis_names]  # new axis i is old axis perm[i]
        new_index = {old: new for new, old in enumerate(perm)}
        return Layout(self.global_shape, tuple(self.mesh_shape[i] for i in perm), tuple(axis_names),
                      tuple(self.placements[i] for i in perm), tuple(self.coordinate[i] for i in perm),
                      tuple(new_index[a] for a in self.split_order))

    def coordinates(self) -> Iterator[tuple[int, ...]]:
        """Every coordinate of the mesh, in row-major (rank) order."""
        return itertools.product(*(range(s) for s in self.mesh_shape))

    def is_replica_owner(self) -> bool:
        """True on exactly one rank per distinct non-empty box: the one with coordinate 0
        on every axis that does not shard (Replicate or Partial). Used to write a box
        once. (Empty boxes can have several owners; they hold nothing to write.)"""
        return all(c == 0 for c, p in zip(self.coordinate, self.placements) if not isinstance(p, Shard))

    def owners_intersecting(self, target: Box) -> Iterator[tuple[tuple[int, ...], Box]]:
        """``(coordinate, box)`` of every replica owner (see :meth:`is_replica_owner`)
        whose non-empty box overlaps ``target``: the boxes a reader of ``target`` needs
        from a tensor written with this layout, each once. The work grows with the number
        of boxes yielded, not with the mesh: each ``Shard`` split, in ``split_order``,
        keeps only the range of chunks that meets ``target``. Equal to filtering
        :meth:`coordinates` through :meth:`at` (the unit tests check it), so the box of
        any coordinate yielded is ``self.at(coordinate).box``."""
        if target.numel() == 0:
            return
        # each partial split: (coordinate, offset, shape); non-Shard axes stay at 0 (owner)
        states: list[tuple[list[int], list[int], list[int]]] = [
            ([0] * len(self.mesh_shape), [0] * len(self.global_shape), list(self.global_shape))]
        for axis in self.split_order:
            p = self.placements[axis]
            if isinstance(p, Shard):
                states = [s for state in states for s in self._chunks_meeting(state, axis, p.dim, target)]
        for coord, offset, shape in states:
            box = Box(tuple(offset), tuple(shape))
            inter = box.intersect(target)
            if box.numel() and inter is not None and inter.numel():
                yield tuple(coord), box

    def _chunks_meeting(self, state: tuple, axis: int, dim: int, target: Box) -> Iterator[tuple]:
        """The chunks of ``state``'s piece, split along ``dim`` over mesh ``axis``
        (``chunk_range``), whose rows along ``dim`` overlap ``target``'s."""
        coord, offset, shape = state
        size, k = shape[dim], self.mesh_shape[axis]
        step = -(-size // k) if size else 0
        lo = max(target.global_offset[dim] - offset[dim], 0)
        hi = min(target.global_offset[dim] + target.local_shape[dim] - offset[dim], size)
        if step == 0 or lo >= hi:
            return
        for i in range(lo // step, (hi - 1) // step + 1):  # (hi - 1) // step < k since hi <= size
            start, length = chunk_range(size, k, i)
            c, o, s = list(coord), list(offset), list(shape)
            c[axis], o[dim], s[dim] = i, offset[dim] + start, length
            yield c, o, s

    def axis(self, name: str) -> int:
        try:
            return self.axis_names.index(name)
        except ValueError:
            raise KeyError(f"mesh axis {name!r} not in layout axes {self.axis_names}") from None

    # -- data ------------------------------------------------------------------------
    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``full`` (a view; ``Partial`` axes keep the full value
        on coordinate 0 and zeros elsewhere, so the sum over the axis is ``full``)."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(f"tensor of shape {tuple(full.shape)} does not match layout global shape {self.global_shape}")
        local = full[self._box.slices()]
        if any(p.is_partial() and c != 0 for p, c in zip(self.placements, self.coordinate)):
            local = torch.zeros_like(local)
        return local
