"""The Mooncake drop-in's tests' fixtures: a pool with its metadata server, a store on it.

Every test ends with the pool as it found it: no keys left, no write in flight,
no block in use (the ``pool`` fixture checks).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from typing import Any

import pytest

from beluga.child import server_process
from beluga.compat.mooncake import MooncakeDistributedStore
from beluga.kv import KVStore
from beluga.pool import Geometry, Pool
from beluga.server.server import serve

GEOMETRY = Geometry(max_hosts=8, rpc_bytes_per_host=256 << 10, block_size=16 << 10)


def _serve(spec: str, ready: Any) -> None:
    # short read leases, so that removed values' extents come back within the test
    serve(spec, coherence="native", ready=ready, refresh_s=0.02, read_lease_s=0.2)


def _pool_is_empty(pool: Pool) -> None:
    """No key, no write in flight, and (once read leases ran out) no block in use."""
    with KVStore(pool) as check:
        stats = check.stats()
        assert stats["keys"] == 0, "the test left keys in the pool"
        assert stats["writes_in_flight"] == 0
        deadline = time.monotonic() + 10
        while stats["blocks_used"] and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = check.stats()
        assert stats["blocks_used"] == 0, "the test leaked blocks"


@pytest.fixture
def pool(shm_path: str) -> Iterator[Pool]:
    """A pool with its metadata server; afterwards it must be as empty as it began."""
    p = Pool.create(shm_path, 48 << 20, geometry=GEOMETRY)
    try:
        with server_process(_serve, p.spec):
            yield p
            _pool_is_empty(p)
    finally:
        p.close()
        Pool.destroy(shm_path)


def connect(pool: Pool) -> MooncakeDistributedStore:
    """A store set up the way Mooncake code does, the pool named by the master address."""
    store = MooncakeDistributedStore()
    rc = store.setup(
        "localhost",
        "http://127.0.0.1:8080/metadata",
        512 << 20,
        128 << 20,
        "tcp",
        "",
        f"beluga:{pool.spec}",
    )
    assert rc == 0
    return store


@pytest.fixture
def store(pool: Pool) -> Iterator[MooncakeDistributedStore]:
    s = connect(pool)
    yield s
    s.remove_all()
    assert s.close() == 0


def buffer_of(data: bytes, size: int | None = None) -> tuple[Any, int]:
    """A ctypes buffer holding ``data`` (of ``size`` bytes), and its address."""
    buf = (ctypes.c_ubyte * (size or len(data)))()
    ctypes.memmove(buf, data, len(data))
    return buf, ctypes.addressof(buf)
