"""How the trainer parallelizes a model: TP plan, activation checkpointing and
``fully_shard`` on a meta-device model (the whole model, or one pipeline stage), and how a
batch reaches the device. Shared by the trainer, its pipeline stages
(:mod:`fsdp2d.train.pipeline`) and ``fsdp2d plan``'s dry run.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as recompute

import fsdp2d
from fsdp2d.models import GPT2, Llama, gpt2_tp_plan, llama_tp_plan

from .config import JobConfig

__all__ = ["parallelize_model", "apply_parallelism", "shard_groups", "to_device", "SAVED_OPS"]


def parallelize_model(cfg: JobConfig, mesh: fsdp2d.DeviceMesh) -> torch.nn.Module:
    """The model on the meta device with the TP plan, activation checkpointing and
    ``fully_shard`` applied as ``cfg`` says (``fsdp2d plan`` builds with this too; one
    pipeline stage: :func:`fsdp2d.train.pipeline.parallelize_stage`)."""
    args = cfg.model.to_args()
    with torch.device("meta"):
        model = Llama(args) if cfg.model.name == "llama" else GPT2(args)
    return apply_parallelism(cfg, mesh, model)


def apply_parallelism(cfg: JobConfig, mesh: fsdp2d.DeviceMesh, model: torch.nn.Module) -> torch.nn.Module:
    """TP plan, activation checkpointing and ``fully_shard`` over the data axes (all but
    ``tp`` and ``pp``) on a meta-device model: the whole model, or a pipeline stage that
    holds only some of its pieces (the plan's entries for the missing ones are dropped)."""
    p = cfg.parallel
    if p.tp > 1:
        make_plan = llama_tp_plan if cfg.model.name == "llama" else gpt2_tp_plan
        plan = make_plan(sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel)
        plan = {k: v for k, v in plan.items() if getattr(model, k.split(".")[0], None) is not None}
        fsdp2d.parallelize_module(model, mesh["tp"], plan)
    blocks = model.blocks() if cfg.model.name == "llama" else list(model.h)
    if cfg.training.activation_checkpointing != "none":
        for block in blocks:
            _checkpoint_activations(block, cfg.training.activation_checkpointing)
    dp_axes = tuple(n for n in cfg.mesh_dim_names if n not in ("tp", "pp"))
    bf16 = cfg.training.mixed_precision == "bf16"
    mp = fsdp2d.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else fsdp2d.MixedPrecisionPolicy()
    shard_groups(model, blocks, mesh[dp_axes], mp, keep_unsharded=p.pp > 1)
    return model


def shard_groups(model: torch.nn.Module, blocks: list[torch.nn.Module], dp_mesh: fsdp2d.DeviceMesh,
                 mp: fsdp2d.MixedPrecisionPolicy, keep_unsharded: bool = False) -> None:
    """``fully_shard`` as torchtitan wraps: the embeddings in a group of their own, each
    block, the final norm and the output projection as one group, then the root (which
    holds whatever is left: nothing in fsdp2d's models). So the root's all-gather is not
    exposed at the start of forward, nor its reduce-scatter at the end of backward, and
    the output weight's gradient (the largest) is reduced as soon as backward leaves the
    head. The last block and the head are not resharded after forward: backward needs
    them first; with ``keep_unsharded`` (a pipeline stage) no group is, as torchtitan
    under pipelining: each micro-batch would all-gather again. A pipeline stage lacks the
    pieces (None) it does not hold. With tied embeddings (one tensor in both) the root
    keeps both ends."""
    first, last = ([model.tok_embeddings], [model.norm, model.output]) if isinstance(model, Llama) \
        else ([model.wte, model.wpe], [model.ln_f, model.lm_head])
    first, last = [m for m in first if m is not None], [m for m in last if m is not None]
    tied = model.args.tie_embeddings
    if not tied and first:
        fsdp2d.fully_shard(first if len(first) > 1 else first[0], mesh=dp_mesh, mp_policy=mp,
                           reshard_after_forward=not keep_unsharded)
    for i, block in enumerate(blocks):
        fsdp2d.fully_shard(block, mesh=dp_mesh, mp_policy=mp,
                           reshard_after_forward=i < len(blocks) - 1 and not keep_unsharded)
    if not tied and last:
        fsdp2d.fully_shard(last, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    fsdp2d.fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=not keep_unsharded)


_aten = torch.ops.aten
SAVED_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
})
"""The ops whose outputs selective activation checkpointing keeps for backward: the
matmuls and attention (the FLOPs); everything else in a block is recomputed."""


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing's per-op policy (see :data:`SAVED_OPS`)."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_matmuls)


def _checkpoint_activations(block: torch.nn.Module, mode: str = "full") -> None:
    """Recompute ``block``'s forward in backward instead of keeping its activations:
    all of it (``full``), or all but the outputs of :data:`SAVED_OPS` (``selective``)."""
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r}: use 'full' or 'selective' ('none': do not call)")
    inner = block.forward
    extra = {"context_fn": _selective_contexts} if mode == "selective" else {}

    def forward(*args, **kwargs):
        return recompute(inner, *args, use_reentrant=False, **extra, **kwargs)

    block.forward = forward


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without making the host wait: a copy from pageable memory to
    a GPU waits for everything queued before it, so the batch goes through pinned memory
    (a host-side copy) and then to the device with ``non_blocking`` (the caching host
    allocator keeps the pinned buffer until the copy is done). On the CPU, ``t`` itself."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
