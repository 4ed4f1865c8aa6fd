"""PyTorch's own FSDP2 unit tests (vendored unmodified, tests/clients/pytorch/) on fsdp2d.

Every multi-threaded test of upstream's ``test_fully_shard_state.py`` and
``test_fully_shard_init.py`` (the classes upstream runs on CPU; their multi-process
classes need GPUs) runs twice here, its ranks threads of this process (see
``_upstream_fsdp``):

- flavour ``torch``: as upstream wrote it. :data:`TORCH_PASSES` is what torch passes on
  CPU (the rest skip: they need a GPU); the test asserts it, so a torch upgrade that
  changes the baseline shows up here.
- flavour ``fsdp2d``: ``fully_shard``, ``FSDPModule`` and the policies imported from
  fsdp2d. Every test torch passes must pass, except those in :data:`EXCEPTIONS`, the one
  list of what fsdp2d does differently, each with its reason (an exception that starts
  passing fails, so the list stays true).

The upstream files are not committed (tests/clients/pytorch/README.md: how to fetch them,
and their digests); without them these tests skip, saying so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import _upstream_fsdp as U
from ._upstream import FLAVOURS

if importlib.util.find_spec("expecttest") is None:
    pytest.skip("torch's test harness needs expecttest (the `test` extra)", allow_module_level=True)

# What torch 2.13 passes on CPU (measured with the torch flavour; 20 further tests skip).
TORCH_PASSES = {
    "test_fully_shard_state.py": [
        "TestFullyShardState.test_fully_shard_cls", "TestFullyShardState.test_fully_shard_deepcopy",
        "TestFullyShardState.test_fully_shard_reapply", "TestFullyShardState.test_fully_shard_state",
        "TestFullyShardState.test_fully_shard_unsupported_module_cls",
    ],
    "test_fully_shard_init.py": [
        "TestFullyShardLazyInit.test_fully_shard_double_lazy_init", "TestFullyShardLazyInit.test_fully_shard_is_root",
        "TestFullyShardLazyInit.test_fully_shard_module_and_param_fqns",
        "TestFullyShardLazyInit.test_fully_shard_multi_module_root",
        "TestFullyShardLazyInit.test_reset_sharded_param_in_lazy_init",
        "TestFullyShardManagedModulesAndStates.test_managed_modules_duplicate",
        "TestFullyShardManagedModulesAndStates.test_managed_modules_list_of_mlps",
        "TestFullyShardManagedModulesAndStates.test_managed_modules_nested",
        "TestFullyShardManagedModulesAndStates.test_managed_modules_nested_fully_shard_and_replicate",
        "TestFullyShardManagedModulesAndStates.test_managed_modules_single",
        "TestFullyShardManagedModulesAndStates.test_managed_states_list_of_mlps",
        "TestFullyShardManagedModulesAndStates.test_managed_states_nested_fully_shard",
        "TestFullyShardManagedModulesAndStates.test_managed_states_shared_params_and_buffers",
        "TestFullyShardMeshArg.test_2d_mesh_without_mesh_dim_names", "TestFullyShardMeshArg.test_invalid_mesh_ndim",
        "TestFullyShardOldImport.test_old_import_training",
        "TestFullyShardParamModuleInfos.test_get_param_module_infos_duplicates",
        "TestFullyShardParamModuleInfos.test_get_param_module_infos_list_of_mlps",
        "TestFullyShardParamModuleInfos.test_get_param_module_infos_shared_params",
        "TestFullyShardShardPlacementFn.test_invalid_shard_dim",
        "TestFullyShardShardedParameterTensor.test_raise_noncontiguous_parameter",
        "TestFullyShardShardedParameterTensor.test_raise_scalar_parameter",
    ],
}

_REGISTRY = ("torch's private _get_managed_modules finds the modules an inner fully_shard manages through torch's "
             "own state registry (_get_module_fsdp_state: instances of torch's FSDPState); fsdp2d's modules are "
             "torch's FSDPModule class but their state is fsdp2d's (a read-only view), so it counts them as managed")
# THE list: tests torch passes on CPU that fsdp2d does not, each with its reason.
EXCEPTIONS = {
    "test_fully_shard_init.py::TestFullyShardManagedModulesAndStates.test_managed_modules_nested": _REGISTRY,
    "test_fully_shard_init.py::TestFullyShardManagedModulesAndStates.test_managed_modules_nested_fully_shard_"
    "and_replicate": _REGISTRY,
    "test_fully_shard_init.py::TestFullyShardManagedModulesAndStates.test_managed_states_nested_fully_shard":
        _REGISTRY,
    "test_fully_shard_init.py::TestFullyShardMeshArg.test_2d_mesh_without_mesh_dim_names": (
        "deliberate: fsdp2d accepts a 2-D (replicate, shard) mesh built without mesh_dim_names, addressing its "
        "axes by position (fsdp2d.mesh.axis_names: dim0, dim1); torch asserts names for HSDP"),
    "test_fully_shard_init.py::TestFullyShardShardedParameterTensor.test_raise_noncontiguous_parameter": (
        "deliberate: fsdp2d shards a non-contiguous parameter (a channels_last conv weight) by value: its "
        "shards and the gathered parameter are contiguous copies, the module computes the same values; torch "
        "raises NotImplementedError"),
}

CASES = [(f, name) for f in U.files() for name in U.collect(f)]


@pytest.mark.skipif(not CASES, reason="the upstream FSDP2 test files are not here: tests/clients/pytorch/README.md")
def test_collected_tests_are_the_known_ones():
    """The baseline names real tests (47 collected, all multi-threaded: 27 torch passes on
    CPU, 20 need a GPU) and every exception is a test torch passes."""
    collected = {f"{f}::{n}" for f, n in CASES}
    passes = {f"{f}::{n}" for f, names in TORCH_PASSES.items() for n in names}
    assert passes <= collected and set(EXCEPTIONS) <= passes
    assert (len(collected), len(passes)) == (47, 27)


@pytest.fixture(scope="module")
def results() -> dict:
    """Every case in both flavours, run once in a fresh process (see ``_upstream_fsdp``): ~10 s."""
    cases = [(f, n, flavour) for f, n in CASES for flavour in FLAVOURS]
    proc = subprocess.run([sys.executable, "-m", "tests.dist._upstream_fsdp"], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "PYTORCH_PRINT_REPRO_ON_FAILURE": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {k: tuple(v) for k, v in json.loads(proc.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("file,name", CASES, ids=[f"{f[16:-3]}::{n.split('.')[1]}" for f, n in CASES])
def test_upstream(results, file, name, flavour):
    key = f"{file}::{name}"
    torch_passes = name in TORCH_PASSES[file]
    status, detail = results[f"{key}::{flavour}"]
    assert status != "switch-failed", detail
    if status == "skip":
        assert not torch_passes, f"{key} passes on torch on CPU but skipped here: {detail}"
        pytest.skip(detail)
    if flavour == "fsdp2d" and key in EXCEPTIONS:
        assert status != "pass", f"{key} now passes on fsdp2d: remove it from EXCEPTIONS"
        pytest.xfail(EXCEPTIONS[key])
    assert status == "pass", f"{flavour}: {key} failed:\n{detail}"
    assert torch_passes, f"{key} passes, but is not in TORCH_PASSES (the CPU baseline changed?)"
