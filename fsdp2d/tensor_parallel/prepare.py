"""``SequenceParallel`` and the styles that only move activations: ``PrepareModuleInput``,
``PrepareModuleOutput``, ``PrepareModuleInputOutput``.

Defaults follow torch 2.13: ``SequenceParallel`` and ``PrepareModuleInput`` return
DTensors (``use_local_output=False``), ``PrepareModuleOutput`` plain tensors. fsdp2d's
own plans ask for plain tensors everywhere (``use_local_output=True``): the same
collectives, no DTensor wrapping on the hot path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..mesh import DeviceMesh
from ..placement import Placement, Replicate, Shard
from ._activations import as_output, local_input, redistribute
from ._params import mark_partial_grads
from .style import ParallelStyle

__all__ = ["SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput",
           "LayoutArityError"]


class SequenceParallel(ParallelStyle):
    """For norms (and other replicated-parameter modules) on sequence-sharded activations.

    Parameters stay replicated; because each rank sees only its sequence shard, their
    gradients are partial and are summed over TP in backward. The first input is
    sharded along ``sequence_dim`` (a plain tensor is taken as this rank's shard; a
    DTensor is redistributed to it), and so is the output: a DTensor unless
    ``use_local_output=True``.
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def validate(self, module: nn.Module, fqn: str) -> None:
        if next(module.parameters(recurse=False), None) is None:
            raise TypeError(f"SequenceParallel on {fqn or '<root>'!r}: the module has no parameters of its own "
                            f"(it applies to leaf modules such as norms); match the norm modules instead")

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        return {n: Replicate() for n, _ in module.named_parameters(recurse=False)}

    def apply(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:
        self._shard_params(module, mesh, fqn)
        mark_partial_grads(module, tuple(self.param_placements(module)), mesh.get_group())
        group, seq, use_local = mesh.get_group(), Shard(self.sequence_dim), self.use_local_output

        def pre(mod: nn.Module, args: tuple) -> tuple:
            x, src, size = local_input(args[0], seq, fqn)
            return (redistribute(x, src, seq, group, size), *args[1:])

        def post(mod: nn.Module, args: tuple, out: Any) -> Any:
            return as_output(out, seq, mesh, use_local)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


class LayoutArityError(ValueError, AssertionError):
    """Layouts that do not pair up (an AssertionError too: torch raises one here)."""


def _layouts(layouts: Any) -> tuple | None:
    """torch's arities: ``None``, one placement, or a tuple/list with ``None`` entries."""
    if layouts is None:
        return None
    return tuple(layouts) if isinstance(layouts, (tuple, list)) else (layouts,)


def _paired(style: str, what: str, layouts: Any, desired: Any) -> tuple[tuple, tuple]:
    """``(layouts, desired)`` as equal-length tuples (empty when both are None)."""
    ours, theirs = _layouts(layouts), _layouts(desired)
    if ours is None and theirs is None:
        return (), ()
    if ours is None or theirs is None:
        given, missing = (what, f"desired_{what}") if theirs is None else (f"desired_{what}", what)
        raise LayoutArityError(f"{style}: {given} given without {missing}; pass both (one entry per "
                               f"tensor, None for those left alone)")
    if len(ours) != len(theirs):
        raise LayoutArityError(f"{style}: {what} and desired_{what} should have same length! got "
                               f"{len(ours)} and {len(theirs)}: {ours} and {theirs}")
    return ours, theirs


def _move(x: Any, src: Placement | None, dst: Placement | None, mesh: DeviceMesh, use_local: bool,
          where: str) -> Any:
    """One activation from ``src`` (its own placement if a DTensor) to ``dst``, as torch:
    ``src`` None leaves it as it is; ``dst`` None keeps ``src`` (a DTensor unless
    ``use_local``)."""
    if src is None:
        return x
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: a layout ({src!r}) is given for an input or output that is not a tensor "
                        f"({type(x).__name__}); use None for it")
    dst = src if dst is None else dst
    local, actual, size = local_input(x, src, where)
    return as_output(redistribute(local, actual, dst, mesh.get_group(), size), dst, mesh, use_local)


class PrepareModuleInput(ParallelStyle):
    """Move a module's inputs from ``input_layouts`` to ``desired_input_layouts`` (one
    placement, or one entry per positional input with ``None`` for non-tensors or inputs
    left alone: the module must then be called with exactly that many); the same for
    keyword inputs with ``input_kwarg_layouts``/``desired_input_kwarg_layouts`` (other
    keywords pass through). The module receives DTensors unless ``use_local_output=True``.

    Raises ``LayoutArityError`` (a ValueError, and an AssertionError as torch's) when the
    layouts do not pair up, and ValueError when the module is called with another number
    of positional inputs than ``input_layouts`` has.
    """

    def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                 input_kwarg_layouts: dict[str, Placement] | None = None,
                 desired_input_kwarg_layouts: dict[str, Placement] | None = None,
                 use_local_output: bool = False) -> None:
        self.input_layouts, self.desired_input_layouts = _paired(
            "PrepareModuleInput", "input_layouts", input_layouts, desired_input_layouts)
        self.kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        if set(self.kwarg_layouts) != set(self.desired_kwarg_layouts):
            raise LayoutArityError("PrepareModuleInput: input_kwarg_layouts and desired_input_kwarg_layouts "
                                   f"need the same keys, got {sorted(self.kwarg_layouts)} and "
                                   f"{sorted(self.desired_kwarg_layouts)}")
        self.use_local_output = use_local_output

    def validate(self, module: nn.Module, fqn: str) -> None:
        pass

    def apply(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:
        pairs = list(zip(self.input_layouts, self.desired_input_layouts))
        kw = {k: (self.kwarg_layouts[k], self.desired_kwarg_layouts[k]) for k in self.kwarg_layouts}
        use_local = self.use_local_output

        def pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple:
            if pairs and len(args) != len(pairs):
                raise ValueError(f"PrepareModuleInput on {fqn or '<root>'!r}: module inputs and input_layouts "
                                 f"should have same length! got {len(args)} positional inputs for "
                                 f"{len(pairs)} layouts {self.input_layouts}")
            args = tuple(_move(a, *pair, mesh, use_local, fqn) for a, pair in zip(args, pairs)) if pairs else args
            kwargs = {k: _move(v, *kw[k], mesh, use_local, fqn) if k in kw else v for k, v in kwargs.items()}
            return args, kwargs

        module.register_forward_pre_hook(pre, with_kwargs=True)


class PrepareModuleOutput(ParallelStyle):
    """Move a module's outputs from ``output_layouts`` to ``desired_output_layouts`` (one
    placement, or one entry per output when the module returns a tuple, ``None`` for
    outputs left alone); plain tensors unless ``use_local_output=False``. Raises as
    ``PrepareModuleInput`` does."""

    def __init__(self, *, output_layouts: Any, desired_output_layouts: Any, use_local_output: bool = True) -> None:
        self.output_layouts, self.desired_output_layouts = _paired(
            "PrepareModuleOutput", "output_layouts", output_layouts, desired_output_layouts)
        self.use_local_output = use_local_output

    def validate(self, module: nn.Module, fqn: str) -> None:
        pass

    def apply(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:
        pairs, use_local = list(zip(self.output_layouts, self.desired_output_layouts)), self.use_local_output

        def post(mod: nn.Module, args: tuple, out: Any) -> Any:
            outs = out if isinstance(out, tuple) else (out,)
            if not pairs:  # (PrepareModuleInputOutput without output layouts)
                return out
            if len(outs) != len(pairs):
                raise ValueError(f"PrepareModuleOutput on {fqn or '<root>'!r}: module outputs and output_layouts "
                                 f"should have same length! got {len(outs)} outputs for {len(pairs)} layouts")
            moved = tuple(_move(o, *p, mesh, use_local, fqn) for o, p in zip(outs, pairs))
            return moved if isinstance(out, tuple) else moved[0]

        module.register_forward_hook(post)


class PrepareModuleInputOutput(ParallelStyle):
    """``PrepareModuleInput`` and ``PrepareModuleOutput`` on one module (torch's keywords:
    ``use_local_input`` for the inputs, default False; ``use_local_output``, default True)."""

    def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                 input_kwarg_layouts: dict[str, Placement] | None = None,
                 desired_input_kwarg_layouts: dict[str, Placement] | None = None,
                 use_local_input: bool = False, output_layouts: Any = None, desired_output_layouts: Any = None,
                 use_local_output: bool = True) -> None:
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output)

    def validate(self, module: nn.Module, fqn: str) -> None:
        pass

    def apply(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:
        self.prepare_module_input.apply(module, fqn, mesh)
        self.prepare_module_output.apply(module, fqn, mesh)
