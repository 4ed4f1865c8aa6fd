"""Tiny random Hugging Face models saved as HF folders, for import/export tests.

No hub access: configs are built here, weights are random (``initializer_range`` 0.2,
so logits are O(1) and a relative 1e-5 check is meaningful). Each maker returns the
folder; ``hf_logits`` runs transformers' own model on it.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB, SEQ = 96, 12


def tokens(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def make(kind: str, path: Path) -> Path:
    """``kind``: ``llama`` (GQA, untied, llama3 RoPE scaling, sharded files),
    ``llama_tied``, ``gpt2`` (tied, as HF's), ``gpt2_untied``."""
    import transformers as T

    torch.manual_seed({"llama": 1, "llama_tied": 2, "gpt2": 3, "gpt2_untied": 4}[kind])
    if kind.startswith("llama"):
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
        cfg = T.LlamaConfig(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=8,
                            num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
                            rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=kind == "llama_tied",
                            rope_parameters=rope if kind == "llama" else {"rope_type": "default",
                                                                          "rope_theta": 500.0})
        model = T.LlamaForCausalLM(cfg)
    else:
        cfg = T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=16,
                           initializer_range=0.2, tie_word_embeddings=kind == "gpt2", bos_token_id=0,
                           eos_token_id=0)
        model = T.GPT2LMHeadModel(cfg)
        with torch.no_grad():  # HF initialises biases and LayerNorms to 0/1: make them count
            for name, p in model.named_parameters():
                if name.endswith("bias") or "ln_" in name:
                    p.add_(0.1 * torch.randn_like(p))
    # The untied Llama is written as several files with an index, as large models are.
    model.save_pretrained(path, safe_serialization=True, max_shard_size="20KB" if kind == "llama" else "1GB")
    return path


def hf_logits(path: Path, x: torch.Tensor) -> torch.Tensor:
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(x).logits


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()
