"""Hostile input in the layout index and the per-rank manifests (issue 13): a checkpoint
saved on a 2x2 (dp, tp) mesh (4 data files, every weight sharded over both axes),
damaged, then loaded into one process, which needs every file. Each damage is refused
with a CheckpointError naming the file and the tensor, the model and optimizer
unchanged, nothing outside the folder opened (``_refused``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from fsdp2d import checkpoint as ckpt

from . import _ckpt as K
from .test_checkpoint_hostile import INDEX, SPEC, _edit, _inside, _refused, _trained


@pytest.fixture(scope="module")
def source(pool, tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("layouts")
    want = pool.run(K.job_save_trained, SPEC, "2x2", str(root / "s"))[0]
    return (root / "s").resolve(), want


@pytest.fixture
def sharded(source, tmp_path) -> Path:
    """A plain copy of the 2x2 checkpoint, with a valid data file outside it."""
    shutil.copytree(source[0], tmp_path / "c")
    shutil.copy(tmp_path / "c" / "rank00000.safetensors", tmp_path / "rank00000.safetensors")
    return tmp_path / "c"


def test_the_sharded_checkpoint_loads_in_one_process(source, sharded):
    model, opt = _trained(seed=1, steps=2)
    assert ckpt.load(sharded, model, opt) == {"step": 1}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in source[1].items())
    index = json.loads((sharded / INDEX).read_text())
    assert "boxes" not in json.dumps(index) and index["mesh"] == {"axes": ["dp", "tp"], "shape": [2, 2]}
    assert index["tensors"]["model/layers.1.weight"]["layout"] == {
        "axes": ["tp", "dp"], "placements": ["S(1)", "S(0)"], "split_order": [0, 1]}


def _set_layout(field: str, value):
    return lambda index: index["tensors"]["model/layers.0.weight"]["layout"].__setitem__(field, value)


@pytest.mark.parametrize("field,value,match", [
    ("placements", ["S(0)", "P"], "placement 'P' is not 'R' or 'S(dim)'"),
    ("placements", ["S(0)", "S(2)"], "placement 'S(2)' is not 'R' or 'S(dim)' with dim < 2"),
    ("placements", ["S(0)", "S(-1)"], "placement 'S(-1)'"),
    ("axes", ["tp", "tp"], "axes ['tp', 'tp'] are not distinct axes of the mesh"),
    ("axes", ["tp", "pp"], "axes ['tp', 'pp'] are not distinct axes of the mesh"),
    ("split_order", [1, 1], "split_order [1, 1] is not a permutation of 0..1"),
    ("split_order", [0], "needs one placement and split position per axis"),
])
def test_a_layout_that_does_not_tile_is_refused(sharded, field, value, match):
    _edit(sharded, _set_layout(field, value))
    msg = _refused(sharded, match)
    assert f"{sharded / INDEX}: 'model/layers.0.weight': layout" in msg, msg


@pytest.mark.parametrize("edit,match", [
    # valid layouts, but not the one the files were written with
    (_set_layout("placements", ["R", "S(0)"]), "has shape"),
    (_set_layout("placements", ["S(1)", "S(0)"]), "has shape"),
    (_set_layout("split_order", [1, 0]), "has shape (2, 4), the index says (1, 4)"),
    (lambda index: index["mesh"].__setitem__("shape", [1, 4]), "is the box at offset"),
    (lambda index: index["mesh"].__setitem__("axes", ["tp", "dp"]), "is the box at offset"),
])
def test_a_layout_other_than_the_saved_one_is_refused(sharded, edit, match):
    _edit(sharded, edit)
    _refused(sharded, match)


def test_a_manifest_placing_a_box_elsewhere_is_refused(sharded):
    K.edit_manifest(sharded / "rank00001.safetensors",
                    lambda m: m["boxes"]["model/layers.0.weight"].__setitem__("offset", [0, 0]))
    _refused(sharded, "rank00001.safetensors: 'model/layers.0.weight' is the box at offset [0, 0] in the file's "
                      "manifest, the index's layout puts it at [3, 0]")


def test_swapped_rank_files_are_refused(sharded):
    """rank00001 (dp 0, tp 1) and rank00002 (dp 1, tp 0) hold boxes of the same shapes:
    only the manifests' own names tell them apart."""
    a, b = sharded / "rank00001.safetensors", sharded / "rank00002.safetensors"
    os.rename(a, sharded / "tmp")
    os.rename(b, a)
    os.rename(sharded / "tmp", b)
    _refused(sharded, "rank00002.safetensors says it is 'rank00001.safetensors': a file was renamed or swapped")


def test_a_manifest_path_escape_is_refused(sharded):
    K.edit_manifest(sharded / "rank00002.safetensors", lambda m: m.__setitem__("file", "../rank00000.safetensors"))
    opened = []
    _refused(sharded, "rank00002.safetensors says it is '../rank00000.safetensors'", opened=opened)
    assert not _inside(opened, sharded), opened


@pytest.mark.parametrize("sha,match", [("0" * 64, "is corrupted: 'model/emb.weight' does not match its sha256"),
                                       ("F" * 64, "its sha256 is missing or not 64 lowercase hex digits"),
                                       (None, "its sha256 is missing")])
def test_a_bad_sha256_in_a_manifest_is_refused(sharded, sha, match):
    K.edit_manifest(sharded / "rank00003.safetensors",
                    lambda m: m["boxes"]["model/emb.weight"].__setitem__("sha256", sha))
    assert "rank00003.safetensors" in _refused(sharded, match)


def test_a_data_file_from_another_save_is_refused(sharded):
    K.edit_manifest(sharded / "rank00003.safetensors", lambda m: m.__setitem__("id", "0123456789abcdef"))
    _refused(sharded, "rank00003.safetensors belongs to another checkpoint (save id '0123456789abcdef'")


def test_a_data_file_without_manifest_is_refused(sharded):
    from safetensors.torch import load_file, save_file

    f = sharded / "rank00002.safetensors"
    save_file(load_file(f), f)
    _refused(sharded, "rank00002.safetensors has no fsdp2d manifest")


def test_an_old_format_index_is_refused_clearly(sharded):
    _edit(sharded, lambda index: index.__setitem__("version", 1))
    _refused(sharded, "version 1 (this fsdp2d reads 'fsdp2d' version 2) (written by an older fsdp2d")


def test_a_reader_keeps_few_files_open(source, sharded, monkeypatch):
    """A reader of a checkpoint of many ranks may need every file: at most _MAX_OPEN
    stay open (here 1 of the 4), each file opened again and checked again when needed."""
    from fsdp2d.checkpoint import _files

    monkeypatch.setattr(_files, "_MAX_OPEN", 1)
    opened, most = [], [0]
    real_file = _files.Folder._file

    def tracked(folder, name):
        opened.append(name)
        out = real_file(folder, name)
        most[0] = max(most[0], len(folder.files))
        return out
    monkeypatch.setattr(_files.Folder, "_file", tracked)
    model, opt = _trained(seed=1, steps=2)
    ckpt.load(sharded, model, opt)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in source[1].items())
    assert most[0] == 1 and len(set(opened)) == 4, (most, sorted(set(opened)))


def _set_stage(name: str, value):
    return lambda index: index["tensors"][name].__setitem__("stage", value)


@pytest.mark.parametrize("edit,match", [
    (_set_stage("model/layers.0.weight", {"tp": 0}), "stage {'tp': 0} is not {axis: coordinate} on one mesh axis "
                                                     "outside its layout"),
    (_set_stage("model/layers.0.weight", {"pp": 0}), "stage {'pp': 0} is not"),
    (_set_stage("model/emb.weight", "pp"), "stage 'pp' is not"),
    (_set_stage("model/emb.weight", {"dp": True}), "stage {'dp': True} is not"),
])
def test_a_pipeline_stage_pin_that_does_not_fit_is_refused(sharded, edit, match):
    """A pipeline checkpoint's ``"stage"`` pin (``save(..., stage_axis=)``) names one mesh
    axis outside the tensor's layout and a coordinate on it; anything else is refused."""
    _edit(sharded, edit)
    _refused(sharded, match)


def test_a_stage_pin_pointing_at_another_file_is_refused(sharded):
    """A valid pin that is not where the box was written: its file has no such tensor."""
    index = json.loads((sharded / INDEX).read_text())
    name = next(n for n, m in index["tensors"].items() if m["layout"]["axes"] == [] and n.startswith("optim/"))
    _edit(sharded, _set_stage(name, {"dp": 1}))
    _refused(sharded, "rank00002.safetensors")
