"""Fixtures for the framework tests: a pool with its metadata server, in this process.

These tests run inside the frameworks' own virtualenvs (ci/run-framework-tests.sh);
in the main environment each module skips at import, naming the install step.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from beluga.kv import MetadataServer
from beluga.pool import Geometry, Pool

SETUP = "bash ci/install-frameworks.sh && bash ci/run-framework-tests.sh"


def need(module: str, venv: str) -> None:
    """Skip the calling test module unless ``module`` imports (it lives in the venv ``venv``)."""
    pytest.importorskip(module, reason=f"needs the {venv} virtualenv: {SETUP}")


@pytest.fixture
def served_pool(shm_path: str) -> Iterator[str]:
    """A 64 MiB pool with a running metadata server; yields its path."""
    pool = Pool.create(shm_path, 64 << 20, geometry=Geometry(max_hosts=8, block_size=16 << 10))
    server = MetadataServer(pool)
    thread = server.start_thread()
    yield shm_path
    server.stop()
    thread.join(timeout=10)
    server.close()
    pool.close()
    Pool.destroy(shm_path)
