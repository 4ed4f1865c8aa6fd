"""``SequenceParallel`` and the styles that only move activations: ``PrepareModuleInput``,
``PrepareModuleOutput``, ``PrepareModuleInputOutput``.

Defaults follow torch 2.13: ``SequenceParallel`` and ``PrepareModuleInput`` return
DTensors (``use_local_output=False``), ``PrepareModuleOutput`` plain tensors. fsdp2d's
own plans ask for plain tensors everywhere (``use_local_output=True``): the same
collectives, no DTensor wrapping on the hot path.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..mesh import DeviceMesh
from ..placement import Placement, Replicate, Shard
from ._activations import as_output, local_input, redistribute
from ._params import mark_partial_grads
from .style import ParallelStyle

__all__ = ["SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput"]


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


def _as_tuple(layouts: Any) -> tuple:
    if layouts is None:
        return ()
    return tuple(layouts) if isinstance(layouts, (tuple, list)) else (layouts,)


def _move(x: Any, src: Placement | None, dst: Placement | None, mesh: DeviceMesh, use_local: bool,
          where: str) -> Any:
    """One activation from ``src`` (its own placement if a DTensor) to ``dst``; ``None``
    on either side leaves it as it is."""
    if src is None or dst is None:
        return x
    local, actual, size = local_input(x, src, where)
    return as_output(redistribute(local, actual, dst, mesh.get_group(), size), dst, mesh, use_local)


class PrepareModuleInput(ParallelStyle):
    """Move a module's inputs from ``input_layouts`` to ``desired_input_layouts`` (one
    entry per positional input, ``None`` for non-tensors or inputs left alone); the
    same for keyword inputs with ``input_kwarg_layouts``/``desired_input_kwarg_layouts``.
    The module receives DTensors unless ``use_local_output=True``.
    """

    def __init__(self, *, input_layouts: Any = None, desired_input_layouts: Any = None,
                 input_kwarg_layouts: dict[str, Placement] | None = None,
                 desired_input_kwarg_layouts: dict[str, Placement] | None = None,
                 use_local_output: bool = False) -> None:
        self.input_layouts = _as_tuple(input_layouts)
        self.desired_input_layouts = _as_tuple(desired_input_layouts)
        if len(self.input_layouts) != len(self.desired_input_layouts):
            raise ValueError("PrepareModuleInput: input_layouts and desired_input_layouts need the same length")
        self.kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        if set(self.kwarg_layouts) != set(self.desired_kwarg_layouts):
            raise ValueError("PrepareModuleInput: input_kwarg_layouts and desired_input_kwarg_layouts need the same keys")
        self.use_local_output = use_local_output

    def validate(self, module: nn.Module, fqn: str) -> None:
        pass

    def apply(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:
        pairs = list(zip(self.input_layouts, self.desired_input_layouts))
        kw = {k: (self.kwarg_layouts[k], self.desired_kwarg_layouts[k]) for k in self.kwarg_layouts}
        use_local = self.use_local_output

        def pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple:
            if len(args) < len(pairs):
                raise ValueError(f"PrepareModuleInput on {fqn!r}: expected {len(pairs)} positional inputs, got {len(args)}")
            args = tuple(_move(a, *pairs[i], mesh, use_local, fqn) if i < len(pairs) else a
                         for i, a in enumerate(args))
            kwargs = {k: _move(v, *kw[k], mesh, use_local, fqn) if k in kw else v for k, v in kwargs.items()}
            return args, kwargs

        module.register_forward_pre_hook(pre, with_kwargs=True)


class PrepareModuleOutput(ParallelStyle):
    """Move a module's outputs from ``output_layouts`` to ``desired_output_layouts``
    (one entry per output when the module returns a tuple); plain tensors unless
    ``use_local_output=False``."""

    def __init__(self, *, output_layouts: Any, desired_output_layouts: Any, use_local_output: bool = True) -> None:
        self.output_layouts = _as_tuple(output_layouts)
        self.desired_output_layouts = _as_tuple(desired_output_layouts)
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError("PrepareModuleOutput: output_layouts and desired_output_layouts need the same length")
        self.use_local_output = use_local_output

    def validate(self, module: nn.Module, fqn: str) -> None:
        pass

    def apply(self, module: nn.Module, fqn: str, mesh: DeviceMesh) -> None:
        pairs, use_local = list(zip(self.output_layouts, self.desired_output_layouts)), self.use_local_output

        def post(mod: nn.Module, args: tuple, out: Any) -> Any:
            outs = out if isinstance(out, tuple) else (out,)
            if len(outs) != len(pairs):
                raise ValueError(f"PrepareModuleOutput on {fqn!r}: expected {len(pairs)} outputs, got {len(outs)}")
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
