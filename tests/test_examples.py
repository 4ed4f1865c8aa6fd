"""The examples run as users run them: under torchrun, 4 CPU ranks."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(script: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", str(ROOT / "examples" / script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.dist
def test_tensor_parallel_example_matches_single_process():
    out = _torchrun("01_tensor_parallel.py")
    pairs = re.findall(r"loss ([\d.]+)\s+single-process ([\d.]+)", out)
    assert len(pairs) == 5, out
    for tp, ref in pairs:  # printed to 6 decimals: equal up to the last digit
        assert abs(float(tp) - float(ref)) <= 2e-6, out


@pytest.mark.dist
def test_fully_shard_2d_example_trains():
    out = _torchrun("02_fully_shard_2d.py")
    losses = [float(v) for v in re.findall(r"loss ([\d.]+)", out)]
    assert len(losses) == 4 and losses[-1] < 0.7 * losses[0], out


@pytest.mark.dist
def test_checkpoint_reshard_example(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
           str(ROOT / "examples" / "03_checkpoint_reshard.py"), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "weights bit-identical = True" in proc.stdout, proc.stdout
    assert (tmp_path / "hf" / "model.safetensors").is_file()
