"""Files that are not what they should be, and folders that hold more than a corpus (review
of issue 29): each is read as what it is or refused in one line naming the file."""

from __future__ import annotations

import gzip
import io
import json

import pytest

from fsdp2d.data import DataError, SourceSpec, pretokenize, resolve_source
from fsdp2d.data.pretokenize import main as pretokenize_main
from fsdp2d.train import cli

from .data_corpus import jsonl_bytes, texts, write
from .test_train_cli import CONFIG, _one_line_error, launches  # noqa: F401  (launches is a fixture)

zstandard = pytest.importorskip("zstandard")
pytest.importorskip("pyarrow")
LINES = jsonl_bytes(texts(200))


def _zstd_flushed(data: bytes) -> bytes:
    """One zstd frame flushed block by block at line ends, as a streaming writer (a log
    shipper, a crawler) writes it: cut at a block boundary, zstandard's stream reader
    returned the lines before the cut without a word."""
    buf = io.BytesIO()
    w = zstandard.ZstdCompressor(level=1).stream_writer(buf, closefd=False)
    for i, line in enumerate(data.splitlines(keepends=True)):
        w.write(line)
        if i % 20 == 19:
            w.flush(zstandard.FLUSH_BLOCK)
    w.flush(zstandard.FLUSH_FRAME)
    return buf.getvalue()


def _block_cut(z: bytes) -> bytes:
    """The longest prefix of ``z`` that zstandard's reader decompresses without an error
    to whole lines, fewer than all of them."""
    for cut in range(len(z) - 1, 0, -1):
        try:
            out = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(z[:cut]), read_across_frames=True).read()
        except zstandard.ZstdError:
            continue
        if out.endswith(b"\n") and len(out) < len(LINES):
            return z[:cut]
    raise AssertionError("no silent cut found")


def _damaged(tmp_path):
    """name -> a source folder holding one truncated or damaged file."""
    full = gzip.compress(LINES)
    z = _zstd_flushed(LINES)
    import pyarrow.parquet as pq_

    write(tmp_path / "pq" / "c.parquet", texts(60), "parquet")
    pq = (tmp_path / "pq" / "c.parquet").read_bytes()
    column = pq_.ParquetFile(tmp_path / "pq" / "c.parquet").metadata.row_group(3).column(1)  # 'text' of row group 3
    page = column.dictionary_page_offset or column.data_page_offset  # its first page header: damaged below
    write(tmp_path / "ds" / "d", texts(60), "arrow")
    stream = tmp_path / "ds" / "d" / "data-00001-of-00002.arrow"
    cases = {"gz": ("web.jsonl.gz", full[:len(full) * 2 // 3]), "zst": ("web.jsonl.zst", _block_cut(z)),
             "parquet": ("c.parquet", pq[:len(pq) * 2 // 3]),
             "row group": ("c.parquet", pq[:page] + b"\xff" * 16 + pq[page + 16:])}
    out = {}
    for name, (file, data) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / file).write_bytes(data)
        out[name] = tmp_path / name / file
    stream.write_bytes(stream.read_bytes()[:-400])
    out["arrow stream"] = stream
    return out


def test_truncated_or_damaged_files_are_refused_naming_them(tmp_path, capsys, launches):  # noqa: F811
    """A .jsonl.gz cut short: a 37-line EOFError traceback from the launcher, and from
    pretokenize, naming no file. A .jsonl.zst cut at a block boundary: read silently (1000 of
    2000 documents, exit 0). A truncated parquet: a 33-line ArrowInvalid traceback from the
    launcher. Now each is one line naming the file, from pretokenize and from the launcher."""
    for name, path in _damaged(tmp_path).items():
        src = path.parent
        with pytest.raises(DataError, match=f"^{path}: cannot be read as ") as err:
            pretokenize(src, tmp_path / "out", workers=0, progress=False)
        assert "\n" not in str(err.value), name
        assert pretokenize_main([str(src), str(tmp_path / "out"), "--workers", "0"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path}: cannot be read as ") and err.count("\n") == 1, (name, err)
        code = cli.train(["--config", CONFIG, f"--data.path={src}", f"--metrics.runs_dir={tmp_path / 'runs'}"])
        _one_line_error(capsys, code, f"config error: {path}: cannot be read as ")
    assert not launches


def test_a_zstd_file_of_several_frames_reads_whole(tmp_path):
    """The frame-by-frame decompression reads concatenated frames (zstd -c a b > ab) whole."""
    from fsdp2d.data import open_store

    half = len(LINES) // 2
    cut = LINES.rindex(b"\n", 0, half) + 1
    z = zstandard.ZstdCompressor().compress(LINES[:cut]) + _zstd_flushed(LINES[cut:])
    (tmp_path / "two.jsonl.zst").write_bytes(z)
    (tmp_path / "one.jsonl").write_bytes(LINES)
    for name in ("two.jsonl.zst", "one.jsonl"):
        pretokenize(tmp_path / name, tmp_path / name.split(".")[0], workers=0, progress=False)
    a, b = (open_store(tmp_path / n) for n in ("two", "one"))
    assert a.documents == b.documents == 200 and (a.parts[0] == b.parts[0]).all()


def test_json_lines_in_a_txt_file_and_json_files_in_a_folder(tmp_path):
    """data.format=jsonl refused a .txt file of JSON lines, telling to set data.format=jsonl;
    with format=jsonl every .json file of a folder (manifest.json, dataset_info.json) was read
    as JSON lines; with format=auto another tool's manifest.json made a raw folder 'not a token
    store'. A file given by name is read for what it holds; a folder gives its JSON-lines files."""
    notes = tmp_path / "notes.txt"
    notes.write_bytes(LINES)
    assert resolve_source(SourceSpec(str(notes), "jsonl")).files == [(notes, "jsonl")]
    assert resolve_source(SourceSpec(str(notes), "text")).files == [(notes, "text")]  # raw JSON text, as asked
    with pytest.raises(DataError, match="holds JSON lines, which data.format=auto would train on as raw JSON text"):
        resolve_source(SourceSpec(str(notes)))
    web = tmp_path / "web"
    write(web / "a.jsonl", texts(5), "jsonl")
    (web / "manifest.json").write_text(json.dumps({"name": "my crawl", "version": 3}))
    (web / "dataset_info.json").write_text("{}")
    for fmt in ("jsonl", "auto"):
        source = resolve_source(SourceSpec(str(web), fmt))
        assert source.kind == "raw" and source.files == [(web / "a.jsonl", "jsonl")], fmt
    with pytest.raises(DataError, match="is not a token store: it has no fsdp2d manifest.json"):
        resolve_source(SourceSpec(str(web), "tokens"))


def test_a_parent_of_datasets_folders_reads_their_rows_only(tmp_path):
    """format=auto over a folder of save_to_disk folders also read the cache-*.arrow files
    that datasets' map/filter leave beside the data (rows of another table); each datasets
    folder is now read as its state.json lists, and a DatasetDict under the folder (its test
    split beside its train split) is refused naming the splits."""
    import shutil

    ds = write(tmp_path / "corpus" / "ds", texts(20), "arrow")
    shutil.copy(ds / "data-00000-of-00002.arrow", ds / "cache-0123abcd.arrow")
    write(tmp_path / "corpus" / "more.jsonl", texts(3), "jsonl")
    names = [f.name for f, _ in resolve_source(SourceSpec(str(tmp_path / "corpus"))).files]
    assert names == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow", "more.jsonl"]
    (tmp_path / "corpus" / "dd").mkdir()
    shutil.copytree(ds, tmp_path / "corpus" / "dd" / "train")
    (tmp_path / "corpus" / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    with pytest.raises(DataError, match="dd is a DatasetDict \\(splits 'train', 'test'\\)"):
        resolve_source(SourceSpec(str(tmp_path / "corpus")))


def test_one_file_read_twice_is_refused(tmp_path):
    """A link inside the folder to another of its files, or one file (or a copy) in two
    sources: its documents were read twice, and a document held out for evaluation in one
    copy was trained on in the other. Refused in one line naming both."""
    from fsdp2d.data import prepare_data
    from fsdp2d.train.config import load_config

    web = tmp_path / "web"
    write(web / "a.jsonl", texts(30), "jsonl")
    (web / "b.jsonl").symlink_to(web / "a.jsonl")
    with pytest.raises(DataError, match="b.jsonl and .*a.jsonl are the same file \\(a link\\)"):
        resolve_source(SourceSpec(str(web)))
    (web / "b.jsonl").unlink()
    (tmp_path / "copy.jsonl").write_bytes((web / "a.jsonl").read_bytes())
    for other in (web / "a.jsonl", tmp_path / "copy.jsonl"):
        (tmp_path / "job.toml").write_text(f"""[data]
workers = 0
[[data.sources]]
path = "{web}"
[[data.sources]]
name = "other"
path = "{other}"
[metrics]
runs_dir = "{tmp_path / 'runs'}"
""")
        with pytest.raises(DataError, match="source 'other' file .* and source 'web' file a.jsonl hold the same bytes"):
            prepare_data(load_config(tmp_path / "job.toml"), progress=False)
