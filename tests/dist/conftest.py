"""Fixtures for multi-rank tests: one 4-rank gloo worker pool for the whole session."""

from pathlib import Path

import pytest

from .pool import worker_pool

WORLD_SIZE = 4
_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    """Every test under tests/dist is a `dist` test (deselect with `-m "not dist"`)."""
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.dist)


@pytest.fixture(scope="session")
def pool():
    """The WorkerPool of 4 gloo ranks that ``fsdp2d.testing.check_parallel`` uses too,
    started once and restarted after failures."""
    return worker_pool(WORLD_SIZE)
