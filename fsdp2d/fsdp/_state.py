"""Forward/backward hooks of ``fully_shard`` modules and the per-tree context.

Every ``fully_shard`` module gets an ``FSDPState`` with a forward pre-hook (prepended, so
it runs before tensor-parallel hooks and they see the unsharded parameters) and a forward
hook. The first FSDP module to run forward is the root: it builds a ``_Context`` shared
by all FSDP modules below it, which records the forward order once (for implicit
prefetch: the next group's all-gather is started before the current group computes;
in backward, the previous one's in the order forwards *finished*, as torch FSDP2: the
root finishes last, so its pre-backward prefetches the last block) and queues one callback at the end of every backward
that flushes the remaining reduce-scatters and waits for them, so the sharded
``.grad``s are complete when ``backward()`` returns.

Backward per group: a hook on the module's forward outputs fires when their gradient is
ready (pre-backward: all-gather again if resharded, copy out, then prefetch the next
group to run backward: its gathered buffer is allocated after this group's is freed);
post-accumulate-grad hooks on the
unsharded parameters count gradients, and the last one starts the reduce-scatter and
reshards. A group with frozen parameters also waits for the gradients of its module's
inputs (``InputsDone``): backward may still read a frozen weight after the last gradient.

A forward that runs inside backward is an activation-checkpointing recompute that
re-entered the module's ``__call__``: it gathers its own group only (no prefetch, no
reshard after it; the post-backward reshards), see ``FSDPState._pre_recompute``.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .. import _trace
from ._group import FSDPParamGroup
from ._policy import MixedPrecisionPolicy


def _eager(fn: Callable) -> Callable:
    """Run an FSDP hook eagerly even inside a ``torch.compile``'d module: under
    compilation it is called through ``torch._dynamo.disable`` (a graph break: its
    collectives, storage resizes and parameter swaps are not traced), as torch's FSDP2
    hooks are; in eager mode it is called directly (one flag check)."""

    @functools.wraps(fn)
    def hook(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return torch._dynamo.disable(fn, recursive=True, reason="fsdp2d's FSDP hooks")(*args, **kwargs)
        return fn(*args, **kwargs)

    return hook


class _Context:
    def __init__(self, states: list["FSDPState"]) -> None:
        self.states = states
        self.order: list[FSDPState] = []  # by forward start (forward prefetch)
        self.finished: list[FSDPState] = []  # by forward end (backward prefetch)
        self.recording = True
        self.callback_queued = False
        self.in_flight: list[FSDPParamGroup] = []  # reductions started, not finished (post_backward)

    def neighbour(self, state: "FSDPState", step: int) -> list["FSDPState"]:
        """The state after (``step=1``: forward, by forward start) or before (``step=-1``:
        the next to run backward, by forward end) ``state``."""
        order = self.order if step > 0 else self.finished
        if self.recording or state not in order:
            return []
        i = order.index(state) + step
        return [order[i]] if 0 <= i < len(order) else []

    def post_backward(self, group: FSDPParamGroup) -> None:
        with _trace.span("post_backward", group.label):
            self._post_backward(group)

    def _post_backward(self, group: FSDPParamGroup) -> None:
        if group.requires_sync and group.needs_reduce:
            # Every earlier reduction moves one stage on (FSDPParamGroup.advance_reduce): one
            # reduce-scatter stays in flight and, with HSDP, the previous group's replicate
            # all-reduce too, which then overlaps the next group's backward.
            self.in_flight = [g for g in self.in_flight if g is not group and g.advance_reduce()]
            group.reduce_grads()
            self.in_flight.append(group)
        elif not group.requires_sync:
            group.accumulate_unsynced()
        if group.reshard_after_backward:
            group.reshard()

    def recover(self) -> None:
        """Clean up after a backward that raised (its end-of-backward callback never ran):
        finish and discard in-flight collectives, drop partial unsharded gradients,
        reshard, and reset every per-backward flag. Called by the root's next forward."""
        for s in self.states:
            g = s.group
            if g is not None:
                g.wait_unshard()
                g.finish_reduce(assign=False)
                for p in g.params:
                    if p.unsharded is not None:
                        p.unsharded.grad = None
                g.needs_reduce, g.grads_ready, g.inputs_done, g.weights_skipped = False, 0, 0, False
                g.reshard()
            s.in_backward = False
        self.in_flight = []
        self.callback_queued = False

    def queue_final_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.final_callback)

    def final_callback(self) -> None:
        groups = [s.group for s in reversed(self.order or self.states) if s.group is not None]
        for g in groups:
            if g.needs_reduce:  # groups whose every gradient did not arrive (unused params)
                self.post_backward(g)
        for g in groups:  # HSDP: every pending all-reduce is started before any is waited for
            g.start_pending_all_reduce()
        for g in groups:
            g.finish_reduce()
            # A gather still in flight here is one no hook of this backward waited for (a
            # prefetch of a group that did not run): finish it (nothing crosses the
            # optimizer step in flight) and reshard per the policy.
            if g.reshard_after_backward and (g.unsharded or g.gathering):
                g.reshard()
            g.wait_unshard()
            g.grads_ready = g.inputs_done = 0
        for g in groups:  # offloaded gradients: on the host before backward() returns
            g.wait_offload()
        for s in self.states:
            s.in_backward = False
        self.in_flight = []
        self.callback_queued = False


class FSDPState:
    """The hooks of one ``fully_shard`` call. ``modules``: the module it was applied to,
    or the modules of a list (one group: the first of them to run forward gathers, the
    last to finish reshards, as torch)."""

    def __init__(self, modules: list[torch.nn.Module], group: FSDPParamGroup | None,
                 mp: MixedPrecisionPolicy) -> None:
        self.modules, self.module, self.group, self.mp = modules, modules[0], group, mp
        self._pending: set[int] = set()  # ids of the list's modules yet to finish this forward
        self.ctx: _Context | None = None
        self.is_root = False
        self.in_backward = False
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        self.is_last_backward = True  # FSDPModule.set_is_last_backward (read by the torch-state view)

    def _lazy_init(self) -> None:
        paths: dict[int, list[str]] = {}  # state id -> the paths of its modules under the root
        states = []
        for path, m in self.module.named_modules():
            s = getattr(m, "_fsdp2d_fsdp", None)
            if s is not None:
                paths.setdefault(id(s), []).append(path)
                if s.module is m:
                    states.append(s)
        ctx = _Context(states)
        for s in states:
            s.ctx, s.is_root = ctx, s is self
            if s.group is not None:
                s.group.ctx = ctx
                s.group.label = ", ".join(paths[id(s)])  # e.g. "layers.0", "norm, output", "" (root)
        if self.group is not None and not self.group.reshard_after_forward_chosen:
            # the root's parameters are needed first in backward (as torch: unless the user chose)
            self.group.reshard_after_forward = False

    @_eager
    def pre_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.ctx is None:
            self._lazy_init()
        if _in_backward():
            return self._pre_recompute(args, kwargs)
        ctx = self.ctx
        if self.is_root and (ctx.callback_queued or any(s.in_backward for s in ctx.states)):
            ctx.recover()  # the previous backward raised before its callback could run
        if self.is_root:
            for s in ctx.states:  # a new forward: no list module is still pending
                s._pending.clear()
        first = not self._pending
        if first:
            self._pending = {id(m) for m in self.modules}
        if ctx.recording and first:
            ctx.order.append(self)
        if self.group is not None:  # idempotent for the later modules of a list
            self.group.sync_params()
            self.group.unshard(async_op=True)
        prefetch = self.forward_prefetch if self.forward_prefetch is not None else ctx.neighbour(self, 1)
        _issue_then_copy_out(self.group, prefetch if first else ())
        if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            args, kwargs = _cast((args, kwargs), self.mp.param_dtype)
        group = self.group
        if group is not None and group.num_trainable < len(group.params) and torch.is_grad_enabled():
            args, kwargs = _inputs_done_hook(group, (args, kwargs))  # see FSDPParamGroup.backward_done
        return args, kwargs

    def _pre_recompute(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The forward hook of an activation-checkpointing recompute: a checkpoint that
        calls the module itself (``checkpoint(block, x)``, transformers' pre-5
        ``GradientCheckpointingLayer``) runs these hooks again inside backward. Gather
        this group only (a no-op when its pre-backward hook or a backward prefetch already
        did): the recompute and then the group's own backward use it, and its
        post-backward reshards it. No forward prefetch (the next group's backward is
        over: nothing would use or free that gather), no forward order, no list
        bookkeeping (a non-reentrant recompute may stop early, mid-forward), as torch's
        FSDP2 in its pre-backward state."""
        group = self.group
        if group is not None:
            group.unshard()
            group.register_unsharded()
        if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            args, kwargs = _cast((args, kwargs), self.mp.param_dtype)
        # A reentrant recompute backpropagates its own graph, and its first forward ran
        # without autograd (no input tokens then): wait for the recompute's inputs. A
        # non-reentrant one's graph only supplies saved tensors: its forward's tokens stand.
        if group is not None and group.num_trainable < len(group.params) and torch.is_grad_enabled() \
                and not group.input_waits:
            args, kwargs = _inputs_done_hook(group, (args, kwargs))
        return args, kwargs

    @_eager
    def post_forward(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        # With autograd off no backward will reshard: do it now (the root included), or an
        # optimizer step before the next forward would leave stale unsharded weights. (A
        # grad-enabled forward never followed by backward leaves the root unsharded; its
        # next unshard re-gathers if the shards changed meanwhile, see unshard.)
        if _in_backward():  # a recompute (see _pre_recompute): the group's post-backward reshards
            return self._hook_output(output)
        self._pending.discard(id(module))
        last = not self._pending
        reshard = last and self.group is not None and not self.in_backward and \
            (self.group.reshard_after_forward or not torch.is_grad_enabled())
        if reshard:
            self.group.reshard()
        if self.ctx.recording and last:
            self.ctx.finished.append(self)
        if self.is_root and self.ctx.recording:
            self.ctx.recording = False
        return self._hook_output(output)

    def _hook_output(self, output: Any) -> Any:
        """Cast the output and hook its gradient (pre-backward). In a recompute the hook
        matters for a reentrant checkpoint, whose recomputed graph is backpropagated."""
        if self.mp.output_dtype is not None:
            output = _cast(output, self.mp.output_dtype)
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        return output

    @_eager
    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self.in_backward:
            return
        with _trace.span("pre_backward", self.group.label if self.group is not None else ""):
            self.in_backward = True
            self.ctx.queue_final_callback()
            if self.group is not None and self.group.unshard_in_backward:
                # accumulating (pipelining's micro-batches) on a group resharded since forward
                suspect = not self.group.requires_sync and _shards_registered(self.group)
                self.group.unshard(async_op=True)
                self.group.wait_unshard()  # the copy-out (a no-op when it is still gathered)
                self.group.register_unsharded()
                if suspect and not _weights_in_backward(self.group):
                    self.group.weights_skipped = True  # see _weights_in_backward
            # Then the prefetch: its gathered buffer is allocated after this group's is freed
            # (one block fewer live at the peak). On CUDA its all-gather waits for this
            # copy-out, whose own gather was prefetched a whole backward earlier.
            prefetch = self.backward_prefetch if self.backward_prefetch is not None else self.ctx.neighbour(self, -1)
            for s in prefetch:
                if not s.in_backward and s.group is not None and s.group.unshard_in_backward:
                    s.group.unshard(async_op=True)


def _issue_then_copy_out(group: FSDPParamGroup | None, prefetch: Any) -> None:
    """(Forward.) Issue the prefetches' all-gathers, then wait for ``group``'s own
    (issued by the caller) and copy it out. In this order on purpose: on CUDA an NCCL
    collective's stream first waits for the work queued so far on the compute stream,
    and the copy-out is queued behind this group's gather, so a prefetch issued after it
    could not start before this group's gather had finished (and on gloo it would reach
    the transport one copy-out later): the next gather would not overlap this one. In
    backward the gather of the group itself was prefetched earlier (see
    ``FSDPState._pre_backward``)."""
    for s in prefetch:
        if s.group is not None:
            s.group.unshard(async_op=True)
    if group is not None:
        group.wait_unshard()  # the copy-out
        group.register_unsharded()


def _shards_registered(group: FSDPParamGroup) -> bool:
    """Whether the modules hold the group's sharded parameters now (resharded since forward)."""
    p = next((p for p in group.params if p.sharded.requires_grad), None)
    return p is not None and p.module._parameters.get(p.name) is p.sharded


def _weights_in_backward(group: FSDPParamGroup) -> bool:
    """Whether the running backward reaches any of the group's trainable unsharded
    parameters (autograd's engine knows which nodes it will run). Not when it computes
    only input gradients: ``autograd.grad(out, inputs)``, as torch's pipelining does in the
    input step of its split (zero-bubble, DualPipeV) backward. Pipelining collects the
    stage's weights from ``submod.parameters()`` before that step and computes their
    gradients from them later: if the module had resharded after forward, it collected the
    shards, which are not in the graph, and those gradients are never computed (torch's
    FSDP2 loses them silently). The pre-backward then flags the group, and the torch-state
    view's ``post_backward`` (pipelining's end of step) refuses, naming it. Asked only for
    a group resharded since forward while gradients accumulate without sync (pipelining
    turns sync off for its micro-batches; a user's ``autograd.grad`` for input gradients
    outside an accumulation window is never flagged): one view and one engine query per
    such group and backward, nothing in ordinary training."""
    with torch.enable_grad():  # backward hooks run without grad mode: the view needs it
        for p in group.params:
            u = p.unsharded
            if u is None or not u.requires_grad:
                continue
            node = u.view_as(u).grad_fn.next_functions[0][0]  # its AccumulateGrad node
            try:
                if torch._C._will_engine_execute_node(node):
                    return True
            except RuntimeError:  # autograd.grad computing exactly these weights (captured)
                return True
    return False


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a forward now is a
    checkpoint's recompute)."""
    return torch._C._current_graph_task_id() != -1


class _Token:
    __slots__ = ("__weakref__",)


class InputsDone(torch.autograd.Function):
    """Identity on the forward inputs of a module with frozen parameters; its backward
    runs once their gradients are complete, i.e. after every op of the module between
    them and its outputs (as torch FSDP2's ``RegisterPostBackwardFunction``)."""

    @staticmethod
    def forward(ctx, group_ref: Any, token: _Token, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group_ref, ctx.token = group_ref, token
        ctx.set_materialize_grads(False)
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple:
        group = ctx.group_ref()
        if group is not None and ctx.token in group.input_waits:
            group.input_waits.discard(ctx.token)
            group.inputs_done += 1
            if group.ctx is not None and group.backward_done():
                group.ctx.post_backward(group)
        return (None, None, *grads)


def _inputs_done_hook(group: FSDPParamGroup, tree: Any) -> Any:
    leaves, spec = tree_flatten(tree)
    where = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not where:
        return tree
    token = _Token()
    group.input_waits.add(token)
    outs = InputsDone.apply(weakref.ref(group), token, *(leaves[i] for i in where))
    for i, t in zip(where, outs):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)
