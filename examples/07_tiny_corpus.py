"""A small real-text corpus in the formats pretraining reads, and a BPE tokenizer for it.

    python examples/07_tiny_corpus.py data

writes (no download: the text is Python's own documentation, installed with Python)::

    data/web/part-000.jsonl ...      module and class docstrings, one JSON line each ({"text": ...})
    data/web/part-003.jsonl.zst      (the last part zstd-compressed)
    data/books.parquet               the help topics of pydoc (`help("if")`...), one row each
    data/tokenizer.json              a byte-level BPE of 2048 tokens with <|endoftext|>

then ``fsdp2d train --config configs/jsonl_mixture_cpu.toml`` pretrains on the mixture
(docs/data.md). Replace the folder with your own .jsonl/.jsonl.gz/.jsonl.zst/parquet files
(a "text" field or column per document) to train on them instead.
"""

import ast
import json
import os
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pydoc_data.topics
import tokenizers
import zstandard


def docstrings() -> list[str]:
    """The standard library's module and class docstrings of 300 characters or more (parsed, not imported)."""
    docs = []
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue
        for node in [tree] + [n for n in tree.body if isinstance(n, ast.ClassDef)]:
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 300:
                docs.append(doc)
    return docs


def main(out: Path) -> None:
    web, books = docstrings(), [v.strip() for _, v in sorted(pydoc_data.topics.topics.items())]
    (out / "web").mkdir(parents=True, exist_ok=True)
    parts = [web[i::4] for i in range(4)]
    for i, part in enumerate(parts):
        lines = "".join(json.dumps({"text": t}) + "\n" for t in part).encode()
        if i == len(parts) - 1:
            (out / "web" / f"part-{i:03d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
        else:
            (out / "web" / f"part-{i:03d}.jsonl").write_bytes(lines)
    pq.write_table(pa.table({"title": sorted(pydoc_data.topics.topics), "text": books}), out / "books.parquet",
                   row_group_size=16)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=2048, special_tokens=["<|endoftext|>"], show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(web + books, trainer)
    tok.save(str(out / "tokenizer.json"))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{len(web)} web documents, {len(books)} books, {size / 1e6:.1f} MB in {out}; tokenizer {out / 'tokenizer.json'}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "data"))
