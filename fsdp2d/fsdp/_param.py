"""Per-parameter FSDP state: where a parameter's shard lives in its group's flat buffer.

A parameter (already TP-local when tensor parallelism was applied) of shape
``(R, *rest)`` is chunked along dim 0 over the shard axis with ``torch.chunk`` semantics:
each rank owns ``chunk_range(R, k, rank)`` rows. In the group's flat buffer every rank
reserves ``padded_rows = ceil(R / k)`` rows for it, so the all-gather and the
reduce-scatter move equal-size segments; padding is zero and never visible.

``sharded`` is the ``nn.Parameter`` the optimizer sees: a view of this rank's rows in
the flat buffer. ``unsharded`` is a persistent ``nn.Parameter`` of the full (TP-local)
shape that the module computes with; its storage is freed (resized to 0) while
resharded and refilled by the all-gather, so autograd's saved references stay valid.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..bridge._layout import fsdp_layout
from ..placement import Layout, chunk_range
from ..tensor_parallel._params import TPParam


class FSDPParam:
    def __init__(self, module: nn.Module, name: str, fqn: str, tp: TPParam | None,
                 mesh_shape: tuple[int, ...], axis_names: tuple[str, ...], coordinate: tuple[int, ...]) -> None:
        param = module._parameters[name]
        assert param is not None
        if param.ndim == 0:
            raise ValueError(f"fully_shard: parameter {fqn!r} is a 0-dim scalar; FSDP shards dim 0, "
                             f"so give it shape (1,)")
        self.module, self.name, self.fqn, self.tp = module, name, fqn, tp
        self.sharded: nn.Parameter = param
        self.requires_grad = param.requires_grad
        self.unsharded_shape = tuple(param.shape)
        k, rank = mesh_shape[-1], coordinate[-1]
        self.num_shards = k
        rows = self.unsharded_shape[0]
        self.padded_rows = -(-rows // k)
        self.row_numel = math.prod(self.unsharded_shape[1:])
        self.segment_numel = self.padded_rows * self.row_numel  # per-rank slot in the flat buffer
        self.rank_rows = [chunk_range(rows, k, i) for i in range(k)]
        start, n = self.rank_rows[rank]
        self.shard_rows = (start, n)
        self.shard_shape = (n, *self.unsharded_shape[1:])
        global_shape = tp.layout.global_shape if tp is not None else self.unsharded_shape
        self.layout: Layout = fsdp_layout(global_shape, tp.layout if tp is not None else None,
                                          mesh_shape, axis_names, coordinate)
        self.offset = 0  # in the all-gather buffer; set by the group
        self.store_offset = 0  # in this parameter's dtype's flat storage
        self.axis_groups: dict = {}  # mesh axis name -> process group, for every layout axis
        self.unsharded: nn.Parameter | None = None
        self.acc_grad: torch.Tensor | None = None  # no-sync accumulation in reduce_dtype
        self.expected_ptr = 0  # data_ptr of the sharded view: a change means replaced storage

    @property
    def even(self) -> bool:
        return self.padded_rows * self.num_shards == self.unsharded_shape[0]

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor of the unsharded shape."""
        start, n = self.shard_rows
        return full[start:start + n]

    def make_unsharded(self, dtype: torch.dtype, device: torch.device) -> None:
        """(Re)create the persistent unsharded parameter, storage freed."""
        t = torch.empty(self.unsharded_shape, dtype=dtype, device=device)
        self.unsharded = nn.Parameter(t, requires_grad=self.requires_grad)
        self.free_unsharded()

    def alloc_unsharded(self) -> None:
        t = self.unsharded
        nbytes = t.numel() * t.element_size()
        if t.untyped_storage().size() != nbytes:
            t.untyped_storage().resize_(nbytes)

    def free_unsharded(self) -> None:
        if self.unsharded is not None and self.unsharded.device.type != "meta":
            self.unsharded.untyped_storage().resize_(0)

    def copy_in(self, gathered: torch.Tensor, dst: torch.Tensor | None = None, offset: int | None = None) -> None:
        """Fill ``dst`` (default: ``unsharded``) from the all-gathered flat buffer viewed
        (k, total), this parameter's segment starting at ``offset`` (default: its own)."""
        offset = self.offset if offset is None else offset
        seg = gathered[:, offset:offset + self.segment_numel]
        # .data: a fresh version counter, so refilling what autograd saved is not an in-place error
        dst = self.unsharded.data if dst is None else dst
        if self.even:
            dst.view(self.num_shards, -1).copy_(seg)
            return
        for i, (start, n) in enumerate(self.rank_rows):
            if n:
                dst[start:start + n].view(-1).copy_(seg[i, : n * self.row_numel])

    def copy_grad_out(self, grad: torch.Tensor, buf: torch.Tensor) -> None:
        """Write ``grad`` (unsharded shape) into the reduce-scatter input viewed (k, total)."""
        seg = buf[:, self.offset:self.offset + self.segment_numel]
        if self.even:
            seg.copy_(grad.reshape(self.num_shards, -1))
            return
        seg.zero_()
        for i, (start, n) in enumerate(self.rank_rows):
            if n:
                seg[i, : n * self.row_numel].copy_(grad[start:start + n].reshape(-1))

    def register(self, which: str) -> None:
        """Make the owning module hold the sharded or the unsharded parameter."""
        self.module._parameters[self.name] = self.unsharded if which == "unsharded" else self.sharded
