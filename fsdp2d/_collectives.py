"""Raw collectives along a tensor dim, shared by tensor parallelism and FSDP.

Every function takes an explicit process group and is a no-op (returns its input, or
the obvious local result) when the group has one rank, so world size 1 runs the same
code path. Sizes along the split dim follow ``torch.chunk`` semantics; when the global
size is given, uneven chunks are padded to equal size for the collective and trimmed
after, so callers never see the padding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .placement import chunk_range

Group = dist.ProcessGroup


def group_size(group: Group | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def chunk_sizes(global_size: int, num_chunks: int) -> list[int]:
    return [chunk_range(global_size, num_chunks, i)[1] for i in range(num_chunks)]


def all_reduce(x: torch.Tensor, group: Group, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or ``op``) of ``x`` over the group, in place on a contiguous copy if needed."""
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, op=op, group=group)
    return x


def split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's ``torch.chunk`` piece of ``x`` along ``dim`` (no communication)."""
    k = group_size(group)
    if k == 1:
        return x
    start, length = chunk_range(x.shape[dim], k, group_rank(group))
    return x.narrow(dim, start, length).contiguous()


def all_gather(x: torch.Tensor, dim: int, group: Group, global_size: int | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``.

    Without ``global_size`` all pieces must have the same size (checked by gloo/NCCL).
    With it, pieces are the ``torch.chunk`` sizes of ``global_size`` (trailing ones may
    be smaller or empty). Gathers into a stacked (k, *x.shape) buffer: along dim 0 the
    result is a free view, along any other dim one concatenating copy.
    """
    k = group_size(group)
    if k == 1:
        return x
    dim = dim % x.ndim
    local = x.shape[dim]
    sizes = [local] * k if global_size is None else chunk_sizes(global_size, k)
    step = max(sizes)
    if local < step:  # pad uneven pieces to the common size
        pad = list(x.shape)
        pad[dim] = step - local
        x = torch.cat([x, x.new_zeros(pad)], dim)
    x = x.contiguous()
    out = x.new_empty((k, *x.shape))
    dist.all_gather_single(out.view(-1), x.view(-1), group=group)
    if dim == 0 and all(s == step for s in sizes):
        return out.view(k * step, *x.shape[1:])
    return torch.cat([out[i].narrow(dim, 0, s) for i, s in enumerate(sizes)], dim)


def reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum over the group, then keep this rank's ``torch.chunk`` piece along ``dim``."""
    k = group_size(group)
    if k == 1:
        return x
    dim = dim % x.ndim
    size = x.shape[dim]
    sizes = chunk_sizes(size, k)
    step = max(sizes) if sizes else 0
    if dim == 0 and step * k == size:
        inp = x.contiguous()
    else:  # stack the (padded) chunks: one copy, whatever the dim
        pieces = []
        for i, s in enumerate(sizes):
            piece = x.narrow(dim, i * step, s) if s else x.narrow(dim, 0, 0)
            if s < step:
                pad = list(x.shape)
                pad[dim] = step - s
                piece = torch.cat([piece, x.new_zeros(pad)], dim)
            pieces.append(piece)
        inp = torch.stack(pieces)
    out_shape = list(x.shape)
    out_shape[dim] = step
    out = x.new_empty(out_shape)
    dist.reduce_scatter_single(out.view(-1), inp.reshape(-1), group=group)
    mine = sizes[group_rank(group)]
    return out if mine == step else out.narrow(dim, 0, mine).contiguous()


def broadcast(x: torch.Tensor, group: Group, src_group_rank: int = 0) -> torch.Tensor:
    """Overwrite ``x`` on every rank with the value held by group rank ``src_group_rank``."""
    if group_size(group) == 1 or x.device.type == "meta":
        return x
    src = dist.get_global_rank(group, src_group_rank)
    buf = x.detach().contiguous()
    dist.broadcast(buf, src=src, group=group)
    return buf
