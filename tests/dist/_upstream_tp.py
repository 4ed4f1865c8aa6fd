"""PyTorch's own TP unit tests, run on the worker pool against torch's TP or fsdp2d's.

The upstream files live unmodified in ``tests/clients/pytorch/`` (see its README). They
are loaded here from source with the imports rewritten on the AST, in memory:

- **the switch** (flavour ``"fsdp2d"`` only): every name imported from
  ``torch.distributed.tensor.parallel`` or one of its submodules (``.api``, ``.style``,
  ``.loss``...) comes from ``fsdp2d.tensor_parallel`` instead. Meshes, placements,
  DTensor, ``CommDebugMode`` and the test harness stay torch's, as the tests build them.
  A name fsdp2d does not provide stays torch's only if :data:`KEEP_TORCH` lists it with
  the reason; any other raises, so a new upstream import cannot slip through.
- **the harness bridge** (both flavours): the files come from a pytorch commit newer than
  the installed wheel's harness. :data:`BRIDGE` supplies the two names it lacks:
  ``HardwareClassification`` (a class attribute the multi-process tests only declare) and
  ``instantiate_device_type_tests``, whose upstream call ``except_for=["cpu"]`` drops the
  multi-process CPU class that torch's older harness made (upstream now runs CPU through
  a single-process LocalTensor class instead). The bridge keeps the generic class, as the
  CPU class, with its ``@parametrize`` tests expanded.

Each test method then runs on every rank of the pool as torch's ``MultiProcessTestCase``
runs it in a spawned process (``set_rng_seed()``, ``self.rank``, then the method), except
that the process group already exists: ``init_pg`` is a no-op, ``destroy_pg`` a barrier,
and ``with_comms``' ``destroy_process_group()`` after a failure is suppressed (the pool
restarts the workers after any failed job instead).
"""

from __future__ import annotations

import ast
import enum
import sys
import types
import unittest
from pathlib import Path

UPSTREAM = Path(__file__).resolve().parents[1] / "clients" / "pytorch"
TESTS = UPSTREAM / "test" / "distributed" / "tensor" / "parallel"
FILES = ("test_tp_style.py", "test_parallelize_api.py", "test_tp_examples.py")
FLAVOURS = ("torch", "fsdp2d")
TORCH_TP = "torch.distributed.tensor.parallel"

# name -> why it may stay torch's in the fsdp2d flavour
KEEP_TORCH = {
    "input_reshard": "used only when recompute_activation=True, which upstream no longer parametrizes "
                     "(its TODO); fsdp2d has no input_reshard",
}


class HardwareClassification(enum.Enum):
    """Stand-in for the upstream harness enum (the tests only set it as a class attribute)."""

    ACCELERATOR = "accelerator"
    CPU = "cpu"


def keep_generic_class(generic_cls, scope, **_ignored) -> None:
    """Stand-in for ``instantiate_device_type_tests``: keep the generic multi-process class
    in ``scope`` (it runs on CPU here) with its ``@parametrize`` tests expanded."""
    from torch.testing._internal.common_utils import instantiate_parametrized_tests

    instantiate_parametrized_tests(generic_cls)
    scope[generic_cls.__name__] = generic_cls


BRIDGE = {"HardwareClassification": "HardwareClassification",  # upstream name -> name here
          "instantiate_device_type_tests": "keep_generic_class"}


class _Rewrite(ast.NodeTransformer):
    def __init__(self, switch: bool) -> None:
        self.switch = switch
        self.switched: list[str] = []

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST | list[ast.AST]:
        mod = node.module or ""
        bridged = [a for a in node.names if a.name in BRIDGE]
        if bridged:  # from <harness> import ..., HardwareClassification, ...
            node.names = [a for a in node.names if a.name not in BRIDGE]
            extra = ast.ImportFrom(module=__name__, level=0, names=[
                ast.alias(BRIDGE[a.name], a.asname or a.name) for a in bridged])
            return [node, extra] if node.names else [extra]
        if not self.switch or not (mod == TORCH_TP or mod.startswith(TORCH_TP + ".")):
            return node
        import fsdp2d.tensor_parallel as fsdp2d_tp

        ours, kept = [], []
        for alias in node.names:
            if hasattr(fsdp2d_tp, alias.name):
                ours.append(alias)
            elif alias.name in KEEP_TORCH:
                kept.append(alias)
            else:
                raise ImportError(f"{mod}.{alias.name}: fsdp2d.tensor_parallel has no such name; "
                                  f"implement it or list it in KEEP_TORCH with the reason")
        self.switched += [a.name for a in ours]
        out = []
        if ours:
            out.append(ast.ImportFrom(module="fsdp2d.tensor_parallel", names=ours, level=0))
        if kept:
            out.append(ast.ImportFrom(module=mod, names=kept, level=0))
        return out


_LOADED: dict = {}


def load(file: str, flavour: str) -> types.ModuleType:
    """The vendored test file ``file`` as a module, imports rewritten for ``flavour``."""
    key = (file, flavour)
    if key not in _LOADED:
        if flavour not in FLAVOURS:
            raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
        path = TESTS / file
        rewrite = _Rewrite(switch=flavour == "fsdp2d")
        tree = ast.fix_missing_locations(rewrite.visit(ast.parse(path.read_text(), str(path))))
        if flavour == "fsdp2d" and not rewrite.switched:
            raise AssertionError(f"{file}: no import of {TORCH_TP} was switched")
        name = f"_upstream_{flavour}_{Path(file).stem}"
        module = types.ModuleType(name)
        module.__file__ = str(path)
        sys.modules[name] = module  # (dataclasses and pickling look classes up here)
        exec(compile(tree, str(path), "exec"), module.__dict__)
        module._switched = rewrite.switched
        _LOADED[key] = module
    return _LOADED[key]


def _test_classes(module: types.ModuleType) -> list[type]:
    from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, LocalDTensorTestBase

    # (the single-process LocalTensor variants upstream also builds are not the CPU class)
    return [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, DTensorTestBase)
            and not issubclass(c, LocalDTensorTestBase) and c.__module__ == module.__name__]


def collect(file: str) -> list[str]:
    """``Class.test_name`` of every multi-process test in ``file`` (parametrized ones expanded)."""
    module = load(file, "torch")
    return sorted(f"{c.__name__}.{n}" for c in _test_classes(module) for n in dir(c) if n.startswith("test"))


def _pool_case(cls: type, method: str, rank: int):
    """An instance of ``cls`` that runs ``method`` in the pool's existing process group."""
    import torch.distributed as dist

    def init_pg(self, eager_init=False, backend=None) -> None:
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(f"the pool has {dist.get_world_size()} ranks, the test wants {self.world_size}")

    def destroy_pg(self, device_id=None) -> None:
        dist.barrier()

    def handle_skip(self, msg: str) -> None:
        raise unittest.SkipTest(msg)

    sub = type(cls.__name__, (cls,), {"init_pg": init_pg, "destroy_pg": destroy_pg,
                                      "_handle_test_skip": handle_skip, "__module__": cls.__module__})
    case = sub(method)
    case.rank = rank
    return case


def run_test(file: str, name: str, flavour: str) -> tuple[str, str]:
    """Pool job: run upstream test ``Class.method`` of ``file``; ``(status, detail)`` with
    status ``pass``, ``skip`` (detail: the reason) or ``fail`` (detail: the traceback)."""
    import traceback

    import torch.distributed as dist
    import torch.distributed.tensor._random as dtensor_random
    from torch.testing._internal import common_utils

    cls_name, method = name.split(".")
    cls = getattr(load(file, flavour), cls_name)
    case = _pool_case(cls, method, dist.get_rank())
    dtensor_random._rng_tracker = None  # as in a fresh process
    common_utils.set_rng_seed()
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *a, **k: None  # with_comms calls it after a failure
    try:
        getattr(case, method)()
    except unittest.SkipTest as e:
        return "skip", str(e)
    except Exception:  # noqa: BLE001 - the driver reports it
        return "fail", traceback.format_exc()
    finally:
        dist.destroy_process_group = destroy
        dtensor_random._rng_tracker = None
    return "pass", ""
