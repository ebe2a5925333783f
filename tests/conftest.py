"""Shared fixtures: small pools under unique /dev/shm names, and leak checks."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import pytest

from beluga.coherence import ModelConfig
from beluga.pool import Geometry, Pool
from beluga.rpc import RpcServer

SHM = "/dev/shm"
# one prefix per test session, so that concurrent sessions never see each other's files
PREFIX = f"beluga-test-{os.getpid()}-"
SMALL = Geometry(max_hosts=4, rpc_bytes_per_host=64 << 10, block_size=64 << 10)


def _leftovers() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith(PREFIX)}


@pytest.fixture
def shm_path() -> Iterator[str]:
    """A unique /dev/shm path that is removed (with any staging file) afterwards."""
    path = os.path.join(SHM, f"{PREFIX}{uuid.uuid4().hex[:12]}")
    yield path
    for p in (path, path + ".creating"):
        if os.path.exists(p):
            os.unlink(p)


@pytest.fixture
def pool(shm_path: str) -> Iterator[Pool]:
    """A fresh 32 MiB shm pool attached in native mode."""
    p = Pool.create(shm_path, 32 << 20, geometry=SMALL)
    yield p
    p.close()
    Pool.destroy(shm_path)


def _children() -> set[psutil.Process]:
    return {
        c
        for c in psutil.Process().children(recursive=True)
        if c.is_running() and c.status() != psutil.STATUS_ZOMBIE
    }


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Every test leaves no new child processes and no test files in /dev/shm.

    (Processes that a module-scoped fixture started before the test are its own.)
    """
    files, children = _leftovers(), _children()
    yield
    extra = _children() - children
    assert not extra, f"test left processes behind: {extra}"
    assert _leftovers() <= files, f"test left files in /dev/shm: {_leftovers() - files}"


@pytest.fixture(params=[0.0, ModelConfig.evict_rate], ids=["evict-off", "evict-on"])
def model_eviction(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> float:
    """Run a protocol test with the model's random eviction off, then on.

    Off, a stale line stays stale for as long as a host holds it (the harshest
    case for a missing invalidate); on, lines also leave at random, written
    back whole (the case for a missing flush and for two writers of a line).
    Set through BELUGA_MODEL_EVICT, so forked hosts inherit it.
    """
    monkeypatch.setenv("BELUGA_MODEL_EVICT", str(request.param))
    return float(request.param)


@contextmanager
def serving(pool: Pool, **options: object) -> Iterator[RpcServer]:
    """An RPC server (the grantor of host ids) in a thread of this process."""
    server = RpcServer(pool, refresh_s=0.01, **options)  # type: ignore[arg-type]
    server.start_thread()
    try:
        yield server
    finally:
        server.close()
