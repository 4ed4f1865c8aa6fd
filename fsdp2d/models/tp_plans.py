"""Default tensor-parallel plans for the reference models.

A plan maps a module-name pattern to a parallel style. Patterns are matched with
``fnmatch`` one dotted level at a time (``"layers.*.attention.wq"`` matches
``layers.0.attention.wq`` but ``*`` never crosses a dot). The styles follow
``torch.distributed.tensor.parallel`` semantics and keywords exactly; they are imported
lazily from :mod:`fsdp2d.tensor_parallel` so importing the models never needs it.

Layout vocabulary (over the TP mesh axis): ``Replicate()`` = every rank holds the whole
activation, ``Shard(d)`` = activation dim ``d`` is split across ranks. Activations are
``(B, T, C)``; ``Shard(1)`` is sequence-sharded, ``Shard(-1)`` is sharded over the last
(hidden or vocab) dim. Within a block the pattern is the Megatron one: a column-wise
linear turns a replicated input into a hidden-sharded output (local heads / local FFN
columns), the row-wise linear after it turns that into partial sums and reduces them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdp2d.tensor_parallel import ParallelStyle

__all__ = ["llama_tp_plan", "gpt2_tp_plan"]


def _styles() -> tuple[SimpleNamespace, Any, Any]:
    """Import the styles lazily (ImportError if fsdp2d.tensor_parallel lacks them)."""
    from fsdp2d.placement import Replicate, Shard
    from fsdp2d.tensor_parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    tp = SimpleNamespace(
        ColwiseParallel=ColwiseParallel, RowwiseParallel=RowwiseParallel,
        SequenceParallel=SequenceParallel, PrepareModuleInput=PrepareModuleInput,
        PrepareModuleOutput=PrepareModuleOutput)
    return tp, Replicate, Shard


def _embedding(tp, Replicate, Shard, sp: bool):
    """Vocab-parallel embedding; under sequence parallel its output is reduce-scattered."""
    return tp.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())


def _rowwise(tp, Shard, sp: bool):
    """Block output projection: all-reduce, or reduce-scatter to the sequence shard."""
    return tp.RowwiseParallel(output_layouts=Shard(1)) if sp else tp.RowwiseParallel()


def _head(tp, Replicate, Shard, sp: bool, loss_parallel: bool):
    """LM head: gathers the sequence first under sequence parallel; vocab-sharded logits
    with loss parallel, replicated otherwise."""
    logits = Shard(-1) if loss_parallel else Replicate()
    if sp:
        return tp.ColwiseParallel(input_layouts=Shard(1), output_layouts=logits)
    return tp.ColwiseParallel(output_layouts=logits)


def llama_tp_plan(*, sequence_parallel: bool = False,
                  loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    """TP plan for :class:`fsdp2d.models.llama.Llama` (torchtitan's layout).

    Without sequence parallelism the residual stream between blocks is ``Replicate``
    ``(B, T, C)`` on every rank: ``tok_embeddings`` is row-wise sharded over the vocab
    and all-reduces its output; ``wq/wk/wv`` and ``w1/w3`` are column-wise (each rank
    holds ``n_heads/tp`` query heads, ``n_kv_heads/tp`` kv heads and ``hidden/tp`` FFN
    columns, activations ``(B, T, C/tp)``-like); ``wo`` and ``w2`` are row-wise and
    all-reduce back to ``Replicate``. Norms run replicated, unsharded.

    With ``sequence_parallel`` the residual stream between blocks is ``Shard(1)``
    ``(B, T/tp, C)``: ``tok_embeddings`` reduce-scatters along the sequence, the norms
    (``attention_norm``, ``ffn_norm``, ``norm``) run on the local sequence chunk,
    ``attention`` / ``feed_forward`` all-gather their first input to ``Replicate``
    (``attention``'s second input, the rope table, is left alone: it is a plain tensor
    for the full sequence length), and ``wo`` / ``w2`` reduce-scatter back to
    ``Shard(1)``. ``output`` gathers the sequence before its column-wise matmul.

    ``output`` produces ``Replicate`` logits ``(B, T, V)``, or with ``loss_parallel``
    vocab-sharded logits ``Shard(-1)`` ``(B, T, V/tp)`` for a vocab-parallel loss.
    """
    tp, Replicate, Shard = _styles()
    sp = sequence_parallel
    plan: dict[str, ParallelStyle] = {"tok_embeddings": _embedding(tp, Replicate, Shard, sp)}
    if sp:
        plan["norm"] = tp.SequenceParallel(use_local_output=True)
        plan["layers.*.attention_norm"] = tp.SequenceParallel(use_local_output=True)
        plan["layers.*.ffn_norm"] = tp.SequenceParallel(use_local_output=True)
        plan["layers.*.attention"] = tp.PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_output=True)
        plan["layers.*.feed_forward"] = tp.PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
    for name in ("attention.wq", "attention.wk", "attention.wv",
                 "feed_forward.w1", "feed_forward.w3"):
        plan[f"layers.*.{name}"] = tp.ColwiseParallel()
    for name in ("attention.wo", "feed_forward.w2"):
        plan[f"layers.*.{name}"] = _rowwise(tp, Shard, sp)
    plan["output"] = _head(tp, Replicate, Shard, sp, loss_parallel)
    return plan


def gpt2_tp_plan(*, sequence_parallel: bool = False,
                 loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    """TP plan for :class:`fsdp2d.models.gpt2.GPT2`, the same scheme as Llama's.

    Without sequence parallelism the residual stream is ``Replicate`` ``(B, T, C)``:
    ``wte`` is row-wise over the vocab (all-reduce), ``wpe`` stays unsharded (its
    ``(T, C)`` output is identical on every rank), ``q_proj/k_proj/v_proj`` and
    ``mlp.c_fc`` are column-wise (``n_head/tp`` local heads, ``4C/tp`` local MLP
    columns; column-wise biases are sharded with their rows), ``attn.c_proj`` and
    ``mlp.c_proj`` are row-wise and all-reduce back to ``Replicate`` (their bias is
    replicated and added once, after the reduction).

    With ``sequence_parallel`` the residual stream is ``Shard(1)`` ``(B, T/tp, C)``:
    ``wte`` reduce-scatters along the sequence, ``wpe``'s replicated ``(T, C)`` output
    is split along dim 0 into ``(T/tp, C)`` so that ``tok_emb + pos_emb`` adds matching
    local chunks, ``ln_1/ln_2/ln_f`` run on the local chunk, ``attn`` / ``mlp``
    all-gather their input to ``Replicate``, and the ``c_proj`` linears reduce-scatter
    back to ``Shard(1)``. ``lm_head`` gathers the sequence before its matmul.

    ``lm_head`` produces ``Replicate`` logits, or ``Shard(-1)`` with ``loss_parallel``.
    """
    tp, Replicate, Shard = _styles()
    sp = sequence_parallel
    plan: dict[str, ParallelStyle] = {"wte": _embedding(tp, Replicate, Shard, sp)}
    if sp:
        plan["wpe"] = tp.PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(0))
        plan["ln_f"] = tp.SequenceParallel(use_local_output=True)
        plan["h.*.ln_1"] = tp.SequenceParallel(use_local_output=True)
        plan["h.*.ln_2"] = tp.SequenceParallel(use_local_output=True)
        plan["h.*.attn"] = tp.PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
        plan["h.*.mlp"] = tp.PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
    for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.c_fc"):
        plan[f"h.*.{name}"] = tp.ColwiseParallel()
    for name in ("attn.c_proj", "mlp.c_proj"):
        plan[f"h.*.{name}"] = _rowwise(tp, Shard, sp)
    plan["lm_head"] = _head(tp, Replicate, Shard, sp, loss_parallel)
    return plan
