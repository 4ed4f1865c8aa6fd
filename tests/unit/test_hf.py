"""Hugging Face in and out on one process: from_hf, export --format hf, clear errors.

Tolerance: fp32, relative 1e-5 of the largest logit. fsdp2d and transformers compute the
same functions with different kernels and summation orders (SDPA vs eager attention,
RoPE tables by outer product vs matmul): measured differences are 0 for Llama and
~3e-7 for GPT-2, so 1e-5 leaves margin while any mapping error (a transposed or
swapped weight, a wrong RoPE pairing or scaling) is O(1).
"""

import json

import pytest
import torch

from fsdp2d import checkpoint
from fsdp2d.checkpoint.__main__ import main as ckpt_main
from fsdp2d.hf import from_hf
from fsdp2d.models.llama import precompute_rope
from fsdp2d.hf.weights import HFError, config_from_hf, load_hf_into, model_spec

from .. import hf_models as H

pytest.importorskip("transformers")
TOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {k: H.make(k, root / k) for k in ("llama", "llama_tied", "gpt2", "gpt2_untied")}


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "gpt2", "gpt2_untied"])
def test_from_hf_logits_equal_transformers(folders, kind):
    x = H.tokens()
    model = from_hf(folders[kind])
    with torch.no_grad():
        err = H.rel_err(model(x), H.hf_logits(folders[kind], x))
    assert err < TOL, f"{kind}: logits rel error {err:.2e}"
    head, emb = ("output", "tok_embeddings") if kind.startswith("llama") else ("lm_head", "wte")
    assert (getattr(model, head).weight is getattr(model, emb).weight) == (kind in ("llama_tied", "gpt2"))


def test_rope_scaling_is_honoured(folders):
    """The Llama fixture's llama3 RoPE scaling changes the logits: dropping it must show."""
    x = H.tokens()
    model = from_hf(folders["llama"])
    assert model.args.rope_scaling["rope_type"] == "llama3"
    a = model.args
    model.rope_cache = precompute_rope(a.head_dim, a.max_seq_len, a.rope_theta)  # unscaled
    with torch.no_grad():
        assert H.rel_err(model(x), H.hf_logits(folders["llama"], x)) > 1e-3
    model.args.rope_scaling = None
    with pytest.raises(HFError, match="rope_scaling"):
        load_hf_into(model, folders["llama"])


@pytest.mark.parametrize("kind,shard_bytes", [("llama", 30_000), ("gpt2", 5 * 2**30)])
def test_export_hf_roundtrip(folders, tmp_path, kind, shard_bytes):
    """from_hf -> fsdp2d.checkpoint.save -> export --format hf -> transformers: same logits."""
    model = from_hf(folders[kind])
    checkpoint.save(tmp_path / "ckpt", model, extra={"model": model_spec(model)})
    argv = ["export", "--format", "hf", "--max-shard-gib", str(shard_bytes / 2**30), str(tmp_path / "ckpt"),
            str(tmp_path / "out")]
    assert ckpt_main(argv) == 0
    out = tmp_path / "out"
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()
    if kind == "llama":  # sharded like HF: every tensor listed once in the index
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    x = H.tokens(seed=1)
    with torch.no_grad():
        err = H.rel_err(H.hf_logits(out, x), model(x))
    assert err < TOL, f"{kind}: exported logits rel error {err:.2e}"
    assert config_from_hf(json.loads((out / "config.json").read_text()))[1] == model.args


def test_export_needs_the_architecture(folders, tmp_path, capsys):
    """save records an fsdp2d model's architecture itself (issue 21: from_hf -> save ->
    export failed with "extra['model'] is missing"); any other model needs spec=."""
    model = from_hf(folders["gpt2"])
    checkpoint.save(tmp_path / "ckpt", model)
    assert ckpt_main(["export", "--format", "hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    x = H.tokens()
    with torch.no_grad():
        assert H.rel_err(H.hf_logits(tmp_path / "out", x), model(x)) < TOL
    checkpoint.save(tmp_path / "plain", torch.nn.Linear(2, 2))
    assert ckpt_main(["export", "--format", "hf", str(tmp_path / "plain"), str(tmp_path / "out2")]) == 1
    assert "extra['model'] is missing" in capsys.readouterr().err


def test_clear_errors(folders, tmp_path):
    cfg = json.loads((folders["llama"] / "config.json").read_text())
    with pytest.raises(HFError, match="attention_bias"):
        config_from_hf({**cfg, "attention_bias": True})
    with pytest.raises(HFError, match="model_type='bert'"):
        config_from_hf({**cfg, "model_type": "bert"})
    model = from_hf(folders["gpt2"])
    from safetensors.torch import load_file, save_file
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((folders["gpt2"] / "config.json").read_text())
    tensors = load_file(folders["gpt2"] / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "h.1.mlp.c_fc.bias" not in k}, bad / "model.safetensors")
    with pytest.raises(HFError, match=r"transformer.h.1.mlp.c_fc.bias.* missing"):
        load_hf_into(model, bad)
    save_file({**tensors, "transformer.h.0.extra.weight": torch.zeros(2)}, bad / "model.safetensors")
    with pytest.raises(HFError, match=r"no place.*transformer.h.0.extra.weight"):
        load_hf_into(model, bad)
    tensors["transformer.wpe.weight"] = tensors["transformer.wpe.weight"][:4]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(HFError, match=r"config.json: n_positions=16 but transformer.wpe.weight .* has 4 rows"):
        load_hf_into(model, bad)
