"""Test your own parallel plans and layouts, on a laptop (see docs/testing.md).

- :func:`check_parallel`: train your model with your ``parallelize`` on CPU gloo worker
  processes (started from a plain pytest process, reused across calls) and compare
  outputs module by module, losses, gradients and parameters with one process.
- :mod:`fsdp2d.testing.strategies`: hypothesis strategies for meshes, placements,
  layouts and TP plans, and ``roundtrip(tensor, layout)``.
- :func:`worker_pool`: the pool itself, for your own multi-rank jobs
  (``worker_pool(4).run(module_level_fn, *args)`` returns each rank's result).

``strategies`` needs ``hypothesis`` (imported on first use).
"""

from ._check import ATOL, RTOL, check_parallel, default_optimizer
from ._pool import WorkerPool, capture_error, get_mesh, worker_pool

__all__ = ["check_parallel", "default_optimizer", "RTOL", "ATOL", "worker_pool", "WorkerPool", "get_mesh",
           "capture_error", "strategies"]


def __getattr__(name: str):
    if name == "strategies":
        import importlib

        return importlib.import_module(".strategies", __name__)
    raise AttributeError(f"module 'fsdp2d.testing' has no attribute {name!r}")
