"""Runs that evolve (issue 29): a resume with another global batch, or with files appended
to a source, continues after the last sample consumed, as the logged sample ids show; a
sound checkpoint is never called corrupt; ``checkpoint.init_from`` starts a new run from a
checkpoint's weights (and optimizer state). World size 1, in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.unit.data_corpus import bpe, texts, write

pytest.importorskip("tokenizers")
ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=2", "--model.max_seq_len=16",
        "--model.vocab_size=300", "--data.seq_len=16", "--data.eval_fraction=0.05", "--data.workers=0",
        "--data.log_samples=true", "--training.eval_every=0", "--training.log_every=1", "--checkpoint.every=3",
        "--checkpoint.keep_last=0", "--checkpoint.export_hf=false", "--parallel.dp=1", "--parallel.tp=1"]


@pytest.fixture
def world1(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "FSDP2D_DATA_CHECKED"):
        monkeypatch.delenv(var, raising=False)
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _run(tmp_path, name: str, *extra: str, resume: bool = False):
    import torch.distributed as dist

    from fsdp2d.train.config import load_config
    from fsdp2d.train.trainer import Trainer

    if dist.is_initialized():
        dist.destroy_process_group()
    cfg = load_config(None, [*TINY, f"--data.path={tmp_path / 'web'}", f"--data.tokenizer={tmp_path / 'tok' / 'tokenizer.json'}",
                             f"--metrics.runs_dir={tmp_path / 'runs'}", f"--metrics.run_name={name}",
                             f"--checkpoint.resume={str(resume).lower()}", *extra])
    trainer = Trainer(cfg)
    trainer.maybe_resume()
    trainer.start()
    trainer.run()
    return trainer


def _logged(tmp_path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "runs" / name / "samples.jsonl").read_text().splitlines()]


def test_changed_batch_and_appended_files_continue_after_the_last_sample(tmp_path, world1, capsys):
    bpe(tmp_path / "tok")
    write(tmp_path / "web" / "a.jsonl", texts(30, 1), "jsonl")
    _run(tmp_path, "run", "--training.global_batch=4", "--training.steps=6", "--training.stop_at=3")
    # another global batch: 6 samples a step from sample 12 on
    trainer = _run(tmp_path, "run", "--training.global_batch=6", "--training.steps=6", resume=True)
    rows = _logged(tmp_path, "run")
    assert [r["first"] for r in rows] == [0, 4, 8, 12, 18, 24]  # contiguous: nothing repeated or skipped
    ids = [tuple(i) for r in rows for i in r["ids"]]
    assert ids == [tuple(i) for i in trainer.data.train.sample_ids(0, 30).tolist()]  # the pure function of k
    sequences = trainer.data.sources[0].sequences
    # files appended (sorting last): the epoch under way goes on, then visits the new sequences
    write(tmp_path / "web" / "b.jsonl", texts(20, 2), "jsonl")
    more = _run(tmp_path, "run", "--training.global_batch=6", "--training.steps=50", resume=True)
    grown = more.data.sources[0].sequences
    assert grown > sequences
    rows = _logged(tmp_path, "run")
    assert [r["first"] for r in rows] == [0, 4, 8, 12, 18, 24] + list(range(30, 30 + 6 * 44, 6))
    ids = [tuple(i) for r in rows for i in r["ids"]]
    first_epoch = [seq for _, epoch, seq in ids if epoch == 0]
    assert sorted(first_epoch) == list(range(grown))  # every sequence once, old and new
    assert "resumed from" in capsys.readouterr().out
    metrics = [json.loads(line) for line in (tmp_path / "runs" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["samples_seen"] == 30 + 6 * 44 and metrics[-1]["tokens_seen"] == 16 * (30 + 6 * 44)
    assert metrics[-1]["epoch"] > 1 and metrics[-1]["share/web"] == 1.0


def test_changed_data_at_resume_is_one_line_not_a_corrupt_checkpoint(tmp_path, world1, capsys):
    from fsdp2d.train.config import ConfigError

    bpe(tmp_path / "tok")
    write(tmp_path / "web" / "a.jsonl", texts(30, 1), "jsonl")
    done = _run(tmp_path, "run", "--training.global_batch=4", "--training.steps=6")
    weights = {n: p.full_tensor().clone() for n, p in done.model.named_parameters()}
    write(tmp_path / "web" / "a.jsonl", texts(31, 1), "jsonl")  # edited in place
    with pytest.raises(ConfigError, match=r"step_00000006 is a sound checkpoint, but source 'web' changed since the "
                                          r"checkpoint .*checkpoint.init_from=CHECKPOINT") as err:
        _run(tmp_path, "run", "--training.global_batch=4", "--training.steps=9", resume=True)
    out = capsys.readouterr().out
    assert "does not verify" not in out and "\n" not in str(err.value)  # no older checkpoint tried
    # the way out it names: a new run from those weights and optimizer state, on the new data
    new = _run(tmp_path, "new", "--training.global_batch=4", "--training.steps=1", "--training.stop_at=1",
               f"--checkpoint.init_from={tmp_path / 'runs' / 'run' / 'checkpoints' / 'step_00000006'}",
               "--checkpoint.init_from_optimizer=true", "--optim.lr=1e-12", "--optim.warmup_steps=0")
    assert "initialised from" in capsys.readouterr().out and _logged(tmp_path, "new")[0]["first"] == 0
    for n, p in new.model.named_parameters():  # lr 1e-12: one step leaves the loaded weights
        torch.testing.assert_close(p.full_tensor(), weights[n], rtol=1e-6, atol=1e-6)
    assert all(int(s["step"]) == 7 for s in new.opt.state.values())  # AdamW's state came along (6 + this step)


@pytest.mark.dist
def test_docs_data_md_end_to_end_on_cpu(tmp_path):
    """docs/data.md's commands as written, in a fresh folder: make the corpus, pretokenize a
    source, train the mixture preset (2 CPU ranks; 4 steps). (The resume with another
    global batch is tested in this process above.)"""
    import subprocess
    import sys

    bin_dir = Path(sys.executable).parent
    run = lambda *cmd: subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=400)  # noqa: E731
    made = run(sys.executable, str(ROOT / "examples" / "07_tiny_corpus.py"), "data")
    assert made.returncode == 0, made.stderr[-2000:]
    pre = run(str(bin_dir / "fsdp2d"), "pretokenize", "data/web", "tokens/web", "--tokenizer", "data/tokenizer.json")
    assert pre.returncode == 0 and "eos 0" in pre.stdout, pre.stderr[-2000:]
    short = ["--training.steps=4", "--training.eval_every=2", "--training.eval_steps=1", "--checkpoint.every=2",
             "--training.log_every=1"]
    train = run(str(bin_dir / "fsdp2d"), "train", "--config", str(ROOT / "configs" / "jsonl_mixture_cpu.toml"), *short)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
    assert "data: web (w 3" in train.stdout and "eos 0" in train.stdout
    rows = [json.loads(line) for line in (tmp_path / "runs" / "jsonl_mixture_cpu" / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples_seen"] for r in rows] == [16, 32, 48, 64] and all("share/books" in r for r in rows)
    assert all(0 < r["loss"] < 9 for r in rows)  # ln(2048) = 7.6 at the start; no NaN
