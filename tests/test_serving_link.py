"""StoreLink, the integrations' pool connection, under threads and fork.

The stores it makes are wrapped to record when they are made and closed, so
the tests can say: one connection for any number of threads connecting at
once; a store is never closed while a thread still uses it, even when
another thread's failure drops it; every store is closed in the end; a
forked child connects its own and leaves the parent's alone.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections.abc import Iterator

import pytest

from beluga.errors import PoolNotNamedError, RpcError
from beluga.integrations import _link
from beluga.integrations._link import StoreLink
from beluga.kv import KVStore
from beluga.pool import Geometry, Pool
from beluga.server import MetadataServer

THREADS = 6
JOIN_S = 60


class TrackedStore(KVStore):
    """A KVStore that remembers every instance and whether it was closed."""

    made: list[TrackedStore] = []
    guard = threading.Lock()

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.closes = 0
        with TrackedStore.guard:
            TrackedStore.made.append(self)

    def close(self) -> None:
        self.closes += 1
        super().close()


@pytest.fixture
def served(shm_path: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setattr(_link, "KVStore", TrackedStore)
    TrackedStore.made = []
    pool = Pool.create(shm_path, 32 << 20, geometry=Geometry(max_hosts=16, block_size=4096))
    server = MetadataServer(pool)
    thread = server.start_thread()
    yield shm_path
    server.stop()
    thread.join(timeout=10)
    server.close()
    pool.close()
    Pool.destroy(shm_path)


def run_threads(target: object, n: int = THREADS) -> list[BaseException]:
    """Run ``target(i, barrier)`` on ``n`` threads at once; the errors they raised."""
    barrier = threading.Barrier(n, timeout=JOIN_S)
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            target(i, barrier)  # type: ignore[operator]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    return errors


def test_threads_connecting_at_once_share_one_connection(served: str) -> None:
    link = StoreLink(served, who="test", retry_s=0)
    got: list[KVStore | None] = [None] * THREADS

    def connect(i: int, barrier: threading.Barrier) -> None:
        barrier.wait()
        with link.connected() as store:
            got[i] = store

    assert run_threads(connect) == []
    assert len(TrackedStore.made) == 1 and all(s is TrackedStore.made[0] for s in got)
    link.close()
    link.close()
    assert TrackedStore.made[0].closes == 1
    with link.connected() as store:
        assert store is None  # closed links stay closed


@pytest.mark.leaves("keys")
def test_a_store_dropped_by_one_thread_stays_open_for_the_others(served: str) -> None:
    link = StoreLink(served, who="test", retry_s=0)
    rounds = 20

    def work(i: int, barrier: threading.Barrier) -> None:
        for r in range(rounds):
            barrier.wait()  # every thread holds a store when one of them drops it
            with link.connected() as store:
                assert store is not None
                barrier.wait()
                if r % THREADS == i:
                    link.lost(RpcError("injected"), store)
                key = f"k{i}-{r}"
                store.put(key, key.encode() * 100)
                assert store.get(key) == key.encode() * 100
                assert store.closes == 0  # still open while borrowed
                barrier.wait()

    assert run_threads(work) == []
    # one store per round (each round drops one), each closed by its last borrower
    assert [s.closes for s in TrackedStore.made] == [1] * rounds
    link.close()


def test_a_late_report_of_a_dropped_store_keeps_the_new_one(served: str) -> None:
    link = StoreLink(served, who="test", retry_s=0)
    old = link.acquire()
    link.lost(RpcError("first"), old)
    new = link.acquire()
    assert new is not None and new is not old and old.closes == 0  # old is still borrowed
    link.lost(RpcError("the same outage, seen late"), old)
    with link.connected() as store:
        assert store is new
    link.release(old)
    assert old.closes == 1 and new.closes == 0
    link.release(new)
    link.close()
    assert new.closes == 1


def test_close_waits_for_borrowers(served: str) -> None:
    link = StoreLink(served, who="test")
    store = link.acquire()
    link.close()
    assert store is not None and store.closes == 0 and store.get("x") is None
    link.release(store)
    assert store.closes == 1


def _child(link: StoreLink, parent_host: int, answer: mp.Queue) -> None:
    with link.connected() as store:
        assert store is not None and store.rpc.host_id != parent_host
        store.put("from-child", b"child")
        answer.put(store.rpc.host_id)
    link.close()


@pytest.mark.leaves("keys")
def test_a_forked_child_connects_its_own(served: str) -> None:
    link = StoreLink(served, who="test")
    with link.connected() as parent:
        assert parent is not None
        ctx = mp.get_context("fork")
        answer = ctx.Queue()
        child = ctx.Process(target=_child, args=(link, parent.rpc.host_id, answer))
        child.start()
        child.join(JOIN_S)
        assert child.exitcode == 0
        assert answer.get(timeout=JOIN_S) != parent.rpc.host_id
        assert parent.get("from-child") == b"child"  # the parent's connection is untouched
    link.close()


def test_a_link_without_a_spec_takes_beluga_pool_or_says_what_to_set(
    served: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BELUGA_POOL", raising=False)
    with pytest.raises(PoolNotNamedError, match="set Engine X's 'pool' option"):
        StoreLink("", who="Engine X")
    monkeypatch.setenv("BELUGA_POOL", served)
    link = StoreLink(None, who="Engine X")
    assert link.spec == served and link.available()
    link.close()


def test_call_answers_the_default_on_an_outage_and_raises_a_bug(
    served: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", logger="beluga.integrations")
    link = StoreLink(served, who="test", retry_s=3600)
    assert link.call(lambda s: s.get("x"), b"default") is None  # connected: the work's answer
    seen: list[tuple[KVStore, bool]] = []
    ran: list[KVStore] = []

    def outage(store: KVStore) -> None:
        ran.append(store)
        raise RpcError("the server died")

    def on_outage(store: KVStore) -> None:  # runs before the link lets go of the store
        with link.connected() as current:
            seen.append((store, current is store))

    for _ in range(2):  # the second call comes before the next try to connect
        assert link.call(outage, "default", on_outage=on_outage) == "default"
    (store,) = TrackedStore.made
    assert ran == [store] and seen == [(store, True)] and store.closes == 1
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1  # one warning per outage, however many calls meet it
    link.close()

    def bug(store: KVStore) -> None:
        raise ValueError("a bug, not an outage")

    link = StoreLink(served, who="test", retry_s=3600)
    with pytest.raises(ValueError, match="a bug"):
        link.call(bug, None, on_outage=on_outage)
    assert len(seen) == 1 and link.available()  # a bug neither counts nor drops the store
    link.close()


def test_a_link_from_a_frameworks_options_reads_its_names_after_the_prefix(
    served: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = {"x.pool": served, "x.timeout_s": "7", "x.retry_s": 9, "pool": "elsewhere"}
    link = StoreLink.from_options(options, who="Engine X", where="X's config", prefix="x.")
    assert (link.spec, link._timeout_s, link._retry_s) == (served, 7.0, 9.0)
    link.close()
    monkeypatch.delenv("BELUGA_POOL", raising=False)
    with pytest.raises(PoolNotNamedError, match=r"set 'x\.pool' in X's config"):
        StoreLink.from_options({"pool": served}, who="Engine X", where="X's config", prefix="x.")
