"""fsdp2d's own multi-rank tests run on the public worker pool of :mod:`fsdp2d.testing`
(one pool for the session, shared with ``check_parallel``)."""

from fsdp2d.testing._pool import GRACE_S, WorkerPool, capture_error, get_mesh, worker_pool  # noqa: F401
