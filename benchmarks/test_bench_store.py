"""pytest-benchmark: the store's operations, with its metadata server in another process.

Run: pytest benchmarks/test_bench_store.py -m benchmark --benchmark-only
(CI runs them once each at smoke size, with --benchmark-disable.)  The
side-by-side comparison with memcpy and Mooncake Store is ``beluga bench store``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

from beluga.bench.store import BATCH, BATCH_VALUE, serve_in_child
from beluga.child import server_process
from beluga.kv import KVStore
from beluga.pool import Pool

#: leaves("keys"): the timed puts stay in the pool (tests/conftest.py)
pytestmark = [pytest.mark.benchmark, pytest.mark.leaves("keys")]
SIZES = [16 << 10, 2 << 20]


@pytest.fixture
def store(pool: Pool) -> Iterator[KVStore]:
    with server_process(serve_in_child, pool.spec), KVStore(pool) as kv:
        yield kv


@pytest.mark.parametrize("size", SIZES)
def test_put(benchmark, store: KVStore, size: int) -> None:
    value = os.urandom(size)
    benchmark(store.put, "bench", value)  # each put publishes a new version out of place
    assert store.get("bench") == value


@pytest.mark.parametrize("size", SIZES)
def test_get(benchmark, store: KVStore, size: int) -> None:
    value = os.urandom(size)
    store.put("bench", value)
    assert benchmark(store.get, "bench") == value


@pytest.mark.parametrize("size", SIZES)
def test_get_into(benchmark, store: KVStore, size: int) -> None:
    value = np.frombuffer(os.urandom(size), dtype=np.uint8)
    out = np.empty_like(value)
    store.put_from("bench", value)
    assert benchmark(store.get_into, "bench", out) == size
    assert np.array_equal(out, value)


def test_batch_get_into(benchmark, store: KVStore) -> None:
    keys = [f"bench-{i}" for i in range(BATCH)]
    values = [os.urandom(BATCH_VALUE) for _ in keys]
    out = [bytearray(BATCH_VALUE) for _ in keys]
    store.put_batch(keys, values)
    assert benchmark(store.batch_get_into, keys, out) == [BATCH_VALUE] * BATCH
    assert out == values


def test_is_exist(benchmark, store: KVStore) -> None:
    store.put("bench", b"value")
    assert benchmark(store.is_exist, "bench")
