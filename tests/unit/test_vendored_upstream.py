"""PyTorch's vendored unit tests stay byte for byte as upstream (digests in their README).

The TP tests are committed; the FSDP2 tests are read from the store and not committed
(their README says why): each is checked when present, and may be absent."""

import hashlib
import re
from pathlib import Path

UPSTREAM = Path(__file__).resolve().parents[1] / "clients" / "pytorch"


def _listed() -> list[dict[str, str]]:
    """``{path: digest}`` of each sha256 block of the README (committed, then fetched)."""
    blocks = re.findall(r"sha256 .*?```\n(.*?)```", (UPSTREAM / "README.md").read_text(), re.S)
    return [{path: digest for digest, path in (line.split() for line in b.splitlines())} for b in blocks]


def test_vendored_pytorch_tests_are_unmodified():
    committed, fetched = _listed()
    on_disk = {str(p.relative_to(UPSTREAM)) for p in UPSTREAM.rglob("*")
               if p.is_file() and p.name != "README.md" and "__pycache__" not in p.parts}
    assert set(committed) <= on_disk and on_disk <= set(committed) | set(fetched), \
        "every vendored file, and only those, has a digest in README.md"
    for path, digest in {**committed, **fetched}.items():
        if path in on_disk:
            got = hashlib.sha256((UPSTREAM / path).read_bytes()).hexdigest()
            assert got == digest, f"{path} differs from upstream (sha256 {got}); vendored files are never edited"
