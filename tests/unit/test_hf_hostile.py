"""Hugging Face folders under hostile input (issue 21): nothing read outside the folder,
nothing half-loaded, never silently wrong.

Folders are written here from a small fsdp2d model through the same name table the
import uses (no transformers needed: tests/unit/test_hf.py checks the table against
transformers itself). Every refusal is one :class:`HFError`; after one, the target
model's state is bit-for-bit what it was.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from fsdp2d.hf import files as F
from fsdp2d.hf import from_hf, load_hf_into
from fsdp2d.models import Llama, LlamaArgs
from fsdp2d.hf.weights import HFError, hf_config, hf_rule

ARGS = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=48, max_seq_len=16,
            rope_theta=10000.0, norm_eps=1e-5)
X = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def llama(seed: int = 0, **kw) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaArgs(**{**ARGS, **kw}))


def hf_tensors(model: Llama) -> dict[str, torch.Tensor]:
    """The HF tensors of ``model`` (the table read backwards; Llama has no fused tensors)."""
    return {hf_rule("llama", n).hf: p.detach().clone() for n, p in model.named_parameters()}


def write(model: Llama, path: Path, tensors: dict | None = None, cfg: dict | None = None,
          shards: int = 1) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(model) if tensors is None else tensors
    (path / "config.json").write_text(json.dumps(cfg or hf_config("llama", model.args)))
    if shards == 1:
        save_file(tensors, path / "model.safetensors")
        return path
    names, weight_map = sorted(tensors), {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, path / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def state(model: torch.nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def logits(model: Llama) -> torch.Tensor:
    with torch.no_grad():
        return model(X)


@pytest.fixture
def base(tmp_path):
    return write(llama(), tmp_path / "hf")


# -- 1. every config field that changes the computation is compared ------------------------------
@pytest.mark.parametrize("field,value,ours", [
    ("num_attention_heads", 8, "n_heads"), ("num_key_value_heads", 4, "n_kv_heads"),
    ("rope_theta", 500000.0, "rope_theta"), ("rms_norm_eps", 1e-3, "norm_eps"),
    ("max_position_embeddings", 16, None)])
def test_load_compares_every_computing_field(tmp_path, field, value, ours):
    """4 query / 2 kv heads and 8 / 4 at the same width have the same tensor shapes:
    loading one into the other must refuse, naming the field, the file and both values."""
    src = llama(seed=1)
    cfg = hf_config("llama", src.args)
    cfg[field] = value
    if field == "rope_theta":
        cfg["rope_parameters"]["rope_theta"] = value
    if field == "num_attention_heads":
        cfg["head_dim"] = 32 // value
    folder = write(src, tmp_path / "hf", cfg=cfg)
    model = llama()
    if ours is None:  # the RoPE table's length changes no logit: not compared
        load_hf_into(model, folder)
        assert torch.equal(logits(model), logits(src))
        return
    before = state(model)
    with pytest.raises(HFError, match=rf"config\.json.*{field}={value}.*{ours}="):
        load_hf_into(model, folder)
    assert same_state(before, state(model))


# -- 2. (export: test_hf_export.py) a folder holding two exports is ambiguous ----------------------
def test_a_folder_with_both_layouts_is_refused(tmp_path):
    folder = write(llama(seed=1), tmp_path / "hf", shards=2)
    save_file(hf_tensors(llama(seed=2)), folder / "model.safetensors")
    with pytest.raises(HFError, match="both"):
        from_hf(folder)


# -- 5. integer and bool tensors ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
def test_non_float_tensor_is_refused(tmp_path, dtype):
    src = llama(seed=1)
    t = hf_tensors(src)
    t["model.norm.weight"] = torch.ones(32, dtype=dtype)
    folder = write(src, tmp_path / "hf", tensors=t)
    model = llama()
    before = state(model)
    with pytest.raises(HFError, match=r"model\.norm\.weight.*" + str(dtype).removeprefix("torch.")):
        load_hf_into(model, folder)
    assert same_state(before, state(model))
    with pytest.raises(HFError, match=r"model\.norm\.weight"):
        from_hf(folder)


def test_lossless_float_dtypes_load(tmp_path):
    src = llama(seed=1)
    folder = write(src, tmp_path / "hf", tensors={k: v.double() for k, v in hf_tensors(src).items()})
    assert torch.equal(logits(from_hf(folder)), logits(src))


# -- 6. nothing outside the folder ---------------------------------------------------------------
def _outside(tmp_path):
    """A decoy folder beside the model: a valid shard and config the loader must not open."""
    decoy = write(llama(seed=9), tmp_path / "decoy")
    return decoy


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlinked_shard", "symlinked_single", "symlinked_config"])
def test_nothing_outside_the_folder_is_opened(tmp_path, how):
    decoy = _outside(tmp_path)
    folder = write(llama(seed=1), tmp_path / "hf", shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    victim = next(iter(index["weight_map"]))
    if how in ("dotdot", "absolute"):
        index["weight_map"][victim] = "../decoy/model.safetensors" if how == "dotdot" else str(
            decoy / "model.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    elif how == "symlinked_shard":
        shard = folder / index["weight_map"][victim]
        shard.unlink()
        shard.symlink_to(decoy / "model.safetensors")
    elif how == "symlinked_single":
        shutil.rmtree(folder)
        folder = write(llama(seed=1), tmp_path / "hf")
        (folder / "model.safetensors").unlink()
        (folder / "model.safetensors").symlink_to(decoy / "model.safetensors")
    else:
        (folder / "config.json").unlink()
        (folder / "config.json").symlink_to(decoy / "config.json")
    model = llama()
    before = state(model)
    with pytest.raises(HFError, match="outside"):
        load_hf_into(model, folder)
    assert same_state(before, state(model))
    with pytest.raises(HFError, match="outside"):
        from_hf(folder)


def test_symlinks_inside_the_folder_are_fine(tmp_path):
    src = llama(seed=1)
    folder = write(src, tmp_path / "hf")
    (folder / "blobs").mkdir()
    (folder / "model.safetensors").rename(folder / "blobs" / "abc")
    (folder / "model.safetensors").symlink_to("blobs/abc")
    assert torch.equal(logits(from_hf(folder)), logits(src))


def test_init_from_refuses_a_config_outside(tmp_path):
    from fsdp2d.train.config import ConfigError, load_config
    from fsdp2d.hf.launch import apply_init_from

    decoy = _outside(tmp_path)
    folder = write(llama(seed=1), tmp_path / "hf")
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(decoy / "config.json")
    cfg = load_config(None, [f"--model.init_from={folder}"])
    with pytest.raises(ConfigError, match="outside"):
        apply_init_from(cfg)


# -- 7. validated before the first byte reaches the model ----------------------------------------
def _lie(kind: str, src: Llama) -> tuple[dict, dict]:
    t, cfg = hf_tensors(src), hf_config("llama", src.args)
    if kind == "extra":
        t["model.layers.1.self_attn.extra.weight"] = torch.zeros(3)
    elif kind == "head_shape":
        t["lm_head.weight"] = t["lm_head.weight"][:, :16].contiguous()
    elif kind == "missing_norm":
        del t["model.norm.weight"]
    elif kind == "tie_lie":  # says tied, ships its own head
        cfg["tie_word_embeddings"] = True
    return t, cfg


@pytest.mark.parametrize("kind", ["extra", "head_shape", "missing_norm", "tie_lie"])
def test_refused_import_leaves_the_model_untouched(tmp_path, kind):
    src = llama(seed=1)
    tensors, cfg = _lie(kind, src)
    folder = write(src, tmp_path / "hf", tensors=tensors, cfg=cfg)
    model = llama()
    before = state(model)
    with pytest.raises(HFError):
        load_hf_into(model, folder)
    assert same_state(before, state(model)), "refused import changed the model (half-loaded)"


# -- 8. configs checked for sanity before anything is allocated -----------------------------------
BAD_CONFIG = [
    ("vocab_size", 65, "vocab_size"), ("vocab_size", 10**11, "vocab_size"), ("vocab_size", 1e11, "vocab_size"),
    ("num_hidden_layers", 10**7, "num_hidden_layers"), ("num_hidden_layers", 3, "num_hidden_layers"),
    ("hidden_size", 32.5, "hidden_size"), ("hidden_size", -5, "hidden_size"), ("hidden_size", 0, "hidden_size"),
    ("hidden_size", "32", "hidden_size"), ("hidden_size", [32], "hidden_size"), ("hidden_size", True, "hidden_size"),
    ("hidden_size", 64, "hidden_size"), ("intermediate_size", 40, "intermediate_size"),
    ("num_attention_heads", 5, "num_attention_heads"), ("num_key_value_heads", 3, "num_key_value_heads"),
    ("rms_norm_eps", -1.0, "rms_norm_eps"), ("rms_norm_eps", "x", "rms_norm_eps"),
    ("rope_theta", float("nan"), "rope_theta"), ("max_position_embeddings", 0, "max_position_embeddings"),
    ("tie_word_embeddings", "yes", "tie_word_embeddings"),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 10000.0}, "factor"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}, "yarn"),
    ("rope_parameters", "linear", "rope_parameters"),
]


@pytest.mark.parametrize("field,value,named", BAD_CONFIG, ids=lambda v: repr(v)[:20])
def test_bad_config_is_one_hferror(tmp_path, field, value, named):
    src = llama(seed=1)
    cfg = hf_config("llama", src.args)
    cfg[field] = value
    if field == "rope_parameters" or field == "rope_theta":
        cfg.pop("rope_theta" if field == "rope_parameters" else "rope_parameters")
    folder = write(src, tmp_path / "hf", cfg=cfg)
    t0 = time.perf_counter()
    with pytest.raises(HFError, match=rf"config\.json.*{named}"):
        from_hf(folder)
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("damage", ["not_json", "config_list", "no_weight_map", "weight_map_list",
                                    "missing_shard", "truncated_shard", "garbage_shard", "no_model_type"])
def test_damaged_files_are_one_hferror(tmp_path, damage):
    folder = write(llama(seed=1), tmp_path / "hf", shards=2)
    index_path = folder / "model.safetensors.index.json"
    shard = folder / "model-00001-of-00002.safetensors"
    if damage == "not_json":
        (folder / "config.json").write_text("{not json")
    elif damage == "config_list":
        (folder / "config.json").write_text("[1, 2]")
    elif damage == "no_weight_map":
        index_path.write_text(json.dumps({"metadata": {}}))
    elif damage == "weight_map_list":
        index_path.write_text(json.dumps({"weight_map": ["a"]}))
    elif damage == "missing_shard":
        shard.unlink()
    elif damage == "truncated_shard":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "garbage_shard":
        shard.write_bytes(b"\xff" * 64)
    else:
        cfg = json.loads((folder / "config.json").read_text())
        del cfg["model_type"]
        (folder / "config.json").write_text(json.dumps(cfg))
    model = llama()
    before = state(model)
    with pytest.raises(HFError):
        load_hf_into(model, folder)
    assert same_state(before, state(model))
    with pytest.raises(HFError):
        from_hf(folder)


# -- hypothesis: hostile folders against a real small model ----------------------------------------
_OPENED: list[str] | None = None


def _audit(event, args):
    if event == "open" and _OPENED is not None and isinstance(args[0], (str, os.PathLike)):
        _OPENED.append(os.path.realpath(args[0]))


def _safe_open(path, *a, **kw):
    """safetensors opens its files in Rust, unseen by the audit hook: record them too."""
    if _OPENED is not None:
        _OPENED.append(os.path.realpath(path))
    return _real_safe_open(path, *a, **kw)


_real_safe_open = F.safe_open


sys.addaudithook(_audit)
HOSTILE_VALUES = st.sampled_from([0, -1, 3, 7, 10**12, 2.5, float("inf"), "8", None, [4], {"a": 1}, True])
CONFIG_FIELDS = st.sampled_from(["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                 "vocab_size", "intermediate_size", "rms_norm_eps", "rope_theta",
                                 "max_position_embeddings", "tie_word_embeddings", "head_dim", "hidden_act",
                                 "model_type", "rope_parameters"])
NAMES = sorted(hf_tensors(llama()))
MUTATION = st.one_of(
    st.tuples(st.just("config"), CONFIG_FIELDS, HOSTILE_VALUES),
    st.tuples(st.just("drop_field"), CONFIG_FIELDS, st.none()),
    st.tuples(st.just("drop"), st.sampled_from(NAMES), st.none()),
    st.tuples(st.just("extra"), st.sampled_from(["model.layers.2.mlp.up_proj.weight", "x", "lm_head.bias"]), st.none()),
    st.tuples(st.just("duplicate"), st.sampled_from(NAMES), st.none()),
    st.tuples(st.just("dtype"), st.sampled_from(NAMES),
              st.sampled_from([torch.int32, torch.int8, torch.bool, torch.float64])),
    st.tuples(st.just("shape"), st.sampled_from(NAMES), st.sampled_from([(1,), (3, 3), "rows-1", "T"])),
    st.tuples(st.just("path"), st.sampled_from(NAMES),
              st.sampled_from(["../decoy/model.safetensors", "ABS", "/etc/passwd", "sub/../../decoy/model.safetensors",
                               "", ".", "nosuch.safetensors", "config.json"])),
    st.tuples(st.just("symlink"), st.sampled_from(["config.json", "shard", "shard_inside"]), st.none()),
)


def _mutate(root: Path, base: Path, muts: list) -> Path:
    folder = root / "hf"
    shutil.copytree(base, folder, symlinks=True)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    cfg = json.loads((folder / "config.json").read_text())
    files: dict[str, dict] = {}
    for fname in set(index["weight_map"].values()):
        files[fname] = load_file(folder / fname)
    for kind, a, b in muts:
        where = index["weight_map"].get(a) if isinstance(a, str) else None
        if kind == "config":
            cfg[a] = b
        elif kind == "drop_field":
            cfg.pop(a, None)
        elif kind == "drop" and where in files:
            files[where].pop(a, None)
            index["weight_map"].pop(a, None)
        elif kind == "extra":
            fname = sorted(files)[0]
            files[fname][a] = torch.zeros(2, 2)
            index["weight_map"][a] = fname
        elif kind == "duplicate" and where in files:  # the same name in a second shard too
            other = next((f for f in sorted(files) if f != where), None)
            if other is not None and a in files[where]:
                files[other][a] = files[where][a] + 1
        elif kind == "dtype" and where in files and a in files[where]:
            t = files[where][a]  # float64 is lossless; back from an integer it is not: stay integer
            files[where][a] = t.to(b) if t.is_floating_point() or not b.is_floating_point else t
        elif kind == "shape" and where in files and a in files[where]:
            t = files[where][a]
            if b == "T":  # a square transpose is only other weights: make it a shape change
                b = "rows-1" if t.dim() != 2 or t.shape[0] == t.shape[1] else b
            files[where][a] = (t[:-1] if b == "rows-1" else t.T if b == "T" else torch.zeros(b)).contiguous()
        elif kind == "path" and a in index["weight_map"]:
            index["weight_map"][a] = str(root / "decoy" / "model.safetensors") if b == "ABS" else b
        elif kind == "symlink":
            target = (root / "decoy" / ("config.json" if a == "config.json" else "model.safetensors"))
            name = "config.json" if a == "config.json" else sorted(files)[0]
            if a == "shard_inside":
                target = folder / sorted(files)[-1]
            files.pop(name, None)
            (folder / name).unlink()
            (folder / name).symlink_to(target)
    for fname, tensors in files.items():
        save_file(tensors, folder / fname)
    index_path.write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(cfg)) if not (folder / "config.json").is_symlink() else None
    return folder


@pytest.fixture(scope="module")
def hostile_base(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    model = llama(seed=1)
    return model, write(model, root / "base", shards=2)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(muts=st.lists(MUTATION, min_size=1, max_size=2))
def test_hostile_folders(hostile_base, muts):
    """Load exactly what the unmodified model computes, or raise one HFError with the
    model untouched; never open a file outside the folder."""
    global _OPENED
    src, base = hostile_base
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write(llama(seed=9), root / "decoy")
        folder = _mutate(root, base, muts)
        model = llama()
        _OPENED = []
        try:
            with mock.patch.object(F, "safe_open", _safe_open):
                _check_one(model, folder, src, muts)
            decoy = os.path.realpath(root / "decoy")
            opened = [p for p in _OPENED if p.startswith(decoy + os.sep) or p == "/etc/passwd"]
            assert not opened, f"{muts}: opened {opened}"
        finally:
            _OPENED = None


def _check_one(model: Llama, folder: Path, src: Llama, muts: list) -> None:
    before = state(model)
    try:
        load_hf_into(model, folder)
    except HFError:
        assert same_state(before, state(model)), f"{muts}: half-loaded"
    else:
        assert torch.equal(logits(model), logits(src)), f"{muts}: loaded, but computes something else"
    try:
        built = from_hf(folder)
    except HFError:
        return
    # The config is the truth for what no tensor vouches for (eps, theta): the weights must
    # be exactly the files', and the same config computes the same logits.
    assert same_state(state(built), state(src)), f"{muts}: from_hf loaded other weights"
    if built.args == src.args:
        assert torch.equal(logits(built), logits(src)), f"{muts}: from_hf computes something else"


def test_the_hub_cache_layout_loads(tmp_path):
    """snapshots/<rev>/NAME -> ../../blobs/<sha>, as huggingface_hub writes it; a link
    from there to anywhere else is still refused."""
    src = llama(seed=1)
    model_dir = tmp_path / "models--x--tiny"
    flat = write(src, tmp_path / "flat")
    (model_dir / "blobs").mkdir(parents=True)
    snap = model_dir / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (flat / name).rename(model_dir / "blobs" / f"sha-{name}")
        (snap / name).symlink_to(f"../../blobs/sha-{name}")
    assert torch.equal(logits(from_hf(snap)), logits(src))
    decoy = _outside(tmp_path)
    (snap / "config.json").unlink()
    (snap / "config.json").symlink_to(decoy / "config.json")
    with pytest.raises(HFError, match="outside"):
        from_hf(snap)


def test_null_fields_take_their_defaults(tmp_path):
    src = llama(seed=1)
    cfg = {**hf_config("llama", src.args), "num_key_value_heads": None, "tie_word_embeddings": None}
    folder = write(llama(seed=1, n_kv_heads=None), tmp_path / "hf", cfg=cfg)
    assert from_hf(folder).args.kv_heads == 4


def test_a_read_error_after_validation_says_partial(base, monkeypatch):
    """The one failure no check can foresee (the disk, mid-copy) is named as such."""
    import fsdp2d.hf.weights as M

    calls = []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("Input/output error")
        return real(*a, **kw)

    real = M._read
    monkeypatch.setattr(M, "_read", failing)
    with pytest.raises(HFError, match="partially loaded"):
        load_hf_into(llama(), base)
    with pytest.raises(HFError, match="max_seq_len"):
        from_hf(base, max_seq_len=-1)
