"""Hugging Face ``config.json`` <-> fsdp2d model arguments, checked before anything is built.

Design
------
A config is input from outside: every field fsdp2d reads is checked for type and range
here (an int is an int, not ``32.5``, ``"32"``, ``True`` or ``[32]``; sizes are
positive and below :data:`MAX_SIZE`; eps and theta are finite and positive; RoPE
scaling is a dict of a supported type with its numbers), so a bad config is one
:class:`HFError` naming the file, the field and the value, never a traceback from
deep inside model construction or a 12 TB allocation. Sizes a file can vouch for
(vocabulary, width, layers) are compared with the tensors by the loader;
:data:`COMPUTING_FIELDS` lists the fields that change what a model computes, which
:func:`check_against_model` compares with an already built model.
"""

from __future__ import annotations

import math
from typing import Any

from ..models.gpt2 import GPT2Args
from ..models.llama import LlamaArgs

__all__ = ["HFError", "config_from_hf", "hf_config", "check_against_model", "COMPUTING_FIELDS", "MAX_SIZE"]

# A bound on any one size a config may give (vocabulary, width, layers, positions): far
# above every released model, far below an allocation that would take the machine down.
MAX_SIZE = 2**24
_ROPE_TYPES = ("default", "linear", "llama3")


class HFError(ValueError):
    """An HF folder or config that fsdp2d cannot map (names the file, key or field)."""


def _get(cfg: dict, key: str, default: Any) -> Any:
    """``cfg[key]``; a missing key or JSON null is the default (HF writes null for "unset")."""
    v = cfg.get(key)
    return default if v is None else v


def _int(cfg: dict, path: str, key: str, default: Any = None, *, lo: int = 1, hi: int = MAX_SIZE) -> int:
    v = _get(cfg, key, default)
    if type(v) is not int or not lo <= v <= hi:
        raise HFError(f"{path}: {key}={v!r} must be an integer in [{lo}, {hi}]")
    return v


def _float(cfg: dict, path: str, key: str, default: float) -> float:
    v = _get(cfg, key, default)
    if type(v) not in (int, float) or not math.isfinite(v) or v <= 0:
        raise HFError(f"{path}: {key}={v!r} must be a finite number > 0")
    return float(v)


def _bool(cfg: dict, path: str, key: str, default: bool) -> bool:
    v = _get(cfg, key, default)
    if type(v) is not bool:
        raise HFError(f"{path}: {key}={v!r} must be true or false")
    return v


def _require(cfg: dict, path: str, key: str, ok: bool, want: str) -> None:
    if not ok:
        raise HFError(f"{path}: {key}={cfg.get(key)!r} is not supported by fsdp2d's model (needs {want})")


def _rope(cfg: dict, path: str) -> tuple[float, dict | None]:
    """(theta, scaling) from transformers 5's ``rope_parameters`` or 4.x's fields."""
    key = "rope_parameters" if cfg.get("rope_parameters") is not None else "rope_scaling"
    params = cfg.get(key) or {}
    if not isinstance(params, dict):
        raise HFError(f"{path}: {key}={params!r} must be an object (rope_type, rope_theta, ...)")
    params = dict(params)
    where = {**cfg, **({"rope_theta": params.pop("rope_theta")} if "rope_theta" in params else {})}
    theta = _float(where, path, "rope_theta", 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise HFError(f"{path}: {key}.rope_type={kind!r} is not supported ({', '.join(_ROPE_TYPES)})")
    if kind == "default":
        return theta, None
    needs = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor",
                                                   "original_max_position_embeddings")
    for k in needs:
        _float(params, f"{path}: {key}", k, math.nan)  # nan: a missing number is refused
    if kind == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
        raise HFError(f"{path}: {key}: high_freq_factor must exceed low_freq_factor")
    return theta, {"rope_type": kind, **params}


def config_from_hf(cfg: Any, path: str = "config.json") -> tuple[str, LlamaArgs | GPT2Args]:
    """``(arch, args)`` of fsdp2d's model for an HF ``config.json`` dict. Every field is
    type- and range-checked; fields fsdp2d's models cannot honour raise :class:`HFError`
    naming the file, the field and its value."""
    if not isinstance(cfg, dict):
        raise HFError(f"{path}: a config must be a JSON object, not {type(cfg).__name__}")
    kind = cfg.get("model_type")
    if kind in ("llama", "mistral") and not cfg.get("sliding_window"):
        return "llama", _llama(cfg, path)
    if kind == "gpt2":
        return "gpt2", _gpt2(cfg, path)
    raise HFError(f"{path}: model_type={kind!r} is not supported (llama, mistral without sliding window, gpt2)")


def _llama(cfg: dict, path: str) -> LlamaArgs:
    dim, heads = _int(cfg, path, "hidden_size"), _int(cfg, path, "num_attention_heads")
    kv = _int(cfg, path, "num_key_value_heads", heads)
    _require(cfg, path, "num_attention_heads", dim % heads == 0 and (dim // heads) % 2 == 0,
             f"a divisor of hidden_size={dim} leaving an even head size")
    _require(cfg, path, "num_key_value_heads", heads % kv == 0, f"a divisor of num_attention_heads={heads}")
    _require(cfg, path, "head_dim", cfg.get("head_dim") in (None, dim // heads)
             and type(cfg.get("head_dim")) in (type(None), int), f"hidden_size/heads={dim // heads}")
    _require(cfg, path, "hidden_act", cfg.get("hidden_act", "silu") == "silu", "silu")
    for key in ("attention_bias", "mlp_bias"):
        _require(cfg, path, key, cfg.get(key, False) is False, "false")
    theta, scaling = _rope(cfg, path)
    return LlamaArgs(
        dim=dim, n_layers=_int(cfg, path, "num_hidden_layers"), n_heads=heads, n_kv_heads=kv,
        vocab_size=_int(cfg, path, "vocab_size"), ffn_hidden=_int(cfg, path, "intermediate_size"),
        norm_eps=_float(cfg, path, "rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_seq_len=_int(cfg, path, "max_position_embeddings", 2048),
        tie_embeddings=_bool(cfg, path, "tie_word_embeddings", False))


def _gpt2(cfg: dict, path: str) -> GPT2Args:
    n, heads = _int(cfg, path, "n_embd"), _int(cfg, path, "n_head")
    _require(cfg, path, "n_head", n % heads == 0, f"a divisor of n_embd={n}")
    _require(cfg, path, "activation_function", cfg.get("activation_function", "gelu_new")
             in ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")
    _require(cfg, path, "n_inner", cfg.get("n_inner") in (None, 4 * n) and type(cfg.get("n_inner")) in
             (type(None), int), f"4 * n_embd = {4 * n}")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        _require(cfg, path, key, cfg.get(key, want) is want, str(want).lower())
    return GPT2Args(n_layer=_int(cfg, path, "n_layer"), n_head=heads, n_embd=n,
                    vocab_size=_int(cfg, path, "vocab_size"), block_size=_int(cfg, path, "n_positions"),
                    layer_norm_eps=_float(cfg, path, "layer_norm_epsilon", 1e-5),
                    tie_embeddings=_bool(cfg, path, "tie_word_embeddings", True))


def hf_config(arch: str, args: LlamaArgs | GPT2Args) -> dict:
    """The HF ``config.json`` dict of fsdp2d model ``args`` (inverse of :func:`config_from_hf`)."""
    if arch == "llama":
        a = args
        rope = {"rope_theta": a.rope_theta, "rope_type": "default", **(a.rope_scaling or {})}
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a.dim,
                "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
                "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim, "vocab_size": a.vocab_size,
                "intermediate_size": a.ffn_hidden_dim, "rms_norm_eps": a.norm_eps, "hidden_act": "silu",
                "max_position_embeddings": a.max_seq_len, "rope_theta": a.rope_theta, "rope_parameters": rope,
                "tie_word_embeddings": a.tie_embeddings, "attention_bias": False, "mlp_bias": False}
    if not args.bias:
        raise HFError("gpt2 without biases (GPT2Args.bias=False) has no Hugging Face GPT-2 equivalent")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": args.n_embd,
            "n_layer": args.n_layer, "n_head": args.n_head, "vocab_size": args.vocab_size,
            "n_positions": args.block_size, "layer_norm_epsilon": args.layer_norm_eps, "n_inner": None,
            "activation_function": "gelu_new", "tie_word_embeddings": args.tie_embeddings,
            "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0,
            # GPT-2's <|endoftext|> when the vocabulary has it (transformers' default is 50256)
            **dict.fromkeys(("bos_token_id", "eos_token_id"), 50256 if args.vocab_size > 50256 else None)}


# (fsdp2d argument or property, HF field): every field that changes what the model
# computes, shape-changing or not (heads at one width share every tensor shape). Llama's
# max_seq_len only sizes the RoPE table, GPT-2's bias is always true in HF: not compared.
COMPUTING_FIELDS = {
    "llama": (("dim", "hidden_size"), ("n_layers", "num_hidden_layers"), ("n_heads", "num_attention_heads"),
              ("kv_heads", "num_key_value_heads"), ("vocab_size", "vocab_size"),
              ("ffn_hidden_dim", "intermediate_size"), ("norm_eps", "rms_norm_eps"), ("rope_theta", "rope_theta"),
              ("rope_scaling", "rope_parameters")),
    "gpt2": (("n_embd", "n_embd"), ("n_layer", "n_layer"), ("n_head", "n_head"), ("vocab_size", "vocab_size"),
             ("block_size", "n_positions"), ("layer_norm_eps", "layer_norm_epsilon"), ("bias", "bias")),
}
_LABEL = {"kv_heads": "n_kv_heads", "ffn_hidden_dim": "ffn_hidden", "rope_scaling": "rope_scaling"}


def check_against_model(arch: str, args: LlamaArgs | GPT2Args, model_args: LlamaArgs | GPT2Args, path: str) -> None:
    """Raise :class:`HFError` naming the field, ``path`` and both values where the config's
    ``args`` would compute something else than the model built with ``model_args``. A tied
    checkpoint may fill an untied model (both copies start from the embedding), not the
    reverse."""
    if not isinstance(args, type(model_args)):
        raise HFError(f"{path}: holds a {type(args).__name__} model, the model given has {type(model_args).__name__}")
    for ours, theirs in COMPUTING_FIELDS[arch]:
        a, m = getattr(args, ours), getattr(model_args, ours)
        if a != m:
            raise HFError(f"{path}: {theirs}={a!r} but the model has {_LABEL.get(ours, ours)}={m!r}; build the "
                          f"model with config_from_hf's args")
    if model_args.tie_embeddings and not args.tie_embeddings:
        raise HFError(f"{path}: tie_word_embeddings=false but the model ties its head to the embedding")
