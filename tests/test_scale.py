"""Scale by construction (DESIGN item 9), checked on one simulated rank of big jobs.

``tests/scale_probe.py`` runs, in its own process under torch's fake process group and
``FakeTensorMode`` (nothing allocated), one fsdp2d training step of a TP=2 Llama at
dp = 8 and dp = 1024, with shapes that split evenly at both sizes and shapes that split
unevenly at both, and reports what the step dispatched. ``tests/ckpt_scale_probe.py``
saves and loads a checkpoint of a TP=8 Llama with AdamW state as rank 0 and as the last
rank of W = 64 and W = 8192 under the fake process group.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("scale_probe.py")
CKPT_PROBE = Path(__file__).with_name("ckpt_scale_probe.py")


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
    # the gradient average is the reduce-scatter's own (ReduceOp.AVG, as on NCCL, which the
    # fake backend stands for): no division kernel per group
    assert "aten.div_" not in big["ops"], big["ops"]


@pytest.mark.parametrize("name", ["even-16", "even-2048", "uneven-16", "uneven-2048"])
def test_step_has_no_data_dependent_ops(probe, name):
    """No .item()/.tolist()/nonzero in forward + backward: on a GPU each is a host sync
    (the step ran under FakeTensorMode, which would also refuse most of them)."""
    assert probe[name]["data_dependent"] == 0, probe[name]["ops"]


def test_dropped_model_is_freed(probe):
    """A model, a block and an FSDP state are garbage once the user drops the model and
    its optimizer after a training step (torch FSDP2 frees them too)."""
    assert probe["leak"]["alive"] == 0


@pytest.fixture(scope="module")
def ckpt_probe(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("ckpt_scale")
    out = subprocess.run([sys.executable, str(CKPT_PROBE), str(folder)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_checkpoint_metadata_does_not_grow_with_world_size(ckpt_probe):
    """W = 64 (8 x 8) vs W = 8192 (1024 x 8): the index is the same size (it describes
    each tensor's layout, not every rank's boxes: only the digits of the world size and
    mesh shape differ), and a save hands the network the same few bytes on the first and
    the last rank (4 all-reduces of 5 int64s: no rank's boxes go to any other rank; the
    previous format all-gathered every rank's boxes, 150 KB per rank at W = 8 measured,
    and listed every box, 128 KB of index at W = 8 and ~26 MB at W = 8192). Loading back
    on the same mesh opens only this rank's own file and sends 40 bytes."""
    small, big = ckpt_probe["64"], ckpt_probe["8192"]
    assert 0 <= big["first"]["index_bytes"] - small["first"]["index_bytes"] <= 8, (small, big)
    assert big["first"]["index_bytes"] < 16_000
    for rank in ("first", "last"):
        assert small[rank]["save"] == big[rank]["save"] == {"count": 4, "bytes": 160, "kinds": ["all_reduce"]}
    for probe in (small, big):
        assert probe["first"]["files_written"] == ["fsdp2d.index.json", "rank00000.safetensors"]
        assert probe["first"]["load"] == {"count": 1, "bytes": 40, "kinds": ["all_reduce"]}
        assert probe["first"]["load_opened"] == ["rank00000.safetensors"]
    # each rank writes its own data, which shrinks as the mesh grows
    assert big["last"]["own_file_bytes"] < small["last"]["own_file_bytes"]
