"""The launcher's parent process: mistakes are one line on stderr and exit code 2, found
before torchrun starts and before anything is written (issue 12, items 11 and 13)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdp2d.train import cli

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "debug_cpu.toml")


@pytest.fixture
def launches(monkeypatch):
    """No worker is ever started: the command torchrun would get is recorded instead."""
    calls = []
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(cli, "_launch", lambda cmd, env=None: calls.append(cmd) or 0)
    return calls


def _one_line_error(capsys, code: int, *needles: str) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


def test_config_flag_without_a_value(launches, capsys):
    _one_line_error(capsys, cli.train(["--config"]), "--config needs a file")
    _one_line_error(capsys, cli.train(["--config", "--resume"]), "--config needs a file")
    assert not launches


def test_missing_config_file(launches, capsys, tmp_path):
    _one_line_error(capsys, cli.train(["--config", str(tmp_path / "nope.toml")]), "nope.toml does not exist")
    _one_line_error(capsys, cli.train(["--config", str(tmp_path)]), "cannot read config file")
    assert not launches


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(launches, capsys, tmp_path):
    code = cli.train(["--config", CONFIG, "--parallel.device=cuda", f"--metrics.runs_dir={tmp_path}"])
    _one_line_error(capsys, code, "parallel.device=cuda", "no usable CUDA")
    assert not launches and not any(tmp_path.iterdir())


def test_fresh_run_refuses_an_earlier_runs_folder(launches, capsys, tmp_path):
    """An earlier run's folder: a fresh run would rotate its own new checkpoint away (the
    earlier one has a higher step). Refused, naming the ways out; nothing deleted."""
    run = tmp_path / "job"
    (run / "checkpoints" / "step_00000300").mkdir(parents=True)
    (run / "config.toml").write_text("[training]\nsteps = 300\n")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    args = ["--config", CONFIG, f"--metrics.runs_dir={tmp_path}", "--metrics.run_name=job"]
    _one_line_error(capsys, cli.train(args), "holds an earlier run", "--resume", "--metrics.run_name",
                    "--overwrite")
    assert not launches
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert cli.train([*args, "--resume"]) == 0 and cli.train([*args, "--overwrite"]) == 0
    assert len(launches) == 2 and cli.train([*args[:2], f"--metrics.runs_dir={tmp_path}",
                                             "--metrics.run_name=other"]) == 0


def test_missing_data_path(launches, capsys, tmp_path):
    code = cli.train(["--config", CONFIG, f"--data.path={tmp_path / 'none'}", f"--metrics.runs_dir={tmp_path}"])
    _one_line_error(capsys, code, "does not exist")


def test_an_empty_corpus_is_refused_before_torchrun(launches, capsys, tmp_path):
    """(It reached the workers before issue 29; tests/test_launch_errors.py runs a corpus
    only the workers refuse.) Nothing is written."""
    (tmp_path / "empty.txt").write_text("")
    code = cli.train(["--config", CONFIG, f"--data.path={tmp_path / 'empty.txt'}", f"--metrics.runs_dir={tmp_path}"])
    _one_line_error(capsys, code, "empty.txt holds no documents (only empty files)")
    assert not launches and [p.name for p in tmp_path.iterdir()] == ["empty.txt"]


def test_help_lists_the_subcommands(capsys):
    """Issue 21 item 14: ``fsdp2d --help`` exited 2 with one usage line."""
    assert cli.main(["--help"]) == 0 and cli.main(["-h"]) == 0
    out = capsys.readouterr().out
    for name in ("train", "plan", "plot", "pretokenize", "generate"):
        assert f"\n  {name} " in out, out
    assert cli.main([]) == 2 and cli.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "plan" in err and "nope" in err, err


def test_vocabulary_is_checked_before_torchrun_starts(launches, capsys, tmp_path):
    """Issues 29 and 32 (item 13): model.vocab_size against the tokenizer, and every token
    id of the corpus, in the launcher: one line, exit code 2, no rank started (before:
    41 s into the start, 139 lines; a bad id a third of the way in, 33 steps of training)."""
    import numpy as np

    from fsdp2d.data import save_tokens

    from .data_corpus import bpe, texts, write

    pytest.importorskip("tokenizers")
    tok = bpe(tmp_path / "tok")
    write(tmp_path / "web.jsonl", texts(20), "jsonl")
    base = ["--config", CONFIG, f"--metrics.runs_dir={tmp_path / 'runs'}"]
    code = cli.train([*base, f"--data.path={tmp_path / 'web.jsonl'}", f"--data.tokenizer={tok}"])
    _one_line_error(capsys, code, "model.vocab_size=256 is smaller than the vocabulary of tokenizer",
                    "(300 ids): set model.vocab_size=300")
    ids = np.random.default_rng(0).integers(0, 256, 3000)
    ids[1001] = 256
    save_tokens(tmp_path / "t.bin", ids)
    code = cli.train([*base, f"--data.path={tmp_path / 't.bin'}", "--data.format=uint16"])
    _one_line_error(capsys, code, "t.bin: token id 256 at token offset 1001")
    assert not launches


class _Trainer:
    """Stands in for the workers' Trainer: ``run`` raises ``error`` (None: finishes)."""

    error: BaseException | None = None

    def __init__(self, cfg) -> None:
        self.step, self.ckpts = 3, type("C", (), {"latest": lambda self: None})()

    def maybe_resume(self) -> None:
        pass

    def start(self) -> None:
        pass

    def run(self) -> None:
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize("error,aborts", [(None, False), (RuntimeError("NCCL timeout"), True),
                                          (KeyboardInterrupt(), True)])
def test_worker_aborts_process_groups_after_an_exception(monkeypatch, error, aborts):
    """Issue 30 item 5: after an exception or Ctrl-C some collectives may be unfinished, and
    destroy_process_group() would wait for them; the worker aborts instead."""
    from fsdp2d.train import trainer

    calls = []
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(cli, "shutdown", lambda *, abort: calls.append(abort))
    monkeypatch.setattr(cli, "worker_failed", lambda exc, run_dir, rank: calls.append(str(exc)) or 1)
    monkeypatch.setattr(_Trainer, "error", error)
    monkeypatch.setattr(trainer, "Trainer", _Trainer)
    code = cli.train(["--config", CONFIG])
    assert code == {type(None): 0, RuntimeError: 1, KeyboardInterrupt: 130}[type(error)]
    assert calls == (["NCCL timeout"] if isinstance(error, RuntimeError) else []) + [aborts]
