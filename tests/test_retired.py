"""How engines learn what left the pool: ``KVStore.retired`` (the server's RETIRED op).

Eviction is the server's alone, so a router's view of what an engine can
load (vLLM's ``BlockRemoved`` events) needs the server to say which keys it
took out.  Every way a key leaves the index is reported once, in order,
and a value replaced under its key is not; a cursor of another server
life, or older than what the server keeps, is a gap.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from beluga.coherence import digest
from beluga.kv import KVStore
from beluga.kv import protocol as p
from beluga.pool import Geometry, Pool
from beluga.server import MetadataServer
from beluga.server import service as service_module
from beluga.transfer import Buffers

#: values are stored to be evicted and reported; the pool keeps some (tests/conftest.py)
pytestmark = pytest.mark.leaves("keys")
SIZE = 5000
BLOCKS = 1024


class Served:
    """A pool and its server in a thread, restartable."""

    def __init__(self, path: str, rpc_bytes_per_host: int | None = None) -> None:
        self.path = path
        rpc = {} if rpc_bytes_per_host is None else {"rpc_bytes_per_host": rpc_bytes_per_host}
        geometry = Geometry(max_hosts=4, block_size=16 << 10, **rpc)
        self.pool = Pool.create(path, BLOCKS * (16 << 10) + (4 << 20), geometry=geometry)
        self.start()

    def start(self) -> None:
        self.server = MetadataServer(self.pool)
        self.thread = self.server.start_thread()

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(timeout=10)
        self.server.close()


@pytest.fixture
def served(shm_path: str) -> Iterator[Served]:
    s = Served(shm_path)
    try:
        yield s
    finally:
        s.stop()
        s.pool.close()
        Pool.destroy(shm_path)


@pytest.fixture
def paged(shm_path: str) -> Iterator[Served]:
    """A pool whose RPC area is small: an answer of RETIRED holds a few hundred keys."""
    s = Served(shm_path, rpc_bytes_per_host=8 << 10)
    try:
        yield s
    finally:
        s.stop()
        s.pool.close()
        Pool.destroy(shm_path)


def d(key: bytes) -> bytes:
    return digest(key)


def test_every_way_out_of_the_index_is_reported_once_in_order(served: Served) -> None:
    with KVStore(served.path) as store:
        first = store.retired()
        assert first.digests == [] and not first.gap
        store.batch_put_from([b"a", b"b", b"c"], [b"x" * SIZE] * 3)
        store.put(b"b", b"y" * SIZE)  # replaced: still there, not retired
        assert store.remove(b"a")
        assert not store.remove(b"never")
        ref = store.locate([b"c"])[0]
        assert ref is not None
        store.mem.store(ref.payload_offset, b"\xff" * 8)  # corrupt: the reader drops it
        assert store.load([ref], _sink(1), drop_corrupt=True) == [False]
        got = store.retired(first.cursor)
        assert got.digests == [d(b"a"), d(b"c")] and not got.gap
        again = store.retired(got.cursor)
        assert again.digests == [] and again.cursor == got.cursor


def test_evictions_are_reported_oldest_first_across_many_answers(served: Served) -> None:
    with KVStore(served.path) as store:
        cursor = store.retired().cursor
        keys = [b"k%05d" % i for i in range(2 * BLOCKS)]
        value = random.Random(1).randbytes(SIZE)
        for start in range(0, len(keys), 64):
            store.batch_put_from(keys[start : start + 64], [value] * 64)
        got = store.retired(cursor)
        evicted = [k for k in keys if not store.is_exist(k)]
        most = (store.rpc.max_payload - p.RETIRED_HEADER_BYTES) // 16
        assert len(evicted) > most  # more than one answer's worth
        assert got.digests == [d(k) for k in evicted]  # LRU: the oldest went first
        assert not got.gap


def test_a_cursor_of_an_earlier_server_life_is_a_gap(served: Served) -> None:
    with KVStore(served.path) as store:
        cursor = store.retired().cursor
        store.batch_put_from([b"a", b"b"], [b"x" * SIZE] * 2)
    served.stop()
    served.start()
    with KVStore(served.path) as store:
        assert store.is_exist(b"a")  # recovered
        assert store.remove(b"b")
        got = store.retired(cursor)
        assert got.gap and got.digests == [d(b"b")]  # what left since the restart


def test_more_retirements_than_the_server_keeps_is_a_gap(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    served.stop()
    monkeypatch.setattr(service_module, "RETIRED_KEEP", 4)
    served.start()
    with KVStore(served.path) as store:
        cursor = store.retired().cursor
        keys = [b"r%d" % i for i in range(6)]
        store.batch_put_from(keys, [b"x" * 100] * 6)
        for k in keys:
            assert store.remove(k)
        got = store.retired(cursor)
        assert got.gap and got.digests == [d(k) for k in keys[2:]]
        kept = store.retired(got.cursor)
        assert kept.digests == [] and not kept.gap


def _page(store: KVStore) -> int:
    """How many keys one RETIRED answer holds (what KVStore.retired asks for)."""
    return (store.rpc.max_payload - p.RETIRED_HEADER_BYTES) // p.RECORD_BYTES[p.StoreOp.RETIRED]


def _remove_many(store: KVStore, keys: list[bytes]) -> None:
    """Store each key and remove it: one retirement per key, in this order (64 keys in the
    pool at a time: nothing is evicted)."""
    for start in range(0, len(keys), 64):
        batch = keys[start : start + 64]
        store.batch_put_from(batch, [b"x" * 100] * len(batch))
        for k in batch:
            assert store.remove(k)


def test_a_gap_in_the_first_page_of_a_long_answer_is_reported(
    paged: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server keeps two and a half answers' worth of keys, and more left since the
    cursor: the answer, three pages long, starts past the cursor (a gap) in its first
    page only."""
    with KVStore(paged.path) as store:
        most = _page(store)
    paged.stop()
    monkeypatch.setattr(service_module, "RETIRED_KEEP", 2 * most + most // 2)
    paged.start()
    with KVStore(paged.path) as store:
        cursor = store.retired().cursor
        keys = [b"g%05d" % i for i in range(3 * most)]
        _remove_many(store, keys)
        got = store.retired(cursor)
        assert got.digests == [d(k) for k in keys[-(2 * most + most // 2) :]]
        assert got.gap, "a gap in the first page was forgotten by the last"
        after = store.retired(got.cursor)
        assert after.digests == [] and not after.gap


def test_a_gap_that_opens_between_two_pages_of_an_answer_is_reported(
    paged: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer's first page comes whole; before the second is asked for, so many keys
    leave that the server no longer keeps the next one: the gap is in a middle page, and
    the answer says so."""
    with KVStore(paged.path) as store:
        most = _page(store)
    paged.stop()
    monkeypatch.setattr(service_module, "RETIRED_KEEP", 2 * most)
    paged.start()
    with KVStore(paged.path) as store, KVStore(paged.path) as other:
        cursor = store.retired().cursor
        first = [b"f%05d" % i for i in range(2 * most)]
        _remove_many(store, first)
        later = [b"l%05d" % i for i in range(most + most // 2)]
        call = store.rpc.call
        pages = 0

        def between_pages(op: int, *args: Any) -> bytes:
            nonlocal pages
            if op == p.StoreOp.RETIRED:
                pages += 1
                if pages == 2:  # after the first page: the server drops what it held next
                    _remove_many(other, later)
            return call(op, *args)

        monkeypatch.setattr(store.rpc, "call", between_pages)
        got = store.retired(cursor)
        assert pages >= 3, "the answer did not span three pages"
        assert got.gap, "a gap in a middle page was forgotten by the last"
        assert got.digests[:most] == [d(k) for k in first[:most]]
        assert got.digests[-len(later) :] == [d(k) for k in later]


def _sink(n: int) -> Buffers:
    return Buffers([np.zeros(SIZE, dtype=np.uint8) for _ in range(n)])
