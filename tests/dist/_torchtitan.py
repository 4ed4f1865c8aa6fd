"""torchtitan 0.3.0's own llama3 parallelize function on 4 CPU ranks: jobs for the pool.

What runs is torchtitan's code: ``ParallelDims.build_mesh`` builds its meshes,
``set_llama3_sharding_config`` sets its sharding (sequence parallel on, its
default), and ``torchtitan.models.llama3.parallelize_llama`` applies its TP
(``Module.parallelize``) and its ``apply_fsdp_to_decoder`` (per block, ``[norm, lm_head]``
as one group, the root; gradient division disabled: the loss is divided by the global token
count instead). The fsdp2d run is the same call with the names torchtitan's
``torchtitan.distributed.fsdp`` imported from ``torch.distributed.fsdp`` switched to fsdp2d's
(``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``, ``CPUOffloadPolicy``), as a user
switches imports.

CPU workarounds, the same on both sides:
- ``torchtitan.distributed.parallel_dims.device_type = "cpu"`` (torchtitan falls back to
  "cuda" where no accelerator is found);
- attention: every layer's ``inner_attention`` is ``ScaledDotProductAttention`` (causal),
  not FlexAttention (no CPU backward); torchtitan's ``get_attention_config`` refuses "sdpa"
  for language models only because SDPA cannot take per-document masks, which this run
  does not use;
- ``spmd_backend="partial_dtensor"`` (DTensor on the TP axis only; torchtitan's default
  "spmd_types" path hands ``fully_shard`` the ``dp_mesh_dims`` of a full SPMD mesh, a
  torch-FSDP-only keyword fsdp2d refuses);
- fp32 parameters (torchtitan's default is bf16 compute), so 1e-6 comparisons mean something;
- torch's "fake" process-group backend registered (``import
  torch.testing._internal.distributed.fake_pg``): ``build_mesh`` gives size-1 axes (pp, cp,
  ep, ...) fake groups, a backend the torch 2.13 wheel only knows once that module is imported;
- ``set_force_sum_reduction_for_comms(True)`` on every FSDP module (gloo has no PREMUL_SUM);
- without triton (the CPU wheel has none) the one torchtitan module that needs it at import,
  ``torchtitan.distributed.minimal_async_ep.kernels`` (GPU kernels of MoE expert
  parallelism, unused by a dense Llama), is replaced by a module whose functions raise.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types

import torch

from . import _parity as P

DP, TP, STEPS, LR = 2, 2, 5, 1e-2
BATCH, SEQ = 8, 16
# (vocab, ffn hidden): even, and uneven (vocab 97 rows split 49/48 over tp, then 25/24 and
# 24/24 over dp; hidden 90: 45 per tp rank, 23/22 per dp rank).
SHAPES = {"even": (128, 176), "uneven": (97, 90)}
_DIMS: dict = {}


def stub_triton_kernels() -> None:
    """Without triton, give torchtitan an importable stand-in for its MoE GPU kernels."""
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if importlib.util.find_spec("triton") is not None or name in sys.modules:
        return
    stub = types.ModuleType(name)

    def missing(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def raise_(*args, **kwargs):
            raise RuntimeError(f"{name}.{attr} needs triton (stubbed by fsdp2d's tests: no triton here)")
        return raise_

    stub.__getattr__ = missing  # type: ignore[method-assign]
    sys.modules[name] = stub


def _parallel_dims():
    """torchtitan's ParallelDims for dp_shard=2 x tp=2, meshes built once per worker."""
    if "pd" not in _DIMS:
        stub_triton_kernels()
        import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
        import torchtitan.distributed.parallel_dims as pdm

        pdm.device_type = "cpu"
        pd = pdm.ParallelDims(dp_replicate=1, dp_shard=DP, cp=1, tp=TP, pp=1, ep=1, world_size=DP * TP,
                              spmd_backend="partial_dtensor")
        pd.build_mesh()
        _DIMS["pd"] = pd
    return _DIMS["pd"]


def _configs():
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    parallelism = ParallelismConfig(data_parallel_shard_degree=DP, tensor_parallel_degree=TP,
                                    spmd_backend="partial_dtensor")
    training = TrainingConfig(local_batch_size=BATCH // DP, seq_len=SEQ, mixed_precision_param="float32")
    return parallelism, training, CompileConfig()


def _model(parallelism, shape: str) -> torch.nn.Module:
    """A small torchtitan Llama3 (2 layers, GQA 4/2 heads, dim 64) with causal SDPA."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    dim, n_heads = 64, 4
    vocab, hidden = SHAPES[shape]
    layers = _build_llama3_layers(
        n_layers=2, dim=dim, n_heads=n_heads, n_kv_heads=2,
        hidden_dim=hidden,
        rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=SEQ, theta=500000, scaling="llama"),
        attn_backend="flex")
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg = Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init={"weight": torch.nn.init.normal_}),
        norm=RMSNorm.Config(normalized_shape=dim, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=dim, out_features=vocab,
                              param_init={"weight": torch.nn.init.xavier_normal_}),
        layers=layers)
    # What cfg.update_from_config does for a trainer config, minus the import of torchtitan's
    # trainer (datasets, torchdata, wandb, ...): torchtitan's sharding of every sub-config.
    set_llama3_sharding_config(cfg, enable_sp=parallelism.enable_sequence_parallel)
    torch.manual_seed(1234)
    model = cfg.build()
    model.init_states()
    return model


# The names torchtitan.distributed.fsdp imports from torch's FSDP2, all switched by default;
# the partial switches (fully_shard alone, fully_shard + MixedPrecisionPolicy) left
# torchtitan's ``isinstance(m, FSDPModule)`` false for fsdp2d's modules before fsdp2d's class
# subclassed torch's.
ALL_NAMES = ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy")


@contextlib.contextmanager
def _fsdp2d_names(names: tuple[str, ...]):
    """torchtitan's FSDP module with ``names`` (its torch FSDP2 imports) switched to fsdp2d's."""
    import torchtitan.distributed.fsdp as ttf

    import fsdp2d

    saved = {n: getattr(ttf, n) for n in names}
    for n in names:
        setattr(ttf, n, getattr(fsdp2d, n))
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(ttf, n, v)


def train(impl: str, shape: str, names: tuple[str, ...] = ALL_NAMES) -> dict:
    """parallelize_llama with ``impl``'s fully_shard (torch or fsdp2d: ``names`` switched),
    STEPS AdamW steps."""
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    pd = _parallel_dims()
    from torchtitan.models.llama3 import parallelize_llama

    parallelism, training, compile_config = _configs()
    model = _model(parallelism, shape)
    with _fsdp2d_names(names) if impl == "fsdp2d" else contextlib.nullcontext():
        import torchtitan.distributed.fsdp as ttf

        parallelize_llama(model, parallel_dims=pd, training=training, parallelism=parallelism,
                          compile_config=compile_config, ac_config=None, dump_folder="/tmp")
        fsdp_modules = [m for m in model.modules() if isinstance(m, ttf.FSDPModule)]
    for m in fsdp_modules:
        m.set_force_sum_reduction_for_comms(True)
    batch_mesh = pd.get_mesh("batch")
    losses, norms = _steps(model, SHAPES[shape][0], batch_mesh.get_local_rank(), batch_mesh.size(),
                           batch_mesh.get_group())
    with torch.no_grad():
        params = {name: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
                  for name, p in model.named_parameters()}
    out = {"losses": losses, "grad_norms": norms, "params": params,
           "fsdp_modules": sorted(type(m).__name__ for m in fsdp_modules),
           "types": sorted({type(m).__module__.split(".")[0] for m in fsdp_modules})}
    if impl == "fsdp2d":  # torchtitan's disable_fsdp_gradient_division reached fsdp2d's groups
        import fsdp2d

        # None: a root that owns no parameter
        groups = [m._fsdp2d_fsdp.group for m in model.modules() if isinstance(m, fsdp2d.FSDPModule)]
        out["divide_factors"] = sorted({g.divide_factor for g in groups if g is not None})
    return out


def reference(shape: str) -> dict:
    """The same model (same seed) in one process on the whole batch: no parallelism."""
    torch.set_num_threads(1)
    parallelism, _, _ = _configs()
    model = _model(parallelism, shape)
    losses, norms = _steps(model, SHAPES[shape][0], 0, 1, None)
    return {"losses": losses, "grad_norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _grad_norm(model: torch.nn.Module) -> float:
    """The 2-norm of all full gradients (each DTensor gradient gathered whole)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        squares = [(g.full_tensor() if isinstance(g, DTensor) else g).double().pow(2).sum()
                   for g in (p.grad for p in model.parameters()) if g is not None]
    return torch.stack(squares).sum().sqrt().item()


def _steps(model: torch.nn.Module, vocab: int, rank: int, n: int, group) -> tuple[list[float], list[float]]:
    """STEPS AdamW steps on this data rank's rows of each global batch; the global losses
    and the gradient norms."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=P.EPS, weight_decay=0.1, foreach=True)
    losses, norms = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)  # (B, T + 1)
        x, y = tokens[:, :-1].chunk(n)[rank], tokens[:, 1:].chunk(n)[rank]
        logits = model(x)  # (B / n, T, V)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        # torchtitan's loss: a sum over this rank's tokens / the global token count
        # (FSDP's gradient division is off: the reduce-scatter sums).
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / (BATCH * SEQ)
        loss.backward()
        norms.append(_grad_norm(model))
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if group is not None:
            dist.all_reduce(total, group=group)
        losses.append(total.item())
    return losses, norms
