"""Checkpoints under hostile input (issue 12, items 1-8): a damaged or malicious index or
file is refused with a CheckpointError before anything reaches the model or optimizer;
nothing outside the folder is opened; nothing unbounded is allocated."""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import sys
import threading
import weakref
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fsdp2d import checkpoint as ckpt
from fsdp2d.checkpoint import _files

from . import _ckpt as K

SPEC = {"vocab": 8, "dims": [4, 6, 2], "biases": [True, False], "seed": 0}
INDEX = "fsdp2d.index.json"


def _trained(seed: int, steps: int = 1):
    model = K.build_stack(SPEC, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        torch.manual_seed(100 * seed + step)
        model(torch.randint(0, SPEC["vocab"], (5,))).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _snapshot(model, opt) -> dict:
    return {"params": {k: v.clone() for k, v in model.state_dict().items()},
            "state": {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                      for p, s in opt.state.items()},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}


def _identical(a: dict, b: dict) -> bool:
    def same(x, y):
        if torch.is_tensor(x) or torch.is_tensor(y):
            return torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y)
        return x == y
    return (a["params"].keys() == b["params"].keys() and all(same(v, b["params"][k]) for k, v in a["params"].items())
            and a["state"].keys() == b["state"].keys()
            and all(s.keys() == b["state"][p].keys() and all(same(v, b["state"][p][k]) for k, v in s.items())
                    for p, s in a["state"].items())
            and a["groups"] == b["groups"])


@pytest.fixture
def saved(tmp_path) -> Path:
    """A real checkpoint (model + AdamW state) as a plain folder tmp_path/ck/c, with a
    tempting outside file next to it: ../rank00000.safetensors holds valid data."""
    model, opt = _trained(seed=0)
    ckpt.save(tmp_path / "s", model, opt, extra={"step": 1})
    root = tmp_path / "ck"
    root.mkdir()
    shutil.copytree((tmp_path / "s").resolve(), root / "c")
    shutil.copy(root / "c" / "rank00000.safetensors", root / "rank00000.safetensors")
    return root / "c"


def _edit(path: Path, fn) -> None:
    index = json.loads((path / INDEX).read_text())
    fn(index)
    (path / INDEX).write_text(json.dumps(index))


def _refused(path: Path, match: str | None = None, optim: bool = True, opened: list | None = None) -> str:
    model, opt = _trained(seed=1, steps=2)
    before = _snapshot(model, opt)
    with pytest.raises(ckpt.CheckpointError) as err, _opens() as seen:
        ckpt.load(path, model, opt if optim else None)
    if opened is not None:
        opened += seen
    assert _identical(before, _snapshot(model, opt)), "a failed load changed the model or optimizer"
    if match is not None:
        assert match in str(err.value), str(err.value)
    return str(err.value)


_OPENED: list | None = None
_THREAD = threading.get_ident()


def _audit(event, args):
    if event == "open" and _OPENED is not None and threading.get_ident() == _THREAD:
        _OPENED.append(args[0])


sys.addaudithook(_audit)


@contextmanager
def _opens():
    """Records every path opened by this process inside the block (audit hook)."""
    global _OPENED
    _OPENED = []
    try:
        yield _OPENED
    finally:
        _OPENED = None


def _inside(opened: list, folder: Path) -> list:
    """The opened paths that are not the folder, a plain name in it (opened through
    the folder's descriptor), or a path inside it."""
    real = folder.resolve()
    bad = []
    for p in opened:
        if isinstance(p, int):
            continue
        p = os.fsdecode(p)
        if "/" not in p and p not in ("..", "."):
            continue
        r = Path(p).resolve()
        if r != real and real not in r.parents and Path(p) != folder and Path(p) != folder.parent:
            bad.append(p)
    return bad


# -- 1. paths ------------------------------------------------------------------------------
def test_files_outside_the_folder_are_never_opened(saved):
    outside = saved.parent / "rank00000.safetensors"
    (saved / "evil.safetensors").symlink_to(outside)
    secret_size = str(Path("/etc/hostname").stat().st_size) if Path("/etc/hostname").exists() else "@@"
    for name in ["../rank00000.safetensors", str(outside), "/etc/hostname", "evil.safetensors", "sub/x", ".."]:
        def point(index, name=name):
            for tname, meta in index["tensors"].items():
                meta["file"], meta["key"] = name, tname
        raw = (saved / INDEX).read_text()
        _edit(saved, point)
        opened = []
        msg = _refused(saved, opened=opened)
        assert not _inside(opened, saved), (name, opened)
        assert f"{secret_size} bytes" not in msg and str(outside.stat().st_size) not in msg, msg
        (saved / INDEX).write_text(raw)


def test_a_manifest_naming_another_file_is_refused(saved):
    """A manifest's own file name is compared, never opened: one that says
    ../rank00000.safetensors (the tempting outside copy) is refused as renamed."""
    K.edit_manifest(saved / "rank00000.safetensors", lambda m: m.__setitem__("file", "../rank00000.safetensors"))
    opened = []
    _refused(saved, "says it is '../rank00000.safetensors': a file was renamed or swapped", opened=opened)
    assert not _inside(opened, saved), opened


def test_the_folder_link_must_point_to_a_version_beside_it(tmp_path, saved):
    (tmp_path / "elsewhere").symlink_to(saved)
    _refused(tmp_path / "elsewhere", "not to a version folder")


# -- 2-5. boxes, dtypes, fields, checksums -----------------------------------------------------
def test_a_file_whose_dtype_differs_from_the_index_is_refused(saved):
    tensors = load_file(saved / "rank00000.safetensors")
    key = "model/emb.weight"
    tensors[key] = tensors[key].to(torch.int64)  # same shape, int64 where the index says float32
    K.edit_manifest(saved / "rank00000.safetensors",
                    lambda m: m["boxes"][key].__setitem__("sha256", _files._digest(tensors[key])), tensors)
    _refused(saved, "holds I64 data, the index says float32")


def test_a_missing_extra_is_refused_before_the_model_changes(saved):
    _edit(saved, lambda index: index.pop("extra"))
    _refused(saved, "missing fields ['extra']")


def test_malformed_optimizer_hyperparameters_are_refused(saved):
    _edit(saved, lambda index: index.__setitem__("optim_hparams", [{"params": [], "lr": "fast"}]))
    _refused(saved, "'params'")
    _edit(saved, lambda index: index.__setitem__("optim_hparams", [{"lr": "fast"}]))
    _refused(saved, "'lr'")
    _edit(saved, lambda index: index.__setitem__("optim_hparams", []))
    _refused(saved, "param groups")


def test_every_box_needs_a_checksum(saved):
    K.edit_manifest(saved / "rank00000.safetensors", lambda m: m["boxes"]["model/emb.weight"].pop("sha256"))
    _refused(saved, "'model/emb.weight': its sha256 is missing")


# -- 7. a checkpoint saved before the first optimizer step ------------------------------------
def test_checkpoint_without_optimizer_state_loads_with_fresh_state(tmp_path):
    model, opt = _trained(seed=0, steps=0)  # no step yet: AdamW has no state
    opt.param_groups[0]["lr"] = 0.125
    ckpt.save(tmp_path / "c", model, opt, extra={"step": 0})
    model2, opt2 = _trained(seed=1, steps=2)  # this one has state: it must become fresh
    assert ckpt.load(tmp_path / "c", model2, opt2) == {"step": 0}
    assert len(opt2.state) == 0 and opt2.param_groups[0]["lr"] == 0.125
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    # and it trains on exactly like the original
    for m, o in ((model, opt), (model2, opt2)):
        torch.manual_seed(7)
        m(torch.randint(0, SPEC["vocab"], (5,))).square().sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


# -- 8. the offline tools ---------------------------------------------------------------------
def test_cli_reports_a_malformed_index_in_one_line(saved, tmp_path, capsys):
    from fsdp2d.checkpoint.__main__ import main

    _edit(saved, lambda index: index.__setitem__("tensors", []))
    assert main(["inspect", str(saved)]) == 1
    assert main(["export", str(saved), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "Traceback" not in err and "tensors is not a JSON object" in err, err


def test_export_checks_before_allocating_the_declared_shape(saved, tmp_path, capsys, monkeypatch):
    from fsdp2d.checkpoint.__main__ import main

    _edit(saved, lambda index: index["tensors"]["model/emb.weight"].__setitem__("shape", [2**33, 4]))  # 137 GB
    sizes = []
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda shape, **kw: sizes.append(math.prod(shape)) or real(shape, **kw))
    assert main(["export", str(saved), str(tmp_path / "out")]) == 1
    assert "has shape (8, 4), the index says (8589934592, 4)" in capsys.readouterr().err
    assert all(n < 2**20 for n in sizes), sizes


# -- what it must show: hostile indexes ---------------------------------------------------------
def _json_paths(doc, prefix=()):
    """Every (path, value) in a JSON document (lists of boxes: the first two only)."""
    yield prefix, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _json_paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:2]):
            yield from _json_paths(v, prefix + (i,))


HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**65), st.integers(-1, 9), st.floats(allow_nan=True),
    st.sampled_from(["../rank00000.safetensors", "/etc/hostname", "evil.safetensors", ".", "..", "",
                     "rank00000.safetensors", "float64", "int64", "bfloat16", "bool", "F32", "0" * 64,
                     "model/emb.weight@0,0", "__metadata__"]),
    st.lists(st.integers(-3, 2**40), max_size=4), st.lists(st.integers(0, 9), max_size=3),
    st.just({}), st.just([]), st.text(max_size=6))


@st.composite
def mutations(draw, paths, leaves):
    """1-3 edits: a hostile value, a plausible one (another field's value of the same
    index, or an int nudged by a little), a deleted or a duplicated field."""
    out = []
    for _ in range(draw(st.integers(1, 3))):
        path, value = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["set", "plausible", "plausible", "nudge", "delete", "duplicate"]))
        if op == "plausible":
            op, value = "set", draw(st.sampled_from(leaves))
        elif op == "nudge":
            op, value = "set", (value + draw(st.integers(-2, 2)) if type(value) is int else draw(HOSTILE))
        elif op == "set":
            value = draw(HOSTILE)
        out.append((path, op, value))
    return out


def _apply(index, path, op, value):
    if not path:
        return value if op == "set" else index
    parent = index
    for k in path[:-1]:
        try:
            parent = parent[k]
        except (KeyError, IndexError, TypeError):
            return index
    k = path[-1]
    try:
        if op == "set":
            parent[k] = value
        elif op == "delete":
            del parent[k]
        elif isinstance(parent, list):
            parent.append(copy.deepcopy(parent[k]))
        else:
            parent[k] = copy.deepcopy(parent[k])
    except (KeyError, IndexError, TypeError):
        pass
    return index


def _documents(folder: Path) -> dict:
    """The JSON documents of a checkpoint a hostile edit may target: the index, and the
    manifest of each data file."""
    docs = {INDEX: json.loads((folder / INDEX).read_text())}
    for f in sorted(folder.glob("rank*.safetensors")):
        with safe_open(f, "pt") as h:
            docs[f.name] = json.loads(h.metadata()["fsdp2d"])
    return docs


@pytest.fixture(scope="module", params=["1 rank", "2x2"])
def real_checkpoint(request, tmp_path_factory):
    """A real checkpoint with AdamW state, saved by one process or on a 2x2 (dp, tp) mesh
    (4 data files, every weight sharded over both axes, loaded here into one process)."""
    root = tmp_path_factory.mktemp("hostile")
    if request.param == "1 rank":
        model, opt = _trained(seed=0)
        ckpt.save(root / "s", model, opt, extra={"step": 1})
        want = {k: v.clone() for k, v in model.state_dict().items()}
    else:
        want = request.getfixturevalue("pool").run(K.job_save_trained, SPEC, "2x2", str(root / "s"))[0]
    docs = {}
    for name, doc in _documents(root / "s").items():
        paths = [(p, v) for p, v in _json_paths(doc) if p]
        docs[name] = paths, [v for _, v in paths if not isinstance(v, (dict, list))]
    biggest = max(math.prod(m["shape"]) * 4 for m in _documents(root / "s")[INDEX]["tensors"].values())
    return root, docs, want, biggest


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_hostile_indexes(real_checkpoint, data):
    """Random damage to a real checkpoint's index or to one data file's manifest: load
    either succeeds with the saved values, or raises CheckpointError leaving model and
    optimizer bit-identical; it never opens a file outside the folder, and never
    allocates more than the model's own size plus one box."""
    root, docs, want, biggest = real_checkpoint
    work = root / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    folder = work / "c"
    shutil.copytree((root / "s").resolve(), folder)
    shutil.copy(folder / "rank00000.safetensors", work / "rank00000.safetensors")
    (folder / "evil.safetensors").symlink_to(work / "rank00000.safetensors")
    target = data.draw(st.sampled_from(sorted(docs)))
    doc = _documents(folder)[target]
    for path, op, value in data.draw(mutations(*docs[target])):
        doc = _apply(doc, path, op, value)
    if target == INDEX:
        (folder / INDEX).write_text(json.dumps(doc))
    else:
        K.edit_manifest(folder / target, lambda m: (m.clear(), m.update(doc)) if isinstance(doc, dict) else None)
        if not isinstance(doc, dict):  # the whole manifest replaced by a non-object
            with safe_open(folder / target, "pt") as h:
                tensors = {k: h.get_tensor(k) for k in h.keys()}
            save_file(tensors, folder / target, metadata={"fsdp2d": json.dumps(doc)})

    model, opt = _trained(seed=1, steps=2)
    before = _snapshot(model, opt)
    own = sum(t.numel() * t.element_size() for t in [*model.state_dict().values(),
              *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))])
    live, peak = [0], [0]

    def tracked(shape, dtype):
        t = torch.empty(shape, dtype=dtype)
        n = t.numel() * t.element_size()
        live[0] += n
        peak[0] = max(peak[0], live[0])
        weakref.finalize(t, lambda: live.__setitem__(0, live[0] - n))
        return t

    real_empty, _files._empty = _files._empty, tracked
    try:
        with _opens() as opened:
            try:
                ckpt.load(folder, model, opt)
                ok = True
                event("loaded")
            except ckpt.CheckpointError as exc:
                ok = False
                event(str(exc).replace(str(folder), "F")[:70])
    finally:
        _files._empty = real_empty
    assert not _inside(opened, folder), opened
    assert peak[0] <= own + biggest, (peak[0], own, biggest)
    if ok:
        assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    else:
        assert _identical(before, _snapshot(model, opt))


# -- 6, 10: several ranks ------------------------------------------------------------------------
def test_ranks_that_read_different_checkpoints_all_refuse(pool, tmp_path):
    for r in pool.run(K.job_mixed_checkpoints, str(tmp_path), timeout=60):
        assert r["error"] is not None and r["error"][0] == "CheckpointError", r
        assert "disagree on the checkpoint they read" in r["error"][1] and r["unchanged"], r


def test_a_one_rank_save_error_reaches_every_rank_at_once(pool, tmp_path):
    for r in pool.run(K.job_one_rank_bad_extra, str(tmp_path), timeout=30):
        assert r["error"] is not None and r["error"][0] == "CheckpointError", r
        assert "rank 0: TypeError" in r["error"][1] and r["seconds"] < 10, r
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


def test_ranks_holding_different_tensors_all_refuse_to_save(pool, tmp_path):
    for r in pool.run(K.job_ranks_disagree, str(tmp_path), timeout=30):
        assert r["error"] is not None and r["error"][0] == "CheckpointError", r
        assert "the ranks disagree on the tensors to save" in r["error"][1], r
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())
