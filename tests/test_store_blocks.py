"""The store's one data path: ``KVStore.save(keys, source)`` and ``KVStore.load(refs, sink)``.

Saves skip what the pool holds or another writer is writing (duplicate work
costs no capacity), give every extent back when the move fails, and report
each key's outcome; loads validate every block, also one named twice in a
batch (two vLLM requests of one step can load one pool block into two
engine blocks), and refuse a value whose length is not the sink's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from beluga.chaos.roles import Midway
from beluga.kv import KVStore
from beluga.pool import Geometry, Pool
from beluga.server import MetadataServer
from beluga.transfer import Buffers, Pieces

#: blocks are written to be read back; the pool keeps them (tests/conftest.py)
pytestmark = pytest.mark.leaves("keys")
SIZE = 5000


@contextlib.contextmanager
def _served(path: str) -> Iterator[tuple[KVStore, MetadataServer]]:
    """A pool, its metadata server on a thread, and a store."""
    pool = Pool.create(path, 16 << 20, geometry=Geometry(max_hosts=4, block_size=16 << 10))
    server = MetadataServer(pool)
    thread = server.start_thread()
    try:
        with KVStore(path) as s:
            yield s, server
    finally:
        server.stop()
        thread.join(timeout=10)
        server.close()
        pool.close()
        Pool.destroy(path)


@pytest.fixture
def store(shm_path: str) -> Iterator[KVStore]:
    with _served(shm_path) as (s, _):
        yield s


@pytest.fixture
def served(shm_path: str) -> Iterator[tuple[KVStore, MetadataServer]]:
    """A store and its server (whose allocator a test may aim at a block)."""
    with _served(shm_path) as pair:
        yield pair


def data(key: bytes, size: int = SIZE) -> bytes:
    return random.Random(key).randbytes(size)


def values(store: KVStore, keys: list[bytes]) -> list[bytes]:
    out = [data(k) for k in keys]
    store.batch_put_from(keys, out)
    return out


def sinks(n: int, size: int = SIZE) -> list[np.ndarray]:
    return [np.zeros(size, dtype=np.uint8) for _ in range(n)]


def test_a_block_named_twice_is_read_into_both_places(store: KVStore) -> None:
    a, b = values(store, [b"a", b"b"])
    ra, rb = store.locate([b"a", b"b"])
    out = sinks(3)
    assert store.load([ra, rb, ra], Buffers(out)) == [True, True, True]
    assert [o.tobytes() for o in out] == [a, b, a]


def test_another_version_of_a_block_named_twice_is_a_miss(store: KVStore) -> None:
    (a,) = values(store, [b"a"])
    (ra,) = store.locate([b"a"])
    stale = dataclasses.replace(ra, version=ra.version + 1)  # as if located at another time
    out = sinks(2)
    assert store.load([ra, stale], Buffers(out)) == [True, False]
    assert out[0].tobytes() == a


def test_a_corrupted_block_named_twice_is_a_miss_in_both_places(store: KVStore) -> None:
    values(store, [b"a", b"b"])
    ra, rb = store.locate([b"a", b"b"])
    value = store.get(b"a")
    assert value is not None
    with Pool.attach(store.pool.spec) as hostile:
        hostile.memory.nt_store(ra.payload_offset + 77, bytes([value[77] ^ 0xFF]))
        hostile.memory.sfence()
    assert store.load([ra, rb, ra], Buffers(sinks(3))) == [False, True, False]


def test_a_load_takes_only_values_of_the_sinks_length(store: KVStore) -> None:
    a, _ = values(store, [b"a", b"b"])
    refs = store.locate([b"a", b"missing", b"b"], prefix=False)
    assert refs[1] is None
    out = [np.zeros(SIZE, np.uint8), np.zeros(SIZE, np.uint8), np.zeros(SIZE - 1, np.uint8)]
    assert store.load(refs, Buffers(out)) == [True, False, False]
    assert out[0].tobytes() == a and not out[2].any()  # nothing copied into a short sink
    with pytest.raises(ValueError, match="2 refs but 3 values"):
        store.load(refs[:2], Buffers(out))


def test_pieces_are_one_value_each_way(store: KVStore) -> None:
    header, payload = b"h" * 64, data(b"p")
    saved = store.save([b"chunk"], Pieces([[header, payload]]))
    assert saved.stored == [0] and store.get(b"chunk") == header + payload
    got_header, got_payload = bytearray(64), np.zeros(SIZE, np.uint8)
    refs = store.locate([b"chunk"])
    assert store.load(refs, Pieces([[got_header, got_payload]])) == [True]
    assert bytes(got_header) == header and got_payload.tobytes() == payload


def test_a_save_skips_what_is_committed_and_costs_it_no_capacity(store: KVStore) -> None:
    saved = store.save([b"a", b"b"], Buffers([data(b"a"), data(b"b")]))
    assert (saved.stored, saved.present, saved.lost) == ([0, 1], [], [])
    used, (ra,) = store.stats()["blocks_used"], store.locate([b"a"])
    saved = store.save([b"a", b"c", b"c"], Buffers([b"other" * 10, data(b"c"), data(b"c")]))
    # "a" is committed: its value stays; "c" twice in one batch is written once
    assert (saved.stored, saved.present) == ([1], [0, 2])
    assert store.get(b"a") == data(b"a") and store.locate([b"a"]) == [ra]
    stats = store.stats()
    assert stats["blocks_used"] == used + 1 and stats["duplicate_writes_skipped"] == 2
    saved = store.save([b"a"], Buffers([b"new"]), replace=True)  # a put replaces
    assert saved.stored == [0] and store.get(b"a") == b"new"


def test_a_key_another_writer_is_writing_is_in_flight_when_not_waited_for(
    store: KVStore, shm_path: str
) -> None:
    with KVStore(shm_path) as other:
        answers: list[Any] = []

        def meanwhile(mem: Any, places: Any) -> None:  # "k" is reserved, not yet committed
            answers.append(other.save([b"k", b"j"], Buffers([b"second", b"j"]), wait_s=0))
            assert other.get(b"k") is None

        first = store.save([b"k"], Midway([b"first"], meanwhile))
        (second,) = answers
        assert first.stored == [0]
        assert (second.stored, second.present, second.in_flight) == ([1], [], [0])
        assert other.get(b"k") == b"first" and other.get(b"j") == b"j"


def skipped(store: KVStore, count: int) -> None:
    """Wait until the server has skipped ``count`` duplicate writes in all."""
    deadline = time.monotonic() + 30
    while store.stats()["duplicate_writes_skipped"] < count:
        assert time.monotonic() < deadline, "the second save never reached its reservation"
        time.sleep(0.005)


@pytest.mark.parametrize("first_commits", [True, False], ids=["commits", "gives-up"])
def test_a_save_waits_for_another_write_of_its_key(
    store: KVStore, shm_path: str, first_commits: bool
) -> None:
    """The second writer of a key waits for the first: once it commits the key is present;
    if it gives up, the second writes it (nothing is left missing)."""
    answers: list[Any] = []
    with KVStore(shm_path) as other:
        second = threading.Thread(
            target=lambda: answers.append(other.save([b"k"], Buffers([b"2nd"]), wait_s=30))
        )

        def meanwhile(mem: Any, places: Any) -> None:
            second.start()
            skipped(store, 1)  # the second save found "k" being written, and waits
            if not first_commits:
                raise RuntimeError("the first writer gives up")

        with contextlib.nullcontext() if first_commits else pytest.raises(RuntimeError):
            store.save([b"k"], Midway([b"1st"], meanwhile))
        second.join(60)
        assert not second.is_alive()
    (answer,) = answers
    if first_commits:
        assert (answer.stored, answer.present) == ([], [0]) and store.get(b"k") == b"1st"
    else:
        assert (answer.stored, answer.present) == ([0], []) and store.get(b"k") == b"2nd"


def test_a_failed_move_gives_every_extent_back(store: KVStore) -> None:
    before = store.stats()

    def fail(mem: Any, places: Any) -> None:
        raise RuntimeError("building the table failed")

    with pytest.raises(RuntimeError, match="building the table failed"):
        store.save([b"c", b"d"], Midway([data(b"c"), data(b"d")], fail))
    after = store.stats()
    assert after["blocks_used"] == before["blocks_used"] and after["writes_in_flight"] == 0
    assert store.batch_is_exist([b"c", b"d"]) == [False, False]
    saved = store.save([b"c"], Buffers([data(b"c")]))  # nothing is left half-written
    assert saved.stored == [0] and store.get(b"c") == data(b"c")


def test_bad_saves_are_refused_before_anything_is_reserved(store: KVStore) -> None:
    before = store.stats()
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.save([b"a", b"b"], Buffers([b"x"]))
    with pytest.raises(ValueError, match="attempts is at least 1"):
        store.save([b"a"], Buffers([b"x"]), attempts=0)
    with pytest.raises(ValueError, match=r"a key is 1\.\.256 bytes"):
        store.save([b""], Buffers([b"x"]))
    after = store.stats()
    assert after["blocks_used"] == before["blocks_used"] and after["writes_in_flight"] == 0


def test_a_reader_drops_a_corrupt_value_and_only_that_version(store: KVStore) -> None:
    values(store, [b"a", b"b"])
    ra, rb = store.locate([b"a", b"b"])
    value = store.get(b"a")
    assert value is not None and ra is not None
    with Pool.attach(store.pool.spec) as hostile:
        hostile.memory.nt_store(ra.payload_offset + 77, bytes([value[77] ^ 0xFF]))
        hostile.memory.sfence()
    assert store.load([ra, rb], Buffers(sinks(2))) == [False, True]  # by default, kept
    assert store.locate([b"a"]) == [ra]
    assert store.load([ra, rb], Buffers(sinks(2)), drop_corrupt=True) == [False, True]
    assert store.locate([b"a"], prefix=False) == [None] and store.is_exist(b"b")
    assert store.stats()["corrupt_dropped"] == 1
    # a reader whose corrupt copy was of an older version drops nothing of the newer one
    store.batch_put_from([b"a"], [b"fresh"])
    (fresh,) = store.locate([b"a"])
    store._drop([ra])
    assert store.locate([b"a"]) == [fresh] and store.get(b"a") == b"fresh"
    assert store.stats()["corrupt_dropped"] == 1


def test_a_value_replaced_meanwhile_is_a_miss_and_is_not_dropped(store: KVStore) -> None:
    values(store, [b"a"])
    (old,) = store.locate([b"a"])
    store.batch_put_from([b"a"], [data(b"new")])  # replaced between the lookup and the read
    assert store.load([old], Buffers(sinks(1)), drop_corrupt=True) == [False]
    assert store.get(b"a") == data(b"new") and store.stats()["corrupt_dropped"] == 0


def test_a_stale_and_a_current_ref_of_one_block_loaded_together_drop_only_a_corrupt_value(
    served: tuple[KVStore, MetadataServer],
) -> None:
    """A key removed and written again into the same block: a ref of its old version and
    one of its new, loaded together with ``drop_corrupt``, in both orders.  The old one
    is a miss; the new one (good) stays in the pool; only once the new value is corrupted
    does a load drop it."""
    store, server = served
    store.put(b"a", data(b"a"))
    (stale,) = store.locate([b"a"])
    assert stale is not None and store.remove(b"a")
    server.service.alloc._cursor = stale.block  # the next extent is the block just freed
    store.put(b"a", data(b"new"))
    (current,) = store.locate([b"a"])
    assert current is not None and current.block == stale.block
    assert current.version != stale.version
    for refs, loaded in (([stale, current], [False, False]), ([current, stale], [True, False])):
        assert store.load(refs, Buffers(sinks(2)), drop_corrupt=True) == loaded
        assert store.locate([b"a"]) == [current], "a good value was dropped"
        assert store.get(b"a") == data(b"new")
    assert store.stats()["corrupt_dropped"] == 0
    with Pool.attach(store.pool.spec) as hostile:
        hostile.memory.nt_store(current.payload_offset + 9, bytes([data(b"new")[9] ^ 0xFF]))
        hostile.memory.sfence()
    assert store.load([current, stale], Buffers(sinks(2)), drop_corrupt=True) == [False, False]
    assert store.locate([b"a"], prefix=False) == [None]
    assert store.stats()["corrupt_dropped"] == 1


@pytest.mark.leaves("writes")  # "a"'s extent, taken back, is sealed by its writer anyway
@pytest.mark.parametrize("other", ["stays-in-flight", "gives-up", "commits"])
def test_a_save_names_a_lost_lease_while_it_waits_for_another_writer_of_its_second_key(
    store: KVStore, shm_path: str, other: str
) -> None:
    """A save of "a" and "b" without ``replace``, ``wait_s`` 0.2: another store holds "b"
    in flight, and "a"'s write lease is lost before its commit.  "a" is ``lost`` whatever
    the other writer does meanwhile: it keeps "b" in flight past the wait ("b" is
    ``in_flight``, its value the other's), gives up ("b" is stored by this save), or
    commits ("b" is ``present``)."""
    answers: list[Any] = []
    reserved, go = threading.Event(), threading.Event()
    give_up = other == "gives-up"

    def stall(mem: Any, places: Any) -> None:
        reserved.set()
        assert go.wait(30)
        if give_up:
            raise RuntimeError("the other writer gives up")

    def other_save() -> None:
        with contextlib.suppress(RuntimeError):
            answers.append(holder.save([b"b"], Midway([b"the other's"], stall)))

    with KVStore(shm_path) as holder:
        second = threading.Thread(target=other_save)
        second.start()
        assert reserved.wait(30)

        def lose_a(mem: Any, places: Any) -> None:  # "b" was skipped: in flight
            store._abort([places[0]])  # "a"'s grant is taken back: its commit is refused
            if other != "stays-in-flight":
                go.set()
                second.join(30)

        saved = store.save([b"a", b"b"], Midway([data(b"a"), b"mine"], lose_a), wait_s=0.2)
        go.set()
        second.join(30)
        assert not second.is_alive()
    assert saved.lost == [0], saved
    assert store.get(b"a") is None
    if other == "stays-in-flight":
        assert (saved.stored, saved.present, saved.in_flight) == ([], [], [1])
        assert store.get(b"b") == b"the other's"
    elif other == "gives-up":
        assert (saved.stored, saved.present, saved.in_flight) == ([1], [], [])
        assert store.get(b"b") == b"mine"
    else:
        assert (saved.stored, saved.present, saved.in_flight) == ([], [1], [])
        assert store.get(b"b") == b"the other's"


def test_a_peek_is_the_first_bytes_as_the_pool_holds_them_unchecked(store: KVStore) -> None:
    a, b = values(store, [b"a", b"b"])
    refs = store.locate([b"a", b"b"])
    assert store.peek(refs, 64) == [a[:64], b[:64]]
    assert store.peek(refs, SIZE) == [a, b] and store.peek([], 64) == []
    for nbytes in (0, SIZE + 1):
        with pytest.raises(ValueError, match="peek at 1 to a value's length bytes"):
            store.peek(refs, nbytes)
    # a byte changed behind the store's back: a peek shows it, a validated load misses it
    store.mem.nt_store(refs[0].payload_offset + 3, bytes([a[3] ^ 0xFF]))
    store.mem.sfence()
    assert store.peek(refs[:1], 8) == [a[:3] + bytes([a[3] ^ 0xFF]) + a[4:8]]
    assert store.load(refs[:1], Buffers(sinks(1))) == [False]
