"""The all-gather half of a ``fully_shard`` group (:class:`FSDPParamGroup` inherits it):
gathering the shards into the unsharded parameters, resharding, and keeping what the
unsharded copies show equal to the shards (staleness, edits while gathered). State it
reads is the group's: ``params``, ``k``, ``total``, ``flats``, ``flat_param``,
``param_dtype``, ``compute_device``, ``shard_group``, ``label``, ``counts``, ``_gather``,
``_gathered_versions``, ``_copied_versions``, ``optimizer_steps``, ``unsharded``.

With CPU offload the shards are copied to the device and the all-gather is issued on
the side stream (``fsdp2d._streams``); the copy-out waits for the copy's event.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .. import _collectives as C
from .. import _streams, _trace
from .._dtensor import local_of
from ._param import FSDPParam, is_storage


def _count_step(optimizer, args, kwargs) -> None:
    """Count the step in every group whose sharded parameters ``optimizer`` holds (each
    carries its group's counter, ``_fsdp2d_steps``): another model's optimizer (a GAN's
    other half, an EMA copy) leaves this model's gathered copies current."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            steps = getattr(p, "_fsdp2d_steps", None)
            if steps is not None:
                steps[0] += 1


# Fused optimizers update parameters without bumping their version counters, so torch
# optimizer steps are counted too: an unsharded copy gathered before a step is stale.
register_optimizer_step_post_hook(_count_step)

# Groups whose copies out of the host shards (CPU offload) may still be reading them.
_HOST_READS: "weakref.WeakSet[Unshard]" = weakref.WeakSet()


def _wait_host_reads(optimizer, args, kwargs) -> None:
    """Before any optimizer step: an optimizer on the host writes the shards in place,
    which a copy to the device still in flight (a forward with no backward after it:
    backward's end waits for them) would read half-written. Empty in a training step."""
    for group in list(_HOST_READS):
        group.wait_host_reads()


register_optimizer_step_pre_hook(_wait_host_reads)


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
        steps (fused ones included) of optimizers holding this group's parameters are
        counted (:func:`_count_step`). (FSDP1's flat parameter is a DTensor too: its own
        counter counts.)"""
        flat = () if self.flat_param is None else (self.flat_param._version,)
        return (self.optimizer_steps[0], *(f._version for f in self.flats.values()), *flat,
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
        ready = side.record_event() if offloading else None
        if ready is not None:  # the host must not write the shards before the copy read them
            self.host_reads = ready
            _HOST_READS.add(self)
        return _Gather(work, out, send, ready, dests)

    def wait_host_reads(self) -> None:
        """Block the host until the copies out of this group's host shards are done (CPU
        offload), before it writes them: an optimizer step (see :func:`_wait_host_reads`),
        ``load_state_dict`` and ``state_dict`` (``to_rest``). A no-op without one in flight."""
        if self.host_reads is not None:
            self.host_reads.synchronize()
            self.host_reads_done()

    def host_reads_done(self) -> None:
        """The side stream ran past the copies' event (events on one stream complete in order)."""
        self.host_reads = None
        _HOST_READS.discard(self)

    def wait_unshard(self) -> None:
        gather = self._gather
        if gather is None:
            return
        # Dropped before waiting: a wait that raises (a peer's timeout or size mismatch)
        # must not leave a spent handle that the next wait would take as done, marking
        # uninitialised storage unsharded. The next unshard gathers again (or raises again).
        self._gather = None
        # .data assigned on a resharded copy (a reference kept from an earlier forward):
        # the module would compute with that tensor instead of what is gathered now
        stale = [p for p in self.params if not is_storage(p.unsharded, p.unsharded_storage)]
        for p in stale:
            p.restore_unsharded()
        with _trace.span("all_gather_copy_out", self.label):
            if gather.ready is not None:  # the copy to the device (CPU offload)
                _streams.current_stream(self.compute_device).wait_event(gather.ready)
            for p in self.params:
                p.alloc_unsharded()
            self._copy_out(gather.work, gather.out, gather.dests)
        self.unsharded = True
        self._copied_versions = [p.unsharded._version for p in self.params]
        if stale:
            raise RuntimeError(
                f"fsdp2d: parameter {stale[0].fqn!r} of fully_shard({self.label or '<root>'}) had the .data of its "
                f"unsharded copy assigned while the group was resharded (through a reference kept from an earlier "
                f"forward); the model no longer holds that tensor, so the assignment is dropped. Assign through "
                f"model.parameters() after model.unshard(), or copy into the sharded parameter")

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
            gather, self._gather = self._gather, None  # first: see wait_unshard
            if gather.work is not None:
                gather.work.wait()
            if gather.ready is not None:  # (CPU offload) the send buffer goes back to the compute
                # stream's pool while the side stream may still be copying into it (with one
                # shard there is no collective whose wait would order it)
                _streams.current_stream(self.compute_device).wait_event(gather.ready)
        edited = self._edited_unsharded() if self.unsharded else []
        if edited:
            self._write_back(edited)
        for p in self.params:
            p.free_unsharded()
            p.register("sharded")
        self.unsharded = False

    def _edited_unsharded(self) -> list[FSDPParam]:
        """Parameters edited through the unsharded copy since the copy-out (an edit
        through ``model.parameters()`` while the group is gathered: after a forward
        without backward, with ``set_reshard_after_backward(False)``, after a manual
        ``unshard()``): in place (its version counter moved) or by ``p.data = t`` (it
        points at another storage). An in-place edit through ``p.data`` moves no counter
        fsdp2d can read (``.data`` is an alias with a counter of its own) and is not seen:
        docs/architecture.md, "Edits while a group is gathered"."""
        return [p for p, v in zip(self.params, self._copied_versions)
                if p.unsharded._version != v or not is_storage(p.unsharded, p.unsharded_storage)]

    def _write_back(self, edited: list[FSDPParam]) -> None:
        """Write the edited unsharded copies' rows back to this rank's shards, so that the
        edit survives the reshard (each rank takes its own rows); a copy whose ``.data``
        was assigned is read from the assigned tensor, then points at its own storage
        again. Refused, naming the parameter, where that would be wrong (see
        :meth:`_refusal`). The copy is dropped either way."""
        assigned = [q for q in edited if not is_storage(q.unsharded, q.unsharded_storage)]
        p, why = self._refusal(edited, assigned)
        if why is None:
            with torch.no_grad():
                for q in edited:
                    local_of(q.sharded).copy_(q.shard_of(_plain(q.unsharded)))
        for q in assigned:
            q.restore_unsharded()
        if why is None:
            return
        for q in self.params:
            q.free_unsharded()
            q.register("sharded")
        self.unsharded = False
        raise RuntimeError(
            f"fsdp2d: parameter {p.fqn!r} of fully_shard({self.label or '<root>'}) was edited through its unsharded "
            f"copy (in place or by assigning .data, through model.parameters() while the group was gathered), but "
            f"{why}; the edit is dropped. Edit the sharded parameters instead (the tensors model.parameters() "
            f"returns after model.reshard(), or an optimizer's references)")

    def _refusal(self, edited: list[FSDPParam], assigned: list[FSDPParam]) -> tuple[FSDPParam, str | None]:
        """(the parameter at fault, why its edit cannot be written back), or (_, None).
        The shards changed too since the gather (an optimizer step, or an edit through the
        sharded parameter: two edits, neither seen by the other); an assigned tensor that
        cannot be read as the gathered copy; a copy in another dtype than the shards (a
        lower ``param_dtype``: writing it back would round the whole parameter; or an
        assigned tensor of another dtype: a shard keeps its dtype). Every edited copy is
        checked: a mixed-dtype group may hold exact copies (bf16 of bf16 shards) next to
        rounded ones (bf16 of fp32 shards)."""
        for q in edited:
            if q.ext is not None:
                return q, (f"its gathered copy is what the all-gather extension's fsdp_post_all_gather made "
                           f"({q.ext.cls.__name__}: e.g. float8 values), not the shards' values, so writing it back "
                           f"would round the shards")
        if self._shard_versions() != self._gathered_versions:
            return edited[0], ("its shards changed too since they were gathered (an optimizer step, a load, or an "
                               "edit through the sharded parameter), so the edit was made to a stale copy")
        for q in assigned:
            if not q.assigned_readable():
                u = q.unsharded
                why = (f"its .data was assigned a {type(u).__name__} of shape {tuple(u.shape)} on {u.device}, "
                       f"which is not the gathered copy's {q.unsharded_shape} on {q.padded.device}")
                return q, why + (" (a DTensor keeps its old local tensor)" if q.tp_spec is not None else "")
        for q in edited:
            if q.unsharded.dtype != q.sharded.dtype:
                if any(q is a for a in assigned):
                    return q, (f"its .data was assigned a {q.unsharded.dtype} tensor and its shards are "
                               f"{q.sharded.dtype} (cast the whole module instead)")
                return q, (f"the copy is the {q.unsharded.dtype} compute copy of {q.sharded.dtype} shards "
                           f"(MixedPrecisionPolicy.param_dtype); writing it back would round the whole parameter")
        return edited[0], None


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
