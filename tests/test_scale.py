"""Scale by construction (DESIGN item 9), checked on one simulated rank of big jobs.

``tests/scale_probe.py`` runs, in its own process under torch's fake process group and
``FakeTensorMode`` (nothing allocated), one fsdp2d training step of a TP=2 Llama at
dp = 8 and dp = 1024, with shapes that split evenly at both sizes and shapes that split
unevenly at both, and reports what the step dispatched.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("scale_probe.py")


@pytest.fixture(scope="module")
def probe() -> dict:
    out = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["even", "uneven"])
def test_per_step_ops_do_not_grow_with_dp(probe, kind):
    """Every aten and c10d op of forward + backward, counted per op name: the same at
    dp = 8 and dp = 1024 (on a GPU each op is a kernel launch), steady from step to step."""
    small, big = probe[f"{kind}-16"], probe[f"{kind}-2048"]
    assert small["steady"] and big["steady"]
    assert small["ops"] == big["ops"], {k: (small["ops"].get(k), big["ops"].get(k))
                                        for k in set(small["ops"]) | set(big["ops"])
                                        if small["ops"].get(k) != big["ops"].get(k)}
    # 2 blocks + root: one all-gather per group in forward and one in backward for the
    # resharded blocks, plus TP's all-gather of the replicated logits; one reduce-scatter
    # per group
    assert big["collectives"]["c10d._allgather_base_"] == 3 + 2 + 1
    assert big["collectives"]["c10d._reduce_scatter_base_"] == 3


@pytest.mark.parametrize("name", ["even-16", "even-2048", "uneven-16", "uneven-2048"])
def test_step_has_no_data_dependent_ops(probe, name):
    """No .item()/.tolist()/nonzero in forward + backward: on a GPU each is a host sync
    (the step ran under FakeTensorMode, which would also refuse most of them)."""
    assert probe[name]["data_dependent"] == 0, probe[name]["ops"]


def test_dropped_model_is_freed(probe):
    """A model, a block and an FSDP state are garbage once the user drops the model and
    its optimizer after a training step (torch FSDP2 frees them too)."""
    assert probe["leak"]["alive"] == 0
