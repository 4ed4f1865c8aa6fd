"""PyTorch's own FSDP2 unit tests (``test/distributed/_composable/fsdp/``), against torch's
``fully_shard`` or fsdp2d's.

The upstream files (tests/clients/pytorch/, see its README) are loaded by ``_upstream``:
flavour ``"fsdp2d"`` switches the names the tests import from ``torch.distributed.fsdp``
(and its submodules, ``torch.distributed._composable.fsdp``) that fsdp2d provides:
``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``, ``OffloadPolicy``,
``CPUOffloadPolicy``, ``UnshardHandle``. Anything else stays torch's only if
:data:`KEEP_TORCH` lists it with the reason (torch's tensor parallelism, meshes and the
harness always do).

On CPU upstream runs its ``FSDPTestMultiThread`` classes (ranks are threads of one
process over torch's threaded process group); its multi-process ``FSDPTest`` classes
need GPUs (``skip_if_lt_x_gpu``). So the multi-threaded classes run here the same way,
through ``unittest``, in one fresh process for the whole session (``python -m
tests.dist._upstream_fsdp``: the threaded process groups and the harness stay out of the
pytest process, which later forks); the tests are collected from the files' AST.
"""

from __future__ import annotations

import ast
import json
import sys
import types
import unittest

from . import _upstream

TESTS = _upstream.UPSTREAM / "test" / "distributed" / "_composable" / "fsdp"
SWITCHES = {"torch.distributed.fsdp": "fsdp2d.fsdp", "torch.distributed._composable.fsdp": "fsdp2d.fsdp"}

# name -> why it may stay torch's in the fsdp2d flavour
_INTERNAL = "torch's internals the test calls directly (not the API under test)"
KEEP_TORCH = {
    "register_fsdp_forward_method": "torch's works on fsdp2d's modules (it reads the state view fsdp2d plants)",
    "_get_managed_modules": _INTERNAL, "_get_managed_states": _INTERNAL, "ParamModuleInfo": _INTERNAL,
    "_get_param_module_infos": _INTERNAL, "_init_inter_node_process_group": _INTERNAL,
    "_init_intra_node_process_group": _INTERNAL,
}


def files() -> list[str]:
    """The vendored FSDP2 test files present here (see the README: fetched, not committed)."""
    return sorted(p.name for p in TESTS.glob("test_*.py")) if TESTS.is_dir() else []


def load(file: str, flavour: str) -> types.ModuleType:
    return _upstream.load(TESTS / file, flavour, SWITCHES, KEEP_TORCH)


def collect(file: str) -> list[str]:
    """``Class.test_name`` of the multi-threaded (CPU) tests of ``file``, read from its AST
    (classes deriving from ``FSDPTestMultiThread``; no parametrized tests in these files)."""
    tree = ast.parse((TESTS / file).read_text())
    return sorted(f"{c.name}.{f.name}" for c in tree.body if isinstance(c, ast.ClassDef)
                  and any(getattr(b, "id", None) == "FSDPTestMultiThread" for b in c.bases)
                  for f in c.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test"))


def run_test(file: str, name: str, flavour: str) -> tuple[str, str]:
    """Run upstream test ``Class.method`` of ``file`` (its ranks are threads of this
    process); ``(status, detail)`` with status ``pass``, ``skip`` (detail: the reason) or
    ``fail`` (detail: the tracebacks)."""
    from torch.testing._internal import common_utils

    cls_name, method = name.split(".")
    case = getattr(load(file, flavour), cls_name)(method)
    common_utils.set_rng_seed()
    result = unittest.TestResult()
    case.run(result)
    if result.skipped:
        return "skip", result.skipped[0][1]
    problems = result.errors + result.failures
    if problems:
        return "fail", "\n".join(text for _, text in problems)
    return "pass", ""


def run_all(cases: list[tuple[str, str, str]]) -> dict[str, tuple[str, str]]:
    """``{"file::name::flavour": (status, detail)}``; for the fsdp2d flavour the status is
    ``switch-failed`` if the loaded file's ``fully_shard`` is not fsdp2d's."""
    import fsdp2d

    out = {}
    for file, name, flavour in cases:
        result = run_test(file, name, flavour)
        if flavour == "fsdp2d" and load(file, flavour).fully_shard is not fsdp2d.fully_shard:
            result = ("switch-failed", "the loaded file's fully_shard is not fsdp2d's")
        out[f"{file}::{name}::{flavour}"] = result
    return out


if __name__ == "__main__":  # python -m tests.dist._upstream_fsdp < cases.json > results.json
    print(json.dumps(run_all([tuple(c) for c in json.load(sys.stdin)])))
