"""The README's quickstart works verbatim: every command of its ``bash`` block runs, in order, in
one shell, on a copy of the repository (so a stale command fails CI).

Long commands run with a declared step override (``LONG``): the same command with fewer
training steps or layers, and the paths that name the last step rewritten to match. Any other
command runs exactly as written, so a command added to the quickstart is tested as it is.
``make test`` is what runs this test and is the only command skipped.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6  # make train's override: 6 steps still checkpoint (the last step) and export to runs/debug_cpu/hf

# command as written in the README -> what this test runs instead (None: skipped)
LONG = {
    "make test": None,
    "make train": f'make train ARGS="--training.steps={STEPS} --training.eval_every=0"',
    ".venv/bin/fsdp2d plan --config configs/llama3_8b_8gpu.toml --gpu h100":
        ".venv/bin/fsdp2d plan --config configs/llama3_8b_8gpu.toml --gpu h100 --model.n_layers=2",
}
REWRITE = {"step_00000300": f"step_{STEPS:08d}"}  # the last checkpoint of the shortened make train


def quickstart_commands(readme: str) -> list[str]:
    """The commands of the first ```bash block under '## Quickstart', comments stripped."""
    section = readme.split("\n## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README's Quickstart has no ```bash block"
    text = block.group(1).replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def _copy_repo(dst: Path) -> None:
    """The tracked files (a fresh clone's content), modification times kept (make's stamps)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def test_quickstart_parses():
    cmds = quickstart_commands((ROOT / "README.md").read_text())
    assert "make test" in cmds and "make train" in cmds, cmds
    for cmd in LONG:  # an override for a command no longer in the README is stale
        assert cmd in cmds, f"test_readme.LONG names {cmd!r}, which the README's quickstart no longer has"


@pytest.mark.dist
def test_quickstart_runs_verbatim(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (the quickstart runs on a copy of its tracked files)")
    pytest.importorskip("transformers")
    repo = tmp_path / "repo"
    _copy_repo(repo)
    # .venv is the environment running this test (make test built it; the quickstart uses .venv/bin/...)
    venv = Path(sys.executable).parent.parent
    (repo / ".venv").symlink_to(venv)
    stamp = venv / ".installed"
    if not stamp.is_file():
        pytest.skip(f"{venv} is not a venv `make install` built (no .installed stamp)")
    # The state after `make test` on a fresh clone: the venv's stamp is newer than pyproject.toml
    # (copies and worktrees are newer than the stamp, and make would reinstall into the shared venv).
    os.utime(repo / "pyproject.toml", (stamp.stat().st_mtime - 1,) * 2)
    assert subprocess.run(["make", "-q", "install"], cwd=repo, capture_output=True).returncode == 0
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}  # the copy's code, not an installed one
    for cmd in quickstart_commands((ROOT / "README.md").read_text()):
        run = LONG.get(cmd, cmd)
        if run is None:
            continue
        for old, new in REWRITE.items():
            run = run.replace(old, new)
        proc = subprocess.run(["bash", "-c", run], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"README quickstart command failed: {run}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert (repo / "runs/debug_cpu/loss.png").is_file()
    assert (repo / "runs/debug_cpu/hf/config.json").is_file()
