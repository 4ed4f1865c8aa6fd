"""Tensor-parallel plans for Hugging Face models.

:func:`tp_plan` translates the plan an HF model ships (``config.base_model_tp_plan``
plus the head's ``_tp_plan``; transformers 5 merges both, prefixed, into
``model.tp_plan``) into fsdp2d styles, so that::

    parallelize_module(hf_model, mesh["tp"], fsdp2d.hf.tp_plan(hf_model))

works. Each HF style string maps to one fsdp2d style; ``nn.Linear`` / ``nn.Embedding``
get :mod:`fsdp2d.tensor_parallel`'s styles, HF's ``Conv1D`` the styles of
:mod:`fsdp2d.hf.styles`, chosen per module. Models that ship no plan but that
fsdp2d knows (GPT-2: fused ``c_attn`` split per q/k/v) get a built-in one. Strings with
no fsdp2d equivalent (the ``local_*`` family, packed or MoE styles) raise one
``ValueError`` naming every such entry.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from ..models.tp_plans import gpt2_tp_plan, llama_tp_plan
from ..placement import Replicate
from ..tensor_parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel
from .styles import ColwiseConv1D, DivideAttributes, RowwiseConv1D, is_conv1d

__all__ = ["tp_plan", "HF_STYLES"]


class _ByModule(ParallelStyle):
    """One HF style string: the ``nn.Linear``/``nn.Embedding`` style or the ``Conv1D`` one,
    chosen by the module it lands on."""

    def __init__(self, name: str, linear: ParallelStyle, conv1d: ParallelStyle | None) -> None:
        self.name, self.linear, self.conv1d = name, linear, conv1d

    def _pick(self, module: nn.Module, fqn: str) -> ParallelStyle:
        if not is_conv1d(module):
            return self.linear
        if self.conv1d is None:
            raise TypeError(f"HF style {self.name!r} on {fqn!r}: no fsdp2d equivalent for Conv1D")
        return self.conv1d

    def validate(self, module: nn.Module, fqn: str) -> None:
        self._pick(module, fqn).validate(module, fqn)

    def apply(self, module: nn.Module, fqn: str, mesh) -> None:
        style = self._pick(module, fqn)
        style.src_data_rank = self.src_data_rank
        style.apply(module, fqn, mesh)


def _colwise(rep: bool) -> Callable[[str], ParallelStyle]:
    out = Replicate() if rep else None
    return lambda n: _ByModule(n, ColwiseParallel(output_layouts=out), ColwiseConv1D(output_layouts=out))


def _rowwise(rep_in: bool) -> Callable[[str], ParallelStyle]:
    inp = Replicate() if rep_in else None
    return lambda n: _ByModule(n, RowwiseParallel(input_layouts=inp), RowwiseConv1D(input_layouts=inp))


# HF style string -> fsdp2d style factory (semantics of transformers' ALL_PARALLEL_STYLES).
HF_STYLES: dict[str, Callable[[str], ParallelStyle]] = {
    "colwise": _colwise(False),
    "colwise_rep": _colwise(True),
    "colwise_gather_output": _colwise(True),
    "rowwise": _rowwise(False),
    "rowwise_rep": _rowwise(True),
    "rowwise_split_input": _rowwise(True),
    # Token ids arrive whole on every rank (torch's RowwiseParallel default, Shard(-1), would
    # read them as sequence shards and gather them).
    "embedding_rowwise": lambda n: _ByModule(n, RowwiseParallel(input_layouts=Replicate()), None),
    "embedding_colwise": lambda n: _ByModule(n, ColwiseParallel(input_layouts=Replicate(),
                                                                output_layouts=Replicate()), None),
    "sequence_parallel": lambda n: SequenceParallel(),
}


def _gpt2_plan(prefix: str) -> dict[str, ParallelStyle]:
    """GPT-2 ships no plan: Megatron's layout on its Conv1D layers, whole heads per rank."""
    p = f"{prefix}h.*"
    return {f"{p}.attn": DivideAttributes("split_size"), f"{p}.attn.c_attn": ColwiseConv1D(fused=3),
            f"{p}.attn.c_proj": RowwiseConv1D(), f"{p}.mlp.c_fc": ColwiseConv1D(), f"{p}.mlp.c_proj": RowwiseConv1D()}


def _hf_strings(hf_model: nn.Module) -> dict[str, str]:
    """The model's plan as HF writes it, module patterns relative to ``hf_model``."""
    plan = getattr(hf_model, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    base = dict(getattr(hf_model.config, "base_model_tp_plan", None) or {})
    prefix = getattr(hf_model, "base_model_prefix", "")
    if prefix and isinstance(getattr(hf_model, prefix, None), nn.Module):
        base = {f"{prefix}.{k}": v for k, v in base.items()}
    return {**base, **(getattr(type(hf_model), "_tp_plan", None) or {})}


def tp_plan(hf_model: nn.Module) -> dict[str, ParallelStyle]:
    """An fsdp2d TP plan for a ``transformers`` model, from the plan it ships.

    Raises ``ValueError`` naming every entry whose style has no fsdp2d equivalent, and
    when the model ships no plan and is not one fsdp2d has a built-in plan for.
    """
    config = getattr(hf_model, "config", None)
    if getattr(config, "model_type", None) == "gpt2":
        prefix = "transformer." if isinstance(getattr(hf_model, "transformer", None), nn.Module) else ""
        return _gpt2_plan(prefix)
    strings = _hf_strings(hf_model) if config is not None else {}
    if not strings:
        raise ValueError(f"{type(hf_model).__name__} ships no tensor-parallel plan (config.base_model_tp_plan) "
                         f"and fsdp2d has no built-in one for it; write a plan with fsdp2d's styles")
    unknown = {k: v for k, v in strings.items() if v not in HF_STYLES}
    if unknown:
        raise ValueError(f"HF tensor-parallel plan entries with no fsdp2d equivalent: "
                         f"{', '.join(f'{k!r}: {v!r}' for k, v in unknown.items())} (supported: "
                         f"{', '.join(sorted(HF_STYLES))})")
    return {pattern: HF_STYLES[kind](kind) for pattern, kind in strings.items()}
