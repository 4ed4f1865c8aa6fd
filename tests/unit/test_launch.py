"""A first run that explains itself (issues 29 and 32), the parts that need no training:
how a worker's failure becomes one line, the run-folder lock, the folder that hides the
package, ``fsdp2d plot --help``, throughput records, the tokenizer in an HF export, and
``generate`` from another directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp2d.checkpoint import CheckpointError
from fsdp2d.train import cli, failure, lock
from fsdp2d.train.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "debug_cpu.toml")


# -- a worker's failure: one line, once ------------------------------------------------------------
def _fail(exc: BaseException, run_dir: Path, rank: int) -> int:
    try:
        raise exc
    except BaseException as raised:  # (worker_failed logs the traceback being handled)
        return failure.worker_failed(raised, run_dir, rank)


def test_worker_failures_print_one_line_from_the_right_rank(tmp_path, monkeypatch, capsys):
    """Under a user's own torchrun: a failure every rank shares is printed by rank 0 only,
    others by each failing rank; a refused config writes nothing, anything else its traceback."""
    monkeypatch.delenv(failure.LAUNCHER_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    run = tmp_path / "run"
    assert _fail(ConfigError("data.path: no tokens"), run, 1) == 2 and capsys.readouterr().err == ""
    assert _fail(ConfigError("data.path: no tokens"), run, 0) == 2
    assert capsys.readouterr().err == "config error: data.path: no tokens\n" and not run.exists()
    assert _fail(CheckpointError("save to X failed"), run, 0) == 2
    log = run / "logs" / "rank0.log"
    assert capsys.readouterr().err == f"error: save to X failed (traceback: {log})\n"
    assert "Traceback" in log.read_text() and "CheckpointError: save to X failed" in log.read_text()
    assert _fail(KeyError("wq"), run, 3) == 1  # not agreed: rank 3 says it, naming itself
    assert capsys.readouterr().err == f"rank 3: error: KeyError: 'wq' (traceback: {run / 'logs' / 'rank3.log'})\n"


def _child_failed(tmp_path, monkeypatch, failures: dict) -> tuple[int, str]:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    got = {}
    for rank, (exitcode, exc) in failures.items():
        error_file = tmp_path / f"error{rank}.json"
        if exc is not None:  # the worker side, as under fsdp2d train: it writes, prints nothing
            monkeypatch.setenv(failure.LAUNCHER_ENV, "1")
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
            assert _fail(exc, tmp_path / "run", rank) == exitcode
        got[rank] = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))
    return failure.child_failed(ChildFailedError("fsdp2d.train", got), str(tmp_path / "run")), None


def test_launcher_prints_the_workers_line_once(tmp_path, monkeypatch, capsys):
    """torchrun's report (25-140 lines, rc 1) becomes the worker's line, once, with its code."""
    err = ConfigError("0 tokens in data.path")
    code, _ = _child_failed(tmp_path, monkeypatch, {0: (2, err), 1: (-15, None), 2: (2, err), 3: (-15, None)})
    out = capsys.readouterr()
    assert code == 2 and out.err == "config error: 0 tokens in data.path\n" and out.out == ""
    # a failure all ranks share, rank 2 first: rank 0's line (its traceback file), whatever the order
    err = CheckpointError("save to X failed")
    code, _ = _child_failed(tmp_path, monkeypatch, {2: (2, err), 0: (2, err)})
    log = tmp_path / "run" / "logs" / "rank0.log"
    assert code == 2 and capsys.readouterr().err == f"error: save to X failed (traceback: {log})\n"


def test_launcher_prints_the_first_failure(tmp_path, monkeypatch, capsys):
    """Rank 3 fails first; its peers fail after it (their connection to it closed): rank 3's line."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    code, _ = _child_failed(tmp_path, monkeypatch, {3: (1, KeyError("wq")),
                                                    0: (1, RuntimeError("Connection closed by peer"))})
    err = capsys.readouterr().err
    assert code == 1 and err == f"rank 3: error: KeyError: 'wq' (traceback: {tmp_path / 'run' / 'logs' / 'rank3.log'})\n"


def test_launcher_names_a_worker_that_died_silently(tmp_path, monkeypatch, capsys):
    code, _ = _child_failed(tmp_path, monkeypatch, {2: (-signal.SIGKILL, None)})
    err = capsys.readouterr().err
    report = tmp_path / "run" / "logs" / "torchrun.log"
    assert code == 1 and err.count("\n") == 1 and "rank 2 was killed by SIGKILL" in err and str(report) in err, err
    assert "fsdp2d.train FAILED" in report.read_text()


# -- one run per run folder ------------------------------------------------------------------------
def _holder(folder: Path) -> subprocess.Popen:
    """Another process holding ``folder``'s run lock (until killed)."""
    code = ("import sys; from fsdp2d.train import lock; lock.acquire(sys.argv[1]); print('held', flush=True); "
            "sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


@pytest.fixture
def launches(monkeypatch):
    calls = []
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(cli, "_launch", lambda cmd, env=None: calls.append((cmd, env)) or 0)
    return calls


def test_a_second_run_in_a_locked_folder_is_refused(tmp_path, launches, capsys):
    """Issue 32 item 2: two runs in one folder both ran. The second is refused in one line
    naming the folder and the holder's pid, by the launcher and by a worker (the lock is
    rank 0's); the lock of a killed run is stale and taken over."""
    run = tmp_path / "job"
    proc = _holder(run)
    try:
        args = ["--config", CONFIG, f"--metrics.runs_dir={tmp_path}", "--metrics.run_name=job"]
        assert cli.train(args) == 2 and not launches
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{run} is in use by another run (pid {proc.pid} on " in err, err
        with pytest.raises(ConfigError, match=f"is in use by another run \\(pid {proc.pid} on "):
            lock.acquire(run)
    finally:
        proc.kill()
        proc.wait()
    assert (run / lock.NAME).exists()  # left behind by a kill -9: stale
    lock.acquire(run)
    try:
        assert f"pid {os.getpid()} on" in (run / lock.NAME).read_text()
    finally:
        lock.release(run)
    assert not (run / lock.NAME).exists()


def test_a_refused_start_leaves_no_folder(tmp_path):
    run = tmp_path / "runs" / "new"
    lock.acquire(run)
    lock.release(run, undo=True)
    assert list(tmp_path.iterdir()) == []


def test_overwrite_clears_what_a_new_run_would_add_to(tmp_path):
    """Review of issue 29: --overwrite kept the earlier run's samples.jsonl, and the new run
    appended after it (TensorBoard events and the HF export alike). They go; the user's
    files, the logs and the token cache stay."""
    from fsdp2d.train import preflight
    from fsdp2d.train.config import load_config

    cfg = load_config(None, [f"--metrics.runs_dir={tmp_path}", "--metrics.run_name=ow", "--data.log_samples=true"])
    run = cfg.run_dir
    for name in ("config.toml", "metrics.jsonl", "samples.jsonl", "loss.png", "notes.md", "logs/rank0.log",
                 "tensorboard/events.out.tfevents.1.host", "tokens/web-abc/tokens.bin", "hf/model.safetensors",
                 "hf/config.json", "hf/tokenizer.json", "hf/README.md"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("{}\n")
    (run / "hf" / ".fsdp2d-export.json").write_text('["config.json", "model.safetensors", "tokenizer.json"]')
    preflight.clear_earlier_run(cfg)
    left = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
    assert left == ["hf/README.md", "logs/rank0.log", "notes.md", "tokens/web-abc/tokens.bin"], left


# -- the clone's folder that hides the package ----------------------------------------------------
def test_a_folder_named_fsdp2d_in_the_working_directory_is_named(tmp_path):
    """Issue 32: run from the folder holding a clone named fsdp2d, `python -m fsdp2d.train`
    imported the clone's root as a namespace package and crashed every rank with "module
    'fsdp2d' has no attribute 'init_device_mesh'"; now one line says why (exit 2)."""
    clone = tmp_path / "fsdp2d"
    clone.mkdir()
    for item in ROOT.iterdir():  # the clone's layout: fsdp2d/{fsdp2d,tests,configs,...}
        if item.name != ".venv":
            (clone / item.name).symlink_to(item)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH", "RANK")}
    proc = subprocess.run([sys.executable, "-m", "fsdp2d.train", "--config", CONFIG], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.count("\n") == 1 and f"the folder {clone} (in the current directory) hides" in proc.stderr


def test_the_workers_import_the_fsdp2d_the_launcher_runs(tmp_path):
    """Review of issue 29: the launcher starts the workers with PYTHONSAFEPATH=1 (no current
    directory on their path), so `python -m fsdp2d.train` from a checkout's root ran that
    checkout in the launcher and the installed copy (or none: ModuleNotFoundError on every
    rank) in the workers. The checkout's folder now goes on their PYTHONPATH."""
    import shutil

    shutil.copytree(ROOT / "fsdp2d", tmp_path / "fsdp2d", ignore=shutil.ignore_patterns("__pycache__"))
    probe = ("import subprocess, sys, fsdp2d; from fsdp2d.train.cli import _child_env; "
             "from fsdp2d.train.config import load_config; env = _child_env(load_config(None, []), 1, 0.0); "
             "print(fsdp2d.__file__); sys.stdout.flush(); "
             "subprocess.run([sys.executable, '-c', 'import fsdp2d; print(fsdp2d.__file__)'], env=env)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    want = str(tmp_path / "fsdp2d" / "__init__.py")
    assert out.stdout.splitlines() == [want, want], out


# -- fsdp2d plot ---------------------------------------------------------------------------------
def test_plot_help_and_old_metrics(tmp_path, capsys):
    """Issue 32: `fsdp2d plot --help` was a traceback (it read '--help' as a run folder).
    Metrics of earlier versions (a per-job tokens_per_s only) still plot."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plot", "--help"])
    assert exit_.value.code == 0 and "usage: fsdp2d plot" in capsys.readouterr().out
    assert cli.main(["plot", str(tmp_path)]) == 2 and "metrics.jsonl does not exist" in capsys.readouterr().err
    old = {"step": 1, "loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0, "mfu": 0.01,
           "peak_mem_mib": 10.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(old) + "\n" + json.dumps({**old, "step": 2}) + "\n")
    assert cli.main(["plot", str(tmp_path)]) == 0 and (tmp_path / "loss.png").stat().st_size > 1000


# -- throughput --------------------------------------------------------------------------------
def test_throughput_per_gpu_per_job_and_mfu_only_with_a_peak(monkeypatch):
    from fsdp2d.train.metrics import Metrics, device_peak, throughput

    assert device_peak("cpu", None) is None and device_peak("cpu", 1e12) == 1e12
    for name, peak in (("NVIDIA H100 80GB HBM3", 989.5e12), ("NVIDIA H200", 989.5e12), ("NVIDIA H100 PCIe", None),
                       ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
                       ("NVIDIA GeForce RTX 4090", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, _n=name: _n)
        assert device_peak("cuda", None) == peak, name
    rec = throughput(4096, 2.0, 4, 6_000, None)
    assert rec == {"tokens_per_s": 2048.0, "tokens_per_s_per_gpu": 512.0}  # no MFU without a known peak
    assert throughput(4096, 2.0, 4, 6_000, 1e9)["mfu"] == pytest.approx(6_000 * 512 / 1e9)
    shown = []
    m = Metrics(Path("."), 10, enabled=True)
    m.tty = False
    import builtins

    real = builtins.print
    builtins.print = lambda *a, **k: shown.append(a[0])
    try:
        m.progress({"step": 1, "loss": 2.0, "lr": 1e-3, **rec, "tokens_seen": 1_234_567}, final=True)
        m.progress({"step": 2, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 100.0, "mfu": 0.5}, final=True)
    finally:
        builtins.print = real
    assert "512 tok/s/GPU (2048 job)" in shown[0] and "1.2M tokens" in shown[0] and "mfu" not in shown[0]
    assert "100 tok/s mfu 50.0%" in shown[1]  # a record of an earlier version


# -- the tokenizer in an HF export, generate from anywhere ---------------------------------------
def _bpe(path: Path) -> Path:
    """A small BPE tokenizer with <s> and </s>, trained here (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["def f(x): return x + 1", "hello world, hello there"] * 20,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(path))
    return path


def _ckpt(tmp_path: Path, extra: dict | None = None) -> tuple[Path, torch.nn.Module]:
    from fsdp2d import checkpoint
    from fsdp2d.hf.weights import model_spec
    from fsdp2d.models import Llama, LlamaArgs

    torch.manual_seed(0)
    model = Llama(LlamaArgs(dim=16, n_layers=1, n_heads=2, vocab_size=256, multiple_of=8, max_seq_len=16))
    ckpt = tmp_path / "runs" / "job" / "checkpoints" / "step_00000001"
    checkpoint.save(ckpt, model, extra={"model": model_spec(model), **(extra or {})})
    return ckpt, model


def test_hf_export_writes_the_tokenizer_and_its_ids(tmp_path):
    """Issue 29: the export had no tokenizer files and bos/eos ids None. A tokenizer.json
    is copied with its config (<s>/</s> found by name); the byte tokenizer is written as an
    equivalent byte-level BPE (ids = bytes, no BOS/EOS); transformers loads both."""
    transformers = pytest.importorskip("transformers")
    from fsdp2d.hf.export import export_hf

    tok = _bpe(tmp_path / "tok.json")
    ckpt, _ = _ckpt(tmp_path, {"tokenizer": str(tok)})
    out = tmp_path / "hf"
    names = {p.name for p in export_hf(ckpt, out)}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names
    config, gen = (json.loads((out / n).read_text()) for n in ("config.json", "generation_config.json"))
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2) == (gen["bos_token_id"], gen["eos_token_id"])
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    assert loaded.bos_token == "<s>" and loaded.eos_token_id == 2
    text = "hello world"
    from tokenizers import Tokenizer

    assert loaded(text, add_special_tokens=False)["input_ids"] == Tokenizer.from_file(str(tok)).encode(text).ids
    assert transformers.AutoConfig.from_pretrained(out).bos_token_id == 1

    export_hf(ckpt, out, tokenizer="bytes")
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    text = "héllo\n\tworld ✓"
    assert loaded(text)["input_ids"] == list(text.encode()) and loaded.decode(list(text.encode())) == text
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] is None


def test_generate_finds_the_runs_tokenizer_from_another_directory(tmp_path, monkeypatch, capsys):
    """Issue 29: `generate` from another directory failed on a relative data.tokenizer.
    It is read against the folder the run was started in (for checkpoints of earlier
    versions), or taken from the absolute path new checkpoints record."""
    from fsdp2d.train.generate import find_tokenizer, main

    (tmp_path / "data").mkdir()
    tok = _bpe(tmp_path / "data" / "tok.json")
    ckpt, _ = _ckpt(tmp_path)  # an older checkpoint: no extra["tokenizer"]
    (ckpt.parent.parent / "config.toml").write_text('[data]\ntokenizer = "data/tok.json"\n'
                                                    '[metrics]\nruns_dir = "runs"\nrun_name = "job"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert find_tokenizer(ckpt) == str(tok)
    assert main([str(ckpt), "--prompt", "hello world", "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()
    moved = tmp_path / "moved.json"
    tok.rename(moved)
    assert find_tokenizer(ckpt, {"extra": {"tokenizer": str(moved)}}) == str(moved)  # new checkpoints
    gone = tmp_path / "gone.json"
    with pytest.raises(ValueError) as err:
        find_tokenizer(ckpt, {"extra": {"tokenizer": str(gone)}})
    assert str(err.value) == f"the run's tokenizer is not at {gone} or {tok} or data/tok.json: pass --tokenizer PATH"


def test_generate_threads_follow_the_idle_cores(monkeypatch):
    """Issue 32: 91 s at load ~10 with torch's default threads, 15 s with one."""
    from fsdp2d.train import generate

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "getloadavg", lambda: (10.0, 10.0, 10.0))
    assert generate.cpu_threads() == 1
    monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 1.0, 1.0))
    assert generate.cpu_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert generate.cpu_threads() == torch.get_num_threads()
