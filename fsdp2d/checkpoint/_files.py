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
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import struct
from pathlib import Path

import torch

from ._index import DTYPES, INDEX, TORCH_DTYPES, CheckpointError, validate_index

_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


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
        self.files: dict[str, tuple[int, dict]] = {}  # name -> (fd, header)
        try:
            raw = self._read_whole(INDEX)
            try:
                doc = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CheckpointError(f"{self.path / INDEX} is corrupted: {exc}") from None
            self.index = validate_index(doc, str(self.path / INDEX))
            self.digest = hashlib.sha256(raw).hexdigest()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for fd, _ in self.files.values():
            os.close(fd)
        self.files = {}
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

    def _file(self, name: str) -> tuple[int, dict]:
        if name not in self.files:
            fd, size = self._open(name)
            try:
                expected = self.index["files"][name]["size"]
                if size != expected:
                    raise CheckpointError(f"{self.path / name} is truncated or has the wrong size: {size} bytes, "
                                          f"expected {expected}")
                self.files[name] = fd, _parse_header(fd, size, self.path / name)
            except BaseException:
                os.close(fd)
                raise
        return self.files[name]

    def check(self, box: dict, dtype_name: str) -> tuple[int, int]:
        """(descriptor, offset) of ``box``'s bytes once its file's header agrees with the
        index on dtype and shape (nothing allocated)."""
        fd, header = self._file(box["file"])
        where = f"{self.path / box['file']}: {box['key']!r}"
        if box["key"] not in header:
            raise CheckpointError(f"{where} is not in the file")
        code, shape, start = header[box["key"]]
        if code != DTYPES[dtype_name]:
            raise CheckpointError(f"{where} holds {code} data, the index says {dtype_name}")
        if shape != list(box["shape"]):
            raise CheckpointError(f"{where} has shape {tuple(shape)}, the index says {tuple(box['shape'])}")
        return fd, start

    def read(self, box: dict, dtype_name: str) -> torch.Tensor:
        """The whole saved ``box`` (a shard, never more), checksum verified."""
        fd, start = self.check(box, dtype_name)
        t = _empty(tuple(box["shape"]), TORCH_DTYPES[DTYPES[dtype_name]])
        view, done = memoryview(t.view(-1).view(torch.uint8).numpy()), 0
        while done < view.nbytes:  # (one call reads at most ~2 GiB)
            got = os.preadv(fd, [view[done:]], start + done)
            if got == 0:
                raise CheckpointError(f"{self.path / box['file']} is truncated in {box['key']!r}")
            done += got
        if _digest(t) != box["sha256"]:
            raise CheckpointError(f"{self.path / box['file']} is corrupted: {box['key']!r} does not match its "
                                  f"sha256 in {INDEX}")
        return t


def _pread_exact(fd: int, n: int, offset: int, where: Path) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise CheckpointError(f"{where} changed size while being read")
    return data


def _parse_header(fd: int, size: int, where: Path) -> dict[str, tuple[str, list[int], int]]:
    """key -> (dtype code, shape, absolute byte offset) of a safetensors file, every
    entry checked: a known dtype, a byte range that matches the shape and lies in the
    file, no two ranges overlapping."""
    bad = f"{where} cannot be read as safetensors"
    if size < 8:
        raise CheckpointError(f"{bad}: {size} bytes")
    (n,) = struct.unpack("<Q", _pread_exact(fd, 8, 0, where))
    if n > min(size - 8, _MAX_HEADER):
        raise CheckpointError(f"{bad}: header length {n} does not fit the file")
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
        ok = (isinstance(e, dict) and e.get("dtype") in TORCH_DTYPES and isinstance(e.get("shape"), list)
              and all(type(s) is int and s >= 0 for s in e["shape"]) and isinstance(e.get("data_offsets"), list)
              and len(e["data_offsets"]) == 2 and all(type(o) is int for o in e["data_offsets"]))
        if ok:
            begin, end = e["data_offsets"]
            nbytes = math.prod(e["shape"]) * TORCH_DTYPES[e["dtype"]].itemsize
            ok = 0 <= begin <= end and end - begin == nbytes and 8 + n + end <= size
        if not ok:
            raise CheckpointError(f"{bad}: entry {key!r} is malformed or points outside the file")
        out[key] = (e["dtype"], e["shape"], 8 + n + begin)
        ranges.append((begin, end))
    ranges.sort()
    if any(b < prev_end for (_, prev_end), (b, _) in zip(ranges, ranges[1:])):
        raise CheckpointError(f"{bad}: two entries share bytes")
    return out
