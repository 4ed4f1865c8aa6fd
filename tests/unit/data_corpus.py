"""Small corpora and a tiny BPE tokenizer, made in the test (no network), for the data tests."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

WORDS = "the quick brown fox jumps over a lazy dog naïve café ✓ data mixture token epoch".split()


def texts(n: int, seed: int = 0) -> list[str]:
    """``n`` documents of 5-60 words (some with newlines and non-ASCII)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(5, 60))).replace(" a ", "\na ") for _ in range(n)]


def bpe(folder: Path, vocab: int = 300, specials: tuple[str, ...] = ("<s>", "</s>")) -> Path:
    """A byte-level BPE trained on :func:`texts`, with ``specials`` as special tokens."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(specials),
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(200, seed=99), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def jsonl_bytes(docs: list[str], field: str = "text") -> bytes:
    return "".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(docs)).encode()


def write(path: Path, docs: list[str], kind: str) -> Path:
    """``docs`` as one file (or folder) of ``kind``: txt (a folder, a file per document),
    jsonl, jsonl.gz, jsonl.zst, parquet (row groups of 7 rows), arrow (a folder laid out
    as ``datasets.save_to_disk`` lays it out: two Arrow stream files plus state.json)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "txt":
        path.mkdir()
        for i, t in enumerate(docs):
            (path / f"doc{i:04d}.txt").write_text(t)
    elif kind == "jsonl":
        path.write_bytes(jsonl_bytes(docs))
    elif kind == "jsonl.gz":
        path.write_bytes(gzip.compress(jsonl_bytes(docs)))
    elif kind == "jsonl.zst":
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(jsonl_bytes(docs)))
    elif kind == "parquet":
        pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path, row_group_size=7)
    elif kind == "arrow":
        path.mkdir()
        half = len(docs) // 2
        names = []
        for i, part in enumerate((docs[:half], docs[half:])):
            names.append(f"data-{i:05d}-of-00002.arrow")
            table = pa.table({"text": part, "id": list(range(len(part)))})
            with pa.ipc.new_stream(str(path / names[-1]), table.schema) as w:
                for batch in table.to_batches(max_chunksize=5):
                    w.write_batch(batch)
        (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                     "_fingerprint": "x", "_split": None}))
        (path / "dataset_info.json").write_text("{}")
    else:
        raise ValueError(kind)
    return path
