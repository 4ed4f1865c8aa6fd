"""PyTorch's own TP unit tests, run on the worker pool against torch's TP or fsdp2d's.

The upstream files live unmodified in ``tests/clients/pytorch/`` (see its README). They
are loaded from source with the imports rewritten on the AST, in memory (``_upstream``):
flavour ``"fsdp2d"`` switches every name imported from ``torch.distributed.tensor.parallel``
or one of its submodules (``.api``, ``.style``, ``.loss``...) to ``fsdp2d.tensor_parallel``;
meshes, placements, DTensor, ``CommDebugMode`` and the test harness stay torch's. A name
fsdp2d does not provide stays torch's only if :data:`KEEP_TORCH` lists it with the reason.

Each test method then runs on every rank of the pool as torch's ``MultiProcessTestCase``
runs it in a spawned process (``set_rng_seed()``, ``self.rank``, then the method), except
that the process group already exists: ``init_pg`` is a no-op, ``destroy_pg`` a barrier,
and ``with_comms``' ``destroy_process_group()`` after a failure is suppressed (the pool
restarts the workers after any failed job instead).
"""

from __future__ import annotations

import types
import unittest

from . import _upstream
from ._upstream import FLAVOURS, HardwareClassification, keep_generic_class  # noqa: F401 (the bridge)

TESTS = _upstream.UPSTREAM / "test" / "distributed" / "tensor" / "parallel"
FILES = ("test_tp_style.py", "test_parallelize_api.py", "test_tp_examples.py")
TORCH_TP = "torch.distributed.tensor.parallel"

# name -> why it may stay torch's in the fsdp2d flavour
KEEP_TORCH = {
    "input_reshard": "used only when recompute_activation=True, which upstream no longer parametrizes "
                     "(its TODO); fsdp2d has no input_reshard",
}


def load(file: str, flavour: str) -> types.ModuleType:
    """The vendored test file ``file`` as a module, imports rewritten for ``flavour``."""
    return _upstream.load(TESTS / file, flavour, {TORCH_TP: "fsdp2d.tensor_parallel"}, KEEP_TORCH)


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
