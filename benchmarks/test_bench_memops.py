"""pytest-benchmark: the coherence recipes at the sizes the issue targets.

Run: pytest benchmarks -m benchmark --benchmark-only
(CI runs them once each at smoke size, with --benchmark-disable.)
"""

from __future__ import annotations

import numpy as np
import pytest

from beluga.coherence import digest
from beluga.pool import Pool

#: leaves("writes"): blocks are sealed with no metadata server to commit them (tests/conftest.py)
pytestmark = [pytest.mark.benchmark, pytest.mark.leaves("writes")]
KEY = digest(b"bench")


@pytest.fixture
def block(pool: Pool) -> tuple[Pool, int, int, int]:
    sb = pool.superblock
    return pool, sb.headers.offset, sb.payloads.offset, sb.payloads.length


@pytest.mark.parametrize("size", [16 << 10, 2 << 20])
def test_memcpy_into_pool(benchmark, block, size: int) -> None:
    pool, _, payload, _ = block
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    benchmark(pool.memory.store, payload, src)
    assert pool.memory.load(payload, 64) == src[:64].tobytes()


@pytest.mark.parametrize("size", [16 << 10, 2 << 20])
def test_nt_store(benchmark, block, size: int) -> None:
    pool, _, payload, _ = block
    src = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)

    def write() -> None:
        pool.memory.nt_store(payload, src)
        pool.memory.sfence()

    benchmark(write)
    assert pool.memory.load(payload, size) == src.tobytes()


def test_publish_16k(benchmark, block) -> None:
    pool, hdr, payload, _ = block
    data = np.random.default_rng(2).integers(0, 256, 16 << 10, dtype=np.uint8)
    benchmark(pool.memory.publish, hdr, payload, KEY, 1, data)


def test_read_validated_16k(benchmark, block) -> None:
    pool, hdr, payload, cap = block
    data = np.random.default_rng(3).integers(0, 256, 16 << 10, dtype=np.uint8)
    pool.memory.publish(hdr, payload, KEY, 1, data)
    out = np.empty_like(data)
    n = benchmark(pool.memory.read_validated, hdr, payload, cap, KEY, 1, out)
    assert n == data.nbytes and np.array_equal(out, data)
