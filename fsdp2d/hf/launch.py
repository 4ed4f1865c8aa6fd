"""The launcher's Hugging Face bridges: start from an HF folder, end with an HF export.

``--model.init_from=PATH``: :func:`apply_init_from` (called right after the config is
loaded, before validation) copies the HF architecture into ``[model]`` so the usual
checks (TP degree divides the heads, ``seq_len <= max_seq_len``...) see the real model;
the trainer then loads the weights shard by shard (:func:`fsdp2d.hf.load_hf_into`)
instead of initialising them. ``checkpoint.export_hf``: rank 0 writes the last
checkpoint as an HF folder ``RUN/hf`` that ``transformers`` loads, with the tokenizer the
data layer made the tokens with (each checkpoint records it:
:class:`fsdp2d.data.tokenizer.TokenizerRecord`).
"""

from __future__ import annotations

from ..train.config import JobConfig, read_init_from


def apply_init_from(cfg: JobConfig) -> JobConfig:
    """With ``model.init_from`` set, make ``[model]`` describe the HF model (in place)."""
    m = cfg.model
    if not m.init_from:
        return cfg
    arch, a = read_init_from(m.init_from)
    m.name = arch
    if arch == "llama":
        m.dim, m.n_layers, m.n_heads, m.n_kv_heads = a.dim, a.n_layers, a.n_heads, a.kv_heads
        m.vocab_size, m.norm_eps, m.rope_theta = a.vocab_size, a.norm_eps, a.rope_theta
        m.max_seq_len = min(m.max_seq_len, a.max_seq_len) if m.max_seq_len else a.max_seq_len
    else:
        m.dim, m.n_layers, m.n_heads, m.n_kv_heads = a.n_embd, a.n_layer, a.n_head, None
        m.vocab_size, m.norm_eps, m.max_seq_len = a.vocab_size, a.layer_norm_eps, a.block_size
    return cfg

