"""Reading a checkpoint folder: nothing outside it, nothing unverified, nothing unbounded.

The folder is opened once as a directory descriptor and every file is opened relative
to it with ``O_NOFOLLOW`` and checked to be a regular file: names come from a
validated index (plain names, see ``_index``), so neither ``..``, an absolute path nor
a symbolic link can lead a read outside, and an outside file's size is never seen.
Reads of one rank all come from the same folder even if ``PATH`` is replaced meanwhile.

Safetensors files are parsed here (an 8-byte header length, a JSON header, raw bytes),
not with ``safe_open``: each box's dtype, shape and byte range are checked against the
header, and the header against the file's size, before anything is allocated; a box is
read into a buffer of exactly its size and verified against its sha256. No pickle.

Each data file carries its manifest in its header's ``__metadata__["fsdp2d"]`` (a JSON
string): ``{"id": <the save's id>, "file": <its own name>, "boxes": {<tensor name>:
{"offset": [...], "sha256": "..."}}}``. The key of a box in the file is its tensor's
name. A box is read only if the manifest belongs to this checkpoint (the index's id),
names the file it was opened as (no renamed or swapped file), and places the box at the
offset the index's layout gives; then its bytes must match its sha256. So the per-box
checksums and offsets that an index of boxes would repeat for every rank live with the
data, and a reader opens only the files whose boxes it needs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import struct
from collections import OrderedDict
from pathlib import Path

import torch

from ..placement import Box
from ._index import DTYPES, INDEX, SHA256, TORCH_DTYPES, CheckpointError, stage_of, validate_index, writer_file

_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header
_MAX_OPEN = 64  # data files a Folder keeps open at once
MANIFEST = "fsdp2d"  # the __metadata__ key of a data file's manifest


def manifest(save_id: str, file: str, boxes: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, str]:
    """The ``__metadata__`` of data file ``file`` holding ``boxes``
    (``{tensor name: (global offset, sha256)}``)."""
    doc = {"id": save_id, "file": file,
           "boxes": {name: {"offset": list(offset), "sha256": sha} for name, (offset, sha) in boxes.items()}}
    return {"format": "pt", MANIFEST: json.dumps(doc, separators=(",", ":"))}


def version_pattern(name: str) -> re.Pattern:
    """Names of the version folders ``save`` writes beside ``name`` (see ``_commit``)."""
    return re.compile(re.escape(f".{name}.v") + r"[0-9a-f]{8,64}")


def _open_dir(path: Path) -> int:
    """A descriptor of the checkpoint folder ``path``: a plain folder, or fsdp2d's
    symbolic link to a version folder beside it (anything else is refused)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        if not path.is_symlink():
            return os.open(path, flags)
        target = os.readlink(path)
        if not version_pattern(path.name).fullmatch(target):
            raise CheckpointError(f"{path} is a symbolic link to {target!r}, not to a version folder that "
                                  f"fsdp2d.checkpoint.save made beside it: pass the checkpoint folder itself")
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return os.open(target, flags, dir_fd=parent)
        finally:
            os.close(parent)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not an fsdp2d checkpoint: it does not exist "
                              f"(or was replaced while being opened: try again)") from None
    except (NotADirectoryError, OSError) as exc:
        raise CheckpointError(f"{path} is not an fsdp2d checkpoint folder: {exc.strerror}") from None


def _digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (any dtype, bf16 included)."""
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Every tensor a load allocates comes from here (the tests measure the peak)."""
    return torch.empty(shape, dtype=dtype)


class Folder:
    """An open checkpoint folder. ``index`` is validated; ``digest`` is the sha256 of
    the index file (ranks compare it to know they read the same checkpoint)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.fd = _open_dir(self.path)
        # name -> (fd, header, manifest), the most recently used last; at most _MAX_OPEN
        # (a reader of a checkpoint of 8192 ranks may need every file, one after another)
        self.files: OrderedDict[str, tuple[int, dict, dict]] = OrderedDict()
        try:
            raw = self._read_whole(INDEX)
            try:
                doc = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CheckpointError(f"{self.path / INDEX} is corrupted: {exc}") from None
            self.index, self.layouts = validate_index(doc, str(self.path / INDEX))
            mesh = self.index["mesh"]
            self.mesh = tuple(mesh["axes"]), tuple(mesh["shape"])
            self.digest = hashlib.sha256(raw).hexdigest()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for fd, *_ in self.files.values():
            os.close(fd)
        self.files.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Folder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open(self, name: str) -> tuple[int, int]:
        """(descriptor, size) of the regular file ``name`` directly in the folder."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path / name} is missing") from None
        except OSError as exc:  # ELOOP: a symbolic link, never followed
            raise CheckpointError(f"{self.path / name} cannot be opened as a regular file of the "
                                  f"checkpoint ({exc.strerror})") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise CheckpointError(f"{self.path / name} is not a regular file")
        return fd, st.st_size

    def _read_whole(self, name: str) -> bytes:
        fd, size = self._open(name)
        try:
            return _pread_exact(fd, size, 0, self.path / name)
        finally:
            os.close(fd)

    def _file(self, name: str) -> tuple[int, dict, dict]:
        """(descriptor, header, manifest) of data file ``name``; a file closed to stay
        under _MAX_OPEN descriptors is opened and checked again when needed again."""
        if name in self.files:
            self.files.move_to_end(name)
        else:
            if len(self.files) >= _MAX_OPEN:
                os.close(self.files.popitem(last=False)[1][0])
            fd, size = self._open(name)
            try:
                header, meta = _parse_header(fd, size, self.path / name)
                self.files[name] = fd, header, self._manifest(name, meta)
            except BaseException:
                os.close(fd)
                raise
        return self.files[name]

    def _manifest(self, name: str, meta: dict) -> dict:
        where = self.path / name
        try:
            doc = json.loads(meta[MANIFEST])
        except (KeyError, TypeError, json.JSONDecodeError):
            raise CheckpointError(f"{where} has no fsdp2d manifest (__metadata__[{MANIFEST!r}]): it was not "
                                  f"written by fsdp2d.checkpoint.save") from None
        if not (isinstance(doc, dict) and isinstance(doc.get("boxes"), dict)):
            raise CheckpointError(f"{where}: its manifest is not {{\"id\", \"file\", \"boxes\"}}")
        if doc.get("id") != self.index["id"]:
            raise CheckpointError(f"{where} belongs to another checkpoint (save id {doc.get('id')!r}, the index's "
                                  f"is {self.index['id']!r}): a file was replaced")
        if doc.get("file") != name:
            raise CheckpointError(f"{where} says it is {doc.get('file')!r}: a file was renamed or swapped")
        return doc["boxes"]

    def source(self, name: str, coordinate: tuple[int, ...]) -> tuple[str, str]:
        """(file, key) of tensor ``name``'s box at ``coordinate`` of its layout: the
        writer's rank file and the tensor's name, unless the index names them (exports)."""
        meta = self.index["tensors"][name]
        axes, at = stage_of(meta)  # a pipeline stage's tensor: in the files of its stage's ranks
        file = meta.get("file") or writer_file(self.mesh, self.layouts[name].axis_names + axes, coordinate + at)
        return file, meta.get("key", name)

    def check(self, source: tuple[str, str], name: str, box: Box) -> tuple[int, int, str]:
        """(descriptor, offset, sha256) of tensor ``name``'s ``box`` at ``source``, once
        the file's header and manifest agree with the index on dtype, shape and offset
        (nothing allocated)."""
        file, key = source
        fd, header, boxes = self._file(file)
        where = f"{self.path / file}: {key!r}"
        dtype_name = self.index["tensors"][name]["dtype"]
        if key not in header:
            raise CheckpointError(f"{where} is not in the file")
        code, shape, start = header[key]
        if code != DTYPES[dtype_name]:
            raise CheckpointError(f"{where} holds {code} data, the index says {dtype_name}")
        if tuple(shape) != box.local_shape:
            raise CheckpointError(f"{where} has shape {tuple(shape)}, the index says {box.local_shape}")
        entry = boxes.get(key)
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where} is not in the file's manifest")
        if entry.get("offset") != list(box.global_offset):
            raise CheckpointError(f"{where} is the box at offset {entry.get('offset')!r} in the file's manifest, "
                                  f"the index's layout puts it at {list(box.global_offset)}")
        sha = entry.get("sha256")
        if not (isinstance(sha, str) and SHA256.fullmatch(sha)):
            raise CheckpointError(f"{where}: its sha256 is missing or not 64 lowercase hex digits in the file's "
                                  f"manifest (every box is verified)")
        return fd, start, sha

    def read(self, source: tuple[str, str], name: str, box: Box) -> torch.Tensor:
        """The whole saved ``box`` of tensor ``name`` (a shard, never more), checksum verified."""
        fd, start, sha = self.check(source, name, box)
        t = _empty(box.local_shape, TORCH_DTYPES[DTYPES[self.index["tensors"][name]["dtype"]]])
        view, done = memoryview(t.view(-1).view(torch.uint8).numpy()), 0
        while done < view.nbytes:  # (one call reads at most ~2 GiB)
            got = os.preadv(fd, [view[done:]], start + done)
            if got == 0:
                raise CheckpointError(f"{self.path / source[0]} is truncated in {source[1]!r}")
            done += got
        if _digest(t) != sha:
            raise CheckpointError(f"{self.path / source[0]} is corrupted: {source[1]!r} does not match its sha256")
        return t

    def data_files(self) -> list[tuple[str, int]]:
        """(name, size) of the folder's ``*.safetensors`` files (regular files only)."""
        out = []
        for name in sorted(os.listdir(self.fd)):
            if name.endswith(".safetensors"):
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    out.append((name, st.st_size))
        return out


def _pread_exact(fd: int, n: int, offset: int, where: Path) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise CheckpointError(f"{where} changed size while being read")
    return data


def _parse_header(fd: int, size: int, where: Path) -> tuple[dict[str, tuple[str, list[int], int]], dict]:
    """(key -> (dtype code, shape, absolute byte offset), ``__metadata__``) of a
    safetensors file, every entry checked: a known dtype, a byte range that matches the
    shape and lies in the file (so a truncated file is caught here, whichever of its
    boxes a rank needs), no two ranges overlapping."""
    bad = f"{where} cannot be read as safetensors"
    if size < 8:
        raise CheckpointError(f"{bad}: {size} bytes")
    (n,) = struct.unpack("<Q", _pread_exact(fd, 8, 0, where))
    if n > min(size - 8, _MAX_HEADER):
        raise CheckpointError(f"{where} is truncated or not safetensors: header length {n} does not fit its "
                              f"{size} bytes")
    try:
        header = json.loads(_pread_exact(fd, n, 8, where))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{bad}: header: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{bad}: the header is not an object")
    out, ranges = {}, []
    for key, e in header.items():
        if key == "__metadata__":
            continue
        ok = (isinstance(e, dict) and isinstance(e.get("dtype"), str) and e["dtype"] in TORCH_DTYPES
              and isinstance(e.get("shape"), list)
              and all(type(s) is int and s >= 0 for s in e["shape"]) and isinstance(e.get("data_offsets"), list)
              and len(e["data_offsets"]) == 2 and all(type(o) is int for o in e["data_offsets"]))
        if ok:
            begin, end = e["data_offsets"]
            nbytes = math.prod(e["shape"]) * TORCH_DTYPES[e["dtype"]].itemsize
            ok = 0 <= begin <= end and end - begin == nbytes
        if not ok:
            raise CheckpointError(f"{bad}: entry {key!r} is malformed")
        if 8 + n + end > size:
            raise CheckpointError(f"{where} is truncated: {key!r} ends at byte {8 + n + end}, the file has {size}")
        out[key] = (e["dtype"], e["shape"], 8 + n + begin)
        ranges.append((begin, end))
    ranges.sort()
    if any(b < prev_end for (_, prev_end), (b, _) in zip(ranges, ranges[1:])):
        raise CheckpointError(f"{bad}: two entries share bytes")
    meta = header.get("__metadata__")
    return out, meta if isinstance(meta, dict) else {}
