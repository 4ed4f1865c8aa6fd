"""Checkpoints that reshard: save on mesh A, load on mesh B, bit for bit."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import _ckpt as K

ROOT = Path(__file__).resolve().parents[2]


@st.composite
def stacks(draw):
    n = draw(st.integers(1, 3))
    # Widths divisible by nothing in particular: uneven TP and FSDP chunks, and widths
    # smaller than the mesh (empty shards) both occur.
    dims = draw(st.lists(st.integers(1, 11), min_size=n + 1, max_size=n + 1))
    biases = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return {"vocab": draw(st.integers(2, 13)), "dims": dims, "biases": biases, "seed": draw(st.integers(0, 99))}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=stacks(), src=st.sampled_from(sorted(K.MESHES)), dst=st.sampled_from(sorted(K.MESHES)))
def test_save_on_one_mesh_load_on_another(pool, tmp_path_factory, spec, src, dst):
    path = str(tmp_path_factory.mktemp("ckpt") / "c")
    pool.run(K.job_save_stack, spec, src, path)
    assert all(pool.run(K.job_load_stack, spec, dst, path))


@pytest.mark.parametrize("dst", ["4x1", "tp4", "1x1", "hsdp2x1x2"])
def test_train_save_reshard_continue(pool, tmp_path, dst):
    """3 steps on 2x2, save; load on another mesh: identical full state, and 2 more AdamW
    steps give the uninterrupted run's losses within 1e-6 relative (fp32: only the
    summation order of the new mesh's reductions differs)."""
    path = str(tmp_path / "c")
    base = pool.run(K.job_train_and_save, path)[0]
    for rank, r in enumerate(pool.run(K.job_resume, path, dst)):
        assert r["extra"] == {"step": 3}
        for k, v in base["state"].items():
            assert torch.equal(r["state"][k], v), f"rank {rank}: {k} differs after loading on {dst}"
        for got, want in zip(r["continued"], base["continued"]):
            assert abs(got - want) <= 1e-6 * abs(want), (rank, r["continued"], base["continued"])


def _script(body: str) -> str:
    return textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, %r)
        from tests.dist._ckpt import build_stack
        from fsdp2d import checkpoint as ckpt
        SPEC = {"vocab": 7, "dims": [5, 9, 3], "biases": [True, False], "seed": 0}
    """ % str(ROOT)) + textwrap.dedent(body)


def test_killed_save_keeps_previous_checkpoint(tmp_path):
    """A save killed after writing its tensor file but before the index (the slowest
    point is simulated by a sleep) must leave the previous checkpoint at the same path
    loadable and unchanged."""
    path = tmp_path / "c"
    code = _script(f"""
        import os, time
        import fsdp2d.checkpoint._commit as commit
        model = build_stack(SPEC, seed=0)
        ckpt.save({str(path)!r}, model)
        print("first saved", flush=True)
        def slow(phase):
            if phase == "shards":
                print("writing", flush=True); time.sleep(60)
        commit.phase = slow
        model2 = build_stack(SPEC, seed=1)
        ckpt.save({str(path)!r}, model2)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    killed = False
    for line in proc.stdout:
        if line.strip() == "writing":
            proc.kill()
            killed = True
            break
    proc.wait(timeout=60)
    assert killed and proc.returncode != 0
    check = _script(f"""
        model = build_stack(SPEC, seed=5)
        ckpt.load({str(path)!r}, model)
        want = build_stack(SPEC, seed=0).state_dict()
        assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
        print("previous checkpoint intact")
    """)
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert "previous checkpoint intact" in out.stdout, out.stderr


def _saved(tmp_path) -> Path:
    from fsdp2d import checkpoint as ckpt

    path = tmp_path / "c"
    ckpt.save(path, K.build_stack({"vocab": 7, "dims": [5, 9, 3], "biases": [True, False], "seed": 0}, seed=0))
    return path


def _load_error(path, spec=None) -> str:
    from fsdp2d import checkpoint as ckpt

    spec = spec or {"vocab": 7, "dims": [5, 9, 3], "biases": [True, False], "seed": 0}
    model = K.build_stack(spec, seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load(path, model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items()), "model changed by a failed load"
    return str(err.value)


def test_corrupted_truncated_missing_and_mismatched(tmp_path):
    path = _saved(tmp_path)
    data_file = path / "rank00000.safetensors"
    raw = data_file.read_bytes()

    data_file.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))  # one flipped byte
    assert "rank00000.safetensors is corrupted" in _load_error(path)

    data_file.write_bytes(raw[: len(raw) // 2])
    assert "rank00000.safetensors is truncated" in _load_error(path)

    data_file.unlink()
    assert "rank00000.safetensors is missing" in _load_error(path)
    data_file.write_bytes(raw)

    msg = _load_error(path, {"vocab": 7, "dims": [5, 9, 3, 2], "biases": [True, False, True], "seed": 0})
    assert "missing keys ['model/layers.2.bias', 'model/layers.2.weight']" in msg
    msg = _load_error(path, {"vocab": 7, "dims": [5, 9], "biases": [True], "seed": 0})
    assert "unexpected keys ['model/layers.1.weight']" in msg
    msg = _load_error(path, {"vocab": 7, "dims": [5, 8, 3], "biases": [True, False], "seed": 0})
    assert "'model/layers.0.weight' has shape (9, 5) in the checkpoint, (8, 5) in the model" in msg

    (path / "fsdp2d.index.json").write_text("{not json")
    assert "fsdp2d.index.json is corrupted" in _load_error(path)


def test_export_and_inspect_cli(tmp_path):
    from safetensors.torch import load_file

    path = _saved(tmp_path)
    out = tmp_path / "hf"
    run = subprocess.run([sys.executable, "-m", "fsdp2d.checkpoint", "export", str(path), str(out)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    model = K.build_stack({"vocab": 7, "dims": [5, 9, 3], "biases": [True, False], "seed": 0}, seed=9)
    model.load_state_dict(load_file(out / "model.safetensors"))  # plain safetensors, strict
    want = K.build_stack({"vocab": 7, "dims": [5, 9, 3], "biases": [True, False], "seed": 0}, seed=0)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.state_dict().items())
    info = subprocess.run([sys.executable, "-m", "fsdp2d.checkpoint", "inspect", str(path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert info.returncode == 0 and "model/layers.0.weight" in info.stdout and "(9, 5)" in info.stdout
    assert json.loads((path / "fsdp2d.index.json").read_text())["world_size"] == 1


SPEC = {"vocab": 7, "dims": [5, 9, 3], "biases": [True, False], "seed": 0}


def test_manager_keeps_last_k(tmp_path):
    from fsdp2d import checkpoint as ckpt

    manager = ckpt.CheckpointManager(tmp_path, keep_last=2)
    model = K.build_stack(SPEC, seed=0)
    for step in (1, 2, 3, 4):
        manager.save(step, model, extra={"step": step})
    assert manager.steps() == [3, 4]
    assert manager.latest() == tmp_path / "step_00000004"
    (tmp_path / "step_00000005").mkdir()  # an incomplete folder (no index) is not a checkpoint
    assert manager.latest() == tmp_path / "step_00000004"


def test_sharded_export_round_trips(tmp_path):
    """An export split into several files (a tiny shard limit) has an HF-style index,
    loads with plain safetensors, and also with fsdp2d.checkpoint.load."""
    from safetensors.torch import load_file

    from fsdp2d import checkpoint as ckpt

    path = _saved(tmp_path)
    files = ckpt.export(path, tmp_path / "hf", max_shard_bytes=200)
    assert len(files) > 1
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    state = {}
    for f in sorted(set(index["weight_map"].values())):
        state.update(load_file(tmp_path / "hf" / f))
    want = K.build_stack(SPEC, seed=0).state_dict()
    assert set(state) == set(want) and all(torch.equal(state[k], v) for k, v in want.items())
    model = K.build_stack(SPEC, seed=4)
    ckpt.load(tmp_path / "hf", model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())


def test_optimizer_state_of_any_optimizer_round_trips(tmp_path):
    """SGD with momentum (state key 'momentum_buffer', not Adam's) saves and loads into a
    fresh optimizer; the loaded run continues exactly like the original. A failed load
    leaves a fresh optimizer without state."""
    from fsdp2d import checkpoint as ckpt

    def run(model, opt, steps):
        for step in steps:
            torch.manual_seed(step)
            model(torch.randint(0, 7, (4,))).square().sum().backward()
            opt.step()
            opt.zero_grad()

    model = K.build_stack(SPEC, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    run(model, opt, range(3))
    ckpt.save(tmp_path / "c", model, opt)
    run(model, opt, range(3, 5))
    model2 = K.build_stack(SPEC, seed=1)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    ckpt.load(tmp_path / "c", model2, opt2)
    run(model2, opt2, range(3, 5))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    ckpt.save(tmp_path / "no_optim", model)
    model3 = K.build_stack(SPEC, seed=2)
    opt3 = torch.optim.SGD(model3.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ckpt.CheckpointError, match="no optimizer state"):
        ckpt.load(tmp_path / "no_optim", model3, opt3)
    assert len(opt3.state) == 0
