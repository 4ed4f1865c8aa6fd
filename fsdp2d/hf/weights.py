"""Hugging Face checkpoints in and out: configs, one name table per architecture, loading.

Design
------
An HF folder (``config.json`` plus ``model.safetensors`` or a sharded
``model.safetensors.index.json``) maps onto fsdp2d's own models (:class:`Llama`,
:class:`GPT2`) through one table per architecture: fsdp2d parameter -> :class:`Rule`
(the HF tensor it comes from, whether HF stores it transposed, and which block of a
fused HF tensor it is). The same table serves import (:func:`load_hf_into`) and export
(:mod:`fsdp2d.hf.export`), so names cannot drift between the two directions.

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

import os
import re
from dataclasses import asdict, dataclass, fields, replace

import torch
from torch import nn

from ..placement import Box
from .config import MAX_SIZE, HFError, check_against_model, config_from_hf, hf_config
from .files import CONFIG, FLOAT_DTYPES, HFFolder, ReadStats
from ..models.gpt2 import GPT2, GPT2Args
from ..models.llama import Llama, LlamaArgs, precompute_rope

__all__ = ["Rule", "TABLES", "from_hf", "load_hf_into", "config_from_hf", "hf_config", "hf_rule",
           "HFError", "ReadStats", "HFFolder", "model_spec",
           "check_sizes"]


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


def model_spec(model: nn.Module) -> dict:
    """``{"arch", "args"}`` of an fsdp2d model: JSON for a checkpoint's ``extra["model"]``,
    which ``export --format hf`` reads to write ``config.json``."""
    arch = "llama" if isinstance(model, Llama) else "gpt2" if isinstance(model, GPT2) else None
    if arch is None:
        raise HFError(f"{type(model).__name__} is not an fsdp2d Llama or GPT2")
    return {"arch": arch, "args": asdict(model.args)}


def args_from_spec(spec: dict) -> tuple[str, LlamaArgs | GPT2Args]:
    """The inverse of :func:`model_spec`, checked as a ``config.json`` would be (a spec is
    read from a checkpoint's index: input like any other); :class:`HFError` if it is not
    one an fsdp2d model could have written."""
    arch = spec.get("arch") if isinstance(spec, dict) else None
    if arch not in ("llama", "gpt2") or not isinstance(spec.get("args"), dict):
        raise HFError(f"model spec {str(spec)[:80]!r}: needs {{'arch': 'llama' or 'gpt2', 'args': {{...}}}}")
    cls = LlamaArgs if arch == "llama" else GPT2Args
    known = {f.name for f in fields(cls)}
    try:
        args = cls(**{k: v for k, v in spec["args"].items() if k in known})
        full = replace(args, bias=True) if arch == "gpt2" else args  # HF's GPT-2 always has biases
        config_from_hf(hf_config(arch, full), "the checkpoint's model spec")  # types and ranges
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise HFError(f"the checkpoint's model spec: {exc}") from exc
    return arch, args


# ------------------------------------------------------------------------ loading


# ------------------------------------------------------------------------ loading

_LAYER = re.compile(r"^(?:model\.layers|transformer\.h|h)\.(\d+)\.")
# (HF field, fsdp2d value, HF tensor, dim): config sizes a stored tensor's shape vouches for.
_VOUCHED = {
    "llama": (("vocab_size", "vocab_size", "model.embed_tokens.weight", 0),
              ("hidden_size", "dim", "model.embed_tokens.weight", 1),
              ("intermediate_size", "ffn_hidden_dim", "model.layers.0.mlp.gate_proj.weight", 0),
              ("num_key_value_heads * head_dim", "kv_dim", "model.layers.0.self_attn.k_proj.weight", 0)),
    "gpt2": (("vocab_size", "vocab_size", "transformer.wte.weight", 0),
             ("n_embd", "n_embd", "transformer.wte.weight", 1),
             ("n_positions", "block_size", "transformer.wpe.weight", 0)),
}
_DTYPE_NAMES = {"I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32",
                "U16": "uint16", "U8": "uint8", "BOOL": "bool"}


def check_sizes(folder: HFFolder, arch: str, args: LlamaArgs | GPT2Args) -> None:
    """The config's sizes that the files vouch for (layers, vocabulary, widths), compared
    before a model is built: a config that lies about them never allocates, and the
    error names the field (the tensor-by-tensor check that follows names tensors)."""
    cfg_path = folder.path / CONFIG
    n_layers = args.n_layers if arch == "llama" else args.n_layer
    stored = {int(m.group(1)) for k in folder.meta if (m := _LAYER.match(k))}
    if stored != set(range(n_layers)):
        raise HFError(f"{cfg_path}: {'num_hidden_layers' if arch == 'llama' else 'n_layer'}={n_layers} but the "
                      f"weights hold {len(stored)} layers ({min(stored, default=None)}..{max(stored, default=None)})")
    for field, ours, tensor, dim in _VOUCHED[arch]:
        want = args.kv_heads * args.head_dim if ours == "kv_dim" else getattr(args, ours)
        try:
            shape = folder.shape(tensor)
        except HFError:
            continue  # the plan names the missing tensor
        if len(shape) == 2 and shape[dim] != want:
            raise HFError(f"{cfg_path}: {field}={want} but {tensor} in the weights has {shape[dim]} "
                          f"{'rows' if dim == 0 else 'columns'}")


def _expected_hf_shape(rule: Rule, global_shape: tuple[int, ...]) -> tuple[int, ...]:
    shape = (global_shape[0] * rule.part[1], *global_shape[1:])
    return tuple(reversed(shape)) if rule.transpose else shape


def _plan(model: nn.Module, folder: HFFolder, arch: str, tied: bool) -> list:
    """``[(entry, rule)]`` for every local piece of ``model``, after checking the whole set
    against the files: every tensor present, of the right shape and a float dtype, and
    no stored tensor left without a place. Touches no tensor data."""
    from ..checkpoint._entries import model_entries  # models must import without checkpoint

    plan, used = [], set()
    for e in model_entries(model):
        fqn = e.name.removeprefix("model/")
        rule = hf_rule(arch, fqn, tied)
        key = folder.key(rule.hf)
        used.add(key)
        want, got = _expected_hf_shape(rule, e.global_shape), folder.shape(key)
        if got != want:
            raise HFError(f"{folder.path}: {rule.hf} has shape {got}, {fqn} needs {want}")
        if (dtype := folder.dtype(key)) not in FLOAT_DTYPES:
            raise HFError(f"{folder.path / folder.meta[key][2]}: {key} is stored as {dtype} "
                          f"({_DTYPE_NAMES.get(dtype, dtype)}); fsdp2d loads float weights only "
                          f"({', '.join(FLOAT_DTYPES)})")
        plan.append((e, fqn, rule))
    unused = sorted(k for k in folder.meta if k not in used and not _IGNORED.match(k))
    if unused:
        raise HFError(f"{folder.path}: tensors with no place in fsdp2d's {arch} model: {unused[:5]}"
                      + (f" (+{len(unused) - 5} more)" if len(unused) > 5 else ""))
    return plan


def _read(folder: HFFolder, rule: Rule, box: Box, global_shape: tuple[int, ...]) -> torch.Tensor:
    """The fsdp2d ``box`` of a tensor of ``global_shape`` that ``rule`` maps: only that
    slice is read from disk."""
    k, _ = rule.part
    sl = list(box.slices())
    sl[0] = slice(sl[0].start + k * global_shape[0], sl[0].stop + k * global_shape[0])
    piece = folder.slice(rule.hf)[tuple(reversed(sl)) if rule.transpose else tuple(sl)]
    folder.stats.bytes += piece.numel() * piece.element_size()
    folder.stats.slices += 1
    return piece.T if rule.transpose else piece


@torch.no_grad()
def load_hf_into(model: nn.Module, path: str | os.PathLike) -> ReadStats:
    """Fill ``model`` (fsdp2d Llama or GPT2, on any mesh) in place from HF folder ``path``.

    Works on the model as built for training: after ``parallelize_module`` /
    ``fully_shard`` and ``to_empty``. Each local piece (via the checkpoint enumeration
    ``model_entries``) reads exactly its own box from disk, so a rank reads its shards,
    not the model. No collective: call it on every rank, or on one process.

    Everything is checked before the first byte reaches the model, so a refusal leaves
    it untouched: raises :class:`HFError` for a file outside the folder (``..``, absolute,
    symlinked out), a damaged config, index or safetensors file, a config field that
    computes something else than the model (heads, kv heads, eps, RoPE, sizes, ...), a
    missing, misshapen, non-float or unplaced tensor, or meta (unmaterialised) pieces.
    Returns the bytes and slices read on this rank.
    """
    with HFFolder(path) as folder:
        args = config_from_hf(folder.config(), str(folder.path / CONFIG))[1]
        arch = model_spec(model)["arch"]
        check_against_model(arch, args, model.args, str(folder.path / CONFIG))
        check_sizes(folder, arch, args)
        plan = _plan(model, folder, arch, args.tie_embeddings)
        for e, fqn, _ in plan:
            if e.tensor.is_meta:
                raise HFError(f"{fqn} is on the meta device: call model.to_empty(device=...) before loading")
        for e, fqn, rule in plan:
            if not e.box.numel():
                continue
            try:
                e.tensor.copy_(_read(folder, rule, e.box, e.global_shape))
            except Exception as exc:  # an I/O error after validation: say the model is partial
                raise HFError(f"{folder.path}: reading {rule.hf} for {fqn} failed after every check passed "
                              f"({exc}); the model is partially loaded: load it again") from exc
        if isinstance(model, Llama):  # the one buffer: not in files, garbage after to_empty
            a = model.args
            model.rope_cache = precompute_rope(a.head_dim, a.max_seq_len, a.rope_theta, model.rope_cache.device,
                                               a.rope_scaling)
        return folder.stats


def from_hf(path: str | os.PathLike, *, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32, max_seq_len: int | None = None) -> Llama | GPT2:
    """fsdp2d's own model (``Llama`` or ``GPT2``) with the weights of HF folder ``path``.

    One process, unparallelized: for a mesh, build the model on meta, parallelize it,
    ``to_empty`` and call :func:`load_hf_into` (see the README). ``max_seq_len``
    overrides Llama's RoPE table length (HF's ``max_position_embeddings``). The config
    is checked against the files' tensors (every name, shape and dtype) on the meta
    device, before anything is allocated; refusals are :class:`HFError` (see
    :func:`load_hf_into`).

    Example::

        model = fsdp2d.hf.from_hf("path/to/hf_folder")
        logits = model(tokens)  # (B, T, V), equal to transformers' AutoModelForCausalLM
    """
    with HFFolder(path) as folder:
        arch, args = config_from_hf(folder.config(), str(folder.path / CONFIG))
        if max_seq_len is not None and arch == "llama":
            if type(max_seq_len) is not int or not 1 <= max_seq_len <= MAX_SIZE:
                raise HFError(f"from_hf: max_seq_len={max_seq_len!r} must be an integer in [1, {MAX_SIZE}]")
            args.max_seq_len = max_seq_len
        check_sizes(folder, arch, args)
        with torch.device("meta"):
            model = (Llama if arch == "llama" else GPT2)(args)
        _plan(model, folder, arch, args.tie_embeddings)
    model.to_empty(device=device)
    load_hf_into(model, path)
    return model.to(dtype)
