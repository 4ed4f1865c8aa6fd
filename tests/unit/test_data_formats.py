"""Every format yields the same tokens as tokenizing the texts directly, with BOS/EOS at
every document boundary; a file that is not what its name or data.format says is
refused in one line (issue 29)."""

from __future__ import annotations

import gzip
import os

import numpy as np
import pytest
import torch

from fsdp2d.data import DataError, load_tokenizer, open_store, pretokenize
from fsdp2d.models import document_ids
from fsdp2d.train.config import load_config
from fsdp2d.train.data import load_tokens

from .data_corpus import bpe, jsonl_bytes, texts, write

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("pyarrow")
DOCS = texts(40)
FORMATS = ["txt", "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return bpe(tmp_path_factory.mktemp("tok"))


def _direct(tok_path, docs: list[str]) -> list[int]:
    """What every reader must give: each text tokenized alone, then <s> ... </s>."""
    t = tokenizers.Tokenizer.from_file(str(tok_path))
    bos, eos = t.token_to_id("<s>"), t.token_to_id("</s>")
    return [i for d in docs for i in [bos, *t.encode(d, add_special_tokens=False).ids, eos]]


def _cfg(path, tok_path, *extra):
    return load_config(None, [f"--data.path={path}", f"--data.tokenizer={tok_path}", *extra]).data


@pytest.mark.parametrize("kind", FORMATS)
def test_every_format_gives_the_texts_tokens_with_bos_and_eos(tmp_path, tok, kind):
    src = write(tmp_path / f"corpus.{kind}", DOCS, kind)
    stream = load_tokens(_cfg(src, tok))
    assert stream.read(0, len(stream)).tolist() == _direct(tok, DOCS)


def test_datasets_save_to_disk_folder(tmp_path, tok):
    datasets = pytest.importorskip("datasets")  # optional extra: pyarrow alone reads the folder
    datasets.Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))}).save_to_disk(str(tmp_path / "ds"))
    stream = load_tokens(_cfg(tmp_path / "ds", tok))
    assert stream.read(0, len(stream)).tolist() == _direct(tok, DOCS)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match="is a DatasetDict .*'train'"):
        load_tokens(_cfg(tmp_path / "dd", tok))


def test_pretokenized_store_in_workers_has_bos_and_eos_at_every_boundary(tmp_path, tok):
    """Parquet row groups and gzip JSON lines through a pool of 2 workers, one folder: the
    store's document index marks exactly the documents, each <s> ... </s>."""
    folder = tmp_path / "mixed"
    write(folder / "a.parquet", DOCS[:25], "parquet")
    write(folder / "b.jsonl.gz", DOCS[25:], "jsonl.gz")
    manifest = pretokenize(folder, tmp_path / "out", str(tok), workers=2, progress=False)
    store = open_store(tmp_path / "out")
    tokens, offsets = np.asarray(store.parts[0]), np.asarray(store.offsets[0])
    assert tokens.tolist() == _direct(tok, DOCS) and manifest["documents"] == len(DOCS) == len(offsets) - 1
    t = tokenizers.Tokenizer.from_file(str(tok))
    bos, eos = t.token_to_id("<s>"), t.token_to_id("</s>")
    assert (tokens[offsets[:-1]] == bos).all() and (tokens[offsets[1:] - 1] == eos).all()
    assert (tokens == bos).sum() == (tokens == eos).sum() == len(DOCS)  # nowhere else
    assert store.manifest["tokenizer"]["bos_id"] == bos and store.manifest["bos"] is True
    assert [row[4] for row in manifest["sources"][0]["files"]] == [25, 15]  # documents per file
    with pytest.raises(DataError, match="is a token store .*not flat uint16 files"):  # documents.bin is no token file
        load_tokens(_cfg(tmp_path / "out", tok, "--data.format=uint16"))


def test_gzip_or_parquet_given_as_text_is_refused(tmp_path, tok):
    """Before issue 29, pretokenize wrote 1.96M tokens of gzip bytes and training went on."""
    gz = tmp_path / "web.txt"
    gz.write_bytes(gzip.compress(jsonl_bytes(DOCS)))
    with pytest.raises(DataError, match=r"web.txt .*holds gzip-compressed JSON lines"):
        load_tokens(_cfg(gz, tok))
    pq = write(tmp_path / "p" / "t.parquet", DOCS, "parquet")
    with pytest.raises(DataError, match=r"t.parquet is given as text \(data.format=text\) but holds a parquet file"):
        load_tokens(_cfg(pq, tok, "--data.format=text"))
    lying = tmp_path / "j" / "web.jsonl"
    lying.parent.mkdir()
    lying.write_bytes(gzip.compress(jsonl_bytes(DOCS)))
    with pytest.raises(DataError, match=r"web.jsonl is named as JSON lines but holds gzip-compressed JSON lines: "
                                        r"rename it \(e.g. to web.jsonl.gz\)"):
        pretokenize(lying.parent, tmp_path / "out", str(tok), workers=0, progress=False)
    assert not (tmp_path / "out").exists()
    binary = tmp_path / "blob"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(DataError, match="blob holds binary data"):
        load_tokens(_cfg(binary, tok))
    as_text = tmp_path / "rows.txt"
    as_text.write_bytes(jsonl_bytes(DOCS))
    with pytest.raises(DataError, match="holds JSON lines, which data.format=auto would train on as raw JSON"):
        load_tokens(_cfg(as_text, tok))


def test_bad_records_are_refused_by_file_and_line(tmp_path, tok):
    f = tmp_path / "c.jsonl"
    f.write_bytes(jsonl_bytes(DOCS[:3]) + b'{"body": "x"}\n')
    with pytest.raises(DataError, match=r"c.jsonl:4: no 'text' field \(it has 'body'\): set data.text_field"):
        load_tokens(_cfg(f, tok))
    (tmp_path / "body.jsonl").write_bytes(jsonl_bytes(DOCS[:3], field="body"))
    body = load_tokens(_cfg(tmp_path / "body.jsonl", tok, "--data.text_field=body"))
    assert body.read(0, len(body)).tolist() == _direct(tok, DOCS[:3])
    f.write_bytes(jsonl_bytes(DOCS[:2]) + b'{"text": 5}\n')
    with pytest.raises(DataError, match=r"c.jsonl:3: 'text' is int, not a string"):
        load_tokens(_cfg(f, tok))
    f.write_bytes(b'{"text": "a"}\n{"text": "b"\n')
    with pytest.raises(DataError, match=r"c.jsonl:2: not a JSON line"):
        load_tokens(_cfg(f, tok))
    pq = write(tmp_path / "t.parquet", DOCS, "parquet")
    with pytest.raises(DataError, match=r"t.parquet has no 'body' column \(it has 'id', 'text'\)"):
        load_tokens(_cfg(pq, tok, "--data.text_field=body"))
    with pytest.raises(DataError, match=r"column 'id' holds int64, not strings"):
        load_tokens(_cfg(pq, tok, "--data.text_field=id"))
    (tmp_path / "bad.txt").write_bytes(b"ok " * 30000 + b"\xff\xfe")  # invalid after the sniffed start
    with pytest.raises(DataError, match=r"bad.txt is not UTF-8 text \(byte 90000"):
        load_tokens(_cfg(tmp_path / "bad.txt", tok))


def test_nothing_is_read_outside_the_data_folder(tmp_path, tok):
    outside = write(tmp_path / "secret.jsonl", DOCS[:2], "jsonl")
    folder = tmp_path / "data"
    write(folder / "a.jsonl", DOCS, "jsonl")
    os.symlink(outside, folder / "b.jsonl")
    with pytest.raises(DataError, match=r"b.jsonl is a link to .*secret.jsonl, outside the data folder"):
        load_tokens(_cfg(folder, tok))
    (folder / "b.jsonl").unlink()
    ds = write(tmp_path / "ds", DOCS, "arrow")
    (ds / "state.json").write_text('{"_data_files": [{"filename": "../secret.jsonl"}]}')
    with pytest.raises(DataError, match=r"names .*secret.jsonl, which is not a file inside"):
        load_tokens(_cfg(ds, tok))


def test_bos_eos_found_and_refused(tmp_path, tok):
    t = load_tokenizer(tok)  # <s> and </s> are special added tokens
    assert (t.bos_id, t.eos_id) == (0, 1)
    plain = bpe(tmp_path / "plain", specials=("<|endoftext|>",))
    p = load_tokenizer(plain)
    assert p.bos_id is None and p.eos_id == 0  # GPT-2 style: one end-of-text token
    (tmp_path / "plain" / "tokenizer_config.json").write_text('{"bos_token": {"content": "<|endoftext|>"}}')
    assert load_tokenizer(plain).bos_id == 0  # tokenizer_config.json wins, as transformers reads it
    none = bpe(tmp_path / "none", specials=())
    (tmp_path / "d.txt").write_text("hello")
    with pytest.raises(DataError, match=r"data.eos=true but .*has no EOS token"):
        load_tokens(_cfg(tmp_path / "d.txt", none, "--data.eos=true"))
    with pytest.raises(DataError, match="data.bos=true but the byte tokenizer has no special tokens"):
        load_tokens(load_config(None, [f"--data.path={tmp_path / 'd.txt'}", "--data.bos=true"]).data)
    stream = load_tokens(_cfg(tmp_path / "d.txt", tok, "--data.bos=false"))
    assert stream.read(0, len(stream)).tolist()[-1] == 1 and 0 not in stream.read(0, len(stream)).tolist()


def test_document_ids_from_bos_and_eos():
    x = torch.tensor([[7, 1, 5, 6, 1, 9], [0, 4, 1, 0, 5, 6]])  # eos 1, bos 0
    assert document_ids(x, eos_id=1).tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 1, 1, 1]]
    assert document_ids(x, bos_id=0, eos_id=1).tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 1, 1, 1]]  # EOS BOS: one
    assert document_ids(x, bos_id=0).tolist() == [[0] * 6, [0, 0, 0, 1, 1, 1]]
    with pytest.raises(ValueError, match="give eos_id, bos_id or both"):
        document_ids(x)


def test_old_pretokenize_output_is_refused_and_flat_files_still_load(tmp_path):
    """A folder from the old ``fsdp2d pretokenize`` (tokens.bin, no document index) names the
    way out; its tokens.bin still loads as one flat document with data.format=uint16."""
    from fsdp2d.data import save_tokens

    old = tmp_path / "old"
    save_tokens(old / "tokens.bin", np.arange(100), "uint16")
    (old / "manifest.json").write_text('{"format": "uint16", "tokens": 100, "vocab_size": 256}')
    with pytest.raises(DataError, match="made by an older fsdp2d pretokenize, without document boundaries: run "
                                        "`fsdp2d pretokenize` again \\(or read its tokens.bin as one flat document "
                                        "with data.format=uint16\\)"):
        load_tokens(load_config(None, [f"--data.path={old}"]).data)
    for path in (old, old / "tokens.bin"):
        flat = load_tokens(load_config(None, [f"--data.path={path}", "--data.format=uint16"]).data)
        assert flat.read(0, 100).tolist() == list(range(100))


def _gpt2_like(folder, config: bool = True):
    """GPT-2's shape: one special token, <|endoftext|>, which transformers' save_pretrained
    writes into tokenizer_config.json as both bos_token and eos_token."""
    path = bpe(folder, specials=("<|endoftext|>",))
    if config:
        (folder / "tokenizer_config.json").write_text('{"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}')
    return path


def test_one_token_as_bos_and_eos_separates_each_document_once(tmp_path):
    """Review of issue 29: with BOS = EOS (GPT-2) every document got it twice, [E a b E E c d E],
    and document_ids read [0, 1, 1, 2, 3, 4, 4, 5]: one-token documents between the pair. Now
    one separator after each document (as GPT-2 was trained), and document_ids with
    bos_id == eos_id reads it as an EOS: two documents. data.bos=true is satisfied by it."""
    tok = _gpt2_like(tmp_path / "gpt2")
    t = load_tokenizer(tok)
    assert t.bos_id == t.eos_id == 0
    (tmp_path / "c").mkdir()
    for i, text in enumerate(("hello world", "the fox")):
        (tmp_path / "c" / f"{i}.txt").write_text(text)
    pretokenize(tmp_path / "c", tmp_path / "out", tok, workers=0, progress=False)
    store = open_store(tmp_path / "out")
    tokens = np.asarray(store.parts[0]).astype(np.int64)
    body = [t.encode([x])[0] for x in ("hello world", "the fox")]
    assert tokens.tolist() == [*body[0], 0, *body[1], 0]
    assert document_ids(torch.from_numpy(tokens)[None], eos_id=0, bos_id=0).tolist() == \
        [[0] * (len(body[0]) + 1) + [1] * (len(body[1]) + 1)]
    for extra in ("--data.bos=true", "--data.eos=true"):
        stream = load_tokens(_cfg(tmp_path / "c", tok, extra))
        assert stream.read(0, len(stream)).tolist() == tokens.tolist()
    stream = load_tokens(_cfg(tmp_path / "c", tok, "--data.eos=false"))  # then before each document
    assert stream.read(0, len(stream)).tolist() == [0, *body[0], 0, *body[1]]


def test_special_token_text_inside_a_document_is_text(tmp_path, tok):
    """Review of issue 29: a document quoting "</s>" (web text often holds "<|endoftext|>")
    got a real EOS id mid-document, a false boundary. Only the data layer's BOS/EOS are special."""
    from fsdp2d.data.encode import encode_documents

    t = load_tokenizer(tok)
    tokens, lengths = encode_documents(["a doc that quotes </s> and <s> in its text"], t, t.bos_id, t.eos_id)
    assert tokens[0] == t.bos_id and tokens[-1] == t.eos_id and lengths.tolist() == [len(tokens)]
    assert t.bos_id not in tokens[1:-1].tolist() and t.eos_id not in tokens[1:-1].tolist()
    assert tokenizers.Tokenizer.from_file(str(tok)).decode(tokens[1:-1].tolist()) == \
        "a doc that quotes </s> and <s> in its text"


def test_a_template_that_adds_only_bos_still_finds_the_eos(tmp_path):
    """Review of issue 29: Llama's and Mistral's tokenizer.json (no tokenizer_config.json)
    has the template "<s> $A" and </s> among its special tokens; the EOS was None, so
    documents were never closed. Each id now comes from the first place that names it."""
    import json

    path = bpe(tmp_path / "llama")
    spec = json.loads(path.read_text())
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                                       {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}}
    path.write_text(json.dumps(spec))
    t = load_tokenizer(path)
    assert (t.bos_id, t.eos_id) == (0, 1)
