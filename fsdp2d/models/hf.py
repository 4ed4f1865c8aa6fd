"""Hugging Face checkpoints in and out: configs, one name table per architecture, loading.

Design
------
An HF folder (``config.json`` plus ``model.safetensors`` or a sharded
``model.safetensors.index.json``) maps onto fsdp2d's own models (:class:`Llama`,
:class:`GPT2`) through one table per architecture: fsdp2d parameter -> :class:`Rule`
(the HF tensor it comes from, whether HF stores it transposed, and which block of a
fused HF tensor it is). The same table serves import (:func:`load_hf_into`) and export
(:mod:`fsdp2d.checkpoint._hf`), so names cannot drift between the two directions.

Conventions mapped:
- GPT-2's ``Conv1D`` stores weights as ``(in, out)``: fsdp2d's ``nn.Linear`` weight
  ``(out, in)`` is its transpose.
- GPT-2's fused ``c_attn`` ``(C, 3C)`` holds q, k, v side by side: fsdp2d's ``q_proj``,
  ``k_proj``, ``v_proj`` are its three column blocks (rows of the transpose).
- RoPE: HF Llama's q/k rows are in the rotate_half layout (channel ``i`` pairs with
  ``i + D/2``), which is exactly how :func:`fsdp2d.models.llama.apply_rope` pairs them,
  so q/k weights are copied without any row permutation.

Loading onto any mesh: :func:`load_hf_into` fills an already built model (meta ->
``parallelize_module`` -> ``fully_shard`` -> ``to_empty``) in place. It enumerates the
rank's local pieces with :func:`fsdp2d.checkpoint._entries.model_entries` (the same
enumeration checkpoints use) and reads, with safetensors' lazy ``get_slice``, only each
piece's box: never the whole model per rank. No collective is involved.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..placement import Box
from .gpt2 import GPT2, GPT2Args
from .llama import Llama, LlamaArgs, precompute_rope

__all__ = ["Rule", "TABLES", "from_hf", "load_hf_into", "config_from_hf", "hf_config", "hf_rule",
           "HFError", "ReadStats"]


class HFError(ValueError):
    """An HF folder or config that fsdp2d cannot map (names the file, key or field)."""


@dataclass(frozen=True)
class Rule:
    """Where one fsdp2d tensor lives in an HF checkpoint.

    ``hf``: the HF tensor name (``{i}`` = layer index). ``transpose``: HF stores the
    transpose (``Conv1D``). ``part=(k, n)``: the fsdp2d tensor is block ``k`` of ``n``
    equal blocks along fsdp2d dim 0 of the (untransposed) HF tensor (fused ``c_attn``).
    """

    hf: str
    transpose: bool = False
    part: tuple[int, int] = (0, 1)


_LLAMA_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_GPT2_LAYER = {
    **{f"{ln}.{p}": Rule(f"transformer.h.{{i}}.{ln}.{p}") for ln in ("ln_1", "ln_2") for p in ("weight", "bias")},
    **{f"attn.{x}_proj.weight": Rule("transformer.h.{i}.attn.c_attn.weight", True, (k, 3)) for k, x in enumerate("qkv")},
    **{f"attn.{x}_proj.bias": Rule("transformer.h.{i}.attn.c_attn.bias", False, (k, 3)) for k, x in enumerate("qkv")},
    **{f"{m}.weight": Rule(f"transformer.h.{{i}}.{m}.weight", True) for m in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")},
    **{f"{m}.bias": Rule(f"transformer.h.{{i}}.{m}.bias") for m in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")},
}

# fsdp2d fqn pattern ({i} = layer index) -> Rule, one table per architecture.
TABLES: dict[str, dict[str, Rule]] = {
    "llama": {
        "tok_embeddings.weight": Rule("model.embed_tokens.weight"),
        **{f"layers.{{i}}.{k}": Rule(f"model.layers.{{i}}.{v}") for k, v in _LLAMA_LAYER.items()},
        "norm.weight": Rule("model.norm.weight"),
        "output.weight": Rule("lm_head.weight"),
    },
    "gpt2": {
        "wte.weight": Rule("transformer.wte.weight"),
        "wpe.weight": Rule("transformer.wpe.weight"),
        **{f"h.{{i}}.{k}": r for k, r in _GPT2_LAYER.items()},
        "ln_f.weight": Rule("transformer.ln_f.weight"),
        "ln_f.bias": Rule("transformer.ln_f.bias"),
        "lm_head.weight": Rule("lm_head.weight"),
    },
}
_HEAD = {"llama": ("output.weight", "tok_embeddings.weight"), "gpt2": ("lm_head.weight", "wte.weight")}
# HF tensors that are not weights (old checkpoints kept these buffers): skipped on import.
_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")
_COMPILED = {arch: [(re.compile(re.escape(p).replace(r"\{i\}", r"(\d+)") + "$"), r) for p, r in t.items()]
             for arch, t in TABLES.items()}


def hf_rule(arch: str, fqn: str, tied: bool = False) -> Rule:
    """The :class:`Rule` of fsdp2d parameter ``fqn``; a tied head reads the embedding."""
    if tied and fqn == _HEAD[arch][0]:
        fqn = _HEAD[arch][1]
    for pattern, rule in _COMPILED[arch]:
        if m := pattern.match(fqn):
            return Rule(rule.hf.replace("{i}", m.group(1)) if m.groups() else rule.hf, rule.transpose, rule.part)
    raise HFError(f"{arch}: fsdp2d parameter {fqn!r} has no Hugging Face counterpart in the name table")


# ------------------------------------------------------------------------ configs


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from transformers 5's ``rope_parameters`` or 4.x's fields."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    return float(theta), (None if kind == "default" else {"rope_type": kind, **params})


def _require(cfg: dict, path: str, key: str, ok: bool, want: str) -> None:
    if not ok:
        raise HFError(f"{path}: {key}={cfg.get(key)!r} is not supported by fsdp2d's model (needs {want})")


def config_from_hf(cfg: dict, path: str = "config.json") -> tuple[str, LlamaArgs | GPT2Args]:
    """``(arch, args)`` of fsdp2d's model for an HF ``config.json`` dict; fields fsdp2d's
    models cannot honour raise :class:`HFError` naming the field."""
    kind = cfg.get("model_type")
    if kind in ("llama", "mistral") and not cfg.get("sliding_window"):
        heads, dim = cfg["num_attention_heads"], cfg["hidden_size"]
        _require(cfg, path, "head_dim", cfg.get("head_dim") in (None, dim // heads), f"hidden_size/heads={dim // heads}")
        _require(cfg, path, "hidden_act", cfg.get("hidden_act", "silu") == "silu", "silu")
        for key in ("attention_bias", "mlp_bias"):
            _require(cfg, path, key, not cfg.get(key), "false")
        theta, scaling = _rope(cfg)
        return "llama", LlamaArgs(
            dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=heads,
            n_kv_heads=cfg.get("num_key_value_heads") or heads, vocab_size=cfg["vocab_size"],
            ffn_hidden=cfg["intermediate_size"], norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta,
            rope_scaling=scaling, max_seq_len=cfg.get("max_position_embeddings", 2048),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    if kind == "gpt2":
        n = cfg["n_embd"]
        _require(cfg, path, "activation_function", cfg.get("activation_function", "gelu_new")
                 in ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")
        _require(cfg, path, "n_inner", cfg.get("n_inner") in (None, 4 * n), f"4 * n_embd = {4 * n}")
        for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
            _require(cfg, path, key, cfg.get(key, want) == want, str(want).lower())
        return "gpt2", GPT2Args(n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_embd=n,
                                vocab_size=cfg["vocab_size"], block_size=cfg["n_positions"],
                                layer_norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
                                tie_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    raise HFError(f"{path}: model_type={kind!r} is not supported (llama, mistral without sliding window, gpt2)")


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


def model_spec(model: nn.Module) -> dict:
    """``{"arch", "args"}`` of an fsdp2d model: JSON for a checkpoint's ``extra["model"]``,
    which ``export --format hf`` reads to write ``config.json``."""
    arch = "llama" if isinstance(model, Llama) else "gpt2" if isinstance(model, GPT2) else None
    if arch is None:
        raise HFError(f"{type(model).__name__} is not an fsdp2d Llama or GPT2")
    return {"arch": arch, "args": asdict(model.args)}


def args_from_spec(spec: dict) -> tuple[str, LlamaArgs | GPT2Args]:
    cls = LlamaArgs if spec["arch"] == "llama" else GPT2Args
    known = {f.name for f in fields(cls)}
    return spec["arch"], cls(**{k: v for k, v in spec["args"].items() if k in known})


# ------------------------------------------------------------------------ loading


@dataclass
class ReadStats:
    """What a load read from the HF files: bytes of tensor data and slices."""

    bytes: int = 0
    slices: int = 0


class HFFolder:
    """Lazy, sliced access to the safetensors of an HF folder (single file or sharded)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.path / "model.safetensors").is_file():
            with safe_open(self.path / "model.safetensors", framework="pt") as f:
                self.weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise HFError(f"{self.path}: has neither model.safetensors nor model.safetensors.index.json")
        self.stats = ReadStats()
        self._files: dict[str, object] = {}

    def config(self) -> dict:
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise HFError(f"{self.path}: no config.json")
        return json.loads(cfg.read_text())

    def key(self, name: str) -> str:
        """The stored key of HF tensor ``name`` (the original GPT-2 files lack ``transformer.``)."""
        if name not in self.weight_map and name.removeprefix("transformer.") in self.weight_map:
            return name.removeprefix("transformer.")
        if name not in self.weight_map:
            raise HFError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        return name

    def _slice(self, name: str):
        key = self.key(name)
        fname = self.weight_map[key]
        if fname not in self._files:
            self._files[fname] = safe_open(self.path / fname, framework="pt").__enter__()
        return self._files[fname].get_slice(key)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, rule: Rule, box: Box, global_shape: tuple[int, ...]) -> torch.Tensor:
        """The fsdp2d ``box`` of a tensor of ``global_shape`` that ``rule`` maps: only that
        slice is read from disk."""
        k, _ = rule.part
        sl = list(box.slices())
        sl[0] = slice(sl[0].start + k * global_shape[0], sl[0].stop + k * global_shape[0])
        piece = self._slice(rule.hf)[tuple(reversed(sl)) if rule.transpose else tuple(sl)]
        self.stats.bytes += piece.numel() * piece.element_size()
        self.stats.slices += 1
        return piece.T if rule.transpose else piece

    def close(self) -> None:
        for f in self._files.values():
            f.__exit__(None, None, None)
        self._files.clear()


def _expected_hf_shape(rule: Rule, global_shape: tuple[int, ...]) -> tuple[int, ...]:
    shape = (global_shape[0] * rule.part[1], *global_shape[1:])
    return tuple(reversed(shape)) if rule.transpose else shape


# Fields that change what the model computes without changing any tensor's shape.
# (A tied checkpoint may fill an untied model: both copies start from the embedding.)
_SEMANTIC = ("norm_eps", "rope_theta", "rope_scaling", "layer_norm_eps", "bias")


def _check_args(model: nn.Module, args: LlamaArgs | GPT2Args, path: Path) -> str:
    spec = model_spec(model)
    if not isinstance(args, type(model.args)):
        raise HFError(f"{path}: holds a {type(args).__name__} model, not the {type(model).__name__} given")
    for name in _SEMANTIC:
        if hasattr(args, name) and getattr(args, name) != getattr(model.args, name):
            raise HFError(f"{path}: config gives {name}={getattr(args, name)!r}, the model has "
                          f"{getattr(model.args, name)!r}; build the model with config_from_hf's args")
    if model.args.tie_embeddings and not args.tie_embeddings:
        raise HFError(f"{path}: the model ties its head to the embedding, the checkpoint has its own head")
    return spec["arch"]


@torch.no_grad()
def load_hf_into(model: nn.Module, path: str | os.PathLike) -> ReadStats:
    """Fill ``model`` (fsdp2d Llama or GPT2, on any mesh) in place from HF folder ``path``.

    Works on the model as built for training: after ``parallelize_module`` /
    ``fully_shard`` and ``to_empty``. Each local piece (via the checkpoint enumeration
    ``model_entries``) reads exactly its own box from disk, so a rank reads its shards,
    not the model. No collective: call it on every rank, or on one process. Raises
    :class:`HFError` for a missing or misshapen HF tensor, an HF tensor the table does
    not place, a config that disagrees with the model, or meta (unmaterialised) pieces.
    Returns the bytes and slices read on this rank.
    """
    from ..checkpoint._entries import model_entries  # models must import without checkpoint

    folder = HFFolder(path)
    try:
        args = config_from_hf(folder.config(), str(folder.path / "config.json"))[1]
        arch = _check_args(model, args, folder.path)
        used = set()
        for e in model_entries(model):
            fqn = e.name.removeprefix("model/")
            if e.tensor.is_meta:
                raise HFError(f"{fqn} is on the meta device: call model.to_empty(device=...) before loading")
            rule = hf_rule(arch, fqn, args.tie_embeddings)
            used.add(folder.key(rule.hf))
            want, got = _expected_hf_shape(rule, e.global_shape), folder.shape(rule.hf)
            if got != want:
                raise HFError(f"{folder.path}: {rule.hf} has shape {got}, {fqn} needs {want}")
            if e.box.numel():
                e.tensor.copy_(folder.read(rule, e.box, e.global_shape))
        unused = sorted(k for k in folder.weight_map if k not in used and not _IGNORED.match(k))
        if unused:
            raise HFError(f"{folder.path}: tensors with no place in fsdp2d's {arch} model: {unused[:5]}"
                          + (f" (+{len(unused) - 5} more)" if len(unused) > 5 else ""))
        if isinstance(model, Llama):  # the one buffer: not in files, garbage after to_empty
            a = model.args
            model.rope_cache = precompute_rope(a.head_dim, a.max_seq_len, a.rope_theta, model.rope_cache.device,
                                               a.rope_scaling)
        return folder.stats
    finally:
        folder.close()


def from_hf(path: str | os.PathLike, *, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32, max_seq_len: int | None = None) -> Llama | GPT2:
    """fsdp2d's own model (``Llama`` or ``GPT2``) with the weights of HF folder ``path``.

    One process, unparallelized: for a mesh, build the model on meta, parallelize it,
    ``to_empty`` and call :func:`load_hf_into` (see the README). ``max_seq_len``
    overrides Llama's RoPE table length (HF's ``max_position_embeddings``).

    Example::

        model = fsdp2d.models.from_hf("path/to/hf_folder")
        logits = model(tokens)  # (B, T, V), equal to transformers' AutoModelForCausalLM
    """
    folder = Path(path)
    arch, args = config_from_hf(HFFolder(folder).config(), str(folder / "config.json"))
    if max_seq_len is not None and arch == "llama":
        args.max_seq_len = max_seq_len
    with torch.device("meta"):
        model = (Llama if arch == "llama" else GPT2)(args)
    model.to_empty(device=device)
    load_hf_into(model, folder)
    return model.to(dtype)
