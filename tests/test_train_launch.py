"""A first run that explains itself, in-process (world size 1, no torchrun): start-up
progress, throughput per GPU and per job, the run's tokenizer in the checkpoint and the HF
export, the run-folder lock seen by a worker, and a resume with nothing left to train."""

from __future__ import annotations

import json

import pytest

from fsdp2d import checkpoint as ckpt
from fsdp2d.train.config import ConfigError
from fsdp2d.train.plot import read_metrics

from .test_train import _fresh_group, _local, world1  # noqa: F401  (world1 is a fixture)
from .unit.test_launch import _bpe, _holder


def test_startup_progress_throughput_and_the_tokenizer(tmp_path, world1, capsys):  # noqa: F811
    """Issue 29 item 6: start-up printed nothing for 21-48 s; tok/s was per job only; the
    HF export had no tokenizer and bos/eos None."""
    from fsdp2d.train.trainer import Trainer

    tok = _bpe(tmp_path / "tok.json")
    trainer = Trainer(_local(tmp_path, "run", f"--data.tokenizer={tok}"))
    trainer.maybe_resume()
    trainer.start()
    trainer.run()
    lines = capsys.readouterr().out.splitlines()
    phases = [line.split("] ", 1)[1] for line in lines if line.startswith("[+")]
    for i, want in enumerate(("mesh dp=1 x tp=1 (1 ranks, gloo)", "data ready", "model built on the meta device",
                              "weights on cpu, initialised", "step 1 done: start-up complete")):
        assert phases[i].startswith(want), phases
    cfg = trainer.cfg
    for r in read_metrics(cfg.run_dir):
        assert r["tokens_per_s_per_gpu"] == r["tokens_per_s"]  # one rank
        assert r["tokens_seen"] == r["step"] * cfg.training.global_batch * cfg.data.seq_len
        assert "mfu" not in r  # CPU: no peak to compare with
    latest = trainer.ckpts.latest()
    assert ckpt.read_index(latest)["extra"]["tokenizer"] == str(tok)
    hf = cfg.run_dir / "hf"
    assert (hf / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert json.loads((hf / "config.json").read_text())["eos_token_id"] == 2


def test_a_token_store_run_records_exports_and_describes_its_own_tokenizer(tmp_path, world1, capsys):  # noqa: F811
    """Review of issue 29: a run on a token store with data.tokenizer unset (the llama3
    presets) said `tokenizer bytes`, recorded none and exported none, and `generate` decoded
    its BPE ids as bytes. Now the store's tokenizer is described, recorded (path, sha256) and
    exported; with its file gone the run says so at the start, still ends with exit 0 and
    an export of the weights alone, and generate refuses in one line."""
    from fsdp2d.data import pretokenize
    from fsdp2d.train.generate import main as generate
    from fsdp2d.train.trainer import Trainer

    tok = _bpe(tmp_path / "tok.json")
    (tmp_path / "c.txt").write_text("def f(x): return x + 1\nhello world, hello there\n" * 150)
    pretokenize(tmp_path / "c.txt", tmp_path / "store", tok, workers=0, progress=False)
    args = [f"--data.path={tmp_path / 'store'}", "--data.format=auto", "--model.vocab_size=64"]
    for name in ("found", "gone"):
        if name == "gone":
            tok.rename(tmp_path / "away.json")
            _fresh_group()
        trainer = Trainer(_local(tmp_path, name, *args))
        trainer.maybe_resume()
        trainer.start()
        trainer.run()
        out = capsys.readouterr().out
        hf, extra = trainer.cfg.run_dir / "hf", ckpt.read_index(trainer.ckpts.latest())["extra"]
        assert extra["tokenizer"] == str(tok.resolve()) and len(extra["tokenizer_sha256"]) == 64
        if name == "found":
            assert f"; tokenizer {tok.resolve()}, bos 1, eos 2" in out, out
            assert (hf / "tokenizer.json").read_bytes() == tok.read_bytes()
        else:
            assert f"; tokenizer {tok.resolve()} (sha256 " in out and "not found; set data.tokenizer to it, or the HF export has no" in out, out
            assert (hf / "model.safetensors").is_file() and not (hf / "tokenizer.json").exists()
            assert generate([str(trainer.ckpts.latest()), "--max-new-tokens", "1"]) == 1
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "which is not there: pass --tokenizer PATH" in err, err


def test_a_worker_refuses_a_folder_another_run_holds(tmp_path, world1):  # noqa: F811
    """Issue 32 item 2, the worker side (a job started by torchrun directly): rank 0 takes
    the lock before the folder is read; refused, the folder is left as it was."""
    from fsdp2d.train.trainer import Trainer

    run = tmp_path / "held"
    proc = _holder(run)
    try:
        with pytest.raises(ConfigError, match=f"{run} is in use by another run \\(pid {proc.pid} on "):
            Trainer(_local(tmp_path, "held"))
        assert sorted(p.name for p in run.iterdir()) == [".lock"]
    finally:
        proc.kill()
        proc.wait()
    _fresh_group()
    trainer = Trainer(_local(tmp_path, "held", "--training.steps=2"))  # the killed holder's lock is stale
    trainer.start()
    trainer.run()
    assert trainer.ckpts.steps() == [2] and not (run / ".lock").exists()  # released at the end


def test_resume_with_nothing_left_to_train_is_refused_before_anything_changes(tmp_path, world1):  # noqa: F811
    """Issue 32 item 12: `--resume --training.steps=4` over a step-6 checkpoint printed
    "steps 7-4 of 4", trained nothing, rewrote config.toml and exited 0. Refused now, in
    one line naming the step, the field and what to do; nothing on disk changes."""
    from fsdp2d.train.trainer import Trainer

    trainer = Trainer(_local(tmp_path, "done", "--training.steps=6", "--checkpoint.every=3"))
    trainer.start()
    trainer.run()
    run = tmp_path / "done"
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for extra, field in ((["--training.steps=4"], "training.steps=4"), (["--training.steps=6"], "training.steps=6"),
                         (["--training.steps=9", "--training.stop_at=5"], "training.stop_at=5")):
        _fresh_group()
        trainer = Trainer(_local(tmp_path, "done", "--checkpoint.resume=true", *extra))
        with pytest.raises(ConfigError) as err:
            trainer.maybe_resume()
        assert f"step_00000006 is at step 6 and {field}; set training.steps above 6" in str(err.value)
        assert "\n" not in str(err.value)
        trainer.close()
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_data_document_mask_masks_each_micro_batch(tmp_path, world1):  # noqa: F811
    """Issue 29: ``data.document_mask = true`` on a JSON-lines corpus of short documents: the
    trainer's loss is the model's with the document ids of the tokenizer's own BOS/EOS (which
    the data layer put around every document), and not the unmasked one. GPT-2 is refused
    by the config check (its learned positions cannot restart)."""
    import torch
    import torch.nn.functional as F

    from fsdp2d.models import document_ids
    from fsdp2d.train.config import validate
    from fsdp2d.train.trainer import Trainer

    tok = _bpe(tmp_path / "tok.json")
    corpus = tmp_path / "docs.jsonl"
    words = ["hello", "world", "there", "def", "return", "x"]
    corpus.write_text("".join(json.dumps({"text": " ".join(words[(i + k) % 6] for k in range(3 + i % 5))}) + "\n"
                              for i in range(400)))
    args = [f"--data.path={corpus}", "--data.format=auto", f"--data.tokenizer={tok}", "--data.document_mask=true"]
    trainer = Trainer(_local(tmp_path, "docs", *args))
    bos, eos = trainer.data.bos_id, trainer.data.eos_id
    assert (bos, eos) == (1, 2)  # <s>, </s> of the tokenizer
    x, y = next(trainer.data.train)
    assert (x == eos).any() and (x == bos).any()  # several documents per row
    with torch.no_grad():
        masked = trainer._loss(x, y)
        want = F.cross_entropy(trainer.model(x, document_ids=document_ids(x, eos_id=eos, bos_id=bos)).flatten(0, 1),
                               y.flatten())
        plain = F.cross_entropy(trainer.model(x).flatten(0, 1), y.flatten())
    assert masked == want and masked != plain
    trainer.close()
    with pytest.raises(ConfigError, match="data.document_mask=true: gpt2's learned positions"):
        validate(_local(tmp_path, "gpt", *args, "--model.name=gpt2"))


@pytest.mark.parametrize("corpus", ["empty.txt", "empty tokens.bin", "36-byte corpus"])
def test_a_refused_corpus_ends_the_worker_in_one_line(tmp_path, world1, monkeypatch, capsys, corpus):  # noqa: F811
    """Issue 32 item 14, the worker side in-process (tests/test_launch_errors.py runs the
    launcher end to end): the worker's run ends in one line on stderr and exit code 2,
    nothing written but the token cache of what it tokenized (reused by the next start). The
    36-byte corpus (one sequence) trained 4 steps on that sequence repeated in every sample
    after issue 29: a train split smaller than one global micro-batch is refused again."""
    from fsdp2d.train import cli, failure

    monkeypatch.delenv(failure.LAUNCHER_ENV, raising=False)
    path, extra = {"empty.txt": ("a.txt", ["--data.format=text"]),
                   "empty tokens.bin": ("tokens.bin", ["--data.format=uint16"]),
                   "36-byte corpus": ("b.txt", ["--data.format=text"])}[corpus]
    (tmp_path / path).write_bytes(b"hello world, 36 bytes of text here.\n" if corpus.startswith("36") else b"")
    cfg = _local(tmp_path, "job", f"--data.path={tmp_path / path}", *extra)
    assert cli._worker(cfg) == 2
    out = capsys.readouterr()
    err = "".join(line for line in out.err.splitlines(keepends=True) if not line.startswith("pretokenize ["))
    assert err.count("\n") == 1 and err.startswith("config error: ") and "Traceback" not in out.out, out
    if corpus.startswith("36"):
        assert "source 'b' (" in err and "36 train tokens: 1 sequence(s) of seq_len + 1 = 33 tokens, fewer than one " \
            "global micro-batch of 2 (1 data-parallel rank(s) x micro_batch 2)" in err, err
    left = {p.relative_to(tmp_path / "job").parts[0] for p in (tmp_path / "job").rglob("*")} \
        if (tmp_path / "job").exists() else set()
    assert left <= {"tokens"}, left


def test_a_restart_at_the_last_step_finishes_the_run(tmp_path, monkeypatch):
    """`torchrun --max-restarts`: a rank killed after the final checkpoint restarts every
    rank at the last step; that is the run completing (no refusal, which made the whole
    job fail), while a step past the end is still refused, restarted or not."""
    from fsdp2d.train import preflight

    cfg = _local(tmp_path, "r", "--training.steps=8")
    with pytest.raises(ConfigError, match="nothing to train: ckpt is at step 8 and training.steps=8"):
        preflight.check_steps_left(cfg, 8, "ckpt")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    preflight.check_steps_left(cfg, 8, "ckpt")  # the run is complete: finish it
    with pytest.raises(ConfigError, match="nothing to train: ckpt is at step 9"):
        preflight.check_steps_left(cfg, 9, "ckpt")
