"""A data source: its path, format and text field, resolved into the files to read.

A source is one of:

* **raw**: text files (one document each), JSON lines (one per line), parquet or Arrow
  files, or a ``datasets`` ``save_to_disk`` folder (one document per row), tokenized
  into a token store (:mod:`fsdp2d.data.store`) before training;
* **tokens**: a token store already made by ``fsdp2d pretokenize`` (a folder with
  ``manifest.json``, ``tokens.bin`` and ``documents.bin``);
* **legacy**: flat ``uint16``/``uint32`` ``.bin`` files with no index
  (``data.format=uint16|uint32``), each file read as one document.

``format=auto`` decides by content: a store folder (fsdp2d's ``manifest.json`` and
``tokens.bin``), a ``save_to_disk`` folder, or the
files under a folder with record suffixes (:data:`~fsdp2d.data.detect.DATA_SUFFIXES`), or
else its text files. Every file's content is checked against its name and the format
asked for (:func:`~fsdp2d.data.detect.check_kind`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .arrow import hf_dataset_files, is_hf_dataset
from .detect import DATA_SUFFIXES, JSONL_SUFFIXES, TEXT_SUFFIXES, check_kind
from .errors import DataError
from .files import STDLIB, list_files, resolve_data_path

__all__ = ["SourceSpec", "ResolvedSource", "resolve_source", "FORMATS", "STORE_MANIFEST"]

FORMATS = ("auto", "text", "jsonl", "parquet", "arrow", "tokens", "uint16", "uint32")
STORE_MANIFEST = "manifest.json"
_FAMILY_SUFFIXES = {"text": TEXT_SUFFIXES, "jsonl": JSONL_SUFFIXES, "parquet": (".parquet",), "arrow": (".arrow",)}
"""What a folder contributes for a format (a file given by name is read whatever its suffix:
a folder's ``manifest.json`` or ``dataset_info.json`` is no corpus)."""


@dataclass(frozen=True)
class SourceSpec:
    """What the config says about one source."""

    path: str
    format: str = "auto"
    text_field: str = "text"
    weight: float = 1.0
    name: str = ""

    @property
    def label(self) -> str:
        """The source's name in metrics and messages: ``name``, else the path's stem."""
        return self.name or (STDLIB if self.path == STDLIB else Path(self.path).name.split(".")[0] or self.path)


@dataclass
class ResolvedSource:
    spec: SourceSpec
    root: Path
    kind: str
    """``raw``, ``tokens`` or ``legacy``."""
    files: list[tuple[Path, str]] = field(default_factory=list)
    """raw: (file, content kind) in reading order; legacy: (file, dtype name)."""

    @property
    def skip_invalid(self) -> bool:
        return self.spec.path == STDLIB


def _store_manifest(folder: Path) -> dict | None:
    path = folder / STORE_MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _is_store(root: Path, manifest: dict | None) -> bool:
    """A folder of fsdp2d's tokens (or an older pretokenize's): its manifest and tokens.bin.
    Another tool's manifest.json beside a corpus does not make one."""
    return manifest is not None and (root / "tokens.bin").is_file() and \
        (manifest.get("format") == "fsdp2d-tokens" or "tokens" in manifest)


def _tokens_source(spec: SourceSpec, root: Path, manifest: dict | None) -> ResolvedSource:
    if manifest is None or manifest.get("format") != "fsdp2d-tokens":
        old = manifest is not None and "tokens" in manifest and (root / "tokens.bin").is_file()
        why = ("it was made by an older fsdp2d pretokenize, without document boundaries: run `fsdp2d pretokenize` "
               "again (or read its tokens.bin as one flat document with data.format=" + str(manifest.get("format")) + ")"
               if old else "it has no fsdp2d manifest.json: make it with `fsdp2d pretokenize SRC OUT`")
        raise DataError(f"{root} is not a token store: {why}")
    return ResolvedSource(spec, root, "tokens")


def _datasets_in_walk(root: Path, files: list[Path]) -> list[Path]:
    """A folder walk's files, with each ``save_to_disk`` folder under ``root`` read as its
    state.json lists (``cache-*.arrow`` files that ``map``/``filter`` leave beside the data
    are no rows of it); a DatasetDict under ``root`` is refused naming its splits (reading
    them all would train on the test split)."""
    out, done, kind = [], set(), {}  # kind: folder -> "dict", "dataset" or "" (each looked at once)

    def kind_of(p: Path) -> str:
        if p not in kind:
            kind[p] = "dict" if (p / "dataset_dict.json").is_file() else "dataset" if (p / "state.json").is_file() else ""
        return kind[p]

    for f in files:
        folders = [p for p in f.parents if p == root or root in p.parents]  # f's folders, up to root
        for p in folders:
            if kind_of(p) == "dict":
                hf_dataset_files(p)  # raises, naming the splits
        dataset = next((p for p in folders if kind_of(p) == "dataset"), None)
        if dataset is None:
            out.append(f)
        elif dataset not in done:
            done.add(dataset)
            out.extend(hf_dataset_files(dataset))
    return out


def _raw_files(spec: SourceSpec, root: Path) -> list[tuple[Path, str]]:
    want = None if spec.format == "auto" else spec.format
    if spec.path == STDLIB and want is None:  # Python's sources: its text files, whatever else it ships
        want = "text"
    if root.is_dir() and is_hf_dataset(root) and want in (None, "arrow"):
        files = hf_dataset_files(root)
    elif want is not None:
        files = list_files(root, _FAMILY_SUFFIXES[want])
    elif root.is_file():
        files = [root]
    else:
        try:
            files = list_files(root, DATA_SUFFIXES)
        except FileNotFoundError:
            files = list_files(root, TEXT_SUFFIXES)
    if root.is_dir() and want in (None, "arrow"):
        files = _datasets_in_walk(root, files)
    out = []
    for f in files:
        try:
            kind = check_kind(f, want)
        except DataError:
            if spec.path == STDLIB:  # its test fixtures in other encodings: not part of the corpus
                continue
            raise
        if kind != "empty":
            out.append((f, kind))
    _refuse_links_to_one_file(out)
    return out


def _refuse_links_to_one_file(files: list[tuple[Path, str]]) -> None:
    """One file reached twice (a link inside the folder to another of its files) would be
    read twice: its documents counted double, one copy maybe held out while the other trains."""
    seen: dict[tuple[int, int], Path] = {}
    for f, _ in files:
        st = f.stat()
        if (other := seen.setdefault((st.st_dev, st.st_ino), f)) != f:
            raise DataError(f"{f} and {other} are the same file (a link): it would be read twice, and a document "
                            f"held out for evaluation in one copy trained on in the other; remove the link")


def resolve_source(spec: SourceSpec) -> ResolvedSource:
    """The files of ``spec`` with their kinds (FileNotFoundError, DataError)."""
    root = resolve_data_path(spec.path)
    if spec.format not in FORMATS:
        raise DataError(f"format {spec.format!r} of source {spec.label!r}: use one of {', '.join(FORMATS)}")
    if spec.format in ("uint16", "uint32"):
        if root.is_dir() and (_store_manifest(root) or {}).get("format") == "fsdp2d-tokens":  # documents.bin: offsets
            raise DataError(f"{root} is a token store (it has {STORE_MANIFEST}), not flat {spec.format} files: set "
                            f"data.format=auto or tokens")
        return ResolvedSource(spec, root, "legacy", [(f, spec.format) for f in list_files(root, (".bin",))])
    manifest = _store_manifest(root) if root.is_dir() else None
    if spec.format == "tokens" or (spec.format == "auto" and _is_store(root, manifest)):
        return _tokens_source(spec, root, manifest)
    files = _raw_files(spec, root)
    if not files:
        raise DataError(f"{root} holds no documents (only empty files)")
    return ResolvedSource(spec, root, "raw", files)
