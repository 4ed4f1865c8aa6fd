"""One ``fully_shard`` group: a flat buffer, one all-gather, one reduce-scatter.

All parameters managed by one ``fully_shard`` call share a flat 1-D buffer of
``sum(segment_numel)`` elements per rank; each sharded ``nn.Parameter`` is a DTensor
whose local tensor is a view into it, so the all-gather sends the buffer itself (no
packing copy) and the optimizer's in-place updates land in it. ``unshard`` gathers
``(k, total)`` and copies every parameter out with one op; ``reduce_grads`` packs the
unsharded gradients into ``(k, total)`` with one op, reduce-scatters into ``(total,)``
and hands each sharded parameter a DTensor gradient whose local tensor is a view of it
(averaged over the data-parallel ranks, in ``reduce_dtype``).

Both collectives can be asynchronous (gloo and NCCL run them on their own threads or
streams): ``unshard(async_op=True)`` returns at once and ``wait_unshard`` finishes it
(over shared memory it copies every rank's piece straight out of where it lies, with no
gathered buffer); reduce-scatters are waited on in ``finish_reduce`` (before the next one
starts, and at the end of backward, before the optimizer can run). With a replicate axis
(HSDP) the reduced shard is then all-reduced over it, asynchronously too: started by
``advance_reduce`` when the next group's gradients are ready and finished when those of
the group after that are, so it runs during that group's backward (the end of backward
starts every pending one before waiting for any). ``wait_unshard`` and ``reshard`` drop the
gather's handle before waiting on it: if the wait raises, the next unshard gathers again
rather than taking the spent handle as done.

This file holds the flat buffer and the group's state; the all-gather half (unshard,
reshard, staleness and edits while gathered) is :mod:`._unshard`, the gradient half
:mod:`._grads`.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from .. import _collectives as C
from .._dtensor import as_dtensor, install_rest_hooks, local_of
from .._stale import mark_replaced
from ._grads import GradReduction
from ._param import FSDPParam, alias, is_storage, storage_of
from ._policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._unshard import Unshard, _Gather


def offload_placement(fqns: list[str], source: torch.device, mesh_device: torch.device) -> tuple[torch.device, torch.device]:
    """With ``CPUOffloadPolicy``: (where the shards are stored, where the group computes)
    for parameters found on ``source``. As torch's FSDP2: the shards live on the host and
    are gathered to the mesh's device (never to the parameters' own); a meta model stays
    meta (nothing allocated) until it is materialised. Materialised on an accelerator
    (``to_empty(device="cuda")``, a CUDA state dict with ``assign=True``) is refused, naming
    the parameters, as torch refuses it: an optimizer built on those objects would step
    tensors that no longer hold the weights."""
    if source.type not in ("cpu", "meta"):
        names = ", ".join(fqns[:4]) + (f" and {len(fqns) - 4} more" if len(fqns) > 4 else "")
        raise RuntimeError(f"fully_shard with CPUOffloadPolicy: {names} are on {source}; materialise the "
                           f"parameters on the CPU (module.to_empty(device='cpu'), or load a CPU state dict), "
                           f"as torch's FSDP2 requires: the shards stay on the host and are gathered to {mesh_device}")
    return source, mesh_device


def check_mesh_device(fqns: list[str], device: torch.device, mesh_device: torch.device) -> None:
    """(Without CPU offload.) Parameters found on ``device`` are gathered by the mesh's
    collectives on ``mesh_device``: they must be of its type (or meta: not materialised).
    A model moved after ``fully_shard`` (``.cuda()`` on a CPU mesh, ``.cpu()`` on a CUDA one)
    is refused at the group's next use, naming the parameters."""
    if device.type not in ("meta", mesh_device.type):
        names = ", ".join(fqns[:4]) + (f" and {len(fqns) - 4} more" if len(fqns) > 4 else "")
        raise RuntimeError(f"fully_shard: parameters {names} are on {device}, but the mesh's collectives run on "
                           f"{mesh_device.type}; move the model before fully_shard (or materialise it with "
                           f"to_empty(device={mesh_device.type!r})), or build the mesh on {device.type}")


class FSDPParamGroup(Unshard, GradReduction):
    def __init__(self, params: list[FSDPParam], shard_group: C.Group, replicate_group: C.Group | None,
                 mp: MixedPrecisionPolicy, offload: OffloadPolicy, fqn: str,
                 mesh_device: torch.device | None = None) -> None:
        self.params, self.fqn, self.mp, self.offload = params, fqn, mp, offload
        self.mesh_device = mesh_device or torch.device("cpu")  # where the mesh's collectives run
        self.label = fqn  # its module path once the root knows it (profiler ranges, errors)
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.k = C.group_size(shard_group)
        self.has_ext = any(p.ext is not None for p in params)  # gathers bytes: see _unshard
        self.dp_size = self.k * C.group_size(replicate_group)
        self.divide_factor = float(self.dp_size)  # set_gradient_divide_factor: 1.0 sums gradients
        self.force_sum = False  # set_force_sum_reduction_for_comms: SUM, then a division of its own
        offset = 0
        for p in params:
            p.offset, offset = offset, offset + p.segment_numel
        self.total = offset
        dtypes = {p.sharded.dtype for p in params}
        if len(dtypes) > 1 and mp.param_dtype is None:
            names = ", ".join(f"{p.fqn}: {p.sharded.dtype}" for p in params[:6])
            raise ValueError(
                f"fully_shard({fqn or '<root>'}): parameters have mixed dtypes ({names}); one group "
                f"all-gathers one buffer, so set MixedPrecisionPolicy(param_dtype=...) or cast the module"
            )
        self.dtype = params[0].sharded.dtype if params else torch.float32  # _build_flat refreshes
        self.param_dtype = mp.param_dtype or self.dtype
        self.reduce_dtype = mp.reduce_dtype or self.param_dtype
        self.flats: dict[torch.dtype, torch.Tensor] = {}  # sharded storage, one per parameter dtype
        self.requires_sync = True
        self.reshard_after_forward = True
        self.reshard_after_forward_chosen = False  # by fully_shard's keyword or the setter: kept on the root
        self.reshard_after_backward = True
        self.unshard_in_backward = True  # FSDPModule.set_unshard_in_backward
        self.unsharded = False
        self._gather: _Gather | None = None
        self._reduce: tuple[Any, torch.Tensor] | None = None
        # CPU offload: (side-stream event, tensors it reads) of the gradient copies to the
        # host in flight (see finish_reduce), held until the event is waited for
        self.offload_event: tuple[Any, Any] | None = None
        self.host_reads: Any = None  # CPU offload: the side stream's event after the last copy out of the shards
        self._reads_before: Any = None  # host_reads when the gradient copy's event was recorded
        self.grads_ready = 0
        self.num_trainable = 0  # set by _sync_requires_grad
        # With frozen parameters: the module's forward inputs still awaiting their
        # gradient (weak tokens: a graph never backpropagated drops its own), and how many
        # arrived in this backward (see backward_done and _state.InputsDone).
        self.input_waits: weakref.WeakSet = weakref.WeakSet()
        self.inputs_done = 0
        self._gathered_versions: tuple = ()  # _shard_versions() at the last gather
        self.optimizer_steps = [0]  # steps of optimizers holding our parameters (see _unshard._count_step)
        self._copied_versions: list[int] = []  # each unsharded parameter's version at the last copy-out
        self.needs_reduce = False
        self.weights_skipped = False  # a backward skipped the weights of the resharded group (see _state)
        self.counts = {"all_gather": 0, "reduce_scatter": 0}
        self._flags: tuple | None = None  # (key, has-gradient flags) when every trainable one is present
        # FSDP1 front end (fsdp2d.fsdp1): grad_dtype keeps gradients in another dtype than the
        # parameters' (keep_low_precision_grads); flat_param, when set, is one DTensor
        # Parameter over the flat storage that receives one flat gradient instead of the
        # per-parameter ones (use_orig_params=False).
        self.grad_dtype: torch.dtype | None = None
        self.accumulate_in_compute_dtype = False  # FSDP1: no-sync sums in param_dtype (see accumulation_dtype)
        self._flat_param: torch.nn.Parameter | None = None
        self.compute_device = params[0].sharded.device if params else torch.device("cpu")
        self._build_flat(self.compute_device, initial=True)

    # -- the flat sharded buffer --------------------------------------------------------
    def _build_flat(self, device: torch.device, initial: bool = False) -> None:
        """Copy every parameter's shard rows into fresh flat buffers (one per dtype; one
        in all but mixed-dtype groups) and make each registered parameter a view of its
        slot (the same Parameter object when it exists, so optimizers keep working).
        ``device``: where the parameters were found; with CPU offload the shards are stored
        on the host (at ``fully_shard`` a model on the accelerator moves there, as torch's;
        later, see :func:`offload_placement`) and the group computes on the mesh's device."""
        store = device
        if isinstance(self.offload, CPUOffloadPolicy) and any(p.ext is not None for p in self.params):
            p = next(p for p in self.params if p.ext is not None)
            raise NotImplementedError(f"fully_shard: parameter {p.fqn!r} ({p.ext.cls.__name__}) uses FSDP2's "
                                      f"all-gather extension, which fsdp2d does not combine with CPUOffloadPolicy: drop "
                                      f"offload_policy, or turn the extension off (torchao: "
                                      f"enable_fsdp_float8_all_gather=False)")
        if isinstance(self.offload, CPUOffloadPolicy) and self.mesh_device.type != "cpu":
            source = torch.device("cpu") if initial and device.type not in ("cpu", "meta") else device
            store, device = offload_placement([p.fqn for p in self.params], source, self.mesh_device)
        else:
            check_mesh_device([p.fqn for p in self.params], device, self.mesh_device)
        current_dtypes = {p.module._parameters[p.name].dtype for p in self.params}
        if len(current_dtypes) > 1 and self.mp.param_dtype is None:
            raise ValueError(f"fully_shard({self.fqn}): parameters now have mixed dtypes {sorted(map(str, current_dtypes))}; "
                             f"cast the whole module or set MixedPrecisionPolicy(param_dtype=...)")
        self.dtype = self.params[0].module._parameters[self.params[0].name].dtype
        self.param_dtype = self.mp.param_dtype or self.dtype
        self.reduce_dtype = self.mp.reduce_dtype or self.param_dtype
        sizes: dict[torch.dtype, int] = {}
        for p in self.params:
            dtype = p.module._parameters[p.name].dtype
            p.store_offset, sizes[dtype] = sizes.get(dtype, 0), sizes.get(dtype, 0) + p.segment_numel
        self.flats = {dtype: torch.zeros(n, dtype=dtype, device=store) for dtype, n in sizes.items()}
        if store.type == "cpu" and self._offloading(device) and getattr(self.offload, "pin_memory", False):
            self.flats = {d: f.pin_memory() for d, f in self.flats.items()}
        for p in self.params:
            current = p.module._parameters[p.name]
            p.requires_grad = current.requires_grad
            flat = self.flats[current.dtype]
            view = alias(flat, p.store_offset, p.shard_shape)
            with torch.no_grad():
                src = _shard_source(p, current)
                if src.device.type != "meta" and store.type != "meta":
                    view.copy_(p.ext.data_of(src) if p.ext is not None else src)
            local = p.ext.wrap(view) if p.ext is not None else view  # the subclass around our rows
            spec, old = p.spec(current.dtype), p.sharded
            if isinstance(current, DTensor) and isinstance(current, torch.nn.Parameter) and current._spec == spec:
                current._local_tensor = local  # keep the object the optimizer may already hold
                p.sharded = current
            else:
                p.sharded = torch.nn.Parameter(as_dtensor(local, spec), requires_grad=p.requires_grad)
                mark_replaced(current, p.fqn, "fully_shard")
            if old is not current and old is not p.sharded:
                mark_replaced(old, p.fqn, "to_empty(), .to() or load_state_dict(assign=True) on the model")
            p.expected_local = local_of(p.sharded)  # (for a subclass: the object the DTensor holds,
            # a new wrapper when nn.Parameter detached it)
            p.sharded_storage = storage_of(p.sharded)
            p.sharded._fsdp2d_steps = self.optimizer_steps
            p.register("sharded")
            for owner, _ in [(p.module, p.name), *p.aliases]:
                install_rest_hooks(owner, self.to_rest)
            p.make_unsharded(self.param_dtype, device)
        self._sync_requires_grad()
        self.compute_device = device
        if self.flat_param is not None:  # rebuilt storage: the flat parameter follows it
            self.flat_param._local_tensor = next(iter(self.flats.values()))

    @property
    def flat_param(self) -> torch.nn.Parameter | None:
        return self._flat_param

    @flat_param.setter
    def flat_param(self, param: torch.nn.Parameter | None) -> None:
        self._flat_param = param
        if param is not None:  # an optimizer stepping it steps this group (see optimizer_steps)
            param._fsdp2d_steps = self.optimizer_steps

    def _sync_requires_grad(self) -> None:
        """Follow ``requires_grad`` changes made after ``fully_shard`` (freezing layers)."""
        for p in self.params:
            wanted = p.sharded.requires_grad
            if p.unsharded.requires_grad != wanted:
                p.unsharded.requires_grad_(wanted)
            p.requires_grad = wanted
            if wanted and not getattr(p.unsharded, "_fsdp2d_hooked", False):
                p.unsharded.register_post_accumulate_grad_hook(_weak_hook(self))
                p.unsharded._fsdp2d_hooked = True
        self.num_trainable = sum(p.requires_grad for p in self.params)

    def _replaced(self, p: FSDPParam) -> bool:
        """The module no longer holds our parameters: a new object (``to_empty()`` on a
        meta model, ``load_state_dict(assign=True)``), or our object whose contents were
        swapped (``to_empty()``/``.double()``/``.to()`` on a real model: torch swaps a
        DTensor parameter's contents, local tensor included). Not a ``p.data = t`` on it,
        which leaves the local tensor in place (see :meth:`_refuse_data_assigned`)."""
        current = p.module._parameters[p.name]
        if current is p.unsharded:
            return False
        if current is not p.sharded:
            return True
        if not _holds_local(p, current):
            return True
        return is_storage(current, p.sharded_storage) and current.dtype not in self.flats

    def _refuse_data_assigned(self) -> None:
        """``p.data = t`` on a sharded parameter: torch's DTensor keeps computing with its
        old local tensor, so the new values are out of reach (and lost on torch's FSDP2
        too). Refused, naming the parameter, before anything reads the shards; the
        assignment is undone so that the model stays usable."""
        for p in self.params:  # (contents swapped, local tensor included: a replacement, see _replaced)
            if not is_storage(p.sharded, p.sharded_storage) and _holds_local(p, p.sharded):
                p.restore_sharded()
                raise RuntimeError(
                    f"fsdp2d: parameter {p.fqn!r} of fully_shard({self.label or '<root>'}) had its .data assigned "
                    f"(p.data = t, or torch.nn.utils.vector_to_parameters) on its sharded DTensor; torch's DTensor "
                    f"keeps computing with its old local tensor, so the new values were lost (on torch's FSDP2 as "
                    f"well) and the assignment is undone. Copy the values in instead: with torch.no_grad(): "
                    f"p.copy_(t) (a DTensor, or the full tensor through load_state_dict)")

    def _send_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's all-gather input in ``dtype``: the flat buffer itself when it has
        that dtype, a cast copy otherwise (mixed dtypes: packed in group order). Blocking
        (the training path's gather with CPU offload is :meth:`_copy_in_offloaded`)."""
        if len(self.flats) == 1:
            return next(iter(self.flats.values())).to(self.compute_device, dtype)
        send = torch.zeros(self.total, dtype=dtype, device=self.compute_device)
        for p in self.params:
            src = self.flats[p.sharded.dtype][p.store_offset:p.store_offset + p.segment_numel]
            send[p.offset:p.offset + p.segment_numel].copy_(src)
        return send

    def _offloading(self, device: torch.device) -> bool:
        return isinstance(self.offload, CPUOffloadPolicy) and device.type != "cpu"

    def sync_params(self) -> None:
        """Adopt parameters replaced behind our back (``to_empty()``, ``load_state_dict``
        with assign): rebuild the flat buffer from whatever the modules now hold. Refuse
        a ``.data`` assignment to a sharded parameter (:meth:`_refuse_data_assigned`)."""
        if not self.params:
            return
        replaced = [p for p in self.params if self._replaced(p)]
        self._refuse_data_assigned()
        if replaced:
            self.wait_unshard()
            self.unsharded = False  # the rebuild makes new (freed) unsharded parameters
            self._build_flat(replaced[0].module._parameters[replaced[0].name].device)
        elif any(p.unsharded.requires_grad != p.sharded.requires_grad for p in self.params):
            self._sync_requires_grad()

    def to_rest(self) -> None:
        """Register the sharded (DTensor) parameters if the unsharded ones are out (or an
        all-gather is in flight); otherwise change nothing: the modules may hold what a
        ``load_state_dict(assign=True)`` just put there."""
        if self.unsharded or self._gather is not None:
            self.reshard()
        self.wait_host_reads()  # (load_state_dict writes the host shards: see Unshard.wait_host_reads)

    def register_unsharded(self) -> None:
        for p in self.params:
            p.register("unsharded")

    # -- gradients -------------------------------------------------------------------
    def _on_grad_ready(self, _param: torch.Tensor) -> None:
        self.grads_ready += 1
        self.needs_reduce = True
        if self.backward_done():
            self.ctx.post_backward(self)

    def backward_done(self) -> bool:
        """Whether this backward is done with the unsharded parameters. A trainable
        parameter's gradient arrives after every op that used it, so the last one ends
        the group's backward, unless some parameters are frozen: autograd may still need
        their weights after that (the input gradient through a frozen weight), so then
        the gradients of the module's inputs must have arrived too (without any, e.g.
        token ids, the end-of-backward callback reshards)."""
        if self.grads_ready < self.num_trainable:
            return False
        return self.num_trainable == len(self.params) or (self.inputs_done > 0 and not self.input_waits)

    # -- exact gathers (summon_full_params) ----------------------------------------------
    def gather_exact(self) -> list[torch.Tensor]:
        """Every parameter unsharded over the data axis in its own dtype (no cast): a
        synchronous all-gather into fresh tensors, leaving the group's state alone."""
        send = self._send_buffer(self.dtype) if len(self.flats) == 1 else None
        out = []
        if send is not None:
            gathered = C.all_gather(send, 0, self.shard_group).view(self.k, self.total)
            for p in self.params:
                full = torch.empty(p.unsharded_shape, dtype=self.dtype, device=self.compute_device)
                p.copy_in(gathered, full)
                out.append(full)
            return out
        for p in self.params:  # mixed dtypes: one gather per parameter (rare; inspection only)
            seg = self.flats[p.sharded.dtype][p.store_offset:p.store_offset + p.segment_numel]
            gathered = C.all_gather(seg.to(self.compute_device), 0, self.shard_group).view(self.k, -1)
            full = torch.empty(p.unsharded_shape, dtype=p.sharded.dtype, device=self.compute_device)
            p.copy_in(gathered, full, offset=0)
            out.append(full)
        return out


def _shard_source(p: FSDPParam, current: torch.Tensor) -> torch.Tensor:
    """This rank's rows of whatever the module holds, read from its placements, never
    from its local shape: a DTensor laid out as our shard (``to_empty()``, ``.to()``), a
    DTensor with the parameter's TP layout (at ``fully_shard``: TP-local, we take our
    rows), or a plain tensor of the global shape (we take our box)."""
    if isinstance(current, DTensor):
        spec, placements = current._spec, tuple(current.placements)
        if spec.mesh == p.spec_mesh and placements == p.layout.placements:
            return current._local_tensor
        tp_mesh = p.tp.mesh if p.tp is not None else None
        if spec.mesh == tp_mesh and placements == p.tp.layout.placements:
            return p.shard_of(current._local_tensor)
        raise ValueError(f"fully_shard: parameter {p.fqn!r} is a DTensor with placements {placements} on {spec.mesh}; "
                         f"expected {p.layout.placements} on {p.spec_mesh}"
                         + (f" or its TP layout {p.tp.layout.placements} on {tp_mesh}" if p.tp is not None else ""))
    if tuple(current.shape) == p.layout.global_shape:
        return p.layout.shard(current)
    raise ValueError(f"fully_shard: parameter {p.fqn!r} was replaced by a plain tensor of shape {tuple(current.shape)}; "
                     f"expected its global shape {p.layout.global_shape} or a DTensor (load full tensors with "
                     f"load_state_dict, not by assigning local pieces)")


def _weak_hook(group: FSDPParamGroup):
    """A gradient hook that refers to its group weakly: hooks live in C++ on the tensor,
    where Python's garbage collector cannot see a cycle back to the group, its modules
    and the model (with a strong reference a dropped model would never be freed)."""
    ref = weakref.ref(group)

    def hook(param: torch.Tensor) -> None:
        g = ref()
        if g is not None:
            g._on_grad_ready(param)

    return hook


def _holds_local(p: FSDPParam, t: torch.Tensor) -> bool:
    """Whether the sharded DTensor ``t`` still computes with the local tensor fsdp2d made
    for ``p``: the same memory, or for an all-gather extension subclass (no storage of its
    own to compare) the same object."""
    if p.ext is not None:
        return local_of(t) is p.expected_local
    return _same_storage(local_of(t), p.expected_local)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` still is the view ``b`` (in-place DTensor ops may rewrap the local
    tensor, so compare the memory; fake and meta tensors have none to compare). The
    device matters too: ``to_empty()`` swaps a DTensor parameter's contents in place, and
    an empty shard has data pointer 0 on the meta device and on the new one alike."""
    if a is b:  # the usual case (checked before every forward): no need to look further
        return True
    if is_fake(a) or a.device.type == "meta" or is_fake(b) or b.device.type == "meta":
        return a is b
    return a.device == b.device and a.data_ptr() == b.data_ptr()
