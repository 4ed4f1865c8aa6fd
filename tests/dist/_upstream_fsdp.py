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
need GPUs (``skip_if_lt_x_gpu``). So the multi-threaded classes run here the same way, in
the test process, through ``unittest``; the others are collected and not run.
"""

from __future__ import annotations

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


def _classes(module: types.ModuleType, threaded: bool) -> list[type]:
    from torch.testing._internal.common_distributed import MultiProcessTestCase, MultiThreadedTestCase

    base = MultiThreadedTestCase if threaded else MultiProcessTestCase
    return [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, base)
            and c.__module__ == module.__name__]


def collect(file: str, threaded: bool = True) -> list[str]:
    """``Class.test_name`` of the multi-threaded (CPU) tests of ``file``, or with
    ``threaded=False`` of its multi-process (GPU) ones."""
    module = load(file, "torch")
    return sorted(f"{c.__name__}.{n}" for c in _classes(module, threaded) for n in dir(c) if n.startswith("test"))


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
