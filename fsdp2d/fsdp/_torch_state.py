"""The read-only view of fsdp2d's state that torch's own code finds on an FSDP module.

torch reaches past ``FSDPModule``'s methods into its state in a few places:
``fully_shard.state(m)`` (pipelining's ``_PipelineStageBase.perform_reduce_grad``),
``m._get_fsdp_state()`` (``register_fsdp_forward_method``, ``share_comm_ctx``). ``fully_shard``
plants a :class:`StateView` where both look (torch's composable-API state dict on the
module, keyed by torch's ``fully_shard`` function, and its registry entry, so torch's
``fully_shard`` or ``replicate`` applied on top refuses the module as already sharded).

The view exposes exactly what those callers use, mapped onto fsdp2d's hooks:

==========================================  ============================================
``_pre_forward`` / ``_post_forward``        the module's forward hooks
``_root_pre_forward`` / ``_lazy_init``      root initialisation (inputs unchanged)
``_state_ctx.all_states``                   the views of every state under the root
``_state_ctx.is_last_backward``             ``FSDPModule.set_is_last_backward``
``_fsdp_param_group(s)``                    :class:`GroupView` (0 or 1 per state)
``_root_post_backward_final_callback()``    the end-of-backward flush (finish reductions)
``_comm_ctx``                               a token; ``share_comm_ctx`` may share it
==========================================  ============================================

:class:`GroupView` has ``post_backward()`` (reduce-scatter now what backward left in the
unsharded gradients, or accumulate them without sync, then reshard per the policy:
pipelining calls it once per step after its microbatches; it refuses a tree where a split
backward met a resharded module, see ``_refuse_skipped_weights``), ``unshard``/``reshard``/
``wait_for_unshard``/``lazy_init`` and the flags the setters set. Anything else raises
``AttributeError`` naming the attribute and that fsdp2d does not expose it; nothing can be
assigned (except the stream token ``share_comm_ctx`` writes, which changes nothing: fsdp2d
uses one side stream per device for every group).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, RegistryItem
from torch.distributed.fsdp import fully_shard as _torch_fully_shard

__all__ = ["StateView", "GroupView", "view_of", "plant", "state_view"]

# contract() keys a module's states by the undecorated function (functools.wraps keeps it)
_STATE_FN = _torch_fully_shard.__wrapped__


class CommContext:
    """What ``_comm_ctx`` returns: fsdp2d keeps no per-root streams (one side stream per
    device serves every group), so sharing it between roots (``share_comm_ctx``, for
    pipeline stages) is accepted and changes nothing."""

    __slots__ = ()


_COMM_CONTEXT = CommContext()


class _View:
    """Attribute access raises naming what fsdp2d does not expose; assignment raises."""

    __slots__ = ("_target",)
    _kind = "state"
    _writable: frozenset[str] = frozenset()

    def __init__(self, target: Any) -> None:
        object.__setattr__(self, "_target", target)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"fsdp2d's view of fully_shard's {self._kind} has no {name!r}: fsdp2d exposes to torch "
                             f"only what pipelining, register_fsdp_forward_method and share_comm_ctx read; use the "
                             f"FSDPModule methods (set_requires_gradient_sync, unshard, ...) instead")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._writable and isinstance(value, CommContext):
            return  # share_comm_ctx: nothing to share (see CommContext)
        raise AttributeError(f"fsdp2d's view of fully_shard's {self._kind} is read-only (setting {name!r}); "
                             f"use the FSDPModule methods instead")


class StateView(_View):
    """What torch reads of one ``fully_shard`` call's state (see the module docstring)."""

    __slots__ = ()
    _writable = frozenset({"_comm_ctx"})

    @property
    def _fsdp_param_groups(self) -> list["GroupView"]:
        state = self._target
        return [GroupView(state)] if state.group is not None else []

    @property
    def _fsdp_param_group(self) -> "GroupView | None":
        groups = self._fsdp_param_groups
        return groups[0] if groups else None

    @property
    def _state_ctx(self) -> "ContextView":
        return ContextView(self._target)

    @property
    def _comm_ctx(self) -> CommContext:
        return _COMM_CONTEXT

    @property
    def _is_root(self) -> bool | None:
        state = self._target
        return None if state.ctx is None else state.is_root

    @property
    def _modules(self) -> tuple[nn.Module, ...]:
        return tuple(self._target.modules)

    @property
    def _mp_policy(self) -> Any:
        return self._target.mp

    @property
    def _states_to_forward_prefetch(self) -> list["StateView"]:
        return [view_of(s) for s in self._target.forward_prefetch or ()]

    @property
    def _states_to_backward_prefetch(self) -> list["StateView"]:
        return [view_of(s) for s in self._target.backward_prefetch or ()]

    def _lazy_init(self) -> None:
        """Make this state the root of the states under its module (a no-op once done).
        Called explicitly (torch's API) it refuses what torch's refuses; fsdp2d's own first
        forward makes whichever module runs first the root."""
        state = self._target
        if state.ctx is not None:
            return
        if len(state.modules) > 1:
            raise RuntimeError(f"FSDP requires a single root module but got {state.modules}")
        for path, m in state.module.named_modules():
            inner = m.__dict__.get("_fsdp2d_fsdp")
            if inner is not None and inner is not state and inner.ctx is not None:
                raise RuntimeError(f"FSDP state has already been lazily initialized for {path}\n"
                                   f"FSDP requires running forward through the root module first")
        state._lazy_init()

    def _root_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._lazy_init()
        return args, kwargs

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self._target.pre_forward(module, args, kwargs)

    def _post_forward(self, module: nn.Module, input: Any, output: Any) -> Any:
        return self._target.post_forward(module, input, output)

    def _root_post_backward_final_callback(self) -> None:
        """Finish every reduction of this root's groups and reshard per the policies (what
        fsdp2d queues at the end of each backward; pipelining calls it after its explicit
        ``post_backward``s)."""
        ctx = self._target.ctx
        if ctx is not None:
            ctx.final_callback()


class ContextView(_View):
    """``_state_ctx``: what is shared by the states under one root."""

    __slots__ = ()
    _kind = "state context"

    @property
    def all_states(self) -> list[StateView]:
        ctx = self._target.ctx
        return [view_of(s) for s in ctx.states] if ctx is not None else []

    @property
    def is_last_backward(self) -> bool:
        ctx = self._target.ctx
        root = next((s for s in ctx.states if s.is_root), self._target) if ctx is not None else self._target
        return root.is_last_backward

    @property
    def post_backward_final_callback_queued(self) -> bool:
        ctx = self._target.ctx
        return ctx is not None and ctx.callback_queued


class GroupView(_View):
    """``_fsdp_param_group``: one ``fully_shard`` call's parameter group."""

    __slots__ = ()
    _kind = "parameter group"
    _writable = frozenset({"comm_ctx"})

    @property
    def _group(self) -> Any:
        return self._target.group

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        return tuple(self._target.modules)

    @property
    def _module_fqn(self) -> str:
        return self._group.label

    @property
    def comm_ctx(self) -> CommContext:
        return _COMM_CONTEXT

    @property
    def fsdp_params(self) -> list["ParamView"]:
        state = self._target
        paths: dict[int, str] = {}
        if state.ctx is not None:  # fqns from the root, as torch's _param_fqn
            root = next((s for s in state.ctx.states if s.is_root), state)
            paths = {id(m): name for name, m in root.module.named_modules()}
        return [ParamView((p, paths.get(id(p.unit)))) for p in self._group.params]

    @property
    def is_unsharded(self) -> bool:
        return bool(self._group.unsharded)

    @property
    def reduce_grads(self) -> bool:
        return self._group.requires_sync

    @property
    def all_reduce_grads(self) -> bool:
        return self._group.requires_sync

    @property
    def reshard_after_backward(self) -> bool:
        return self._group.reshard_after_backward

    @property
    def unshard_in_backward(self) -> bool:
        return self._group.unshard_in_backward

    @property
    def gradient_divide_factor(self) -> float:
        return self._group.divide_factor

    @property
    def force_sum_reduction_for_comms(self) -> bool:
        return self._group.force_sum

    def lazy_init(self) -> None:
        self._group.sync_params()

    def unshard(self, async_op: bool = False) -> None:
        group = self._group
        group.sync_params()
        group.unshard(async_op=async_op)
        if not async_op:
            group.register_unsharded()

    def wait_for_unshard(self) -> None:
        self._group.wait_unshard()
        self._group.register_unsharded()

    def reshard(self) -> None:
        self._group.reshard()

    def post_backward(self, *unused: Any) -> None:
        """Reduce-scatter what backward left in the unsharded gradients (with
        ``requires_gradient_sync``; otherwise accumulate them unsynced), then reshard per
        ``reshard_after_backward``; idempotent, a no-op for a group with nothing pending.
        Gradients that autograd's hooks did not report count too: pipelining's
        zero-bubble weight step assigns ``.grad`` directly."""
        group = self._group
        _refuse_skipped_weights(group)
        _mark_stage(group)
        pending = any(p.unsharded is not None and p.unsharded.grad is not None or p.acc_grad is not None
                      for p in group.params)
        group.needs_reduce = group.needs_reduce or pending
        if group.ctx is not None:
            group.ctx.post_backward(group)
        elif group.reshard_after_backward:  # never ran forward: nothing to reduce
            group.reshard()


def _mark_stage(group: Any) -> None:
    """Only torch's pipelining calls a group's ``post_backward`` (``perform_reduce_grad``):
    its sharded parameters are a pipeline stage's, which ``fsdp2d.clip_grad_norm_`` refuses
    (it would count the other stages as copies of this one). Marked once per parameter
    object (a rebuilt group's new ones are marked at its next step)."""
    for p in group.params:
        if not getattr(p.sharded, "_fsdp2d_pipeline_stage", False):
            p.sharded._fsdp2d_pipeline_stage = True


def _refuse_skipped_weights(group: Any) -> None:
    """Pipelining's end of step on a tree where a split backward (the input step of the
    zero-bubble and DualPipeV schedules) ran on a module resharded after forward: its
    weight gradients were never computed (see ``_state._weights_in_backward``). Refused
    before any group of the tree reduces, so every rank stops at the same point."""
    states = group.ctx.states if group.ctx is not None else []
    skipped = [s.group for s in states if s.group is not None and s.group.weights_skipped]
    if skipped:
        for g in skipped:
            g.weights_skipped = False
        names = ", ".join(repr(g.label or "<root>") for g in skipped)
        raise RuntimeError(f"fsdp2d: torch's pipelining ran a split backward (input step, then weight step) on "
                           f"{names} after fully_shard resharded its parameters at the end of forward, so their "
                           f"gradients were never computed (torch's FSDP2 drops them silently); call fully_shard "
                           f"on each stage's modules with reshard_after_forward=False")


class ParamView(_View):
    """One parameter of a group: its sharded and unsharded parameters and its name."""

    __slots__ = ()
    _kind = "parameter"

    @property
    def _param_fqn(self) -> str:
        p, prefix = self._target
        return f"{prefix}.{p.fqn}" if prefix else p.fqn

    @property
    def sharded_param(self) -> Any:
        return self._target[0].sharded

    @property
    def unsharded_param(self) -> Any:
        return self._target[0].unsharded


def view_of(state: Any) -> StateView:
    """The one :class:`StateView` of an fsdp2d ``FSDPState``."""
    view = state.__dict__.get("view")
    if view is None:
        view = state.view = StateView(state)
    return view


def plant(module: nn.Module, state: Any) -> None:
    """Put ``state``'s view where torch's ``fully_shard.state(module)`` looks, and register
    ``fully_shard`` in the module's composable-API registry (as torch's ``contract`` does)."""
    states = module.__dict__.setdefault(STATE_KEY, OrderedDict())
    states[_STATE_FN] = view_of(state)
    module.__dict__.setdefault(REGISTRY_KEY, OrderedDict())["fully_shard"] = RegistryItem()


def state_view(module: nn.Module) -> StateView | None:
    """``fsdp2d.fully_shard.state(module)``, as torch's ``fully_shard.state``: the view of
    the state of the ``fully_shard`` call that sharded ``module``, None if none did."""
    return module.__dict__.get(STATE_KEY, {}).get(_STATE_FN)
