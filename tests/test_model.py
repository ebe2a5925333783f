"""The simulated non-coherent cache: each rule of model.c, observed from two hosts."""

from __future__ import annotations

import pytest

from beluga.coherence import Memory

LINE = 64


def two_hosts(**kw: object) -> tuple[bytearray, Memory, Memory]:
    shared = bytearray(1 << 16)
    a = Memory(shared, "model", seed=1, **kw)
    b = Memory(shared, "model", seed=2, **kw)
    return shared, a, b


def test_stores_stay_private_until_flushed() -> None:
    shared, a, b = two_hosts()
    a.store(0, b"new!")
    assert bytes(shared[:4]) == bytes(4)
    assert b.load(0, 4) == bytes(4)
    a.flush(0, 4)
    assert bytes(shared[:4]) == b"new!"
    b.invalidate(0, 4)
    assert b.load(0, 4) == b"new!"


def test_loads_see_stale_lines_until_invalidated() -> None:
    _shared, a, b = two_hosts()
    assert b.load(128, 8) == bytes(8)  # b caches the line
    a.nt_store(128, b"12345678")
    assert b.load(128, 8) == bytes(8)  # stale
    b.invalidate(128, 8)
    assert b.load(128, 8) == b"12345678"


def test_writeback_keeps_the_line_clean() -> None:
    shared, a, _ = two_hosts()
    a.store(0, b"x")
    a.writeback(0, 1)
    assert shared[0:1] == b"x"
    shared[0:1] = b"y"  # someone else changes memory; a still holds its clean copy
    assert a.load(0, 1) == b"x"


def test_nt_store_bypasses_and_drops_a_cached_line() -> None:
    shared, a, _ = two_hosts()
    a.store(0, b"dirty")
    a.nt_store(8, b"nt")
    assert bytes(shared[:10]) == b"dirty\0\0\0nt"  # dirty line written back first, whole
    shared[0:1] = b"D"
    assert a.load(0, 1) == b"D"  # the line was dropped, so the load refills it


def test_lines_are_written_back_whole_so_two_writers_lose_data() -> None:
    shared, a, b = two_hosts()
    a.load(0, 1)
    b.load(0, 1)  # both hold the line
    a.store(0, b"A")
    b.store(32, b"B")
    a.flush(0, 1)
    b.flush(32, 1)  # b's whole stale line overwrites a's byte
    assert shared[0:1] == b"\0" and shared[32:33] == b"B"


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
    m = Memory(shared, "model", cache_lines=4)
    for i in range(16):
        m.store(i * LINE, b"\x01")
    stats = m.model_stats()
    assert stats["writebacks"] == 12 and sum(shared[i * LINE] for i in range(16)) == 12


def test_discard_forgets_unflushed_lines_like_a_crash() -> None:
    shared, a, _ = two_hosts()
    a.store(0, b"lost")
    a.discard()
    a.flush(0, 4)
    assert bytes(shared[:4]) == bytes(4)
    assert a.model_stats()["discarded"] == 1


def test_multi_line_ranges_and_unaligned_access() -> None:
    _shared, a, b = two_hosts()
    data = bytes(range(200))
    a.store(30, data)
    a.flush(30, len(data))
    b.invalidate(30, len(data))
    assert b.load(30, len(data)) == data


def test_model_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        Memory(bytearray(64), "model", evict_rate=1.5)
    with pytest.raises(ValueError):
        Memory(bytearray(64), "model", cache_lines=0)
