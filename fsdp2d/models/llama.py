"""Llama-style decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU).

Design
------
The model knows nothing about parallelism. Tensor parallelism later swaps the
``nn.Linear`` weights for local shards, so every size inside ``forward`` is read from
tensor shapes (``view(B, T, -1, head_dim)``), never from ``LlamaArgs``. Only ratios that
survive an even split across ranks are taken from the config: ``head_dim`` and
``n_rep = n_heads // n_kv_heads`` (each rank keeps ``n_heads / tp`` query heads and
``n_kv_heads / tp`` kv heads, whose ratio is still ``n_rep``).

Module names follow torchtitan (``tok_embeddings``, ``layers.{i}.attention.wq``, ...)
so tensor-parallel plans and checkpoints can address them by pattern.

RoPE convention: *half-split* (a.k.a. "rotate_half", the Hugging Face layout). For a
head vector ``x`` of size ``D``, channel ``i < D/2`` is paired with channel ``i + D/2``
and the pair is rotated by angle ``pos * theta ** (-2i / D)``. (Meta's original
checkpoints use the interleaved convention; loading them needs the usual q/k row
permutation.) The tables live in one non-persistent buffer ``rope_cache`` of shape
``(max_seq_len, 2, D/2)``: ``[:, 0]`` is cos, ``[:, 1]`` is sin, float32.

Initialisation: construction always happens on the meta device (no wasted random
init, no RNG consumed); outside a meta context the module is then materialised with
``to_empty`` and ``init_weights()``, so building directly on a device and building on
meta + ``to_empty`` + ``init_weights()`` give identical weights under the same seed.
``init_weights`` only uses in-place ``torch.nn.init`` calls, so it works on any local
shard shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._init import init_, seeded
from ._tie import retie
from .document import document_mask, document_positions

__all__ = [
    "LlamaArgs",
    "Llama",
    "TransformerBlock",
    "Attention",
    "FeedForward",
    "RMSNorm",
    "precompute_rope",
    "apply_rope",
]


@dataclass
class LlamaArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: same as n_heads (plain multi-head attention)
    vocab_size: int = 128256
    multiple_of: int = 256  # the SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 2048
    ffn_hidden: int | None = None  # explicit SwiGLU hidden size (HF ``intermediate_size``)
    rope_scaling: dict | None = None  # HF ``rope_parameters`` ("linear", "llama3"); None: plain RoPE
    tie_embeddings: bool = False  # ``output.weight`` is ``tok_embeddings.weight``

    @classmethod
    def debug(cls) -> "LlamaArgs":
        return cls(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                   multiple_of=32, max_seq_len=64, rope_theta=10000.0)

    @classmethod
    def llama3_8b(cls) -> "LlamaArgs":
        return cls(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                   multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000.0,
                   max_seq_len=8192)

    @classmethod
    def llama3_70b(cls) -> "LlamaArgs":
        return cls(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                   multiple_of=4096, ffn_dim_multiplier=1.3, rope_theta=500000.0,
                   max_seq_len=8192)

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size: ``ffn_hidden`` if set, else 2/3 of 4*dim, times the
        multiplier, rounded up to ``multiple_of``."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


# ---------------------------------------------------------------------------- RoPE


def precompute_rope(head_dim: int, max_seq_len: int, theta: float,
                    device: torch.device | str | None = None, scaling: dict | None = None) -> torch.Tensor:
    """Rotary tables ``(max_seq_len, 2, head_dim // 2)`` float32: [:, 0]=cos, [:, 1]=sin.

    ``scaling`` is a Hugging Face ``rope_parameters``/``rope_scaling`` dict: ``rope_type``
    ``"default"``, ``"linear"`` (frequencies divided by ``factor``) or ``"llama3"`` (Llama
    3.1's wavelength-dependent interpolation); any other type raises ``ValueError``.
    """
    half = head_dim // 2
    exponents = torch.arange(half, dtype=torch.float32, device=device) * 2 / head_dim
    inv_freq = _scale_inv_freq(theta ** -exponents, scaling)  # (D/2,)
    pos = torch.arange(max_seq_len, dtype=torch.float32, device=device)  # (S,)
    angles = torch.outer(pos, inv_freq)  # (S, D/2)
    return torch.stack([angles.cos(), angles.sin()], dim=1)  # (S, 2, D/2)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies (D/2,) after HF's RoPE scaling (same formulas as transformers)."""
    kind = (scaling or {}).get("rope_type", scaling.get("type") if scaling else None) or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        raise ValueError(f"RoPE scaling rope_type={kind!r} is not supported (default, linear, llama3)")
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)  # 0 at the low-frequency end, 1 at the high
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, T, H, D) by ``rope`` (T, 2, D/2), or (B, T, 2, D/2) for positions
    that differ per row (document masking), half-split pairs; float32 math."""
    cos = rope[..., 0, :].unsqueeze(-2)  # (T, 1, D/2) or (B, T, 1, D/2), broadcasts over heads
    sin = rope[..., 1, :].unsqueeze(-2)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)  # (B, T, H, D/2) each
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)  # (B, T, H, D)
    return out.to(x.dtype)


# ------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, in float32, cast back to input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # (..., C)
        rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (..., 1)
        return (xf * rms * self.weight.float()).to(x.dtype)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, T, KV, D) -> (B, T, KV * n_rep, D); query head h reads kv head h // n_rep."""
    if n_rep == 1:
        return x
    return torch.repeat_interleave(x, n_rep, dim=2)


class Attention(nn.Module):
    """Causal grouped-query attention; head counts are read from the weight shards."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        if args.n_heads % args.kv_heads:
            raise ValueError(f"n_heads={args.n_heads} not a multiple of n_kv_heads={args.kv_heads}")
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def init_weights(self, std: float, out_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            _trunc_normal(lin.weight, std)
        _trunc_normal(self.wo.weight, out_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask`` (B, 1, T, T) bool, True = may attend (document masking); None: causal."""
        B, T, _ = x.shape  # (B, T, C)
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, Hl, D), Hl = local heads
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, KVl, D)
        v = self.wv(x).view(B, T, -1, self.head_dim)  # (B, T, KVl, D)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)  # (B, T, Hl, D)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, Hl, T, D)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, Hl, T, D)
        else:  # causal and same-document; the diagonal is always True, so no row is empty
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(B, T, -1)  # (B, T, Hl * D)
        return self.wo(out)  # (B, T, C)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, std: float, out_std: float) -> None:
        _trunc_normal(self.w1.weight, std)
        _trunc_normal(self.w2.weight, out_std)
        _trunc_normal(self.w3.weight, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, C) via (B, T, hidden)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x), rope)``; ``out = h + ffn(norm(h))``."""

    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        # depth-scaled init of the projections that write into the residual stream
        self.out_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(0.02, self.out_std)
        self.feed_forward.init_weights(0.02, self.out_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # the mask goes by keyword only when there is one: TP plans prepare (x, rope) by position
        kw = {} if mask is None else {"mask": mask}
        h = x + self.attention(self.attention_norm(x), rope, **kw)  # (B, T, C)
        return h + self.feed_forward(self.ffn_norm(h))  # (B, T, C)


class Llama(nn.Module):
    """Decoder-only Llama: ``tokens (B, T) long -> logits (B, T, vocab)``."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        target = torch.get_default_device()
        with torch.device("meta"):
            self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
            self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
            self.norm = RMSNorm(args.dim, args.norm_eps)
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
            rope = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta, scaling=args.rope_scaling)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cache", rope, persistent=False)  # (S, 2, D/2)
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialise every parameter in place and recompute ``rope_cache``.

        Deterministic given ``torch.manual_seed``: one draw from the generator gives a base
        seed, and each piece (the embedding, layer ``i``, the output) is filled from its own
        seed, ``base + 1 + i`` for layer ``i``. So a pipeline stage holding only some of the
        pieces (``tok_embeddings``/``norm``/``output`` None, ``layers`` a ``ModuleDict`` keyed
        by the original indices) gets exactly the values they get in the whole model.
        ``buffer_device`` defaults to the device the buffer already lives on.
        """
        device = self.rope_cache.device if buffer_device is None else buffer_device
        a = self.args
        self.rope_cache = precompute_rope(a.head_dim, a.max_seq_len, a.rope_theta, device, a.rope_scaling)
        base = int(torch.randint(0, 2**62, (), device="cpu"))  # the CPU generator: no device sync
        if self.tok_embeddings is not None:
            with seeded(base):
                init_(self.tok_embeddings.weight, lambda x: nn.init.normal_(x, std=1.0))
        for layer in self.blocks():
            with seeded(base + 1 + layer.layer_id):
                layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not a.tie_embeddings:
            with seeded(base + 1 + a.n_layers):
                _trunc_normal(self.output.weight, a.dim ** -0.5)

    def blocks(self) -> list[TransformerBlock]:
        """The transformer blocks this model holds, in order (all of them, or a pipeline
        stage's when ``layers`` is a ``ModuleDict`` keyed by their indices)."""
        layers = self.layers
        return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        out = super()._apply(fn, recurse)
        if self.args.tie_embeddings:
            retie(self.output, self.tok_embeddings)  # _apply gave the head its own copy
        return out

    def forward(self, tokens: torch.Tensor, *, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens`` (B, T) -> logits (B, T, V).

        ``document_ids`` (B, T) int64 (see :mod:`fsdp2d.models.document`): attention never
        crosses a document boundary and RoPE positions restart at 0 at each document's first
        token, so each document's logits are those it would have alone. Under tensor (and
        sequence) parallelism pass the same full ``(B, T)`` ids as the tokens, on every TP
        rank: the mask and positions are built here, for the whole sequence that attention
        sees after its all-gather. None: plain causal attention, positions ``0..T-1``.
        """
        T = tokens.shape[1]  # tokens: (B, T)
        mask = None
        if document_ids is None:
            rope = self.rope_cache[:T]  # (T, 2, D/2)
        else:
            if document_ids.shape != tokens.shape:
                raise ValueError(f"Llama.forward: document_ids has shape {tuple(document_ids.shape)}, the tokens "
                                 f"{tuple(tokens.shape)}: one document id per token")
            pos = document_positions(document_ids)  # (B, T); index_select: integer rows, no host sync
            rope = self.rope_cache.index_select(0, pos.flatten()).unflatten(0, pos.shape)  # (B, T, 2, D/2)
            mask = document_mask(document_ids)  # (B, 1, T, T)
        # a pipeline stage without the embedding receives hidden states (B, T, C) as "tokens"
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)  # (B, T, C)
        for layer in self.blocks():
            h = layer(h, rope) if mask is None else layer(h, rope, mask=mask)  # (B, T, C)
        if self.output is None:  # a pipeline stage before the last
            return h  # (B, T, C)
        return self.output(self.norm(h))  # (B, T, V)

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            n -= self.tok_embeddings.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: ``6 * N + 12 * L * H * d_head * T``."""
        a = self.args
        n = self.num_params(exclude_embedding=True)
        return 6 * n + 12 * a.n_layers * a.n_heads * a.head_dim * seq_len


def _trunc_normal(t: torch.Tensor, std: float, cutoff: float = 3.0) -> None:
    init_(t, lambda x: nn.init.trunc_normal_(x, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std))
