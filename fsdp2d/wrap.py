"""Auto-wrap policies for :class:`fsdp2d.fsdp1.FullyShardedDataParallel`.

The same names and call signatures as ``torch.distributed.fsdp.wrap``, so an FSDP1
script's ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``
or ``ModuleWrapPolicy({Block})`` works unchanged. torch's own policy objects are accepted
as they are (both kinds follow the same protocol):

- a *function policy* ``fn(module=, recurse=, nonwrapped_numel=) -> bool``, walked as
  torch walks it: depth first, asking ``recurse=True`` before descending into a module
  and ``recurse=False`` (with the parameter count its wrapped children left over) after;
- a *policy object* with ``_run_policy(root, ignored_modules, root_kwargs)`` returning
  ``{module: kwargs}`` (``ModuleWrapPolicy``, ``CustomPolicy``; a ``CustomPolicy`` may
  give a module its own constructor arguments, e.g. another ``sharding_strategy``).

:func:`targets` turns either into the modules to wrap, children before parents.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable

from torch import nn

__all__ = ["ModuleWrapPolicy", "CustomPolicy", "transformer_auto_wrap_policy", "size_based_auto_wrap_policy",
           "lambda_auto_wrap_policy", "always_wrap_policy", "targets"]


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wrap every module."""
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable) -> bool:
    """Wrap the modules for which ``lambda_fn(module)`` is true."""
    return True if recurse else bool(lambda_fn(module))


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Iterable[type]) -> bool:
    """Wrap every instance of ``transformer_layer_cls`` (the root is wrapped regardless)."""
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8), force_leaf_modules: set | None = None,
                                exclude_wrap_modules: set | None = None) -> bool:
    """Wrap a module when at least ``min_num_params`` of its parameters are not yet
    wrapped by its children; never descend into ``force_leaf_modules`` and never wrap
    ``exclude_wrap_modules`` (containers), as torch."""
    leaf = size_based_auto_wrap_policy.FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules
    exclude = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None \
        else exclude_wrap_modules
    large = nonwrapped_numel >= min_num_params
    if recurse:
        return large and not isinstance(module, tuple(leaf))
    return large and not isinstance(module, tuple(exclude))


size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]


class ModuleWrapPolicy:
    """Wrap every module that is an instance of one of ``module_classes``."""

    def __init__(self, module_classes: Iterable[type]) -> None:
        self._module_classes = set(module_classes)

    def _run_policy(self, root_module: nn.Module, ignored_modules: set, root_kwargs: dict) -> dict:
        classes = tuple(self._module_classes)
        return {m: copy.copy(root_kwargs) for m in root_module.modules()
                if m not in ignored_modules and isinstance(m, classes)}

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        return transformer_auto_wrap_policy(module, recurse, -1, self._module_classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({self._module_classes})"


class CustomPolicy:
    """``lambda_fn(module)`` returns False (leave it), True (wrap with the root's
    arguments) or a dict of constructor arguments that override the root's."""

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict]) -> None:
        self._lambda_fn = lambda_fn

    def _run_policy(self, root_module: nn.Module, ignored_modules: set, root_kwargs: dict) -> dict:
        out = {}
        for m in root_module.modules():
            if m in ignored_modules:
                continue
            res = self._lambda_fn(m)
            if not isinstance(res, (bool, dict)):
                raise ValueError(f"CustomPolicy: lambda_fn returned {res!r} for {type(m).__name__}; "
                                 f"return False, True or a dict of constructor arguments")
            if res:
                out[m] = {**root_kwargs, **(res if isinstance(res, dict) else {})}
        return out


def targets(root: nn.Module, policy: Any, ignored_modules: set, ignored_params: set,
            root_kwargs: dict) -> list[tuple[nn.Module, dict]]:
    """The modules under ``root`` (not ``root`` itself) that ``policy`` wraps, each with
    its constructor arguments, children before parents."""
    if policy is None:
        return []
    if hasattr(policy, "_run_policy"):  # fsdp2d's or torch's policy objects
        chosen = policy._run_policy(root, ignored_modules, root_kwargs)
        order = [m for m in reversed(list(root.modules())) if m in chosen and m is not root]
        return [(m, chosen[m]) for m in order]
    if not callable(policy):
        raise TypeError(f"auto_wrap_policy must be a policy object (ModuleWrapPolicy, CustomPolicy) or a "
                        f"function(module, recurse, nonwrapped_numel), got {type(policy).__name__}")
    out: list[tuple[nn.Module, dict]] = []

    def walk(module: nn.Module, is_root: bool) -> int:
        """Returns the parameter count wrapped in ``module``'s subtree (torch's walk)."""
        numel = sum(p.numel() for p in module.parameters() if p not in ignored_params)
        if not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        wrapped = sum(walk(child, False) for child in module.children() if child not in ignored_modules)
        if not is_root and policy(module=module, recurse=False, nonwrapped_numel=numel - wrapped):
            out.append((module, dict(root_kwargs)))
            return numel
        return wrapped

    walk(root, True)
    return out
