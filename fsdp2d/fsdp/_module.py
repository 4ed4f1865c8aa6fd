"""``FSDPModule``: the class ``fully_shard`` mixes into a module, a subclass of torch's.

Code across the ecosystem asks ``isinstance(m, torch.distributed.fsdp.FSDPModule)``
(torchtitan's gradient-divide setting, Lightning's ``no_backward_sync``, accelerate's
"already sharded" check, torch's pipelining schedules) and then calls the public setters.
So fsdp2d's class subclasses torch's, and every method torch's class defines is defined
here again: the ones fsdp2d supports with torch's semantics, the others raising
``NotImplementedError`` naming the method and what to do instead. None falls through to
torch's code (which would look for torch's own state and fail with "No FSDP state
found"); ``tests/unit/test_fsdp_module_class.py`` compares the two classes' method lists,
so a method a newer torch adds is caught.

A module's class becomes ``FSDP<Orig>`` with MRO ``[FSDP<Orig>, fsdp2d.FSDPModule,
torch's FSDPModule, Orig, ...]``: the original class sits at index 3, as it does for
torch's own ``ReplicateModule`` (``_orig_cls_mro_index``), so ``__new__`` (slicing a
sharded ``nn.Sequential``) builds the original class, as torch's does.

Where torch reaches into its state (``fully_shard.state(m)``, ``m._get_fsdp_state()``),
it finds the read-only view of :mod:`._torch_state`.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as _TorchUnshardHandle
from torch.distributed.fsdp._fully_shard import _fully_shard as _torch_fully_shard

from ._state import FSDPState
from ._summon import summon_full_params
from ._torch_state import StateView, view_of

__all__ = ["FSDPModule", "UnshardHandle", "fsdp_class", "state_of"]


class UnshardHandle(_TorchUnshardHandle):
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the
    all-gather and registers the unsharded parameters on the module."""

    def __init__(self, state: FSDPState) -> None:
        self._state = state

    def wait(self) -> None:
        group = self._state.group
        if group is not None:
            group.wait_unshard()
            group.register_unsharded()


def _unsupported(name: str, instead: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"FSDPModule.{name} is not supported by fsdp2d: {instead}")

    method.__name__, method.__qualname__ = name, f"FSDPModule.{name}"
    method.__doc__ = f"Not supported by fsdp2d (raises NotImplementedError): {instead}"
    return method


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"FSDPModule.{name} takes a bool, got {value!r}")


class FSDPModule(_TorchFSDPModule):
    """Methods of every module passed to :func:`fsdp2d.fully_shard`; an instance of
    torch's ``FSDPModule`` too."""

    # [FSDP<Orig>, fsdp2d.FSDPModule, torch's FSDPModule, Orig, ...]
    _orig_cls_mro_index: int = 3
    _fsdp2d_fsdp: FSDPState

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Construct the original class, not the FSDP one (``model[0:2]`` on a sharded
        ``nn.Sequential`` builds a plain ``Sequential`` of the sharded children), as torch."""
        orig_cls = cls.__mro__[cls._orig_cls_mro_index]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        if _torch_fully_shard._enable_fsdp_module_new_init:  # torch's switch (torch.compile packages)
            self.__init__(*args, **kwargs)
        return self

    # -- state ---------------------------------------------------------------------------
    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        mods = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        states = [m._fsdp2d_fsdp for m in mods if isinstance(m, FSDPModule)]
        return list({id(s): s for s in states}.values())  # one state may serve a list of modules

    def _groups(self, recurse: bool) -> list[Any]:
        return [s.group for s in self._fsdp_states(recurse) if s.group is not None]

    def _get_fsdp_state(self) -> StateView:
        """The read-only view of this module's state that torch's code reads (pipelining,
        ``register_fsdp_forward_method``, ``share_comm_ctx``); see :mod:`._torch_state`."""
        return view_of(self._fsdp2d_fsdp)

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """``.to()``, ``.double()``, ``.float()``, ``to_empty()``: reshard first (so the
        sharded DTensors are what gets converted), then ``nn.Module``'s conversion, never
        torch's FSDP state code. The group adopts the converted shards at its next use
        (``FSDPParamGroup.sync_params``: a new dtype rebuilds its flat buffer; a device its
        mesh cannot gather on is refused there, naming the parameters)."""
        state = self.__dict__.get("_fsdp2d_fsdp")
        if state is not None and state.group is not None:
            state.group.reshard()
        return super(_TorchFSDPModule, self)._apply(*args, **kwargs)  # the original class's

    # -- gathering -----------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (e.g. to prefetch by hand); not
        recursive, as torch's."""
        state = self._fsdp2d_fsdp
        if state.group is not None:
            state.group.sync_params()
            state.group.unshard(async_op=True)
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters and register the shards again; not recursive."""
        if self._fsdp2d_fsdp.group is not None:
            self._fsdp2d_fsdp.group.reshard()

    def reset_iter_state(self) -> None:
        """After a forward or backward that raised: finish and discard in-flight
        collectives, drop the failed backward's pending reductions, reshard, reset
        per-iteration state (as torch). Gradients already accumulated unsharded under
        ``set_requires_gradient_sync(False)`` are kept, as torch keeps them: zero them to
        restart an accumulation. Call on the root; the next forward of the root does it by
        itself."""
        state = self._fsdp2d_fsdp
        if state.ctx is not None and not state.is_root:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        if state.ctx is not None:
            state.ctx.recover()

    # -- gradient synchronisation --------------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps unsharded gradients (accumulating microbatches, in
        ``reduce_dtype``, as torch FSDP2) and does not reduce-scatter; set True before the
        last microbatch to sync once. (Leaving it True accumulates too: every backward
        reduce-scatters and adds into the sharded ``.grad``s in the parameters' dtype,
        which keeps gradient memory at 1/dp for one reduce-scatter per microbatch, as
        torch FSDP2.) docs/accumulation.md compares the two."""
        for g in self._groups(recurse):
            g.requires_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """True (the default) keeps HSDP's all-reduce across replicas; without a replicate
        axis there is no all-reduce and the flag changes nothing, as torch. False on an
        HSDP group raises NotImplementedError (reduce-scatter-only accumulation is not
        implemented): use ``set_requires_gradient_sync(False)``, which skips both."""
        for g in self._groups(recurse):
            if not requires_all_reduce and g.replicate_group is not None:
                raise NotImplementedError(
                    f"FSDPModule.set_requires_all_reduce(False) on the HSDP group {g.label or '<root>'!r} is not "
                    f"supported by fsdp2d; use set_requires_gradient_sync(False) to accumulate without any collective")

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted with torch's meaning (whether the next backward finalises); fsdp2d
        finishes every reduction at the end of each backward anyway (no state crosses a
        backward), so gradients are complete either way. Recorded for the state view."""
        self._fsdp2d_fsdp.is_last_backward = bool(is_last_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduced gradients by ``factor`` instead of the data-parallel
        size (replicas x shards). ``1.0`` sums them: for a loss already divided by the global
        token count, as torchtitan's. This module's own group only, as torch's.

        Raises ValueError for a factor that is not a positive finite number."""
        if not (isinstance(factor, (int, float)) and 0 < factor < float("inf")):
            raise ValueError(f"set_gradient_divide_factor needs a positive finite factor, got {factor!r}")
        if self._fsdp2d_fsdp.group is not None:
            self._fsdp2d_fsdp.group.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in torch: :meth:`set_gradient_divide_factor`."""
        warnings.warn("Use `set_gradient_divide_factor` instead", DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """As torch's: ``True`` makes this module's gradient collectives reduce with SUM
        and divide afterwards. By default they divide inside the collective where the
        backend can (NCCL: ``ReduceOp.AVG``, or ``PREMUL_SUM`` for a custom factor, in
        float32 and bfloat16; fsdp2d's pairwise exchanges on gloo divide as they sum),
        with no separate division kernel, as torch FSDP2. This module's own group only."""
        if not isinstance(enable, bool):
            raise TypeError(f"set_force_sum_reduction_for_comms takes a bool, got {enable!r}")
        if self._fsdp2d_fsdp.group is not None:
            self._fsdp2d_fsdp.group.force_sum = enable

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Accepted, either value: fsdp2d's reduce-scatter always carries every parameter
        (zeros where a rank had no gradient, and a flag), so ranks that used different
        parameters never mismatch, and a parameter no rank used keeps ``.grad`` None."""
        _check_bool("set_reduce_scatter_unused_params", reduce_scatter_unused_params)

    # -- resharding policies -------------------------------------------------------------
    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether to free the unsharded parameters after forward (e.g. ``True`` on the
        root, which fsdp2d otherwise keeps gathered; ``False`` for evaluation)."""
        _check_bool("set_reshard_after_forward", reshard_after_forward)
        for g in self._groups(recurse):
            g.reshard_after_forward, g.reshard_after_forward_chosen = reshard_after_forward, True

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether to free the unsharded parameters after backward (``False`` saves the
        next forward's all-gather while accumulating microbatches, at their memory)."""
        for g in self._groups(recurse):
            g.reshard_after_backward = reshard_after_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: this module's backward does not all-gather its parameters (for
        modules whose backward reads no weight, e.g. an embedding); its gradients are
        still reduce-scattered. A backward that does read the weights then fails (their
        storage is freed), as torch's. This module's own group only."""
        _check_bool("set_unshard_in_backward", unshard_in_backward)
        if self._fsdp2d_fsdp.group is not None:
            self._fsdp2d_fsdp.group.unshard_in_backward = unshard_in_backward

    # -- prefetching ---------------------------------------------------------------------
    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters when this module's forward starts."""
        self._fsdp2d_fsdp.forward_prefetch = [state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters when this module's backward starts."""
        self._fsdp2d_fsdp.backward_prefetch = [state_of(m) for m in modules]

    # -- performance knobs with nothing to change in fsdp2d ----------------------------------
    def set_post_optim_event(self, event: torch.Event) -> None:
        """Accepted: fsdp2d issues each all-gather from the current stream, after the
        optimizer step queued on it, so there is no earlier point to wait for; the event
        is not kept (as torch discards it after one use)."""

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Accepted: fsdp2d allocates gathered buffers on the compute stream already."""
        _check_bool("_set_unshard_async_op", async_op)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Validated as torch's, then accepted: fsdp2d keeps one reduce-scatter in flight
        and frees each input once it is sent; the value changes timing only in torch."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Accepted: a timing option in torch (one more communicator so the reduce-scatter
        can run beside the all-gather); fsdp2d keeps one group per mesh axis."""
        _check_bool("set_separate_reduce_scatter_group", enable)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """``False`` (the default) is accepted; ``True`` raises NotImplementedError."""
        if enable:
            raise NotImplementedError(
                "FSDPModule.set_allocate_memory_from_process_group_for_comm(True) is not supported by fsdp2d: "
                "its collectives use buffers from torch's allocator; leave it False")

    set_custom_all_gather = _unsupported(
        "set_custom_all_gather", "fsdp2d issues its own flat all-gather per group; use torch's fully_shard "
        "for a custom all-gather")
    set_custom_reduce_scatter = _unsupported(
        "set_custom_reduce_scatter", "fsdp2d issues its own flat reduce-scatter per group; use torch's "
        "fully_shard for a custom reduce-scatter")
    set_all_reduce_hook = _unsupported(
        "set_all_reduce_hook", "reduce across replicas with fully_shard(mesh=mesh['replicate', 'shard']) "
        "(HSDP), or all-reduce the sharded .grad's after backward")
    set_symm_mem_for_comm = _unsupported(
        "set_symm_mem_for_comm", "fsdp2d does not allocate collective buffers in symmetric memory")

    # -- fsdp2d's own ----------------------------------------------------------------------
    def summon_full_params(self, writeback: bool = True) -> contextlib.AbstractContextManager:
        return summon_full_params(self, writeback=writeback)  # type: ignore[arg-type]


def state_of(module: nn.Module) -> FSDPState:
    """The fsdp2d state of an FSDP module; ValueError (torch's type) for another module."""
    if not isinstance(module, FSDPModule):
        raise ValueError(f"Expects an fsdp2d FSDPModule but got {type(module).__name__}: call fsdp2d.fully_shard "
                         f"on it first")
    return module._fsdp2d_fsdp


_FSDP_CLASSES: dict[type, type] = {}


def fsdp_class(cls: type) -> type:
    """``FSDP<cls>``: ``cls`` with :class:`FSDPModule` first in its MRO (one per class)."""
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": _no_deepcopy})
    return _FSDP_CLASSES[cls]


def _no_deepcopy(*args, **kwargs):
    # torch FSDP2's own refusal, word for word: a copy would share the flat buffers and
    # process groups of the original (and its hooks would drive the original's state)
    raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")
