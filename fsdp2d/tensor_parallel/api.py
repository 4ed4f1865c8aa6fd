"""``parallelize_module``: apply a declarative TP plan to a module tree.

A plan is a style (for the module itself) or a dict ``{pattern: style}`` whose patterns
match fully qualified module names with ``fnmatch`` per dotted level
(``layers.*.attention.wq`` matches ``layers.0.attention.wq``, ``layers.1.attention.wq``
and so on; ``*`` never crosses a dot). The whole plan is resolved and validated before
any module changes, so a bad plan leaves the model untouched.
"""

from __future__ import annotations

import copy
import difflib
import warnings
from fnmatch import fnmatchcase
from typing import Mapping

from torch import nn

from ..mesh import DeviceMesh, axis_names, current_mesh
from ._params import TIES
from .style import ParallelStyle

__all__ = ["parallelize_module"]


def _match(root: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """Modules under ``root`` whose dotted path matches ``pattern`` level by level
    (``""``: ``root`` itself, as torch)."""
    found = [("", root)]
    if pattern == "":
        return found
    for part in pattern.split("."):
        found = [
            (f"{path}.{name}" if path else name, child)
            for path, mod in found
            for name, child in mod.named_children()
            if fnmatchcase(name, part)
        ]
    return found


def _first_unmatched(root: nn.Module, pattern: str) -> str:
    """The first dotted level of ``pattern`` (with the levels before it) that matches nothing."""
    parts = pattern.split(".")
    for i in range(1, len(parts) + 1):
        if not _match(root, ".".join(parts[:i])):
            return ".".join(parts[:i])
    return pattern


def _resolve(module: nn.Module, plan: Mapping[str, ParallelStyle]) -> list[tuple[str, nn.Module, ParallelStyle]]:
    all_names = [n for n, _ in module.named_modules() if n]
    chosen: dict[str, tuple[str, nn.Module, ParallelStyle]] = {}
    owner: dict[str, str] = {}
    for pattern, style in plan.items():
        if isinstance(style, type) and issubclass(style, ParallelStyle):
            raise TypeError(f"plan entry {pattern!r}: got the class {style.__name__}; pass an instance, "
                            f"{style.__name__}()")
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"plan entry {pattern!r}: expected a ParallelStyle, got {type(style).__name__}")
        matches = _match(module, pattern)
        if not matches:  # as torch: a generic plan (an HF tp_plan over model variants) may name absent modules
            close = difflib.get_close_matches(pattern, all_names, n=3, cutoff=0.4)
            hint = f" (closest module names: {', '.join(close)})" if close else ""
            warnings.warn(f"parallelize_module: plan key {pattern!r} could not be resolved: no submodule matches "
                          f"{_first_unmatched(module, pattern)!r} in {type(module).__name__}{hint}, skipping this "
                          f"plan entry", UserWarning, stacklevel=4)
            continue
        for fqn, mod in matches:
            if fqn in chosen:
                raise ValueError(
                    f"parallelize_module: module {fqn!r} is matched by two plan patterns, "
                    f"{owner[fqn]!r} and {pattern!r}; make the patterns disjoint"
                )
            chosen[fqn], owner[fqn] = (fqn, mod, style), pattern
    return list(chosen.values())


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh | None = None,
                       parallelize_plan: ParallelStyle | Mapping[str, ParallelStyle] | None = None,
                       *, src_data_rank: int | None = 0) -> nn.Module:
    """Shard ``module``'s parameters over the TP mesh following ``parallelize_plan``.

    Args:
        module: the model (on CPU, CUDA or the meta device). Apply before ``fully_shard``.
        device_mesh: a 1-D mesh, usually ``mesh["tp"]``; None: the mesh of the innermost
            ``with mesh:`` block, as torch.
        parallelize_plan: a style for ``module`` itself, or ``{pattern: style}`` (pattern
            ``""``: ``module`` itself). None warns and changes nothing, as torch.
        src_data_rank: TP rank whose full parameter values are broadcast before slicing
            (torch's default, 0); ``None`` slices each rank's own values without
            communicating.

    Returns ``module``, changed in place: each planned parameter is now an
    ``nn.Parameter`` wrapping a DTensor on ``device_mesh`` whose local tensor is this
    rank's shard (see :func:`tp_params` for layouts).

    Example::

        tp = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        parallelize_module(model, tp, {"layers.*.mlp.fc1": ColwiseParallel(),
                                       "layers.*.mlp.fc2": RowwiseParallel()})

    A plan key that matches no module is skipped with a ``UserWarning`` naming it and the
    closest module names, as torch does (generic plans, such as Hugging Face ``tp_plan``
    patterns over model variants, rely on it).

    Raises: ValueError for no mesh (none given, no ``with mesh:``) or a mesh that is not 1-D,
    or two patterns matching one module; TypeError for a style that
    cannot apply to the module it matched (naming the module); RuntimeError when the
    module was already passed to ``fully_shard`` (wrong order).
    """
    if device_mesh is None:
        device_mesh = current_mesh()  # inside ``with mesh:``, as torch
    if device_mesh is None:
        raise ValueError("parallelize_module needs device_mesh: a 1-D torch DeviceMesh such as mesh['tp'] "
                         "(or call it inside `with mesh:`)")
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"parallelize_module got a {type(device_mesh).__module__}.{type(device_mesh).__name__} "
                        f"as device_mesh; pass a torch DeviceMesh (fsdp2d.init_device_mesh or torch's), e.g. "
                        f"mesh['tp']")
    if device_mesh.ndim != 1:
        raise ValueError(
            f"parallelize_module needs a 1-D mesh, got axes {axis_names(device_mesh)}; "
            f"pass the TP sub-mesh, e.g. mesh[{axis_names(device_mesh)[-1]!r}]"
        )
    if parallelize_plan is None:
        warnings.warn("parallelize_module: no parallelize_plan given, so nothing is parallelized", stacklevel=2)
        return module
    targets = _validated_targets(module, parallelize_plan)
    token = TIES.set({})  # tied parameters are sharded once and stay one object
    try:
        for fqn, mod, style in targets:
            style = copy.copy(style)  # never change the caller's (possibly shared) style object
            style.src_data_rank = src_data_rank
            style.apply(mod, fqn, device_mesh)
    finally:
        TIES.reset(token)
    return module


def _validated_targets(module: nn.Module, plan: ParallelStyle | Mapping[str, ParallelStyle]
                       ) -> list[tuple[str, nn.Module, ParallelStyle]]:
    """(fqn, module, style) for every module the plan names, after every check that can
    fail: nothing has changed yet when one raises."""
    for name, mod in module.named_modules():
        if getattr(mod, "_fsdp2d_fsdp", None) is not None or getattr(mod, "_fsdp2d_fsdp_owner", None) is not None:
            raise RuntimeError(
                f"parallelize_module after fully_shard: module {name or '<root>'!r} is already "
                f"fully sharded. Apply tensor parallelism first, then fully_shard"
            )
    targets = [("", module, plan)] if isinstance(plan, ParallelStyle) else _resolve(module, plan)
    for fqn, mod, style in targets:
        style.validate(mod, fqn)
        for pname in getattr(mod, "_fsdp2d_tp", {}):
            raise ValueError(f"parallelize_module: parameter {fqn}.{pname} is already tensor-parallel")
    _check_ties(module, targets)
    return targets


def _check_ties(module: nn.Module, targets: list[tuple[str, nn.Module, ParallelStyle]]) -> None:
    """A parameter held by several modules (tied weights) must get one placement from
    every style that shards it, and every module holding it must be in the plan:
    otherwise sharding would silently untie it (torch unties and trains another model)."""
    planned: dict[int, tuple[str, object]] = {}  # id(param) -> (first fqn, placement)
    holders: set[tuple[int, str]] = set()  # (id(module), name) the plan shards
    for fqn, mod, style in targets:
        for name, placement in style.param_placements(mod).items():
            p = mod._parameters.get(name)
            if p is None:
                continue
            where = f"{fqn}.{name}" if fqn else name
            first = planned.setdefault(id(p), (where, placement))
            if first[1] != placement:
                raise ValueError(
                    f"parallelize_module: {where} is the same tensor as {first[0]} (tied weights) but the plan "
                    f"shards them as {placement!r} and {first[1]!r}; give both modules styles that shard the "
                    f"tensor the same way (e.g. RowwiseParallel embedding + ColwiseParallel head: Shard(0)), "
                    f"or untie them")
            holders.add((id(mod), name))
    for mname, mod in module.named_modules(remove_duplicate=False):
        for name, p in mod._parameters.items():
            if p is not None and id(p) in planned and (id(mod), name) not in holders:
                where = f"{mname}.{name}" if mname else name
                raise ValueError(
                    f"parallelize_module: {where} is the same tensor as {planned[id(p)][0]} (tied weights), "
                    f"which the plan shards, but {where} is not in the plan; add a style for "
                    f"{mname or '<root>'!r} that shards it the same way, or untie them")
