"""``export --format hf`` over an earlier export (issue 21): the folder's model files are
replaced as a whole (no stale index or shards left beside the new weights), other files
stay, and a failed export leaves the previous one loadable."""

import pytest
import torch

from fsdp2d import checkpoint
from fsdp2d.hf.export import export_hf
from fsdp2d.hf import from_hf
from fsdp2d.hf.weights import model_spec

from .test_hf_hostile import llama, logits


def _ckpt(model, path):
    checkpoint.save(path, model, extra={"model": model_spec(model)})
    return path


def test_export_over_an_earlier_sharded_export(tmp_path):
    old, new, out = llama(seed=1), llama(seed=2), tmp_path / "out"
    export_hf(_ckpt(old, tmp_path / "c1"), out, max_shard_bytes=8_000)
    assert (out / "model.safetensors.index.json").is_file()
    (out / "tokenizer.json").write_text("{}")  # the user's files beside the model stay
    export_hf(_ckpt(new, tmp_path / "c2"), out)
    left = sorted(p.name for p in out.iterdir())
    assert left == [".fsdp2d-export.json", "config.json", "generation_config.json", "model.safetensors",
                    "tokenizer.json"], left
    assert torch.equal(logits(from_hf(out)), logits(new))


def test_a_failed_export_keeps_the_old_one(tmp_path, monkeypatch):
    old, out = llama(seed=1), tmp_path / "out"
    export_hf(_ckpt(old, tmp_path / "c1"), out, max_shard_bytes=8_000)
    files = sorted(p.name for p in out.iterdir())
    import fsdp2d.hf.export as E

    calls = []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) > 2:
            raise OSError("disk full")
        return real(*a, **kw)

    real = E._assemble
    monkeypatch.setattr(E, "_assemble", failing)
    with pytest.raises(OSError, match="disk full"):
        export_hf(_ckpt(llama(seed=2), tmp_path / "c2"), out)
    assert sorted(p.name for p in out.iterdir()) == files
    assert torch.equal(logits(from_hf(out)), logits(old))




_KILL_MID_SWAP = """
import os, sys
import fsdp2d.checkpoint._replace as R
from fsdp2d.hf.export import export_hf
real, calls = os.replace, []
def replace(src, dst):
    calls.append(1)
    if len(calls) > int(sys.argv[3]):  # SIGKILL-like: no rollback, no cleanup
        os._exit(9)
    real(src, dst)
R.os.replace = replace
export_hf(sys.argv[1], sys.argv[2])
"""


@pytest.mark.parametrize("renames", [0, 2, 5])
def test_an_export_killed_inside_its_swap_is_refused_then_replaced(tmp_path, renames):
    """Killed after ``renames`` renames of the swap (old files moved aside, new ones not
    all in): readers refuse the folder instead of loading parts of two models (before
    any rename it is still the old export), and the next export (``--resume`` ends with
    one) replaces every model file and removes the stale staging folder."""
    import subprocess
    import sys

    from fsdp2d.hf.weights import HFError

    old, new, out = llama(seed=1), llama(seed=2), tmp_path / "out"
    export_hf(_ckpt(old, tmp_path / "c1"), out, max_shard_bytes=8_000)
    c2 = _ckpt(new, tmp_path / "c2")
    proc = subprocess.run([sys.executable, "-c", _KILL_MID_SWAP, str(c2), str(out), str(renames)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr[-2000:]
    if renames == 0:  # killed before the swap moved anything: the old export, whole
        assert torch.equal(logits(from_hf(out)), logits(old))
    else:
        with pytest.raises(HFError, match="killed while replacing its model files"):
            from_hf(out)
    export_hf(c2, out)
    assert not list(out.glob(".fsdp2d-export-*"))
    assert torch.equal(logits(from_hf(out)), logits(new))


@pytest.mark.parametrize("spec", [{"arch": "bert", "args": {}}, {"arch": "llama"}, "llama",
                                  {"arch": "llama", "args": {"dim": "32"}}, {"arch": "llama", "args": {"n_heads": 0}},
                                  {"arch": "gpt2", "args": {"n_layer": -1}}])
def test_a_hostile_model_spec_is_one_hferror(tmp_path, spec):
    from fsdp2d.hf.weights import HFError

    with pytest.raises(HFError, match="spec"):
        export_hf(_ckpt(llama(seed=1), tmp_path / "c"), tmp_path / "out", spec=spec)


def test_fsdp2d_export_over_an_earlier_one(tmp_path):
    """The same for the fsdp2d-format export: a single-file export over a sharded one
    leaves no stale index or shard (transformers would read the stale index otherwise)."""
    from fsdp2d.checkpoint import CheckpointError, export

    old, new, out = llama(seed=1), llama(seed=2), tmp_path / "out"
    export(_ckpt(old, tmp_path / "c1"), out, max_shard_bytes=8_000)
    assert (out / "model.safetensors.index.json").is_file()
    export(_ckpt(new, tmp_path / "c2"), out)
    assert sorted(p.name for p in out.iterdir()) == [".fsdp2d-export.json", "fsdp2d.index.json", "model.safetensors"]
    loaded = llama(seed=3)
    checkpoint.load(out, loaded)
    assert torch.equal(logits(loaded), logits(new))
    with pytest.raises(CheckpointError, match="checkpoint being exported"):
        export(tmp_path / "c2", tmp_path / "c2")


def test_an_export_without_a_tokenizer_removes_the_earlier_exports_tokenizer(tmp_path):
    """Review of issue 29: an export without a tokenizer over one with kept the old
    tokenizer files beside the new weights (AutoTokenizer then loaded another run's). Each
    export lists the names it wrote (.fsdp2d-export.json); the next one replaces them all,
    and leaves the user's own files (a README, a tokenizer put there by hand) alone."""
    from .data_corpus import bpe

    tok = bpe(tmp_path / "tok")
    model, out = llama(seed=1, vocab_size=300), tmp_path / "out"
    checkpoint.save(tmp_path / "c1", model, extra={"model": model_spec(model), "tokenizer": str(tok)})
    export_hf(tmp_path / "c1", out)
    assert (out / "tokenizer.json").is_file() and (out / "special_tokens_map.json").is_file()
    (out / "README.md").write_text("mine")
    export_hf(_ckpt(llama(seed=2, vocab_size=300), tmp_path / "c2"), out)
    assert sorted(p.name for p in out.iterdir()) == [".fsdp2d-export.json", "README.md", "config.json",
                                                      "generation_config.json", "model.safetensors"]
    assert "bos_token_id" not in (out / "config.json").read_text()
