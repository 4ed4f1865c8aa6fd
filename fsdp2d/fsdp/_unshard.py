"""The all-gather half of a ``fully_shard`` group (:class:`FSDPParamGroup` inherits it):
gathering the shards into the unsharded parameters, resharding, and keeping what the
unsharded copies show equal to the shards (staleness, edits while gathered). State it
reads is the group's: ``params``, ``k``, ``total``, ``flats``, ``flat_param``,
``param_dtype``, ``compute_device``, ``shard_group``, ``label``, ``counts``, ``_gather``,
``_gathered_versions``, ``_copied_versions``, ``unsharded``.

With CPU offload the shards are copied to the device and the all-gather is issued on
the side stream (``fsdp2d._streams``); the copy-out waits for the copy's event.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import _collectives as C
from .. import _streams, _trace
from .._dtensor import local_of
from ._param import FSDPParam

_OPTIMIZER_STEPS = [0]


def _count_step(optimizer, args, kwargs) -> None:
    _OPTIMIZER_STEPS[0] += 1


# Fused optimizers update parameters without bumping their version counters, so every
# torch optimizer step is counted too: an unsharded copy gathered before a step is stale.
register_optimizer_step_post_hook(_count_step)


class Unshard:
    # -- the send buffer with CPU offload --------------------------------------------------
    def _copy_in_offloaded(self, dtype: torch.dtype) -> torch.Tensor:
        """The host shards copied to the compute device and cast to ``dtype``, on the side
        stream (one copy per flat buffer: one in all but mixed-dtype groups), so neither
        waits behind compute nor holds it up. The buffer is allocated on the compute
        stream, which the side stream waits for first (see :mod:`fsdp2d._streams`); the
        caller issues the all-gather on the side stream too and keeps the buffer until
        the copy-out, which waits for the side stream's event."""
        device = self.compute_device
        send = torch.empty(self.total, dtype=dtype, device=device)
        side = _streams.side_stream(device)
        side.wait_stream(_streams.current_stream(device))
        with side, _trace.span("offload_copy", self.label):
            if len(self.flats) == 1:
                send.copy_(next(iter(self.flats.values())), non_blocking=True)
            else:  # every segment is copied whole: padding included, nothing left unset
                for p in self.params:
                    src = self.flats[p.sharded.dtype][p.store_offset:p.store_offset + p.segment_numel]
                    send[p.offset:p.offset + p.segment_numel].copy_(src, non_blocking=True)
        return send

    # -- all-gather ------------------------------------------------------------------
    def _shard_versions(self) -> tuple:
        """Changes when any shard changes: in-place edits bump the version counter of the
        flat buffer they went through (FSDP1's flat parameter), of the shard's own local
        tensor (an alias of the flat buffer, see ``_param.alias``) or of the DTensor
        parameter itself (an in-place op on a DTensor, ``p.mul_()`` or ``p.copy_(ema)``
        through a reference an optimizer or an EMA helper holds, bumps the DTensor's
        counter only: DTensor runs the op on its local tensor below autograd); optimizer
        steps (fused ones included) are counted globally. (FSDP1's flat parameter is a
        DTensor too: its own counter counts.)"""
        flat = () if self.flat_param is None else (self.flat_param._version,)
        return (_OPTIMIZER_STEPS[0], *(f._version for f in self.flats.values()), *flat,
                *(p.expected_local._version for p in self.params), *(p.sharded._version for p in self.params))

    @property
    def gathering(self) -> bool:
        """An all-gather is in flight (a prefetch not yet waited for)."""
        return self._gather is not None

    def unshard(self, async_op: bool = False) -> None:
        if (self.unsharded or self.gathering) and self._shard_versions() != self._gathered_versions:
            # The shards changed since the gather was sent (optimizer step, load): what it
            # brings, or brought, is stale. Free it and gather the current shards.
            self.reshard()
        if self.unsharded or self.gathering:
            if not async_op:
                self.wait_unshard()
            return
        with _trace.span("all_gather", self.label):
            self._gather = self._issue_gather()
        if not async_op:
            self.wait_unshard()

    def _issue_gather(self) -> "_Gather":
        """Send this rank's shards (see :class:`_Gather`). With CPU offload the all-gather
        is issued on the side stream, behind the copy to the device (on NCCL its stream
        then waits for the side stream, not for compute)."""
        offloading = self._offloading(self.compute_device)
        dests = None
        if self.has_ext:
            send, dests = self._send_bytes()
        else:
            send = self._copy_in_offloaded(self.param_dtype) if offloading else self._send_buffer(self.param_dtype)
        self._gathered_versions = self._shard_versions()  # what is sent, not what is there at the wait
        self.counts["all_gather"] += 1
        side = _streams.side_stream(self.compute_device) if offloading else _streams.HOST
        if self.k == 1:
            work, out = None, send
        else:  # over shared memory the pieces are copied out where they lie (out None)
            work = C.all_gather_rows(send, self.shard_group) if self.params else None
            out = None if work is not None else send.new_empty(self.k * send.numel())  # on the compute stream
            if work is None:
                with side:
                    work = C.all_gather_into(out, send, self.shard_group, async_op=True)
        return _Gather(work, out, send, side.record_event() if offloading else None, dests)

    def wait_unshard(self) -> None:
        gather = self._gather
        if gather is None:
            return
        # Dropped before waiting: a wait that raises (a peer's timeout or size mismatch)
        # must not leave a spent handle that the next wait would take as done, marking
        # uninitialised storage unsharded. The next unshard gathers again (or raises again).
        self._gather = None
        with _trace.span("all_gather_copy_out", self.label):
            if gather.ready is not None:  # the copy to the device (CPU offload)
                _streams.current_stream(self.compute_device).wait_event(gather.ready)
            for p in self.params:
                p.alloc_unsharded()
            self._copy_out(gather.work, gather.out, gather.dests)
        self.unsharded = True
        self._copied_versions = [p.unsharded._version for p in self.params]

    def _send_bytes(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(A group with an all-gather extension parameter, see :mod:`._extension`.) This
        rank's all-gather input as bytes: every other parameter's padded segment in
        ``param_dtype`` and every extension input (float8 data for torchao), back to back;
        and, in the same order, the ``(k, bytes)`` uint8 views the copy-out fills."""
        pieces, dests = [], []
        for p in self.params:
            if p.ext is None:
                src = self.flats[p.sharded.dtype][p.store_offset:p.store_offset + p.segment_numel]
                pieces.append(src.to(self.compute_device, self.param_dtype).view(torch.uint8))
                dests.append(p.padded_by_rank.view(torch.uint8))
            else:
                inputs = p.ext.inputs(p, self.mp)
                pieces += [t.view(-1).view(torch.uint8) for t in inputs]
                dests += p.ext.destinations(inputs, self.k)
        return torch.cat(pieces), dests

    def _finish_extensions(self) -> None:
        """The post-all-gather hooks, after the copy-out (the first makes the parameter)."""
        made = False
        for p in self.params:
            if p.ext is not None:
                full = p.ext.finish(p, self.param_dtype)
                if full is not None:
                    p.adopt_extension_output(full)
                    made = True
        if made:  # hook the new parameters' gradients
            self._sync_requires_grad()

    def _copy_out(self, work: Any, out: torch.Tensor | None, dests: list[torch.Tensor] | None = None) -> None:
        if dests is not None:
            self._copy_out_bytes(work, out, dests)
            self._finish_extensions()
            return
        if out is None:  # shared memory (see unshard): one copy op per rank's piece
            sizes = [p.segment_numel for p in self.params]

            def copy_out(parts: dict[int, torch.Tensor]) -> None:
                for j, piece in parts.items():
                    torch.split_with_sizes_copy(piece, sizes, out=[p.padded_row(j) for p in self.params])

            work.wait(copy_out)
            return
        if work is not None:
            work.wait()
        gathered = out.view(self.k, self.total)
        if self.params:  # one copy op for the whole group, into the padded unsharded storage
            torch.split_with_sizes_copy(gathered, [p.segment_numel for p in self.params], dim=1,
                                        out=[p.padded_by_rank for p in self.params])

    def _copy_out_bytes(self, work: Any, out: torch.Tensor | None, dests: list[torch.Tensor]) -> None:
        sizes = [d.shape[1] for d in dests]
        if out is None:  # shared memory: each rank's piece where it lies
            work.wait(lambda parts: [torch.split_with_sizes_copy(piece, sizes, out=[d[j] for d in dests])
                                     for j, piece in parts.items()])
            return
        if work is not None:
            work.wait()
        torch.split_with_sizes_copy(out.view(self.k, -1), sizes, dim=1, out=dests)

    def reshard(self) -> None:
        if self._gather is not None:  # finish the collective, drop what it brought
            work, self._gather = self._gather.work, None  # first: see wait_unshard
            if work is not None:
                work.wait()
        edited = self._edited_unsharded() if self.unsharded else []
        if edited:
            self._write_back(edited)
        for p in self.params:
            p.free_unsharded()
            p.register("sharded")
        self.unsharded = False

    def _edited_unsharded(self) -> list[FSDPParam]:
        """Parameters edited in place through the unsharded copy since the copy-out (an
        edit through ``model.parameters()`` while the group is gathered: after a forward
        without backward, with ``set_reshard_after_backward(False)``, after a manual
        ``unshard()``)."""
        return [p for p, v in zip(self.params, self._copied_versions) if p.unsharded._version != v]

    def _write_back(self, edited: list[FSDPParam]) -> None:
        """Write the edited unsharded copies' rows back to this rank's shards, so that the
        edit survives the reshard (each rank takes its own rows). Refused, naming the
        parameter, where that would be wrong: the shards changed too since the gather (an
        optimizer step, or an edit through the sharded parameter: two edits, neither
        seen by the other), or the copy is in a lower ``param_dtype`` than the shards
        (writing it back would round the whole parameter). The copy is dropped either way."""
        p = edited[0]
        if self._shard_versions() != self._gathered_versions:
            why = ("its shards changed too since they were gathered (an optimizer step, a load, or an edit "
                   "through the sharded parameter), so the edit was made to a stale copy")
        elif p.unsharded.dtype != p.sharded.dtype:
            why = (f"the copy is the {p.unsharded.dtype} compute copy of {p.sharded.dtype} shards "
                   f"(MixedPrecisionPolicy.param_dtype); writing it back would round the whole parameter")
        else:
            with torch.no_grad():
                for p in edited:
                    local_of(p.sharded).copy_(p.shard_of(_plain(p.unsharded)))
            return
        for q in self.params:
            q.free_unsharded()
            q.register("sharded")
        self.unsharded = False
        raise RuntimeError(
            f"fsdp2d: parameter {p.fqn!r} of fully_shard({self.label or '<root>'}) was edited in place through "
            f"its unsharded copy (model.parameters() while the group was gathered), but {why}; the edit is "
            f"dropped. Edit the sharded parameters instead (the tensors model.parameters() returns after "
            f"model.reshard(), or an optimizer's references)")


class _Gather:
    """An all-gather in flight: its handle (None: nothing to wait for), the buffer it
    fills (None over shared memory, where pieces are copied out where they lie; the send
    buffer itself with one rank), the send buffer (held until the copy-out: with CPU
    offload it is a copy that the collective reads), with CPU offload, the side stream's
    event after the copy to the device, and for a group with all-gather extension
    parameters the uint8 destinations of its byte pieces (see ``_send_bytes``)."""

    __slots__ = ("work", "out", "send", "ready", "dests")

    def __init__(self, work: Any, out: torch.Tensor | None, send: torch.Tensor, ready: Any,
                 dests: list[torch.Tensor] | None = None) -> None:
        self.work, self.out, self.send, self.ready, self.dests = work, out, send, ready, dests


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t
