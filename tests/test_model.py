"""The simulated non-coherent host: each rule of model.c, observed from two hosts."""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from beluga.coherence import Memory

LINE = 64
# Each rule is observed alone, so random eviction is off unless a test turns it on.
# Said explicitly: the production default is ModelConfig's, never the C constructor's.
NO_EVICTION = {"evict_rate": 0.0}
QUIET = {**NO_EVICTION, "drain_rate": 0.0, "refill_rate": 0.0}  # exact steps, nothing random


def two_hosts(**kw: object) -> tuple[bytearray, Memory, Memory]:
    kw = {**NO_EVICTION, **kw}
    shared = bytearray(1 << 16)
    a = Memory(shared, "model", seed=1, **kw)
    b = Memory(shared, "model", seed=2, **kw)
    return shared, a, b


def fresh(m: Memory, off: int, n: int) -> bytes:
    """The reader's recipe: invalidate, MFENCE, load."""
    m.invalidate(off, n)
    m.mfence()
    return m.load(off, n)


# -- the cache ---------------------------------------------------------------------


def test_stores_stay_private_until_flushed_and_fenced() -> None:
    shared, a, b = two_hosts(**QUIET)
    a.store(0, b"new!")
    assert bytes(shared[:4]) == bytes(4)
    assert b.load(0, 4) == bytes(4)
    a.flush(0, 4)
    assert bytes(shared[:4]) == bytes(4)  # CLFLUSHOPT completes at the next fence
    a.sfence()
    assert bytes(shared[:4]) == b"new!"
    assert fresh(b, 0, 4) == b"new!"


def test_writeback_keeps_the_line_clean() -> None:
    shared, a, _ = two_hosts(**QUIET)
    a.store(0, b"x")
    a.writeback(0, 1)
    assert shared[0:1] == b"\0"
    a.sfence()
    assert shared[0:1] == b"x"
    shared[0:1] = b"y"  # someone else changes memory; a still holds its clean copy
    assert a.load(0, 1) == b"x"


def test_lines_are_written_back_whole_so_two_writers_lose_data() -> None:
    shared, a, b = two_hosts()
    a.load(0, 1)
    b.load(0, 1)  # both hold the line
    a.store(0, b"A")
    b.store(32, b"B")
    a.flush(0, 1)
    a.sfence()
    b.flush(32, 1)  # b's whole stale line overwrites a's byte
    b.sfence()
    assert shared[0:1] == b"\0" and shared[32:33] == b"B"


def test_multi_line_ranges_and_unaligned_access() -> None:
    _shared, a, b = two_hosts()
    data = bytes(range(200))
    a.store(30, data)
    a.flush(30, len(data))
    a.sfence()
    assert fresh(b, 30, len(data)) == data


def test_a_host_always_sees_its_own_stores() -> None:
    shared, a, _ = two_hosts(**QUIET)
    a.nt_store(0, b"streamed")
    a.store(100, b"cached")
    a.flush(100, 6)
    assert bytes(shared[:8]) == bytes(8) and bytes(shared[100:106]) == bytes(6)
    assert a.load(0, 8) == b"streamed"  # forwarded from its own write-combining buffer
    assert a.load(100, 6) == b"cached"  # its own write-back in flight
    a.mfence()
    assert bytes(shared[:8]) == b"streamed" and bytes(shared[100:106]) == b"cached"


LINES = 3  # the lines a host's own stores land in below
#: one step of a host: an operation (stores and loads weighted up), a line, a place in it, bytes
_OWN_OPS = st.tuples(
    st.sampled_from(["nt_store", "store"] * 3 + ["load"] * 2 + ["flush", "writeback", "sfence"]),
    st.integers(0, LINES - 1),
    st.integers(0, LINE - 1),
    st.binary(min_size=1, max_size=16),
)


@settings(max_examples=150, deadline=None)
@example(  # a line comes in over its queued bytes, is stored to, and is evicted by a load
    cache_lines=1,
    drain_rate=0.0,
    seed=0,
    ops=[
        ("nt_store", 0, 0, b"old"),
        ("load", 0, 0, b""),
        ("store", 0, 0, b"new"),
        ("load", 1, 0, b""),
    ],
)
@given(
    cache_lines=st.sampled_from([1, 2]),
    drain_rate=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**32),
    ops=st.lists(_OWN_OPS, max_size=30),
)
def test_an_evicted_line_never_overtakes_its_own_queued_bytes(
    cache_lines: int, drain_rate: float, seed: int, ops: list[tuple]
) -> None:
    """Whatever a host stores, cached or streamed, whatever its tiny cache evicts (written
    back over bytes it queued for that line) and whenever its queue drains, memory ends
    with the host's stores in its program order: the last bytes stored at each place."""
    shared = bytearray(1 << 16)
    want = bytearray(LINES * LINE)
    knobs = {**QUIET, "drain_rate": drain_rate}
    m = Memory(shared, "model", seed=seed, cache_lines=cache_lines, **knobs)
    for name, line, at, data in ops:
        off = line * LINE + at
        if name in ("nt_store", "store"):
            data = data[: LINES * LINE - off]
            getattr(m, name)(off, data)
            want[off : off + len(data)] = data
        elif name == "load":
            m.load(off, 1)  # a one- or two-line cache evicts another line
        elif name in ("flush", "writeback"):
            getattr(m, name)(line * LINE, LINE)
        else:
            m.sfence()
    for line in range(LINES):
        m.flush(line * LINE, LINE)
    m.sfence()
    assert bytes(shared[: LINES * LINE]) == bytes(want)


# -- eviction ------------------------------------------------------------------------


def test_random_eviction_leaks_unflushed_stores_deterministically() -> None:
    def leaked(seed: int) -> list[int]:
        shared = bytearray(1 << 16)
        m = Memory(shared, "model", seed=seed, evict_rate=0.05, cache_lines=4096)
        for i in range(512):
            m.store(i * LINE, b"\x01")
        return [i for i in range(512) if shared[i * LINE]]

    first = leaked(7)
    assert 0 < len(first) < 512
    assert leaked(7) == first
    assert leaked(8) != first


def test_a_full_cache_evicts_a_victim() -> None:
    shared = bytearray(1 << 16)
    m = Memory(shared, "model", cache_lines=4, **NO_EVICTION)
    for i in range(16):
        m.store(i * LINE, b"\x01")
    stats = m.model_stats()
    assert stats["writebacks"] == 12 and sum(shared[i * LINE] for i in range(16)) == 12


def test_a_polled_line_is_never_evicted_so_it_stays_stale_while_polled() -> None:
    _shared, a, b = two_hosts(evict_rate=1.0)  # an eviction attempt after every line touched
    b.load(0, 8)  # the flag
    b.load(LINE, 8)  # a line b then leaves cold
    a.nt_store(0, b"raised!!")
    a.nt_store(LINE, b"changed!")
    a.sfence()
    assert all(b.load(0, 8) == bytes(8) for _ in range(5000))  # hot: spared, stale
    assert b.model_stats()["evictions"] >= 1
    assert b.load(LINE, 8) == b"changed!"  # the cold line was evicted, so it refilled


# -- write-combining buffers ---------------------------------------------------------


def test_nt_stores_are_invisible_until_a_fence() -> None:
    shared, a, b = two_hosts(**QUIET)
    a.nt_store(0, b"payload")
    assert bytes(shared[:7]) == bytes(7)
    assert fresh(b, 0, 7) == bytes(7)
    a.sfence()
    assert fresh(b, 0, 7) == b"payload"
    a.nt_store(LINE, b"again")
    a.mfence()  # MFENCE drains them too
    assert bytes(shared[LINE : LINE + 5]) == b"again"


def test_nt_stores_reach_memory_in_any_order_before_the_fence() -> None:
    def published_first(seed: int) -> bool:
        shared = bytearray(1 << 16)
        m = Memory(shared, "model", seed=seed, **NO_EVICTION)
        m.nt_store(0, b"data")  # no SFENCE between the data and its flag: the bug
        m.nt_store(LINE, b"flag")
        return shared[LINE : LINE + 4] == b"flag" and shared[0:4] != b"data"

    outcomes = [published_first(seed) for seed in range(200)]
    assert any(outcomes) and not all(outcomes)
    assert outcomes == [published_first(seed) for seed in range(200)]  # replays exactly


def test_a_write_combining_buffer_may_drain_in_pieces() -> None:
    def visible(seed: int) -> bytes:
        shared = bytearray(1 << 16)
        m = Memory(shared, "model", seed=seed, drain_rate=1.0, **NO_EVICTION)
        m.nt_store(0, b"\xff" * LINE)
        return bytes(shared[:LINE])

    torn = [v for v in map(visible, range(64)) if 0 < v.count(0xFF) < LINE]
    assert torn and all(v.count(0xFF) % 8 == 0 for v in torn)  # whole 8-byte pieces


def test_a_full_write_combining_queue_drains_some_lines_early() -> None:
    shared = bytearray(1 << 16)
    m = Memory(shared, "model", **QUIET)
    m.nt_store(0, b"\x01" * (64 * LINE))
    landed = sum(shared[i * LINE] for i in range(64))
    assert 0 < landed < 64
    assert m.model_stats()["early_drains"] == landed
    m.sfence()
    assert sum(shared[i * LINE] for i in range(64)) == 64


def test_nt_store_writes_back_and_drops_a_cached_line() -> None:
    shared, a, _ = two_hosts(**QUIET)
    a.store(0, b"dirty")
    a.nt_store(8, b"nt")
    a.sfence()
    assert bytes(shared[:10]) == b"dirty\0\0\0nt"  # the dirty line went first, whole
    shared[0:1] = b"D"
    assert a.load(0, 1) == b"D"  # the line was dropped, so the load refills it


# -- invalidation, refills and the store buffer --------------------------------------


def test_loads_see_stale_lines_until_invalidated_and_mfenced() -> None:
    _shared, a, b = two_hosts(**QUIET)
    assert b.load(128, 8) == bytes(8)  # b caches the line
    a.nt_store(128, b"12345678")
    a.sfence()
    assert b.load(128, 8) == bytes(8)  # stale
    b.invalidate(128, 8)
    assert b.load(128, 8) == bytes(8)  # the invalidation has not completed ...
    b.sfence()
    assert b.load(128, 8) == bytes(8)  # ... and SFENCE does not order loads
    b.mfence()
    assert b.load(128, 8) == b"12345678"


def test_an_invalidated_line_may_come_back_before_the_data_is_written() -> None:
    _shared, a, b = two_hosts(drain_rate=0.0, refill_rate=1.0)
    b.invalidate(0, 8)  # too early: before the writer wrote
    b.mfence()
    a.nt_store(0, b"written!")
    a.sfence()
    assert b.load(0, 8) == bytes(8)  # a speculative refill brought the old line back
    assert b.model_stats()["refills"] == 1
    assert fresh(b, 0, 8) == b"written!"


def test_dekker_without_mfence_lets_both_hosts_in() -> None:
    flag_a, flag_b = 0, LINE

    def handshake(fence: str) -> tuple[bytes, bytes]:
        _shared, a, b = two_hosts(**QUIET)
        a.load(flag_b, 1)  # each host has read the other's flag before (an earlier round)
        b.load(flag_a, 1)
        seen = []
        for me, mine, theirs in ((a, flag_a, flag_b), (b, flag_b, flag_a)):
            me.nt_store(mine, b"\x01")  # I want in ...
            me.sfence()
            me.invalidate(theirs, 1)  # ... do you?
            getattr(me, fence)()
            seen.append(me.load(theirs, 1))
        return seen[0], seen[1]

    assert handshake("sfence") == (b"\0", b"\0")  # both enter: the load passed the store
    assert handshake("mfence") == (b"\0", b"\x01")  # b sees a's flag


def test_invalidate_drops_a_dirty_line_so_a_verify_read_cannot_hide_a_missing_flush() -> None:
    shared, a, b = two_hosts(**QUIET)
    a.store(0, b"claim")  # a claim written without a flush ...
    assert fresh(a, 0, 5) == bytes(5)  # ... is not what its own verify-read finds
    assert bytes(shared[:5]) == bytes(5) and fresh(b, 0, 5) == bytes(5)
    assert a.model_stats()["dirty_dropped"] == 1
    a.store(0, b"claim")
    a.flush(0, 5)
    assert fresh(a, 0, 5) == b"claim" and bytes(shared[:5]) == b"claim"


def test_a_store_to_a_line_being_flushed_completes_the_flush_first() -> None:
    shared, a, _ = two_hosts(**QUIET)
    a.store(0, b"one")
    a.flush(0, 3)
    a.store(4, b"two")  # lands after the flush: in a new copy of the line, dirty
    a.mfence()  # completes the flush, but must not drop the newer store
    assert bytes(shared[:7]) == b"one\0\0\0\0" and a.load(0, 7) == b"one\0two"
    a.flush(0, 7)
    a.sfence()
    assert bytes(shared[:7]) == b"one\0two"


# -- crashes, forks, determinism -----------------------------------------------------


def test_discard_forgets_unflushed_lines_like_a_crash() -> None:
    shared, a, _ = two_hosts(**QUIET)
    a.store(0, b"lost")
    a.nt_store(LINE, b"lost too")
    a.discard()
    a.flush(0, 2 * LINE)
    a.mfence()
    assert bytes(shared[: 2 * LINE]) == bytes(2 * LINE)
    assert a.model_stats()["discarded"] == 2


def test_a_crashed_host_lands_exactly_k_writes_and_nothing_after() -> None:
    shared, a, _ = two_hosts(**QUIET)
    a.nt_store(0, b"\x01" * (4 * LINE))  # four lines queued
    a.crash_after(2)
    a.sfence()  # two land, then the host dies mid-fence
    stats = a.model_stats()
    assert stats["landed"] == 2 and stats["crashed"]
    assert sum(shared[i * LINE] for i in range(4)) == 2
    a.store(8 * LINE, b"late")
    a.flush(8 * LINE, LINE)
    a.nt_store(9 * LINE, b"later")
    a.mfence()
    assert bytes(shared[8 * LINE : 10 * LINE]) == bytes(2 * LINE)  # a dead host writes nothing
    assert a.model_stats()["landed"] == 2


def test_the_same_seed_crashes_through_the_same_states() -> None:
    """State k + 1 extends state k: a sweep over k sees every state a write passes through."""
    states = []
    for k in range(9):
        shared = bytearray(1 << 12)
        m = Memory(shared, "model", seed=7, **QUIET)
        m.crash_after(k)
        m.nt_store(0, bytes(range(1, 256)) * 2)  # eight lines, drained in a seeded order
        m.sfence()
        states.append({i for i in range(8) if shared[i * LINE]})
    assert [len(s) for s in states] == list(range(9))
    assert all(a < b for a, b in itertools.pairwise(states))


def test_a_host_that_never_fences_keeps_its_latest_invalidations_in_flight() -> None:
    _, a, b = two_hosts(**QUIET)
    for line in range(100):
        b.load(line * LINE, 8)  # b caches 100 lines
    a.nt_store(0, b"\x07" * (100 * LINE))
    a.sfence()
    b.invalidate(0, 100 * LINE)  # never fenced: only the oldest 36 complete
    seen = [b.load(line * LINE, 1) for line in range(100)]
    assert seen == [b"\x07"] * 36 + [b"\0"] * 64


def _wait_child(pid: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError(f"forked child {pid} hung (a model mutex inherited locked?)")


def _in_child(body: object) -> int:
    """Fork; the child runs body() and exits 0 when it returns True."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if body() else 2  # type: ignore[operator]
        finally:
            os._exit(code)
    return _wait_child(pid)


def test_a_forked_child_starts_empty_and_never_writes_back_the_parents_lines() -> None:
    shared = mmap.mmap(-1, 1 << 16)  # MAP_SHARED: the child's writes would reach the parent
    m = Memory(shared, "model", **QUIET)
    m.store(0, b"parent's")  # dirty in the parent's cache, never flushed
    m.nt_store(LINE, b"queued")  # in the parent's write-combining buffers

    def child() -> bool:
        own_view = m.load(0, 8) == bytes(8) and m.load(LINE, 6) == bytes(6)
        m.flush(0, 1 << 16)
        m.mfence()
        return own_view

    assert _in_child(child) == 0
    assert shared[: 2 * LINE] == bytes(2 * LINE)
    m.flush(0, LINE)
    m.mfence()
    assert shared[:8] == b"parent's" and shared[LINE : LINE + 6] == b"queued"
    m.release()
    shared.close()


def test_fork_while_another_thread_holds_the_model_is_safe() -> None:
    shared = mmap.mmap(-1, 1 << 20)
    m = Memory(shared, "model", **NO_EVICTION)
    stop = threading.Event()
    big = bytearray(512 << 10)  # long enough that the copy runs without the GIL

    def hammer() -> None:
        while not stop.is_set():
            m.load_into(0, big)

    t = threading.Thread(target=hammer)
    t.start()
    try:
        for _ in range(20):
            assert _in_child(lambda: m.load(0, 8) == bytes(8)) == 0
    finally:
        stop.set()
        t.join(timeout=30)
    assert not t.is_alive()
    m.release()
    shared.close()


def test_the_same_seed_replays_the_same_run() -> None:
    def run(seed: int) -> tuple[bytes, dict]:
        shared = bytearray(1 << 16)
        a = Memory(shared, "model", seed=seed, evict_rate=0.05, cache_lines=64)
        b = Memory(shared, "model", seed=seed + 1, evict_rate=0.05, cache_lines=64)
        for i in range(300):
            off = (i * 7919) % ((1 << 16) - 8) & ~7
            (a.store if i % 3 else a.nt_store)(off, i.to_bytes(8, "little"))
            if i % 5 == 0:
                a.flush(off, 8)
            if i % 11 == 0:
                a.sfence()
            b.invalidate(off, 8)
            if i % 2:
                b.mfence()
            b.load(off, 8)
        return bytes(shared), a.model_stats() | {"b": b.model_stats()}

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_model_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        Memory(bytearray(64), "model", evict_rate=1.5)
    with pytest.raises(ValueError):
        Memory(bytearray(64), "model", drain_rate=-0.1)
    with pytest.raises(ValueError):
        Memory(bytearray(64), "model", refill_rate=2.0)
    with pytest.raises(ValueError):
        Memory(bytearray(64), "model", cache_lines=0)
    with pytest.raises(ValueError, match="whole 64-byte lines"):
        Memory(bytearray(100), "model")
