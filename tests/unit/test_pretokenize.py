"""The tokenizer.json data path with a BPE trained here, and pretokenizing a corpus once."""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from fsdp2d.data import open_store, prepare_data
from fsdp2d.data.pretokenize import main, pretokenize
from fsdp2d.data.store import TOKENS
from fsdp2d.train.config import load_config
from fsdp2d.train.data import load_tokens

tokenizers = pytest.importorskip("tokenizers")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Text from the repo (README and the data/checkpoint sources) and a byte-level BPE
    of 400 tokens trained on it, saved as tokenizer.json."""
    root = tmp_path_factory.mktemp("corpus")
    src = root / "text"
    src.mkdir()
    for f in [ROOT / "README.md", *sorted((ROOT / "fsdp2d" / "train").glob("*.py"))]:
        shutil.copy(f, src / f.name)
    (src / "zz_utf8.txt").write_text("naïve café ✓\n")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in sorted(src.iterdir())], trainer)
    tok.save(str(root / "tokenizer.json"))
    return src, root / "tokenizer.json"


def _text_cfg(src, tok):
    return load_config(None, [f"--data.path={src}", f"--data.tokenizer={tok}"]).data


def test_bpe_tokenizer_json_data_path(corpus):
    src, tok_path = corpus
    stream = load_tokens(_text_cfg(src, tok_path))
    tok = tokenizers.Tokenizer.from_file(str(tok_path))
    ids = stream.read(0, len(stream)).tolist()
    text = "".join(f.read_text() for f in sorted(src.iterdir()))
    assert tok.decode(ids) == text  # byte-level BPE: lossless
    assert len(ids) < 0.8 * len(text.encode()) and max(ids) < 400  # it merges, within its vocabulary


def test_pretokenize_matches_the_in_memory_stream_and_is_reused(corpus, tmp_path):
    src, tok = corpus
    out = tmp_path / "tok"
    manifest = pretokenize(src, out, str(tok), workers=2, progress=False)
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["vocab_size"] == 400
    assert manifest["documents"] == len(list(src.iterdir()))  # one document per text file
    text = load_tokens(_text_cfg(src, tok))
    cfg = load_config(None, [f"--data.path={out}"]).data  # format=auto: a token store
    binary = load_tokens(cfg)
    assert np.array_equal(binary.read(0, len(binary)), text.read(0, len(text)).astype(np.uint16))
    before = (out / TOKENS).stat().st_mtime_ns
    pretokenize(src, out, str(tok), workers=2, progress=False)
    assert (out / TOKENS).stat().st_mtime_ns == before  # unchanged sources: nothing redone
    (src / "zz_utf8.txt").write_text("changed\n")
    try:
        assert pretokenize(src, out, str(tok), workers=0, progress=False)["tokens"] != manifest["tokens"]
    finally:
        (src / "zz_utf8.txt").write_text("naïve café ✓\n")


def test_train_cache_and_cli(corpus, tmp_path, capsys):
    """``data.pretokenize=DIR``: the launcher tokenizes each raw source once into DIR (a
    store per source) and every rank memory-maps it; the CLI prints what it wrote."""
    src, tok = corpus
    cfg = load_config(None, [f"--data.path={src}", f"--data.tokenizer={tok}", f"--data.pretokenize={tmp_path / 'p'}",
                             "--model.vocab_size=400", "--data.workers=0"])
    store = prepare_data(cfg, progress=False).stores[0]
    assert store.path.parent == tmp_path / "p" and isinstance(store.parts[0], np.memmap)
    assert np.array_equal(store.parts[0], load_tokens(cfg.data).read(0, store.tokens))
    assert main([str(src), str(tmp_path / "cli"), "--tokenizer", str(tok), "--workers", "2"]) == 0
    out = capsys.readouterr()
    assert "pretokenize [" in out.err and "ETA" in out.err and "(uint16, vocab 400, bos none, eos none)" in out.out
    assert open_store(tmp_path / "cli").tokens == store.tokens
    bytes_cfg = load_config(None, [f"--data.path={src}", f"--data.pretokenize={tmp_path / 'b'}"])
    bytes_store = prepare_data(bytes_cfg, progress=False).stores[0]
    assert os.path.getsize(bytes_store.path / TOKENS) == sum(f.stat().st_size for f in src.iterdir())  # uint8


def test_an_output_that_is_an_input_is_refused(tmp_path, capsys):
    """``fsdp2d pretokenize d/tokens.bin d`` used to truncate its own source to 0 bytes."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "tokens.bin").write_bytes(b"precious text")
    with pytest.raises(ValueError, match="is the input"):
        pretokenize(d / "tokens.bin", d, workers=0, progress=False)
    assert main([str(d / "tokens.bin"), str(d)]) == 1
    assert "is the input" in capsys.readouterr().err
    assert (d / "tokens.bin").read_bytes() == b"precious text"


def test_bad_arguments_are_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nope"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "nope" in err
    with pytest.raises(SystemExit):
        main([str(tmp_path), str(tmp_path / "out"), "--workers", "-1"])
    assert "--workers=-1" in capsys.readouterr().err
    (tmp_path / "not_a_tokenizer.json").write_text("{}")
    (tmp_path / "a.txt").write_text("text")
    assert main([str(tmp_path / "a.txt"), str(tmp_path / "o"), "--tokenizer", str(tmp_path / "not_a_tokenizer.json")]) == 1
    err = capsys.readouterr().err  # issue 32: a 15-line traceback before
    assert err.count("\n") == 1 and "is not a Hugging Face tokenizer.json" in err and not (tmp_path / "o").exists()
