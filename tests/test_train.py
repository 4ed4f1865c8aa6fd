"""The launcher end to end, on the smallest job that shows each property.

Each test starts real jobs (``fsdp2d train`` -> torchrun -> 4 gloo ranks, 2 x 2 mesh), so
they are few: an uninterrupted run, a run stopped half-way and resumed, and a run with a
rank killed mid-way under ``torchrun --max-restarts 1``. fp32 on CPU is deterministic for a
fixed mesh, so resumed loss curves must equal the uninterrupted one bit for bit.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp2d.train.plot import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--config", str(ROOT / "configs" / "debug_cpu.toml"), "--model.dim=32", "--model.n_layers=2",
         "--model.n_heads=4", "--model.n_kv_heads=2", "--model.max_seq_len=32", "--data.seq_len=32",
         "--training.steps=8", "--training.global_batch=8", "--training.log_every=1", "--training.eval_every=4",
         "--training.eval_steps=2", "--checkpoint.every=4", "--checkpoint.keep_last=3",
         "--optim.warmup_steps=2"]  # a clear loss drop within 8 steps (20 warmup steps: noise)


def _train(runs: Path, name: str, *extra: str, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    args = [*SMALL, f"--metrics.runs_dir={runs}", f"--metrics.run_name={name}", *extra]
    cmd = launcher or [sys.executable, "-m", "fsdp2d.train"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run)}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    proc = _train(runs, "base")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return runs, _losses(runs / "base")


@pytest.mark.dist
def test_run_writes_metrics_checkpoints_and_plot(baseline):
    runs, losses = baseline
    run = runs / "base"
    records = read_metrics(run)
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_gpu", "tokens_seen",
                "peak_mem_mib"):  # (no "mfu" on CPU)
        assert all(key in r for r in records), key
    assert sorted(losses) == list(range(1, 9))
    assert "eval_loss" in records[3] and "eval_loss" in records[7]
    assert losses[8] < losses[1]
    listed = sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith("."))
    assert listed == ["step_00000004", "step_00000008"]  # (links to hidden version folders beside them)
    out = subprocess.run([sys.executable, "-m", "fsdp2d.train.cli", "plot", str(run)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and (run / "loss.png").stat().st_size > 1000, out.stderr


@pytest.mark.dist
def test_resume_is_bitwise_identical(baseline):
    runs, want = baseline
    first = _train(runs, "resumed", "--training.stop_at=4")
    assert first.returncode == 0, first.stderr[-3000:]
    second = _train(runs, "resumed", "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout
    assert _losses(runs / "resumed") == want  # every step, bit for bit


def _children(pid: int) -> list[int]:
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if int(fields.get("PPid", "0").strip()) == pid:
            out.append(int(status.parent.name))
    return out


@pytest.mark.dist
def test_killed_rank_restarts_from_checkpoint(baseline):
    """torchrun --max-restarts 1: kill one rank once step 5 is logged; all ranks restart,
    resume from the newest checkpoint there was at the kill (step 4, or 8 when the run got
    that far before the kill landed: the test must not depend on the machine's speed), and
    finish with the uninterrupted run's final loss."""
    runs, want = baseline
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           "--max-restarts", "1", "-m", "fsdp2d.train",
           *SMALL, f"--metrics.runs_dir={runs}", "--metrics.run_name=killed"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = runs / "killed" / "metrics.jsonl"
    deadline = time.time() + 240
    killed = False
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and any(json.loads(l)["step"] >= 5 for l in metrics.read_text().splitlines() if l):
            workers = _children(proc.pid)
            assert workers, "no worker processes found"
            saved = [int(p.name[5:]) for p in (runs / "killed" / "checkpoints").glob("step_*")]
            os.kill(sorted(workers)[-1], signal.SIGKILL)
            killed = True
            break
        time.sleep(0.2)
    out, _ = proc.communicate(timeout=300)
    assert killed, out[-3000:]
    assert proc.returncode == 0, out[-3000:]
    resumed = re.search(r"resumed from \S*step_(\d+) at step (\d+)", out)
    assert resumed, out[-3000:]
    # the newest checkpoint at the kill, or one committed in the instant before it landed
    assert int(resumed.group(2)) >= max(saved, default=4) >= 4, (saved, resumed.group(0))
    got = _losses(runs / "killed")
    assert got[8] == want[8], (got, want)


def test_nan_loss_stops_with_clear_error_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    """World size 1 runs in-process. lr=1e20 without clipping blows the weights up; the
    run must stop at the first non-finite loss, before the optimizer step, with an error
    naming the last good checkpoint, and that checkpoint must load."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    import torch.distributed as dist

    from fsdp2d import checkpoint as ckpt
    from fsdp2d.train.config import load_config
    from fsdp2d.train.trainer import Trainer, TrainingError

    overrides = [a for a in SMALL[2:] if not a.startswith("--training.eval")]
    cfg = load_config(ROOT / "configs" / "debug_cpu.toml", [
        *overrides, "--parallel.dp=1", "--parallel.tp=1", "--training.global_batch=2", "--optim.lr=1e20",
        "--optim.warmup_steps=0", "--optim.max_norm=0", "--checkpoint.every=1", "--training.steps=50",
        "--training.eval_every=0", f"--metrics.runs_dir={tmp_path}", "--metrics.run_name=nan"])
    try:
        trainer = Trainer(cfg)
        with pytest.raises(TrainingError) as err:
            trainer.run()
        message = str(err.value)
        assert "loss is nan" in message or "loss is inf" in message, message
        latest = trainer.ckpts.latest()
        assert latest is not None and str(latest) in message
        assert ckpt.load(latest, trainer.model, trainer.opt)["step"] == trainer.step
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# -- issue 12: nothing lost, nothing overwritten before the run is known to start -----------------
def _local(tmp_path, name: str, *extra: str):
    """A world-size-1 job on a small token file (in-process: no torchrun)."""
    import numpy as np

    from fsdp2d.train.config import load_config
    from fsdp2d.train.data import save_tokens

    data = tmp_path / "tokens.bin"
    if not data.exists():
        save_tokens(data, np.random.default_rng(0).integers(0, 256, 40_000))
    overrides = [a for a in SMALL[2:] if not a.startswith(("--training.eval", "--checkpoint"))]
    return load_config(ROOT / "configs" / "debug_cpu.toml", [
        *overrides, "--parallel.dp=1", "--parallel.tp=1", "--training.global_batch=2",
        f"--data.path={data}", "--data.format=uint16", "--training.eval_every=0", "--checkpoint.every=2",
        "--training.steps=4", f"--metrics.runs_dir={tmp_path}", f"--metrics.run_name={name}", *extra])


@pytest.fixture
def world1(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _fresh_group():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def test_startup_checks_and_resume_fallback(tmp_path, world1, capsys):
    """Items 12, 14, 15 and the worker side of 11, in one world-size-1 job:
    an eval split smaller than one batch is refused before step 1 (nothing written);
    a resume with another model size fails without touching config.toml; a corrupt
    newest checkpoint is skipped (logged) for the newest one that verifies; a fresh run
    refuses the run folder, and --overwrite replaces it."""
    from fsdp2d.train.config import ConfigError
    from fsdp2d.train.trainer import Trainer

    from fsdp2d import checkpoint as ckpt

    # 12: 40k tokens, eval_fraction 1e-4 -> 4 tokens: not one sequence of 33
    with pytest.raises(ConfigError, match="eval split"):
        Trainer(_local(tmp_path, "tiny_eval", "--training.eval_every=2", "--data.eval_fraction=0.0001"))
    assert not (tmp_path / "tiny_eval").exists()
    _fresh_group()

    trainer = Trainer(_local(tmp_path, "run"))
    trainer.maybe_resume()
    trainer.start()
    trainer.run()
    config = (tmp_path / "run" / "config.toml").read_text()
    assert trainer.ckpts.steps() == [2, 4]
    _fresh_group()

    # 14: another model size: a clear error, config.toml as it was
    trainer = Trainer(_local(tmp_path, "run", "--model.dim=64", "--checkpoint.resume=true"))
    with pytest.raises(ckpt.CheckpointError, match="has shape"):
        trainer.maybe_resume()
    assert (tmp_path / "run" / "config.toml").read_text() == config
    _fresh_group()

    # 15: the newest checkpoint corrupt: resume from step 2, and say so
    data = (tmp_path / "run" / "checkpoints" / "step_00000004").resolve() / "rank00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    trainer = Trainer(_local(tmp_path, "run", "--checkpoint.resume=true"))
    trainer.maybe_resume()
    out = capsys.readouterr().out
    assert trainer.step == 2 and "step_00000004 does not verify" in out and "resumed from" in out, out
    _fresh_group()

    # 11 (worker side): a fresh run in this folder is refused; --overwrite starts over
    with pytest.raises(ConfigError, match="holds an earlier run"):
        Trainer(_local(tmp_path, "run"))
    assert trainer.ckpts.steps() == [2, 4]
    _fresh_group()
    trainer = Trainer(_local(tmp_path, "run", "--checkpoint.overwrite=true", "--training.steps=2"))
    trainer.start()
    assert trainer.ckpts.steps() == [] and not (tmp_path / "run" / "metrics.jsonl").exists()
    trainer.run()
    assert trainer.ckpts.steps() == [2]


# -- issue 13: no host syncs in a training step ---------------------------------------------------
class _HostReads:
    """Counts what makes the CPU wait for the device: data-dependent ops (``.item()``,
    ``float(t)``, ``nonzero``...: torch tags them) and ``Tensor.tolist``/``numpy``
    (which dispatch nothing on the CPU). The optimizer's step counters are not counted:
    torch keeps them on the host (``capturable=False``) so that reading them waits for
    nothing."""

    def __init__(self, trainer, monkeypatch) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        self.count = 0
        host = lambda t: any(t is s.get("step") for s in trainer.opt.state.values())  # noqa: E731
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                tags = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
                if any(tag in func.tags for tag in tags) and not host(args[0]):
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        for name in ("tolist", "numpy"):
            method = getattr(torch.Tensor, name)

            def read(t, *args, _method=method, **kwargs):
                counter.count += 1
                return _method(t, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, read)
        self.mode = Mode


def test_training_steps_read_the_device_only_to_log_or_save(tmp_path, world1, monkeypatch):
    """DESIGN item 9: a step between two logged (or checkpointed) steps makes no host
    sync; a logged step reads every step's loss and gradient norm since the last read
    in one, and logs what a run reading every step logs (loss, gradient norm, lr)."""
    from fsdp2d.train.plot import read_metrics
    from fsdp2d.train.trainer import Trainer

    every = Trainer(_local(tmp_path, "every", "--training.steps=6", "--checkpoint.every=3", "--training.log_every=1"))
    every.run()
    _fresh_group()
    trainer = Trainer(_local(tmp_path, "lazy", "--training.steps=6", "--checkpoint.every=3",
                             "--training.log_every=4"))
    reads, step = _HostReads(trainer, monkeypatch), trainer.train_step
    per_step = {}

    def counted(batches, read=True):
        before = reads.count
        with reads.mode():
            out = step(batches, read)
        per_step[trainer.step + 1] = (read, reads.count - before)
        return out

    trainer.train_step = counted
    trainer.run()
    # steps 3 and 6 checkpoint, 4 and 6 log: one read each, before the optimizer step
    assert per_step == {1: (False, 0), 2: (False, 0), 3: (True, 1), 4: (True, 1), 5: (False, 0), 6: (True, 1)}
    want = {r["step"]: r for r in read_metrics(tmp_path / "every")}
    got = read_metrics(tmp_path / "lazy")
    assert [r["step"] for r in got] == [4, 6]
    for r in got:
        keys = ("loss", "grad_norm", "lr")
        assert {k: r[k] for k in keys} == {k: want[r["step"]][k] for k in keys}


def test_nan_loss_between_reads_is_reported_with_its_step(tmp_path, world1):
    """A non-finite loss at a step that does not log is found at the next read (here step
    8), named with its own step; the run stops before step 8's optimizer step, and no
    checkpoint was written after it (step 4's, if the loss went bad later, or none)."""
    import re

    from fsdp2d.train.trainer import Trainer, TrainingError

    trainer = Trainer(_local(tmp_path, "nan_lazy", "--optim.lr=1e20", "--optim.warmup_steps=0", "--optim.max_norm=0",
                             "--training.steps=8", "--checkpoint.every=4", "--training.log_every=8"))
    with pytest.raises(TrainingError) as err:
        trainer.run()
    found = re.search(r"loss is (nan|inf) at step (\d+)(.*); stopped before step (\d+)'s optimizer step\. "
                      r"Last good checkpoint: (\S+)\.", str(err.value))
    assert found, err.value
    bad, read = int(found.group(2)), int(found.group(4))
    assert read == (4 if bad <= 4 else 8) and trainer.step == read - 1, err.value
    assert trainer.ckpts.steps() == ([] if bad <= 4 else [4])
    if bad != read:
        assert f", read at step {read}" in found.group(3), err.value


@pytest.mark.dist
def test_ctrl_c_prints_one_message_with_the_latest_checkpoint(tmp_path):
    """Issue 21 item 13: Ctrl-C (SIGINT to the launcher's process group, as a terminal
    sends it) used to print a KeyboardInterrupt traceback per process (~200 lines here);
    now rank 0 says at which step it stopped, the newest checkpoint and how to continue."""
    args = [*SMALL, "--training.steps=2000", "--training.eval_every=0", "--checkpoint.every=2",
            f"--metrics.runs_dir={tmp_path}", "--metrics.run_name=int"]
    proc = subprocess.Popen([sys.executable, "-m", "fsdp2d.train", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics, deadline = tmp_path / "int" / "metrics.jsonl", time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and any(json.loads(l)["step"] >= 3 for l in metrics.read_text().splitlines() if l):
            os.killpg(proc.pid, signal.SIGINT)
            break
        time.sleep(0.2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out and "signal" not in out, out[-3000:]
    said = re.findall(r"interrupted at step (\d+); latest checkpoint: (\S+)\. Continue .* --resume", out)
    assert len(said) == 1, out[-3000:]
    step, path = int(said[0][0]), Path(said[0][1])
    assert step >= 3 and path.parent == tmp_path / "int" / "checkpoints" and path.name.startswith("step_"), said
    assert len(out.splitlines()) < 30, out  # the warnings, a progress line per step, the message
    assert out.count("DTensor random operators") <= 1, out  # rank 0's copy only (it was one per rank)


def test_resume_drops_metrics_after_the_checkpoint(tmp_path, world1, capsys):
    """Issue 21 item 15: a run stopped after logging steps its last checkpoint does not
    hold (here: step 3 logged, checkpoint 3 lost) repeated them in metrics.jsonl on
    resume. The resumed run drops the lines after its checkpoint's step first."""
    from fsdp2d.train.trainer import Trainer

    trainer = Trainer(_local(tmp_path, "run", "--training.stop_at=3"))
    trainer.start()
    trainer.run()
    trainer.ckpts.remove(3)  # as if killed after step 3 was logged, before its checkpoint
    _fresh_group()
    trainer = Trainer(_local(tmp_path, "run", "--checkpoint.resume=true"))
    trainer.maybe_resume()
    assert trainer.step == 2
    trainer.start()
    trainer.run()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]  # the file, not read_metrics's view


def test_checkpoint_inspect_summarises_the_rng_state(tmp_path, world1):
    """Issue 21 item 15: ``checkpoint inspect`` printed the RNG state, ~5 KB of base64;
    now it says the state is there and its size."""
    from fsdp2d import checkpoint as ckpt
    from fsdp2d.train.trainer import Trainer

    trainer = Trainer(_local(tmp_path, "ins", "--training.steps=2"))
    trainer.start()
    trainer.run()
    latest = trainer.ckpts.latest()
    rng = ckpt.load(latest, trainer.model, trainer.opt)["rng"]
    out = ckpt.inspect(latest)
    assert rng[:40] not in out and '"rng": "<RNG state, ' in out, out
    assert max(len(line) for line in out.splitlines()) < 1000, out


def test_start_and_end_summaries(tmp_path, world1, capsys):
    """Issue 21 item 15: a run said nothing of what it was about to train or what it left
    behind; rank 0 now prints one line at the start and one at the end."""
    from fsdp2d.train.trainer import Trainer

    trainer = Trainer(_local(tmp_path, "sum"))
    trainer.start()
    trainer.run()
    lines = capsys.readouterr().out.splitlines()
    start = [line for line in lines if line.startswith("fsdp2d train: ")]
    end = [line for line in lines if line.startswith("done: ")]
    assert len(start) == 1 and len(end) == 1, lines
    params = sum(p.numel() for p in trainer.model.parameters())  # world size 1: the full sizes
    assert f"{params:,} parameters" in start[0] and "mesh dp=1 x tp=1" in start[0], start
    assert str(tmp_path / "sum") in start[0] and "steps 1-4" in start[0], start
    assert f"latest checkpoint {trainer.ckpts.latest()}" in end[0] and "2 kept" in end[0], end
    hf = f"HF export: {tmp_path / 'sum' / 'hf'}" if trainer.cfg.checkpoint.export_hf else "HF export: off"
    assert hf in end[0], end
