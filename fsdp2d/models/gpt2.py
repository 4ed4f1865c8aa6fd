"""GPT-2 style decoder (learned positions, LayerNorm, GELU MLP, biased linears).

Design
------
Like :mod:`fsdp2d.models.llama`, the model is parallelism-agnostic: inside ``forward``
all head counts and widths are read from tensor shapes (``view(B, T, -1, head_dim)``)
because tensor parallelism replaces ``nn.Linear`` weights by local shards. Attention
uses *separate* ``q_proj`` / ``k_proj`` / ``v_proj`` linears (instead of GPT-2's fused
``c_attn``) so each can be column-sharded on its own without splitting a fused weight.

Token and position embeddings are added as ``tok_emb (B, T, C) + pos_emb (T, C)``
with broadcasting; a sequence-parallel plan shards ``pos_emb`` along dim 0 to match
sequence-sharded token embeddings.

The LM head is *not* tied to ``wte`` unless ``tie_embeddings`` (HF's GPT-2 ties it;
tensor parallelism shards the two modules separately, so a tie does not survive
``parallelize_module``: a loader fills both from the same tensor). Construction happens on meta and is materialised with
``to_empty`` + ``init_weights()`` when not building under a meta device, so both paths
give identical weights under the same seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._init import init_
from ._tie import retie

__all__ = ["GPT2Args", "GPT2", "Block", "CausalSelfAttention", "MLP"]


@dataclass
class GPT2Args:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50304
    block_size: int = 1024  # maximum sequence length (rows of wpe)
    bias: bool = True  # biases in linears (except lm_head) and LayerNorms
    layer_norm_eps: float = 1e-5
    tie_embeddings: bool = False  # ``lm_head.weight`` is ``wte.weight`` (as in HF's GPT-2)

    @classmethod
    def debug(cls) -> "GPT2Args":
        return cls(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=64)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q/k/v projections."""

    def __init__(self, args: GPT2Args):
        super().__init__()
        C = args.n_embd
        self.head_dim = args.head_dim
        self.q_proj = nn.Linear(C, C, bias=args.bias)
        self.k_proj = nn.Linear(C, C, bias=args.bias)
        self.v_proj = nn.Linear(C, C, bias=args.bias)
        self.c_proj = nn.Linear(C, C, bias=args.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, C)
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hl, T, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hl, T, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hl, T, D)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, Hl, T, D)
        out = out.transpose(1, 2).reshape(B, T, -1)  # (B, T, Hl * D)
        return self.c_proj(out)  # (B, T, C)


class MLP(nn.Module):
    """``c_proj(gelu_tanh(c_fc(x)))`` with a 4x hidden width."""

    def __init__(self, args: GPT2Args):
        super().__init__()
        self.c_fc = nn.Linear(args.n_embd, 4 * args.n_embd, bias=args.bias)
        self.c_proj = nn.Linear(4 * args.n_embd, args.n_embd, bias=args.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.c_fc(x), approximate="tanh")  # (B, T, 4C)
        return self.c_proj(h)  # (B, T, C)


class Block(nn.Module):
    """Pre-LN block: ``x = x + attn(ln_1(x))``; ``x = x + mlp(ln_2(x))``."""

    def __init__(self, args: GPT2Args):
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.n_embd, eps=args.layer_norm_eps, bias=args.bias)
        self.attn = CausalSelfAttention(args)
        self.ln_2 = nn.LayerNorm(args.n_embd, eps=args.layer_norm_eps, bias=args.bias)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT2(nn.Module):
    """GPT-2: ``tokens (B, T) long -> logits (B, T, vocab)``."""

    def __init__(self, args: GPT2Args):
        super().__init__()
        self.args = args
        target = torch.get_default_device()
        with torch.device("meta"):
            self.wte = nn.Embedding(args.vocab_size, args.n_embd)
            self.wpe = nn.Embedding(args.block_size, args.n_embd)
            self.h = nn.ModuleList(Block(args) for _ in range(args.n_layer))
            self.ln_f = nn.LayerNorm(args.n_embd, eps=args.layer_norm_eps, bias=args.bias)
            self.lm_head = nn.Linear(args.n_embd, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialise every parameter in place, in a fixed (deterministic) order.

        Linears and embeddings: normal(0, 0.02); residual projections (``c_proj``):
        std ``0.02 / sqrt(2 * n_layer)``; biases zero; LayerNorm weights one.
        ``buffer_device`` is accepted for API symmetry with Llama (no buffers here).
        """
        del buffer_device
        proj_std = 0.02 / math.sqrt(2 * self.args.n_layer)
        init_(self.wte.weight, lambda x: nn.init.normal_(x, std=0.02))
        init_(self.wpe.weight, lambda x: nn.init.normal_(x, std=0.02))
        for block in self.h:
            _init_layer_norm(block.ln_1)
            for lin in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
                _init_linear(lin, 0.02)
            _init_linear(block.attn.c_proj, proj_std)
            _init_layer_norm(block.ln_2)
            _init_linear(block.mlp.c_fc, 0.02)
            _init_linear(block.mlp.c_proj, proj_std)
        _init_layer_norm(self.ln_f)
        if not self.args.tie_embeddings:
            _init_linear(self.lm_head, 0.02)

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        out = super()._apply(fn, recurse)
        if self.args.tie_embeddings:
            retie(self.lm_head, self.wte)  # _apply gave the head its own copy
        return out

    def forward(self, tokens: torch.Tensor, *, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        if document_ids is not None:  # per-row positions would be (B, T, C): the SP plan splits wpe's (T, C) output
            raise NotImplementedError("GPT2.forward: document_ids (document masking) is supported by fsdp2d's "
                                      "Llama only; use model.name=llama, or pass no document_ids")
        T = tokens.shape[1]  # tokens: (B, T)
        pos = torch.arange(T, device=tokens.device)  # (T,)
        tok_emb = self.wte(tokens)  # (B, T, C)
        pos_emb = self.wpe(pos)  # (T, C), broadcasts over B
        x = tok_emb + pos_emb  # (B, T, C)
        for block in self.h:
            x = block(x)  # (B, T, C)
        return self.lm_head(self.ln_f(x))  # (B, T, V)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count; ``exclude_embedding`` drops ``wte`` and ``wpe``."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            n -= self.wte.weight.numel() + self.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: ``6 * N + 12 * L * H * d_head * T``."""
        a = self.args
        n = self.num_params(exclude_embedding=True)
        return 6 * n + 12 * a.n_layer * a.n_head * a.head_dim * seq_len


def _init_linear(lin: nn.Linear, std: float) -> None:
    init_(lin.weight, lambda x: nn.init.normal_(x, mean=0.0, std=std))
    if lin.bias is not None:
        nn.init.zeros_(lin.bias)


def _init_layer_norm(ln: nn.LayerNorm) -> None:
    nn.init.ones_(ln.weight)
    if ln.bias is not None:
        nn.init.zeros_(ln.bias)
