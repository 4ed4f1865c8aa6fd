"""What one training step does on one rank, measured while it runs (real or fake tensors).

:class:`StepProbe` is a ``TorchDispatchMode``. Entered *inside* ``FakeTensorMode`` it
sees every op of a dry-run step before the fake mode does (it works the same on real
tensors, which is how the estimator is checked against a real CPU run). It records:

* **memory**: every tensor storage any op reads or writes (plus what :meth:`track` is
  given at the start) with its size, the op index at which it appeared and the one at
  which it was freed (weakref on the storage) or resized (``UntypedStorage.resize_``,
  which FSDP uses to free and refill unsharded parameters). The peak is the largest
  live total after any op; :meth:`breakdown` splits the storages alive at the peak by
  the categories :meth:`tag` gave them (parameters, gradients, optimizer state...).
  This is the storage-level accounting ``benchmarks/compare_torch.py`` uses for real
  runs; allocator rounding and fragmentation, the CUDA context and NCCL's own buffers
  are not tensors and are not counted.
* **collectives**: every c10d op (and fsdp2d's pairwise exchanges, which report
  themselves) per mesh axis and kind, with its logical bytes (see
  :mod:`fsdp2d.debug`: all-gather: the gathered output; reduce-scatter: the unreduced
  input; all-reduce: the tensor).
* **roofline work**: per op, its FLOPs (``torch.utils.flop_counter``'s formulas:
  matmuls and attention), the bytes it reads and writes (its distinct tensor inputs
  and outputs once each; view ops, allocations and collectives move none) and how many
  times the step runs it (1; more for the micro-batches a dry run counts without running
  them). The estimator turns these into a time per op on a GPU.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from fsdp2d.debug import describe_c10d_op, watch_exchanges, watch_storage_resizes

__all__ = ["StepProbe"]

_aten = torch.ops.aten
# ops that allocate or re-describe memory without reading or writing it
_NO_TRAFFIC = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.new_empty.default,
               _aten.new_empty_strided.default, _aten.set_.source_Storage_storage_offset,
               _aten.resize_.default, _aten.detach.default, _aten.lift_fresh.default}
# ``tensor.device`` of a fake tensor: dispatched, and over half of a dry run's ops (C++
# and autograd ask every operand's device); it reads and writes no data
_DEVICE = torch.ops.prim.device.default


def _cpu_flash_flops(func, *args, out_val: Any = None, **kwargs) -> int:
    """FLOPs of CPU flash attention (torch's counter knows only the CUDA kernels): the
    same formulas, from ``(B, H, T, D)`` shapes."""
    name = func._schema.name
    if name == "aten::_scaled_dot_product_flash_attention_for_cpu":
        q, k, v = args[:3]
        return sdpa_flop_count(q.shape, k.shape, v.shape)
    if name == "aten::_scaled_dot_product_flash_attention_for_cpu_backward":
        grad_out, q, k, v = args[:4]
        return sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)
    return 0


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _flat(values: Any) -> list[torch.Tensor]:
    """The tensors among ``values`` and its lists/tuples, one level deep: what aten ops
    take and return (a faster ``tree_flatten``; c10d ops nest deeper and use that)."""
    if isinstance(values, torch.Tensor):
        return [values]
    out = []
    for a in values:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(b for b in a if isinstance(b, torch.Tensor))
    return out


def _op_info(func) -> tuple[bool, Any]:
    """(moves data, FLOP formula or None) of an aten op."""
    moves = not func.is_view and func not in _NO_TRAFFIC
    formula = flop_registry.get(func.overloadpacket)
    if formula is None and func._schema.name.startswith("aten::_scaled_dot_product_flash_attention_for_cpu"):
        formula = partial(_cpu_flash_flops, func)
    return moves, formula


class StepProbe(TorchDispatchMode):
    """Memory, collectives and roofline work of the code run while active (see module doc).

    ``axis_of_group`` maps a process group's name to its mesh axis name; collectives
    on other groups count under ``"other"``.
    """

    def __init__(self, axis_of_group: dict[str, str]) -> None:
        super().__init__()
        self.axis_of_group = axis_of_group
        self.collectives: dict[tuple[str, str], list[int]] = {}  # (axis, kind) -> [count, bytes]
        self.flops = 0
        self.ops: list[tuple[int, int, int]] = []  # (flops, bytes, times) per op with either
        self.t = 0  # op index
        self.current = self.peak = self.peak_at = 0
        self.phase = ""
        self.phase_peak: dict[str, int] = {}
        self._live: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (ref, entry index)
        self.entries: list[list[int]] = []  # [size, born, died] (died = -1 while alive)
        self.category: dict[int, str] = {}  # entry index -> category
        self._watch = watch_exchanges(self._add_collective)
        self._info: dict = {}  # aten op -> _op_info(op)

    # -- memory ---------------------------------------------------------------------
    def track(self, tree: Any, category: str | None = None) -> None:
        """Count the storages of ``tree``'s tensors (DTensors: their local tensors) as
        live; ``category`` tags them (a later tag wins)."""
        for t in _tensors(tree):
            t = t._local_tensor if isinstance(t, DTensor) else t
            index = self._see(t)
            if index is not None and category is not None:
                self.category[index] = category

    tag = track

    def _see(self, t: torch.Tensor) -> int | None:
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return None
        if t.device.type == "meta":  # fake tensors report their fake device, not meta
            return None
        return self._update(st)

    def _update(self, st: torch.UntypedStorage) -> int:
        key, size = id(st), st.nbytes()
        entry = self._live.get(key)
        if entry is not None and entry[0]() is st:
            index = entry[1]
            if self.entries[index][0] == size:
                return index
            self._retire(key)  # resized: the old size ends here, the new one starts
            old_category = self.category.get(index)
        else:
            old_category = None
        index = len(self.entries)
        self.entries.append([size, self.t, -1])
        if old_category is not None:
            self.category[index] = old_category
        self._live[key] = (weakref.ref(st, lambda _r, key=key, index=index: self._free(key, index)), index)
        self.current += size
        if self.current > self.peak:
            self.peak, self.peak_at = self.current, self.t
        if self.current > self.phase_peak.get(self.phase, -1):
            self.phase_peak[self.phase] = self.current
        return index

    def _retire(self, key: int) -> None:
        _, index = self._live.pop(key)
        self.entries[index][2] = self.t
        self.current -= self.entries[index][0]

    def _free(self, key: int, index: int) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[1] == index:
            self._retire(key)

    def live_bytes(self, category: str) -> int:
        """Bytes of the live storages tagged ``category`` now."""
        return sum(self.entries[i][0] for _, i in self._live.values() if self.category.get(i) == category)

    def breakdown(self) -> dict[str, int]:
        """Bytes alive at the peak by category (untagged: ``"other"``)."""
        out: dict[str, int] = {}
        for index, (size, born, died) in enumerate(self.entries):
            if born <= self.peak_at and (died == -1 or died > self.peak_at):
                name = self.category.get(index, "other")
                out[name] = out.get(name, 0) + size
        return out

    # -- collectives ----------------------------------------------------------------
    def _add_collective(self, group: dist.ProcessGroup | None, kind: str, nbytes: int) -> None:
        axis = "other" if group is None else self.axis_of_group.get(group.group_name, "other")
        entry = self.collectives.setdefault((axis, kind), [0, 0])
        entry[0] += 1
        entry[1] += nbytes

    # -- dispatch -------------------------------------------------------------------
    def __enter__(self) -> "StepProbe":
        self._resizes = watch_storage_resizes(self._update).__enter__()
        self._watch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._resizes.__exit__(*exc)
        self._watch.__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor desugars into local ops, which come back here
        self.t += 1
        if func is _DEVICE:  # what the general path below does for it, without flattening
            t = args[0]
            self._see(t)
            if isinstance(t, FakeTensor) and not t.fake_mode.in_kernel_invocation:
                return t.fake_device  # FakeTensorMode's own answer, without its dispatch (~30 us each)
            return func(*args)
        kwargs = kwargs or {}
        if func.namespace != "aten":  # c10d collectives, whose arguments nest deeper
            described = describe_c10d_op(func, args) if func.namespace == "c10d" else None
            if described is not None:
                self._add_collective(*described)
            for t in _tensors((args, kwargs)):
                self._see(t)
            out = func(*args, **kwargs)
            for t in _tensors(out):
                self._see(t)
            return out
        ins = _flat(args) + (_flat(kwargs.values()) if kwargs else [])
        for t in ins:
            self._see(t)
        out = func(*args, **kwargs)
        outs = _flat(out) if isinstance(out, (torch.Tensor, list, tuple)) else []
        for t in outs:
            self._see(t)
        info = self._info.get(func)
        if info is None:
            info = self._info[func] = _op_info(func)
        moves, formula = info
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        moved = 0
        if moves:
            seen = set()
            for t in ins + outs:
                if id(t) not in seen:
                    seen.add(id(t))
                    moved += t.numel() * t.element_size()
        if flops or moved:
            self.flops += flops
            self.ops.append((int(flops), moved, 1))
        return out
