"""Metric writers beside metrics.jsonl (TensorBoard, W&B) and the progress line's ETA.

Neither tensorboard nor wandb is a dependency, so the packages are stood in for by
fakes that record calls: what is tested is fsdp2d's wiring and its errors."""

import json
import sys
import types

import pytest

from fsdp2d.train.config import load_config
from fsdp2d.train.metrics import Metrics
from fsdp2d.train.writers import build_writers


class _Recorder:
    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []

    def add_scalar(self, key, value, step):
        self.calls.append((key, value, step))

    def log(self, values, step):
        self.calls.append((values, step))

    flush = close = finish = lambda self: self.calls.append("closed")


def test_tensorboard_and_wandb_get_every_logged_record(tmp_path, monkeypatch, capsys):
    made = {}
    tb = types.ModuleType("torch.utils.tensorboard")
    tb.SummaryWriter = lambda **kw: made.setdefault("tb", _Recorder(**kw))
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kw: made.setdefault("wandb", _Recorder(**kw))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tb)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    cfg = load_config(None, ["--metrics.tensorboard=true", "--metrics.wandb=offline"])
    metrics = Metrics(tmp_path, 2, enabled=True, writers=build_writers(cfg.metrics, tmp_path, {"a": 1}))
    record = {"step": 1, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 10.0, "mfu": 0.1}
    metrics.log(record)
    metrics.close()
    assert made["tb"].kwargs == {"log_dir": str(tmp_path / "tensorboard")}
    assert ("train/loss", 2.5, 1) in made["tb"].calls and made["tb"].calls[-1] == "closed"
    assert made["wandb"].kwargs["mode"] == "offline" and made["wandb"].kwargs["config"] == {"a": 1}
    assert made["wandb"].calls[0] == ({f"train/{k}": float(v) for k, v in record.items() if k != "step"}, 1)
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == record
    out = capsys.readouterr().out
    assert "step 1/2 loss 2.5000" in out and "ETA" not in out  # no step timed yet: no ETA (see below)


@pytest.mark.parametrize("option,package", [("--metrics.tensorboard=true", "torch.utils.tensorboard"),
                                            ("--metrics.wandb=online", "wandb")])
def test_missing_package_fails_at_start_with_the_install_command(tmp_path, monkeypatch, option, package):
    monkeypatch.setitem(sys.modules, package, None)  # import fails as if not installed
    cfg = load_config(None, [option])
    with pytest.raises(ImportError, match=f"pip install {package.split('.')[-1]}"):
        build_writers(cfg.metrics, tmp_path, {})
    assert build_writers(load_config(None, []).metrics, tmp_path, {}) == []


def test_eta_waits_for_steady_state_steps(tmp_path, monkeypatch, capsys):
    """Issue 21 item 15: the first ETA counted the start-up and the first (slowest) step
    against every step left (0:19:33 for a 1.5 min run). None is shown until 3 steps are
    timed after the first printed one; then it is their mean step time."""
    from fsdp2d.train import metrics as M

    clock = iter([20.0, 21.0, 22.0, 23.0])  # steps 1-4 logged at these times, 20 s after start-up
    monkeypatch.setattr(M.time, "perf_counter", lambda: next(clock))
    m = M.Metrics(tmp_path, 100, enabled=True)
    record = {"loss": 1.0, "lr": 1e-3, "tokens_per_s": 1.0, "mfu": 0.0}
    for step in range(1, 5):
        m.log({**record, "step": step})
    lines = capsys.readouterr().out.splitlines()
    assert not any("ETA" in line for line in lines[:3]), lines
    assert lines[3].endswith("ETA 0:01:36"), lines  # (23 - 20) s / 3 steps x 96 steps left
