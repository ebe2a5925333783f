"""Shared fixtures: small pools under unique /dev/shm names, and leak checks.

Every test leaves no new child process, no test file in /dev/shm and nothing
in the pools it made: a pool that a test destroys (``Pool.destroy``), or that
``shm_path`` removes after it, is read first, and must hold no committed key
and no write in flight.  A test that leaves either on purpose says so with
``@pytest.mark.leaves("keys")`` and/or ``leaves("writes")`` (a crash, a
stalled writer, blocks sealed with no server to commit them), on itself, on
its module, or through a fixture that marks the tests using it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import psutil
import pytest

from beluga.coherence import LINE, BlockState, ModelConfig, parse_header
from beluga.errors import BelugaError
from beluga.pool import Backend, Geometry, Pool
from beluga.rpc import RpcServer

# helper modules whose asserts pytest explains, as in a test file
pytest.register_assert_rewrite("tests.proxy_rig")

SHM = "/dev/shm"
# one prefix per test session, so that concurrent sessions never see each other's files
PREFIX = f"beluga-test-{os.getpid()}-"
SMALL = Geometry(max_hosts=4, rpc_bytes_per_host=64 << 10, block_size=64 << 10)


#: what a test may leave in its pools on purpose, as ``leaves`` markers name it
LEFTOVER_KINDS = ("keys", "writes")


def _leftovers() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith(PREFIX)}


@dataclass(frozen=True)
class PoolContents:
    """What a pool holds, by its block header and commit tables (the server's truth)."""

    spec: str
    keys: int  # committed values: a PUBLISHED header whose commit word holds its version
    writes: int  # writes in flight: a WRITING header, or a PUBLISHED one not committed


def pool_contents(spec: str | Backend) -> PoolContents | None:
    """Read a pool's block headers and commit words; None when ``spec`` holds no pool."""
    try:
        pool = Pool.attach(spec, coherence="native")
    except (BelugaError, OSError, ValueError):  # nothing there, or not (any more) a pool
        return None
    with pool:
        sb, spec = pool.superblock, pool.spec
        lines = np.frombuffer(pool.memory.load(sb.headers.offset, sb.nblocks * LINE), np.uint8)
        commits = np.frombuffer(pool.memory.load(sb.commits.offset, sb.commits.length), "<u8")
    keys = writes = 0
    for block in np.flatnonzero(lines.reshape(sb.nblocks, LINE).any(axis=1)).tolist():
        h = parse_header(lines[block * LINE : (block + 1) * LINE].tobytes())
        if h is None or h.state == BlockState.FREE:
            continue
        committed = h.state == BlockState.PUBLISHED and int(commits[block]) == h.version
        keys += committed
        writes += not committed
    return PoolContents(str(spec), keys, writes)


#: the contents of every pool the running test let go of (reset for each test)
_let_go: list[PoolContents] = []


def _record(spec: str | Backend) -> None:
    contents = pool_contents(spec)
    if contents is not None:
        _let_go.append(contents)


@pytest.fixture
def shm_path() -> Iterator[str]:
    """A unique /dev/shm path that is removed (with any staging file) afterwards."""
    path = os.path.join(SHM, f"{PREFIX}{uuid.uuid4().hex[:12]}")
    yield path
    if os.path.exists(path):
        _record(path)
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


def _allowed_leftovers(request: pytest.FixtureRequest) -> set[str]:
    allowed = {kind for mark in request.node.iter_markers("leaves") for kind in mark.args}
    unknown = allowed - set(LEFTOVER_KINDS)
    assert not unknown, f"leaves() takes {LEFTOVER_KINDS}, not {sorted(unknown)}"
    return allowed


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test leaves no new child processes, no test files in /dev/shm, and no keys
    or writes in flight in the pools it destroys, except what it marks it ``leaves``.

    (Processes that a module-scoped fixture started before the test are its own.)
    """
    files, children = _leftovers(), _children()
    destroy = Pool.__dict__["destroy"]

    def read_then_destroy(spec: str | Backend) -> None:
        _record(spec)
        destroy.__func__(spec)

    # set by hand, not with monkeypatch: a test's own monkeypatch.undo() must not end it
    Pool.destroy = staticmethod(read_then_destroy)  # type: ignore[method-assign]
    _let_go.clear()
    try:
        yield
    finally:
        Pool.destroy = destroy  # type: ignore[method-assign]
    extra = _children() - children
    assert not extra, f"test left processes behind: {extra}"
    assert _leftovers() <= files, f"test left files in /dev/shm: {_leftovers() - files}"
    allowed = _allowed_leftovers(request)  # read now: a fixture may have marked the test
    left = [
        f"{c.spec}: {n} {kind}"
        for c in _let_go
        for kind, n in (("keys", c.keys), ("writes", c.writes))
        if n and kind not in allowed
    ]
    assert not left, (
        f"test left in its pools: {'; '.join(left)} (committed keys, writes in flight); "
        "remove them, or mark the test @pytest.mark.leaves(...) if it means to"
    )


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
    server = RpcServer.open(pool, refresh_s=0.01, **options)  # type: ignore[arg-type]
    server.start_thread()
    try:
        yield server
    finally:
        server.close()
