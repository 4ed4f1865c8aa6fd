"""The run's tokenizer is what the data layer made the tokens with, and checkpoints, the HF
export and ``generate`` use that or refuse in one line: never a guessed ``bytes``.

Found in review of issue 29: the default config (``data.format = "auto"``) recorded no
tokenizer, so ``make train``'s HF export had none; a token store's BPE was described and
decoded as ``bytes``; a tokenizer folder was recorded as the folder and the end-of-run
export failed on it; a recorded tokenizer file that was gone fell back to ``bytes``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fsdp2d import checkpoint
from fsdp2d.data import prepare_data, pretokenize
from fsdp2d.data.tokenizer import TokenizerRecord, file_sha256
from fsdp2d.hf.export import export_hf
from fsdp2d.hf.weights import model_spec
from fsdp2d.models import Llama, LlamaArgs
from fsdp2d.train.config import load_config
from fsdp2d.train.generate import find_tokenizer

from .data_corpus import bpe, texts, write

pytest.importorskip("tokenizers")
ROOT = Path(__file__).resolve().parents[2]


def _prepared(tmp_path: Path, *extra: str):
    cfg = load_config(None, [f"--metrics.runs_dir={tmp_path / 'runs'}", "--data.workers=0", "--model.vocab_size=300",
                             *extra])
    return prepare_data(cfg, progress=False)


def _ckpt(folder: Path, record: TokenizerRecord, vocab: int = 300) -> Path:
    torch.manual_seed(0)
    model = Llama(LlamaArgs(dim=16, n_layers=1, n_heads=2, vocab_size=vocab, multiple_of=8, max_seq_len=16))
    ckpt = folder / "checkpoints" / "step_00000001"
    checkpoint.save(ckpt, model, extra={"model": model_spec(model), **record.extra()})
    return ckpt


def test_the_default_config_records_the_byte_tokenizer(tmp_path):
    """configs/debug_cpu.toml reads by content (format auto) with the byte tokenizer: the
    run's tokenizer is ``bytes`` (it was None, so make train's HF export had no tokenizer)."""
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("hello world " * 20)
    cfg = load_config(ROOT / "configs" / "debug_cpu.toml", [f"--data.path={tmp_path / 't'}",
                                                              f"--metrics.runs_dir={tmp_path / 'runs'}"])
    assert cfg.data.format == "auto"
    assert prepare_data(cfg, progress=False).tokenizer == TokenizerRecord("bytes")


def test_a_token_store_names_its_own_tokenizer(tmp_path):
    """A store made with a BPE, read with data.tokenizer unset (the llama3 presets): the run's
    tokenizer is the store's (path and sha256), not ``bytes``; a tokenizer folder is recorded
    as its tokenizer.json; a store whose tokenizer file is gone is recorded by name and
    sha256 as not found."""
    tok = bpe(tmp_path / "tok")
    write(tmp_path / "web.jsonl", texts(30), "jsonl")
    pretokenize(tmp_path / "web.jsonl", tmp_path / "store", tmp_path / "tok", workers=0, progress=False)
    p = _prepared(tmp_path, f"--data.path={tmp_path / 'store'}")
    assert p.tokenizer == TokenizerRecord(str(tok.resolve()), file_sha256(tok), True)
    assert str(p.tokenizer) == str(tok.resolve())
    raw = _prepared(tmp_path, f"--data.path={tmp_path / 'web.jsonl'}", f"--data.tokenizer={tmp_path / 'tok'}")
    assert raw.tokenizer.name == str(tok.resolve()) and raw.tokenizer.found  # the folder's tokenizer.json
    shutil.move(tmp_path / "tok", tmp_path / "elsewhere")
    gone = _prepared(tmp_path, f"--data.path={tmp_path / 'store'}").tokenizer
    assert gone == TokenizerRecord(str(tok.resolve()), file_sha256(tmp_path / "elsewhere" / "tokenizer.json"), False)
    assert "not found; set data.tokenizer to it, or the HF export has no tokenizer and generate needs --tokenizer" \
        in str(gone)


def test_generate_and_export_refuse_a_recorded_tokenizer_that_is_gone_or_changed(tmp_path, capsys):
    """find_tokenizer returned 'bytes' for a recorded file that was gone (no config.toml
    beside the checkpoint): refused now in one line naming the file and --tokenizer; so is
    a file changed since (its sha256), and tokens that named no tokenizer. The export
    refuses too, and exports without one only when asked (--no-tokenizer)."""
    from fsdp2d.checkpoint.__main__ import main as export_main

    tok = bpe(tmp_path / "tok")
    record = TokenizerRecord(str(tok), file_sha256(tok), True)
    ckpt = _ckpt(tmp_path / "run", record)
    assert find_tokenizer(ckpt, checkpoint.read_index(ckpt)) == str(tok)
    shutil.move(tok, tmp_path / "moved.json")
    for gone in ({"extra": {"tokenizer": "/gone/tokenizer.json"}}, checkpoint.read_index(ckpt)):
        with pytest.raises(ValueError) as err:
            find_tokenizer(ckpt, gone)
        assert "which is not there: pass --tokenizer PATH" in str(err.value) and "\n" not in str(err.value)
    tok.write_text((tmp_path / "moved.json").read_text().replace("</s>", "</S>"))
    with pytest.raises(ValueError, match="which has changed since: pass --tokenizer PATH"):
        find_tokenizer(ckpt, checkpoint.read_index(ckpt))
    assert export_main(["export", "--format", "hf", str(ckpt), str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has changed since: pass --tokenizer PATH" in err, err
    assert export_main(["export", "--format", "hf", "--no-tokenizer", str(ckpt), str(tmp_path / "hf")]) == 0
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    unknown = _ckpt(tmp_path / "flat", TokenizerRecord(None, None, False))
    with pytest.raises(ValueError, match="trained on token files that name no tokenizer: pass --tokenizer PATH"):
        find_tokenizer(unknown, checkpoint.read_index(unknown))
    assert "tokenizer.json" not in {p.name for p in export_hf(unknown, tmp_path / "hf2")}  # none to write


def test_a_tokenizer_folder_works_in_generate_and_the_export(tmp_path, capsys):
    """data.tokenizer may be a folder: it is recorded as its tokenizer.json (the run ended
    with `HFError: ... Is a directory` and no export), and `generate --tokenizer FOLDER` and
    `export --tokenizer FOLDER` read its tokenizer.json."""
    from fsdp2d.train.generate import main as generate

    tok = bpe(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    ckpt = _ckpt(tmp_path / "run", TokenizerRecord("bytes"))
    names = {p.name for p in export_hf(ckpt, tmp_path / "hf", tokenizer=str(tmp_path / "tok"))}
    assert "tokenizer.json" in names and (tmp_path / "hf" / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 1
    assert generate([str(ckpt), "--tokenizer", str(tmp_path / "tok"), "--prompt", "the fox", "--max-new-tokens", "2",
                     "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("the fox")
