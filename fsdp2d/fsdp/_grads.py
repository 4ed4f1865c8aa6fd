"""The gradient half of a ``fully_shard`` group (:class:`FSDPParamGroup` inherits it):
accumulating without sync, packing the unsharded gradients for one reduce-scatter,
and handing each sharded parameter its reduced gradient (and, with CPU offload, the
event an optimizer must wait for). State it reads is the group's: ``params``, ``k``,
``total``, ``param_dtype``, ``reduce_dtype``, ``grad_dtype``, ``accumulate_in_compute_dtype``,
``compute_device``, the groups, ``_reduce``,
``_flags``, ``flat_param``, ``divide_factor``, ``force_sum``, ``offload``, ``offload_event``,
``label``."""

from __future__ import annotations

import dataclasses

import torch

from .. import _collectives as C
from .. import _streams, _trace
from .._division import Division, division
from .._dtensor import as_dtensor, local_of


class GradReduction:
    def accumulate_unsynced(self) -> None:
        """Without gradient sync, move this backward's unsharded gradients into
        accumulators in :meth:`accumulation_dtype`; the synced backward adds them back
        before reducing. ``unsharded.grad`` then only ever holds the current backward's
        gradient, which is what an aborted backward's recovery drops."""
        dtype = self.accumulation_dtype()
        for p in self.params:
            g = p.unsharded_grad()
            if g is not None:  # .to() is a no-op reference when the dtypes already match
                p.acc_grad = g.to(dtype) if p.acc_grad is None else p.acc_grad.add_(g)
                p.unsharded.grad = None

    def accumulation_dtype(self) -> torch.dtype:
        """The dtype no-sync accumulators sum in. ``fully_shard`` (torch FSDP2's rule,
        ``FSDPParam.to_accumulated_grad_if_needed``): ``reduce_dtype`` (bf16 gradients
        summed over many microbatches in bf16 would lose precision; with no
        ``reduce_dtype`` that is ``param_dtype``). The FSDP1 front end
        (``accumulate_in_compute_dtype``): the forward/backward dtype ``param_dtype``,
        whatever ``reduce_dtype`` says, because torch FSDP1 leaves the unsharded gradient
        in ``FlatParameter.grad`` under ``no_sync`` and autograd adds each backward's
        gradient to it in that dtype; it casts to ``reduce_dtype`` only to reduce."""
        return self.param_dtype if self.accumulate_in_compute_dtype else self.reduce_dtype

    def reduce_grads(self) -> None:
        """Launch the (async) reduce-scatter of the unsharded gradients, if syncing."""
        if not self.needs_reduce or not self.requires_sync:
            return
        grads = []
        for p in self.params:
            g = p.unsharded_grad()
            if p.acc_grad is not None:  # microbatches accumulated without sync
                g = p.acc_grad if g is None else p.acc_grad.add_(g)
                p.acc_grad = None
            grads.append(g)
            p.unsharded.grad = None
        with _trace.span("pack", self.label):
            buf = self._pack_grads(grads)
        all_had = self._every_trainable_had(grads)
        self.counts["reduce_scatter"] += 1
        self.weights_skipped = False  # an earlier input-only backward (autograd.grad) outside pipelining
        # (work, out, all_had, whether out holds the sum over the replicate axis once work is done)
        d = self._division()
        if self.k == 1:
            out = buf.view(-1)
            if self.replicate_group is None:  # else the all-reduce divides
                for f in (d.pre, d.within, d.post):
                    if f != 1.0:
                        out.div_(f)
            self._reduce = (None, out, all_had, self.replicate_group is None)
        else:
            out = buf.new_empty(self.total + len(self.params))
            with _trace.span("reduce_scatter", self.label):  # (HSDP: the all-reduce divides by post)
                work = C.reduce_scatter_into(out, buf.view(-1), self.shard_group, async_op=True,
                                             division=d if self.replicate_group is None else d.first)
            self._reduce = (work, out, all_had, self.replicate_group is None)
        self.needs_reduce = False

    def _division(self) -> Division:
        """How the gradients' sum over the data-parallel ranks is divided by
        ``divide_factor`` (torch FSDP2's rule, see :func:`fsdp2d._division.division`)."""
        return division(self.divide_factor, self.reduce_dtype, self.force_sum)

    def _pack_grads(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """The reduce-scatter input ``(k, total + n)``: every parameter's gradient in its
        segment (zeros without one, so the collective is identical on every rank), then
        one flag column per parameter, 1 in every row where this rank has a gradient:
        after the reduce-scatter every rank knows how many ranks had one (a collective
        decision, so a parameter used on some ranks only still updates everywhere)."""
        n, k, dtype = len(self.params), self.k, self.reduce_dtype
        # One _chunk_cat is one copy kernel on CUDA only when every input is contiguous and
        # all share one dtype that is the output's, or bf16 into an fp32 output (it then
        # widens on the way). Anything else (a stride-0 expanded view, a dtype it does not
        # cast) takes its composite path: a zero-padded copy per input, then a cat (+2 ops
        # per parameter). So the flags are a materialised (k, n) tensor, cached, in the
        # gradients' dtype (0 and 1 are exact in any float dtype), and gradients go in
        # uncast where _chunk_cat casts them itself: for bf16 gradients reduced in fp32
        # (torchtitan's policy) a cast first moves 2 + 4 bytes per element and the copy
        # 4 + 4 more, 14 where the casting copy moves 6. Widening is exact: .to()'s bits.
        present = {g.dtype for g in grads if g is not None}
        src = present.pop() if len(present) == 1 else dtype
        if src != dtype and (src, dtype) != (torch.bfloat16, torch.float32):
            src = dtype  # a cast _chunk_cat's fast path does not do: cast each gradient first
        if self._every_trainable_had(grads):  # the usual case: a cached device tensor, no host-to-device copy
            key = (src, self.compute_device, tuple(p.requires_grad for p in self.params))
            if self._flags is None or self._flags[0] != key:  # 1 per trainable, 0 per frozen parameter
                row = torch.tensor([float(r) for r in key[2]], dtype=src, device=self.compute_device)
                self._flags = (key, row.expand(k, n).contiguous())
            flags = self._flags[1]
        else:
            row = torch.tensor([0.0 if g is None else 1.0 for g in grads], dtype=src, device=self.compute_device)
            flags = row.expand(k, n).contiguous()
        grads = [torch.zeros(p.unsharded_shape, dtype=src, device=self.compute_device) if g is None
                 else g.to(src) for p, g in zip(self.params, grads)]  # .to: no-op when it matches
        buf = torch.empty((k, self.total + n), dtype=dtype, device=self.compute_device)
        # Each gradient chunked over the k ranks along dim 0 (torch.chunk sizes, zero-padded
        # to padded_rows), rank-major: one op, even or not, at any k.
        torch._chunk_cat([*grads, flags], dim=0, num_chunks=k, out=buf)
        return buf

    def _every_trainable_had(self, grads: list[torch.Tensor | None]) -> bool:
        """Whether this rank has a gradient for every parameter that requires one (frozen
        parameters never have one, on any rank: no flags need reading for them)."""
        return all(g is not None for p, g in zip(self.params, grads) if p.requires_grad)

    def advance_reduce(self) -> bool:
        """Move this group's reduction one stage on: with a replicate axis (HSDP) whose
        all-reduce has not started, wait for the reduce-scatter and start the all-reduce
        asynchronously (True: still in flight; see ``_Context.post_backward``); otherwise
        finish it (False)."""
        if self.start_pending_all_reduce():
            return True
        self.finish_reduce()
        return False

    def start_pending_all_reduce(self) -> bool:
        """Start this group's replicate all-reduce if its reduce-scatter has not moved on
        yet (True); never wait for one already running (``advance_reduce`` would finish it)."""
        if self._reduce is None or self._reduce[3]:
            return False
        self._start_all_reduce()
        return True

    def _start_all_reduce(self) -> None:
        # Asynchronous, as torch FSDP2 runs it on its own stream: a synchronous all-reduce
        # here would hold the compute stream (NCCL) or the host (gloo) for its whole time
        # right when the next group's backward could run; waited for in finish_reduce.
        work, out, all_had, _ = self._reduce
        if work is not None:
            work.wait()
        d = self._division()  # the reduce-scatter divided by pre and within already
        self._reduce = (C.all_reduce_start(out, self.replicate_group, division=d if self.k == 1 else d.last),
                        out, all_had, True)

    def finish_reduce(self, assign: bool = True) -> None:
        """Wait for the reduce-scatter (and the replicate all-reduce) and accumulate into
        the sharded ``.grad``s of the parameters that had a gradient (``assign=False``:
        wait and discard). The collectives divided by ``divide_factor`` already."""
        if self._reduce is None:
            return
        if assign:
            self.start_pending_all_reduce()
        work, out, all_had, _ = self._reduce
        self._reduce = None
        with _trace.span("reduce_scatter_wait", self.label):
            if work is not None:
                work.wait()
        if assign:
            self._assign_grads(out, all_had)

    def _assign_grads(self, out: torch.Tensor, all_had: bool) -> None:
        """Hand each sharded parameter its piece of the reduced ``out`` (the flag columns
        stay positive where some rank had a gradient).

        Where this rank had every trainable gradient, every trainable parameter gets one:
        no need to read the flags (no host sync in a normal step, frozen parameters or
        not). Otherwise the flags say which parameters some rank had a gradient for (all
        ranks agree); the others keep .grad None, as in torch.

        CPU offload: the reduced shards go to the host in one copy per group (per dtype),
        on the side stream (:meth:`_grads_to_host`). New gradients are views of that host
        buffer, read by nobody before the end of backward (``wait_offload``, before an
        optimizer can read them on the CPU, as torch FSDP2 does). Adding to an existing
        .grad reads the copy on the CPU at once, so then the host waits for it here
        (torch's rule too). (The copies of the shards to the device that this backward
        issued are on the same side stream, before the gradient copies, so waiting for
        those covers them: the optimizer's writes to the pinned shards cannot race them.)"""
        host = self._offloading(self.compute_device)
        if self.flat_param is not None:  # FSDP1: one flat gradient (zeros where a rank had none)
            flat = self.flat_param
            dtype = self._grad_dtype(flat)
            g = self._grads_to_host(out, {dtype})[dtype] if host else out[:self.total]
            if flat.grad is None:
                g = g.to(flat.device, dtype, non_blocking=True)  # (a no-op from the host buffer)
                meta = flat._spec.tensor_meta._replace(dtype=g.dtype)
                set_grad(flat, as_dtensor(g, dataclasses.replace(flat._spec, tensor_meta=meta)))
            else:
                self.wait_offload()
                _accumulate(local_of(flat.grad), g, flat.dtype)
            return
        had_grad = [float(p.requires_grad) for p in self.params] if all_had else out[self.total:].tolist()
        mine = [p for p, flag in zip(self.params, had_grad) if flag > 0]
        if host:
            by_dtype = self._grads_to_host(out, {self._grad_dtype(p.sharded) for p in mine})
            if any(p.sharded.grad is not None for p in mine):
                self.wait_offload()  # an add on the CPU reads the copy now
        for p in mine:
            g = p.shard_in(by_dtype[self._grad_dtype(p.sharded)]) if host else p.shard_in(out)
            current = p.sharded.grad
            if current is None:  # (.to: a no-op from the host buffer, a cast on the device if needed)
                g = g.to(p.sharded.device, self.grad_dtype or p.sharded.dtype, non_blocking=True)
                set_grad(p.sharded, as_dtensor(g, p.spec(g.dtype)))
            else:
                _accumulate(local_of(current), g, p.sharded.dtype)

    def _grad_dtype(self, param: torch.Tensor) -> torch.dtype:
        """The dtype ``param``'s reduced shard goes to the host in: its gradient's, or the
        reduction's to be added to an existing gradient (``_accumulate`` rounds once)."""
        if param.grad is not None:
            return self.reduce_dtype  # the reduce-scatter's output dtype
        return self.grad_dtype or param.dtype

    def _grads_to_host(self, out: torch.Tensor, dtypes: set[torch.dtype]) -> dict[torch.dtype, torch.Tensor]:
        """``out[:total]`` (the reduced shards, on the compute device) copied to a fresh
        host buffer per dtype (pinned on CUDA: the copy does not block the host), cast on
        the way, on the side stream after the compute stream's work so far (the reduction
        that wrote ``out``). ``out`` is held with the side stream's event until
        :meth:`wait_offload` (see :mod:`fsdp2d._streams`)."""
        device = self.compute_device
        side = _streams.side_stream(device)
        side.wait_stream(_streams.current_stream(device))
        pin = bool(getattr(self.offload, "pin_memory", False)) and device.type == "cuda"
        hosts = {d: torch.empty(self.total, dtype=d, pin_memory=pin) for d in sorted(dtypes, key=str)}
        with side, _trace.span("offload_copy", self.label):
            for h in hosts.values():
                h.copy_(out[:self.total], non_blocking=True)
        self._wait_grad_copies()  # (an earlier copy of this group's not waited for: none in a normal step)
        self.offload_event = (side.record_event(), out)
        self._reads_before = self.host_reads  # the copies out of the shards that this event follows
        return hosts

    def wait_offload(self) -> None:
        """Block the host until this group's gradient copies to the CPU are done, then
        release what they read. The copies out of the host shards came earlier on the same
        side stream: done too. (Without gradient copies, a frozen group's or in a backward
        without gradient sync, they stay pending: a host write waits for them, see
        ``Unshard.wait_host_reads``; no host sync here that the step did not have.)"""
        if self.offload_event is not None:
            self._wait_grad_copies()
            if self.host_reads is self._reads_before:  # (not a gather issued after the gradient copy)
                self.host_reads_done()

    def _wait_grad_copies(self) -> None:
        if self.offload_event is not None:
            self.offload_event[0].synchronize()
            self.offload_event = None


def _accumulate(current: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> None:
    """``current += g`` (a reduced shard), summed in ``dtype``, the sharded parameters'
    dtype. A gradient kept in another dtype (FSDP1's ``keep_low_precision_grads``: bf16
    on fp32 parameters) is upcast, summed and cast back, as torch FSDP1 does
    (``prepare_gradient_for_backward`` upcasts the saved shard, ``_accumulate_sharded_grad``
    adds in the parameter dtype, ``prepare_gradient_for_optim`` casts down): one rounding
    per backward instead of two. The copy to the host (CPU offload) blocks: the add reads it."""
    g = g.to(current.device, dtype)
    if current.dtype == dtype:
        current.add_(g)
    else:
        current.copy_(current.to(dtype).add_(g))


def set_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    if grad.dtype != param.dtype:  # keep_low_precision_grads (FSDP1): torch checks .grad_dtype
        param.grad_dtype = None
    param.grad = grad
