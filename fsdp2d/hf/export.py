"""Export an fsdp2d checkpoint as a Hugging Face folder that ``transformers`` loads.

``export_hf(CKPT, OUT)`` writes ``config.json``, ``generation_config.json`` and the
weights under HF's names (``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
plus ``model.safetensors.index.json`` above ``max_shard_bytes``). Names, transposes and
fused tensors come from the same per-architecture table as the import
(:data:`fsdp2d.hf.weights.TABLES`), read backwards: an HF tensor is the concatenation
along fsdp2d dim 0 of the fsdp2d tensors mapped to it (in block order), transposed where
HF stores ``Conv1D`` weights. The architecture comes from ``extra["model"]`` of the
checkpoint (:func:`fsdp2d.hf.weights.model_spec`), from the ``"model"`` that
:func:`fsdp2d.checkpoint.save` records for an fsdp2d Llama or GPT2, or from ``spec=``.
Streamed like :func:`fsdp2d.checkpoint.export`: the split into files is planned from the
index, then each file is assembled, written and freed before the next. An earlier export
in the folder is replaced as a set (``_replace``): a stale index and its shards do not
stay beside the new weights, and a failed export leaves the previous one whole.

The tokenizer: ``tokenizer=`` (``"bytes"`` or a ``tokenizer.json`` or its folder; ``False``:
none), else the one the checkpoint records (``extra["tokenizer"]``, saved by ``fsdp2d
train``; refused in one line when that file is gone or changed since:
:func:`fsdp2d.hf.tokenizer.recorded_tokenizer`), else none. With one,
the folder also gets ``tokenizer.json``, ``tokenizer_config.json`` and
``special_tokens_map.json`` (:mod:`fsdp2d.hf.tokenizer`), and ``config.json`` /
``generation_config.json`` carry its ``bos_token_id`` / ``eos_token_id``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from .tokenizer import recorded_tokenizer, tokenizer_files
from .weights import HFError, Rule, args_from_spec, hf_config, hf_rule
from ..placement import Box
from ..checkpoint._files import Folder
from ..checkpoint._io import _fsync_write, read_box
from ..checkpoint._replace import write_replacing

__all__ = ["export_hf"]


def _hf_groups(index: dict, arch: str, tied: bool) -> dict[str, list[tuple[int, str, Rule]]]:
    """HF name -> [(block k, fsdp2d checkpoint name, rule)], blocks sorted."""
    groups: dict[str, list[tuple[int, str, Rule]]] = {}
    for name in sorted(n for n in index["tensors"] if n.startswith("model/")):
        rule = hf_rule(arch, name.removeprefix("model/"), tied)
        groups.setdefault(rule.hf, []).append((rule.part[0], name, rule))
    for hf_name, parts in groups.items():
        parts.sort()
        n = parts[0][2].part[1]
        if [k for k, _, _ in parts] != list(range(n)) and not (tied and len(parts) == 2 * n):
            raise HFError(f"{hf_name}: the checkpoint holds blocks {[k for k, _, _ in parts]} of {n}")
    return groups


def _assemble(folder: Folder, hf_name: str, parts: list) -> torch.Tensor:
    """The full HF tensor ``hf_name`` from its fsdp2d pieces (a tied head's second copy,
    saved by a tensor-parallel run, must equal the embedding: it is checked, not written)."""
    tensors, seen = [], {}
    for k, name, rule in parts:
        shape = tuple(folder.index["tensors"][name]["shape"])
        full = read_box(folder, name, Box((0,) * len(shape), shape))
        if k in seen:
            if not torch.equal(seen[k][1], full):
                raise HFError(f"{name} and {seen[k][0]} are tied in the config but differ in the checkpoint "
                              f"(trained untied under tensor parallelism?); export needs one tensor")
            continue
        seen[k] = (name, full)
        tensors.append(full)
    out = torch.cat(tensors, dim=0) if len(tensors) > 1 else tensors[0]
    return (out.T if parts[0][2].transpose else out).contiguous()


def _plan(index: dict, groups: dict, max_shard_bytes: int) -> list[list[str]]:
    plan: list[list[str]] = [[]]
    size = 0
    for hf_name in sorted(groups):
        metas = [index["tensors"][name] for k, name, _ in groups[hf_name]]
        nbytes = sum(math.prod(m["shape"]) * getattr(torch, m["dtype"]).itemsize for m in metas)
        if plan[-1] and size + nbytes > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append(hf_name)
        size += nbytes
    return plan


def export_hf(ckpt: str | os.PathLike, out: str | os.PathLike, *, spec: dict | None = None,
              max_shard_bytes: int = 5 * 2**30, tokenizer: str | bool | None = None) -> list[Path]:
    """Write checkpoint ``ckpt`` (saved on any mesh) as a Hugging Face folder ``out``.

    ``spec`` (``{"arch", "args"}``, see :func:`fsdp2d.hf.weights.model_spec`) defaults to
    the checkpoint's ``extra["model"]``; ``tokenizer`` to the checkpoint's
    ``extra["tokenizer"]`` (see the module doc). Offline, one process. Returns the files
    written. Raises :class:`~fsdp2d.hf.weights.HFError` when the architecture is unknown, a
    tensor has no HF name, or the tokenizer cannot be read, is not the one recorded, or has
    more ids than the model.
    """
    with Folder(ckpt) as folder:
        return _export_hf(folder, Path(out), spec, max_shard_bytes, tokenizer)


def _tokenizer(folder: Folder, tokenizer: str | bool | None, args) -> tuple[dict[str, bytes], dict]:
    """The tokenizer files to write and its special ids ({} and {} without a tokenizer)."""
    if tokenizer is None:
        tokenizer = recorded_tokenizer(folder.index, folder.path)
    if not tokenizer:
        return {}, {}
    vocab = args.vocab_size
    try:
        files, special = tokenizer_files(tokenizer, getattr(args, "max_seq_len", None) or args.block_size)
        from tokenizers import Tokenizer

        size = Tokenizer.from_str(files["tokenizer.json"].decode()).get_vocab_size(with_added_tokens=True)
    except Exception as exc:  # tokenizers raises a bare Exception for a damaged file
        raise HFError(f"tokenizer {tokenizer}: cannot be read ({exc}); give another (--tokenizer) or none "
                      f"(--no-tokenizer, tokenizer=False)") from exc
    if size > vocab:
        raise HFError(f"tokenizer {tokenizer} has {size} ids, the model's vocabulary {vocab}: not this model's")
    return files, special


def _export_hf(folder: Folder, out: Path, spec: dict | None, max_shard_bytes: int,
               tokenizer: str | None) -> list[Path]:
    index = folder.index
    spec = spec or index.get("extra", {}).get("model") or index.get("model")
    if spec is None:
        raise HFError(f"{folder.path}: extra['model'] is missing (the model saved was not an fsdp2d Llama or "
                      f"GPT2); save with extra={{'model': model_spec(model)}} or pass spec=")
    arch, args = args_from_spec(spec)
    groups = _hf_groups(index, arch, args.tie_embeddings)
    plan = _plan(index, groups, max_shard_bytes)
    tok = _tokenizer(folder, tokenizer, args)
    return write_replacing(out, folder.path, lambda stage: _write_files(folder, stage, plan, groups, arch, args, tok))


def _write_files(folder: Folder, out: Path, plan: list[list[str]], groups: dict, arch: str, args,
                 tok: tuple[dict[str, bytes], dict]) -> list[str]:
    """Every file of the export, written (and fsynced) into ``out``; their names."""
    n = len(plan)
    fnames = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map, total, dtype = {}, 0, "float32"
    for fname, names in zip(fnames, plan):
        shard = {name: _assemble(folder, name, groups[name]) for name in names}
        total += sum(t.numel() * t.element_size() for t in shard.values())
        dtype = str(next(iter(shard.values())).dtype).removeprefix("torch.")
        weight_map.update({name: fname for name in names})
        data = st_save(shard, metadata={"format": "pt"})
        del shard
        _fsync_write(out / fname, data)
        del data
    written = list(fnames)
    if n > 1:
        _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
        written.append("model.safetensors.index.json")
    files, special = tok
    ids = {k: special[k] for k in ("bos_token_id", "eos_token_id")} if files else {}
    _write_json(out / "config.json", {**hf_config(arch, args), **ids, "dtype": dtype})
    _write_json(out / "generation_config.json", {"_from_model_config": True, **ids})
    for name, data in files.items():
        _fsync_write(out / name, data)
    return written + ["config.json", "generation_config.json", *files]


def _write_json(path: Path, obj: dict) -> None:
    _fsync_write(path, (json.dumps(obj, indent=2) + "\n").encode())
