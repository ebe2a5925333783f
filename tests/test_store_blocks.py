"""The store's validated read when a batch names one pool block more than once.

Two vLLM requests of one step can load one pool block into two engine blocks:
``KVStore.read_blocks`` validates each block once for all its rows, and every
copy is still checked.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

import numpy as np
import pytest

from beluga.kv import BlockRef, KVStore, MetadataServer
from beluga.pool import Geometry, Pool

#: blocks are written to be read back; the pool keeps them (tests/conftest.py)
pytestmark = pytest.mark.leaves("keys")
SIZE = 5000


@pytest.fixture
def store(shm_path: str) -> Iterator[KVStore]:
    pool = Pool.create(shm_path, 16 << 20, geometry=Geometry(max_hosts=4, block_size=16 << 10))
    server = MetadataServer(pool)
    thread = server.start_thread()
    try:
        with KVStore(shm_path) as s:
            yield s
    finally:
        server.stop()
        thread.join(timeout=10)
        server.close()
        pool.close()
        Pool.destroy(shm_path)


def values(store: KVStore, keys: list[bytes]) -> list[bytes]:
    data = [random.Random(k).randbytes(SIZE) for k in keys]
    store.batch_put_from(keys, data)
    return data


def rows(refs: list[BlockRef]) -> np.ndarray:
    """Each ref's whole value into buffer 0, one after another (a ref may repeat a block)."""
    table = [(0, i * SIZE, r.payload_offset, SIZE) for i, r in enumerate(refs)]
    return np.array(table, dtype=np.uint64)


def test_a_block_named_twice_is_read_into_both_places(store: KVStore) -> None:
    a, b = values(store, [b"a", b"b"])
    ra, rb = store.locate([b"a", b"b"])
    refs = [ra, rb, ra]
    out = np.zeros(3 * SIZE, dtype=np.uint8)
    assert store.read_blocks(refs, [out], rows(refs)) == [True, True, True]
    assert out.tobytes() == a + b + a


def test_another_version_of_a_block_named_twice_is_a_miss(store: KVStore) -> None:
    (a,) = values(store, [b"a"])
    (ra,) = store.locate([b"a"])
    stale = dataclasses.replace(ra, version=ra.version + 1)  # as if located at another time
    out = np.zeros(2 * SIZE, dtype=np.uint8)
    assert store.read_blocks([ra, stale], [out], rows([ra, stale])) == [True, False]
    assert out[:SIZE].tobytes() == a


def test_a_corrupted_block_named_twice_is_a_miss_in_both_places(store: KVStore) -> None:
    values(store, [b"a", b"b"])
    ra, rb = store.locate([b"a", b"b"])
    value = store.get(b"a")
    assert value is not None
    with Pool.attach(store.pool.spec) as hostile:
        hostile.memory.nt_store(ra.payload_offset + 77, bytes([value[77] ^ 0xFF]))
        hostile.memory.sfence()
    refs = [ra, rb, ra]
    out = np.zeros(3 * SIZE, dtype=np.uint8)
    assert store.read_blocks(refs, [out], rows(refs)) == [False, True, False]


def test_a_write_context_commits_a_fill_and_gives_back_the_rest(store: KVStore) -> None:
    """writing(): the fill seals and commits; anything else before it frees the extents."""
    data = [random.Random(k).randbytes(SIZE) for k in (b"a", b"b")]
    with store.writing([b"a", b"b"], [SIZE, SIZE]) as w:
        table = np.array(
            [(i, 0, off, SIZE) for i, off in enumerate(w.payload_offsets)], dtype=np.uint64
        )
        w.fill(data, table)
        with pytest.raises(ValueError, match="already filled"):
            w.fill(data, table)
    assert store.get_batch([b"a", b"b"]) == data
    used = store.stats()["blocks_used"]
    with (
        pytest.raises(RuntimeError, match="building the table failed"),
        store.writing([b"c"], [SIZE]),
    ):
        raise RuntimeError("building the table failed")
    with store.writing([b"d"], [SIZE]):
        pass  # never filled
    stats = store.stats()
    assert stats["blocks_used"] == used and stats["writes_in_flight"] == 0
    assert not store.is_exist(b"c") and not store.is_exist(b"d")
