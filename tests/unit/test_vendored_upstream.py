"""PyTorch's vendored TP unit tests stay byte for byte as upstream (digests in their README)."""

import hashlib
import re
from pathlib import Path

UPSTREAM = Path(__file__).resolve().parents[1] / "clients" / "pytorch"


def _listed() -> dict[str, str]:
    block = re.search(r"sha256 .*?```\n(.*?)```", (UPSTREAM / "README.md").read_text(), re.S).group(1)
    return {path: digest for digest, path in (line.split() for line in block.splitlines())}


def test_vendored_pytorch_tests_are_unmodified():
    listed = _listed()
    on_disk = {str(p.relative_to(UPSTREAM)) for p in UPSTREAM.rglob("*")
               if p.is_file() and p.name != "README.md" and "__pycache__" not in p.parts}
    assert on_disk == set(listed), "every vendored file, and only those, has a digest in README.md"
    for path, digest in listed.items():
        got = hashlib.sha256((UPSTREAM / path).read_bytes()).hexdigest()
        assert got == digest, f"{path} differs from upstream (sha256 {got}); vendored files are never edited"
