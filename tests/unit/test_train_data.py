"""Pretraining data: sources, token files, packing, data-parallel sharding, resumption."""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fsdp2d.data import Blend, SourceOrder
from fsdp2d.train.config import load_config
from fsdp2d.train.data import (
    TokenBatches, TokenStream, build_data, list_files, load_tokenizer, load_tokens,
    resolve_data_path, save_tokens, split_tokens,
)

T = 8  # seq_len in the synthetic tests


def _ramp(n: int) -> TokenStream:
    """Token i = i, so a sequence's id is ``inputs[0] // T``."""
    return TokenStream([np.arange(n, dtype=np.uint32)])


def _ids(x: torch.Tensor) -> list[int]:
    return (x[:, 0] // T).tolist()


def test_packing_shifts_targets_by_one():
    loader = TokenBatches(_ramp(10 * T + 1), T, micro_batch=2)
    x, y = next(loader)
    assert x.shape == y.shape == (2, T) and x.dtype == torch.int64
    assert torch.equal(y, x + 1)  # the ramp: each target is the next token
    assert all(int(r[0]) % T == 0 and torch.equal(r, torch.arange(int(r[0]), int(r[0]) + T)) for r in x)
    assert loader.orders[0].sequences == 10


def test_dp_ranks_get_disjoint_slices_covering_the_batch():
    stream, dp, mb = _ramp(100 * T + 1), 4, 3
    ranks = [TokenBatches(stream, T, mb, r, dp, seed=5) for r in range(dp)]
    perm = np.random.default_rng([5, 0, 0]).permutation(100)
    seen: list[int] = []
    for step in range(100 // (dp * mb)):
        block = [i for it in ranks for i in _ids(next(it)[0])]
        assert block == perm[step * dp * mb:(step + 1) * dp * mb].tolist()  # disjoint, covering, in order
        seen += block
    assert len(set(seen)) == len(seen) == 96  # no sequence twice in an epoch
    tail = [i for it in ranks for i in _ids(next(it)[0])]  # the next micro-step crosses into epoch 2
    assert tail[:4] == perm[96:].tolist() and set(tail[4:]) <= set(range(100))
    assert all(it.samples == 108 for it in ranks)


def test_same_rank_twice_gives_identical_batches_and_epochs_reshuffle():
    a, b = (TokenBatches(_ramp(40 * T + 1), T, 2, 1, 2, seed=3) for _ in range(2))
    for (xa, ya), (xb, yb) in itertools.islice(zip(a, b), 25):  # crosses two epochs
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    order = a.orders[0]
    assert [order.locate(j)[1] for j in range(40)] != [order.locate(j)[1] for j in range(40, 80)]
    other = TokenBatches(_ramp(40 * T + 1), T, 2, 1, 2, seed=4)
    assert a.sample_ids(0, 8).tolist() != other.sample_ids(0, 8).tolist()


@pytest.mark.parametrize("taken", [0, 3, 9, 10, 23])  # 10 micro-steps per epoch
def test_state_round_trip_resumes_exactly(taken):
    make = lambda: TokenBatches(_ramp(40 * T + 1), T, 2, 0, 2, seed=7)  # noqa: E731
    run = make()
    for _ in range(taken):
        next(run)
    state = json.loads(json.dumps(run.state_dict()))  # plain ints
    assert state["samples"] == 4 * taken
    resumed = make()
    resumed.samples = state["samples"]
    for (xa, _), (xb, _) in itertools.islice(zip(run, resumed), 12):
        assert torch.equal(xa, xb)


def test_resume_with_another_micro_batch_layout_continues_at_the_next_sample():
    """A batch is a function of the samples consumed: 3 steps of G = 8 then G = 5 (which
    does not divide 24; refused before issue 29) read samples 24, 25, ... in order."""
    stream = _ramp(48 * T + 1)
    run = TokenBatches(stream, T, micro_batch=4, dp_rank=0, dp_size=2, seed=1)
    for _ in range(3):
        next(run)
    want = [int(i) for i in run.sample_ids(24, 10)[:, 2]]
    five = TokenBatches(stream, T, 5, 0, 1, seed=1)
    five.samples = run.state_dict()["samples"]
    assert _ids(next(five)[0]) + _ids(next(five)[0]) == want


def test_token_stream_reads_across_parts_and_views():
    s = TokenStream([np.arange(0, 5), np.arange(5, 7), np.empty(0, np.int64), np.arange(7, 12)])
    assert len(s) == 12 and s.read(3, 9).tolist() == list(range(3, 9))
    v = s.view(4, 11)
    assert len(v) == 7 and v.read(0, 7).tolist() == list(range(4, 11))
    assert v.view(2, 5).read(0, 3).tolist() == [6, 7, 8]
    with pytest.raises(IndexError):
        v.read(0, 8)


def test_one_document_split_holds_out_its_end():
    train, held_out = split_tokens(_ramp(1000), 0.1)
    assert (len(train), len(held_out)) == (900, 100)
    assert held_out.read(0, 3).tolist() == [900, 901, 902]
    assert len(split_tokens(_ramp(1000), 0.0)[1]) == 0


@pytest.mark.parametrize("fmt, top", [("uint16", 65535), ("uint32", 2**32 - 1)])
def test_binary_token_files_round_trip(tmp_path, fmt, top):
    tokens = np.array([0, 1, 2, 300, top], dtype=np.int64)
    path = save_tokens(tmp_path / "a.bin", tokens, fmt)
    assert path.stat().st_size == len(tokens) * (2 if fmt == "uint16" else 4)
    cfg = load_config(None, [f"--data.path={path}", f"--data.format={fmt}"]).data
    stream = load_tokens(cfg)
    assert isinstance(stream.parts[0], np.memmap) and stream.read(0, 5).tolist() == tokens.tolist()
    # a folder: *.bin files in sorted order, read across file boundaries
    save_tokens(tmp_path / "b.bin", tokens + 1 - (tokens == top), fmt)
    cfg.path = str(tmp_path)
    assert load_tokens(cfg).read(3, 7).tolist() == [300, top, 1, 2]
    with pytest.raises(ValueError, match=f"do not fit {fmt}"):
        save_tokens(tmp_path / "c.bin", [top + 1], fmt)


def test_odd_sized_token_file_is_an_error(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\x00\x01\x02")
    cfg = load_config(None, [f"--data.path={tmp_path}", "--data.format=uint16"]).data
    with pytest.raises(ValueError, match="not a whole number of uint16 tokens"):
        load_tokens(cfg)


def test_bytes_tokenizer_over_a_sorted_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("bb")
    (tmp_path / "sub" / "c.md").write_text("é")
    (tmp_path / "a.py").write_text("a\n")
    (tmp_path / "skip.bin").write_bytes(b"zz")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "h.txt").write_text("hidden")
    files = list_files(tmp_path, (".txt", ".md", ".py"))
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["a.py", "b.txt", "sub/c.md"]
    cfg = load_config(None, [f"--data.path={tmp_path}"]).data
    assert load_tokens(cfg).read(0, 6).tolist() == list(b"a\nbb") + list("é".encode())
    with pytest.raises(FileNotFoundError, match=r"no \*.txt"):
        list_files(tmp_path / "sub", (".txt",))


def test_missing_path_and_missing_tokenizers_package(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="'stdlib' for Python's own sources"):
        resolve_data_path(tmp_path / "nope")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails as if not installed
    with pytest.raises(ImportError, match="pip install tokenizers"):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "t.txt").write_text("hello world hello")
    cfg = load_config(None, [f"--data.path={tmp_path / 't.txt'}",
                             f"--data.tokenizer={tmp_path / 'tokenizer.json'}"]).data
    assert load_tokens(cfg).read(0, 3).tolist() == [1, 2, 1]  # no special tokens: none to add


def test_stdlib_source_resolves_and_yields_batches(tmp_path):
    root = resolve_data_path("stdlib")
    assert root == Path(os.path.dirname(os.__file__)) and (root / "os.py").is_file()
    cfg = load_config(None, ["--parallel.dp=2", "--parallel.tp=2", "--data.seq_len=64",
                             f"--metrics.runs_dir={tmp_path}"])
    data = build_data(cfg, dp_rank=1)
    assert len(data.sources[0].train) > 1_000_000 and data.train.dp_size == 2
    assert isinstance(data.sources[0].store.parts[0], np.memmap)  # the cache, memory-mapped
    x, y = next(data.train)
    assert x.shape == (8, 64) and torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 256
    first = [next(data.eval_batches())[0] for _ in range(2)]
    assert torch.equal(first[0], first[1])  # evaluation always reads the same batches
    assert data.bos_id is None and data.eos_id is None  # the byte tokenizer has no special tokens


def test_too_little_data_and_out_of_vocab_ids():
    with pytest.raises(ValueError, match="no sequence"):
        TokenBatches(_ramp(T), T, micro_batch=2, dp_rank=0, dp_size=2)
    with pytest.raises(ValueError, match="dp_rank=2 must be in"):
        TokenBatches(_ramp(100), T, 1, dp_rank=2, dp_size=2)
    loader = TokenBatches(_ramp(4 * T + 1), T, 1, vocab_size=T)
    with pytest.raises(ValueError, match="raise model.vocab_size"):
        next(loader)
