"""FSDP2's all-gather extension protocol: tensor subclasses that choose what is gathered.

A parameter whose (TP-local) tensor defines ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather`` (torchao's float8 training weights with
``enable_fsdp_float8_all_gather=True``) is gathered as torch's FSDP2 gathers it:

- pre hook, on this rank's sharded tensor (the subclass wrapping its rows of the flat
  buffer): ``fsdp_pre_all_gather(mesh)`` or ``fsdp_pre_all_gather(mesh, outer_size,
  outer_stride, module, mp_policy)`` (chosen by its signature, as torch) returns
  ``(all_gather_inputs, metadata)``; ``mesh`` is the FSDP shard mesh, ``outer_size`` the
  unsharded (TP-local) shape. Inputs of the shard's row count are padded with zero rows to
  the group's padded row count (an uneven last shard), so every rank sends the same bytes;
- the group's one all-gather moves every input's bytes (float8 data, not the weights'
  float32) beside the other parameters', as one ``uint8`` buffer;
- post hook: the first gather calls ``fsdp_post_all_gather(outputs, metadata,
  param_dtype)`` and makes the unsharded parameter from the tensor it returns (its first
  rows, a DTensor when torch's TP applied); later gathers refill the same outputs and call
  it with ``out=`` that parameter. Resharding frees the outputs' (and the returned inner
  tensors') storage, as torch.

At rest the sharded parameter is a DTensor whose local tensor is the subclass (rebuilt
around fsdp2d's flat storage with ``__tensor_unflatten__``), so
``precompute_float8_dynamic_scale_for_fsdp`` finds it and its scales are used.

Refused in ``fully_shard``, in one line naming the parameter (never dropped silently): a
subclass with only one of the hooks; a subclass whose flattening does not hold exactly one
inner tensor of the parameter's shape and dtype (NF4/QLoRA's quantized blocks: fsdp2d
cannot shard them by rows); any other tensor subclass without the hooks (fsdp2d would
store it as a plain tensor); CPU offload of an extension parameter.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["Extension", "extension_of"]


def extension_of(tensor: torch.Tensor, fqn: str) -> "Extension | None":
    """The :class:`Extension` of a parameter's (TP-local) tensor, None for a plain one;
    raises ValueError for a tensor subclass fsdp2d cannot shard without losing it."""
    pre, post = hasattr(tensor, "fsdp_pre_all_gather"), hasattr(tensor, "fsdp_post_all_gather")
    where = f"fully_shard: parameter {fqn!r} is a {type(tensor).__name__}"
    if pre != post:
        raise ValueError(f"{where} that defines only {'fsdp_pre_all_gather' if pre else 'fsdp_post_all_gather'}; "
                         f"the all-gather extension needs both")
    if not pre:
        if is_traceable_wrapper_subclass(tensor):
            raise ValueError(f"{where} tensor subclass without fsdp_pre_all_gather/fsdp_post_all_gather; fsdp2d "
                             f"would store it as a plain tensor (dropping the subclass): convert it to a plain "
                             f"tensor first, or implement the FSDP2 all-gather extension")
        return None
    return Extension(tensor, where)


class Extension:
    """Per-parameter state of the protocol: how to rebuild the subclass around fsdp2d's
    shard storage, and the persistent all-gather outputs of its inputs."""

    def __init__(self, template: torch.Tensor, where: str) -> None:
        names, self.ctx = template.__tensor_flatten__() if is_traceable_wrapper_subclass(template) else ([], None)
        data = [n for n in names if getattr(template, n).shape == template.shape
                and getattr(template, n).dtype == template.dtype]
        if len(data) != 1:
            raise ValueError(f"{where} whose flattening holds {len(data)} inner tensors of the parameter's shape and "
                             f"dtype (of {names}); fsdp2d shards extension tensors that wrap one such tensor "
                             f"(torchao float8 all-gather), not quantized blocks (NF4/QLoRA): use torch's "
                             f"fully_shard for those")
        self.cls, self.key = type(template), data[0]
        n_args = len(inspect.signature(template.fsdp_pre_all_gather).parameters)
        if n_args not in (1, 5):
            raise ValueError(f"{where} whose fsdp_pre_all_gather takes {n_args} arguments; torch's contract is "
                             f"(mesh) or (mesh, outer_size, outer_stride, module, mp_policy)")
        self.n_args = n_args
        self.outputs: list[torch.Tensor] = []  # (k * numel,) per all-gather input, persistent
        self.inner: list[torch.Tensor] = []  # what the first post hook returned to free at reshard
        self.input_shapes: list[torch.Size] = []
        self.metadata: Any = None
        self.created = False  # the unsharded parameter comes from the post hook
        self.shard_mesh: Any = None  # the mesh's shard axis, sliced once (a slice costs ~0.1-0.5 ms)

    def _shard_mesh(self, p: Any) -> Any:
        """The 1-D shard mesh the pre-all-gather hook is given (the last axis under HSDP)."""
        if self.shard_mesh is None:
            self.shard_mesh = p.mesh if p.mesh.ndim == 1 else p.mesh[p.mesh.mesh_dim_names[-1]]
        return self.shard_mesh

    # -- at rest ---------------------------------------------------------------------------
    def data_of(self, t: torch.Tensor) -> torch.Tensor:
        """The plain tensor a subclass instance wraps (``t`` itself if plain)."""
        return getattr(t, self.key) if isinstance(t, self.cls) else t

    def wrap(self, plain: torch.Tensor) -> torch.Tensor:
        """The subclass around ``plain`` (this rank's rows of the flat storage)."""
        return self.cls.__tensor_unflatten__({self.key: plain}, self.ctx, plain.shape, plain.stride())

    def reset(self) -> None:
        """Forget the outputs (a rebuilt group makes a new unsharded parameter)."""
        self.outputs, self.inner, self.input_shapes, self.metadata, self.created = [], [], [], None, False

    # -- the all-gather --------------------------------------------------------------------
    def inputs(self, p: Any, mp: Any) -> list[torch.Tensor]:
        """This rank's all-gather inputs, padded to ``p.padded_rows`` rows, contiguous."""
        local = p.sharded._local_tensor
        mesh = self._shard_mesh(p)
        if self.n_args == 1:
            inputs, self.metadata = local.fsdp_pre_all_gather(mesh)
        else:
            size = torch.Size(p.unsharded_shape)
            inputs, self.metadata = local.fsdp_pre_all_gather(mesh, size, torch.empty(size, device="meta").stride(),
                                                              p.module, mp)
        out = []
        for t in inputs:
            rows = t.shape[0] if t.ndim else -1
            if rows == p.shard_rows[1] and rows != p.padded_rows:
                t = torch.cat([t, t.new_zeros((p.padded_rows - rows, *t.shape[1:]))])
            elif rows != p.padded_rows:
                raise ValueError(f"fsdp_pre_all_gather of parameter {p.fqn!r} returned an input of shape "
                                 f"{tuple(t.shape)}; fsdp2d gathers inputs of the shard's {p.shard_rows[1]} rows "
                                 f"(or {p.padded_rows} padded)")
            out.append(t.contiguous())
        if self.input_shapes and [t.shape for t in out] != self.input_shapes:
            raise ValueError(f"fsdp_pre_all_gather of parameter {p.fqn!r} changed its input shapes from "
                             f"{self.input_shapes} to {[t.shape for t in out]}")
        self.input_shapes = [t.shape for t in out]
        return out

    def destinations(self, inputs: list[torch.Tensor], k: int) -> list[torch.Tensor]:
        """``(k, bytes)`` uint8 views of the outputs (made at the first gather), where the
        group's copy-out puts every rank's piece of each input."""
        if not self.outputs:
            self.outputs = [torch.empty(k * t.numel(), dtype=t.dtype, device=t.device) for t in inputs]
        self.alloc()
        return [o.view(k, -1).view(torch.uint8) for o in self.outputs]

    def alloc(self) -> None:
        for t in self.outputs:
            nbytes = t.numel() * t.element_size()
            if t.untyped_storage().size() != nbytes:
                t.untyped_storage().resize_(nbytes)
        for t in self.inner:  # (torchao float8's is a view of the output: allocated with it)
            if t.untyped_storage().size() == 0:
                t.untyped_storage().resize_((t.storage_offset() + t.numel()) * t.element_size())

    def free(self) -> None:
        for t in (*self.outputs, *self.inner):
            t.untyped_storage().resize_(0)

    def finish(self, p: Any, param_dtype: torch.dtype) -> torch.Tensor | None:
        """After the copy-out: the post hook. Returns the unsharded tensor to make the
        parameter from at the first gather (its padded rows; the caller takes the first
        ones), None later (the hook updated ``p.unsharded`` in place)."""
        outputs = tuple(o.view(-1, *s[1:]) for o, s in zip(self.outputs, self.input_shapes))
        hook = p.sharded._local_tensor.fsdp_post_all_gather
        if self.created:
            hook(outputs, self.metadata, param_dtype, out=p.unsharded)
            self.metadata = None
            return None
        unsharded, inner = hook(outputs, self.metadata, param_dtype)
        self.inner, self.metadata, self.created = list(inner), None, True
        return unsharded
