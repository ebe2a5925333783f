"""The metadata service in-process, with time and writer liveness as inputs.

No RPC and no sleeping: requests are built by hand, the clock is a number
the test moves, and "is this writer alive" is a set the test edits.  This is
where the reuse rule is pinned down to the millisecond: a write whose lease
ran out is cancelled but its extent is not reused while its writer lives; a
late seal never becomes a committed value, before or after a restart.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from beluga.coherence import LINE, digest, parse_header
from beluga.errors import CapacityError
from beluga.kv import protocol as p
from beluga.pool import Geometry, Pool
from beluga.rpc import Request
from beluga.server import allocator
from beluga.server.allocator import BlockAllocator, overlapping
from beluga.server.service import MetadataService

GEOMETRY = Geometry(max_hosts=4, rpc_bytes_per_host=64 << 10, block_size=16 << 10)
WRITER = (1, 7)  # host id 1 in its 7th generation


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def small(shm_path: str) -> Iterator[Pool]:
    pool = Pool.create(shm_path, 12 << 20, geometry=GEOMETRY)
    yield pool
    pool.close()
    Pool.destroy(shm_path)


class Harness:
    """A service over a pool, and a writer that talks to it the way KVStore does."""

    def __init__(self, pool: Pool, clock: Clock, alive: set[tuple[int, int]], **opts: float):
        self.pool, self.clock, self.alive = pool, clock, alive
        self.opts = opts
        self.svc = self.start()

    def start(self) -> MetadataService:
        return MetadataService(
            self.pool,
            clock=self.clock,
            writer_alive=lambda h, g: (h, g) in self.alive,
            **self.opts,
        )

    def request(self, op: p.StoreOp, payload: bytes, who: tuple[int, int] = WRITER) -> Request:
        return Request(who[0], int(op), payload, who[1])

    def alloc(self, key: str, length: int, who: tuple[int, int] = WRITER) -> p.Grant:
        raw = self.svc.op_alloc(
            self.request(p.StoreOp.ALLOC, p.encode_alloc([(digest(key.encode()), length, 1)]), who)
        )
        (grant,) = p.decode_grants(raw)
        return grant

    def write(self, key: str, grant: p.Grant, data: bytes, who: tuple[int, int] = WRITER) -> None:
        """What a writer does in the pool: WRITING header, payload, PUBLISHED header."""
        sb, mem = self.pool.superblock, self.pool.memory
        mem.publish(
            sb.block_header_offset(grant.block),
            sb.block_payload_offset(grant.block),
            digest(key.encode()),
            grant.version,
            data,
            writer=who[0],
            writer_gen=who[1],
        )

    def begin(self, key: str, grant: p.Grant, n: int, who: tuple[int, int] = WRITER) -> None:
        """A writer's first store: its WRITING header (then it stalls or dies)."""
        sb = self.pool.superblock
        self.pool.memory.begin_write(
            sb.block_header_offset(grant.block),
            sb.block_payload_offset(grant.block),
            digest(key.encode()),
            grant.version,
            n,
            writer=who[0],
            writer_gen=who[1],
        )

    def commit(self, key: str, grant: p.Grant, who: tuple[int, int] = WRITER) -> bool:
        payload = p.encode_commit([(digest(key.encode()), grant.block, grant.version)])
        (ok,) = p.decode_flags(self.svc.op_commit(self.request(p.StoreOp.COMMIT, payload, who)))
        return ok

    def put(self, key: str, data: bytes, who: tuple[int, int] = WRITER) -> p.Grant:
        grant = self.alloc(key, len(data), who)
        self.write(key, grant, data, who)
        assert self.commit(key, grant, who)
        return grant

    def lookup(self, key: str) -> p.Location | None:
        raw = self.svc.op_lookup(
            self.request(p.StoreOp.LOOKUP, p.encode_digests([digest(key.encode())]))
        )
        return p.decode_locations(raw)[0]

    def read(self, key: str) -> bytes | None:
        loc = self.lookup(key)
        if loc is None:
            return None
        sb = self.pool.superblock
        r = self.pool.memory.read_bytes(
            sb.block_header_offset(loc.block),
            sb.block_payload_offset(loc.block),
            sb.block_size * 4,
            digest(key.encode()),
            loc.version,
        )
        return None if isinstance(r, int) else r


@pytest.fixture
def h(small: Pool) -> Harness:
    return Harness(small, Clock(), {WRITER}, write_lease_s=1.0, read_lease_s=2.0)


@pytest.mark.leaves("keys")
def test_an_expired_lease_cancels_the_write_but_quarantines_its_extent(h: Harness) -> None:
    stalled = h.alloc("a", 5000)
    h.clock.now += 1.001
    h.svc.tick()
    s = h.svc.stats()
    assert s["lease_expiries"] == 1 and s["quarantined_extents"] == 1
    assert s["blocks_used"] == 1  # not reusable while its writer may still store into it
    other = h.put("b", b"B" * 5000)
    assert other.block != stalled.block
    h.write("a", stalled, b"A" * 5000)  # the stalled writer resumes and seals late
    assert not h.commit("a", stalled)  # refused: the write was cancelled ...
    s = h.svc.stats()
    assert s["late_commits_refused"] == 1 and s["quarantined_extents"] == 0
    assert s["blocks_used"] == 1  # ... and its extent is free now that its writer is done
    assert h.read("a") is None and h.read("b") == b"B" * 5000


def test_a_quarantined_extent_is_freed_when_its_writer_dies(h: Harness) -> None:
    h.alloc("a", 100)
    h.clock.now += 5
    h.svc.tick()
    assert h.svc.stats()["blocks_used"] == 1
    h.alive.clear()  # the writer's host id is no longer held, alive, in generation 7
    h.svc.tick()
    s = h.svc.stats()
    assert s["blocks_used"] == 0 and s["dead_writer_reclaims"] == 1


def test_a_dead_writer_within_its_lease_is_reclaimed_at_once(h: Harness) -> None:
    h.alloc("a", 100)
    h.alive.clear()
    h.svc.tick()
    assert h.svc.stats()["blocks_used"] == 0 and h.svc.stats()["lease_expiries"] == 0


@pytest.mark.leaves("writes")  # it ends holding a grant: a WRITING header
def test_a_client_gone_frees_its_writes_only(h: Harness) -> None:
    h.alloc("mine", 100)
    h.alloc("theirs", 100, who=(2, 1))
    h.alive.add((2, 1))
    h.svc.client_gone(1)
    assert h.svc.stats()["blocks_used"] == 1 and h.svc.stats()["writes_in_flight"] == 1
    assert [pend.host for pend in h.svc.pending.values()] == [2]  # theirs, not mine, is left


@pytest.mark.leaves("keys")
def test_a_late_seal_is_not_a_committed_value_after_a_restart(h: Harness) -> None:
    """The writer's lease ran out, it sealed late, the server died before its COMMIT:
    the pool holds a PUBLISHED header that was never committed."""
    h.put("a", b"old")
    late = h.alloc("a", 3)
    h.clock.now += 2
    h.svc.tick()
    h.write("a", late, b"new")  # sealed after its lease ran out, never committed
    h.svc = h.start()  # a new server recovers from the pool
    assert h.read("a") == b"old"  # the committed value, not the late one
    s = h.svc.stats()
    assert s["recovered_keys"] == 1 and s["writes_in_flight"] == 1  # the late one is a write
    # A new server does not remember the cancellation; the write's COMMIT may still
    # land.  That is safe: quarantine kept anyone else out of its extent, so these
    # bytes are exactly what the writer wrote for "a", and now it is acknowledged.
    assert h.commit("a", late) and h.read("a") == b"new"


_KEYS = ("a", "b", "c")
#: a writer's puts and removes of a few keys, and server restarts, in any order
_PUTS_REMOVES_RESTARTS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.sampled_from(_KEYS), st.binary(min_size=1, max_size=100)),
        st.tuples(st.just("remove"), st.sampled_from(_KEYS), st.just(b"")),
        st.tuples(st.just("restart"), st.just(""), st.just(b"")),
    ),
    max_size=12,
)


# it ends holding a grant (a WRITING header), and the keys it put
@pytest.mark.leaves("keys", "writes")
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@example(ops=[("put", "a", b"x" * 100), ("remove", "a", b"")])
@given(ops=_PUTS_REMOVES_RESTARTS)
def test_recovery_never_resurrects_a_removed_key(
    shm_path: str, ops: list[tuple[str, str, bytes]]
) -> None:
    """Whatever puts, removes and restarts came before, a recovered server finds each key's
    last committed value, or nothing once it was removed, holds blocks for those values
    alone, and grants versions above every version granted before."""
    pool = Pool.create(shm_path, 12 << 20, geometry=GEOMETRY)
    try:
        h = Harness(pool, Clock(), {WRITER}, write_lease_s=1.0, read_lease_s=2.0)
        want: dict[str, bytes] = {}
        granted = 0

        def recovered() -> None:
            h.svc = h.start()  # a new server recovers from the pool
            assert {k: h.read(k) for k in _KEYS} == {k: want.get(k) for k in _KEYS}
            assert h.svc.stats()["blocks_used"] == len(want)

        for op, key, value in ops:
            if op == "put":
                granted = max(granted, h.put(key, value).version)
                want[key] = value
            elif op == "remove":
                payload = p.encode_digests([digest(key.encode())])
                removed = p.decode_flags(h.svc.op_remove(h.request(p.StoreOp.REMOVE, payload)))
                assert removed == [key in want]
                want.pop(key, None)
            else:
                recovered()
        recovered()
        assert h.alloc(_KEYS[0], 1).version > granted  # versions never repeat after a restart
    finally:
        pool.close()
        Pool.destroy(shm_path)


@pytest.mark.leaves("keys")
def test_a_write_in_flight_at_a_restart_can_still_commit(h: Harness) -> None:
    g = h.alloc("a", 10)
    h.write("a", g, b"0123456789")
    h.svc = h.start()  # the server restarts before the COMMIT arrives
    assert h.commit("a", g)
    assert h.read("a") == b"0123456789"
    assert h.commit("a", g)  # the same COMMIT again (at-least-once RPC) is still a success


def test_recovered_writes_of_a_dead_writer_are_freed(h: Harness) -> None:
    h.begin("a", h.alloc("a", 10), 10)
    h.alive.clear()
    h.svc = h.start()
    assert h.svc.stats()["writes_in_flight"] == 1
    h.svc.tick()  # its writer (host 1, generation 7, from the header) is gone
    assert h.svc.stats()["writes_in_flight"] == 0 and h.svc.stats()["blocks_used"] == 0


@pytest.mark.leaves("keys", "writes")  # and a grant it holds: a WRITING header
def test_eviction_is_lru_and_waits_for_read_leases(small: Pool) -> None:
    h = Harness(small, Clock(), {WRITER}, read_lease_s=2.0, high_watermark=1.0, low_watermark=1.0)
    n = h.pool.superblock.nblocks
    for i in range(n):
        h.put(f"k{i}", bytes(100))
    assert h.lookup("k0") is not None  # k0 becomes the most recently used
    h.put("one-more", bytes(100))
    assert h.lookup("k1") is None and h.lookup("k0") is not None  # the oldest went
    assert h.svc.stats()["evictions"] >= 1
    raw = h.svc.op_lookup(
        h.request(
            p.StoreOp.LOOKUP,
            p.encode_digests([digest(f"k{i}".encode()) for i in range(n)], p.LOOKUP_LEASE),
        )
    )
    leased = [i for i, loc in enumerate(p.decode_locations(raw)) if loc is not None]
    assert leased
    with pytest.raises(CapacityError, match="nothing can be evicted"):
        for i in range(n):  # everything is leased: nothing may be evicted
            h.alloc(f"new{i}", 100)
    assert all(digest(f"k{i}".encode()) in h.svc.index for i in leased), "a leased key went"
    h.clock.now += 2.001  # the read leases run out
    h.svc.tick()
    h.alloc("fits now", 100)


@pytest.mark.leaves("keys")
def test_readers_hints_reorder_the_lru_and_hints_naming_nothing_are_ignored(h: Harness) -> None:
    """A hint (block, low half of the version) moves the key whose entry begins at that
    block with that version to the LRU end; a hint ring is anyone's bytes, so a block
    outside the pool or a version not the entry's moves nothing, and breaks nothing."""
    a, _ = h.put("a", b"1"), h.put("b", b"2")
    low, n = 0xFFFFFFFF, h.pool.superblock.nblocks
    hostile = [(2**32 - 1, 1), (n, a.version & low), (a.block, (a.version + 1) & low)]
    hints = list(hostile)
    h.svc.ix.fold_hints = lambda hosts=None: hints  # type: ignore[method-assign]
    h.svc.fold_hints()
    assert list(h.svc.index) == [digest(b"a"), digest(b"b")]  # nothing moved
    hints[:] = [*hostile, (a.block, a.version & low)]
    h.svc.fold_hints()
    assert list(h.svc.index) == [digest(b"b"), digest(b"a")]  # "a" was hit last


@pytest.mark.leaves("keys")
def test_retired_extents_wait_out_their_read_leases(h: Harness) -> None:
    h.put("a", b"1")
    h.svc.op_lookup(h.request(p.StoreOp.LOOKUP, p.encode_digests([digest(b"a")], p.LOOKUP_LEASE)))
    h.put("a", b"2")  # replaced: the old extent is retired under the read lease
    assert h.svc.stats()["retiring_extents"] == 1 and h.svc.stats()["blocks_used"] == 2
    h.clock.now += 1.999
    h.svc.tick()
    assert h.svc.stats()["blocks_used"] == 2
    h.clock.now += 0.002
    h.svc.tick()
    assert h.svc.stats()["blocks_used"] == 1 and h.read("a") == b"2"


@pytest.mark.leaves("keys", "writes")  # the stalled writer's grant stays held
def test_a_grant_outlives_its_server_before_its_writer_writes(h: Harness) -> None:
    """Chaos seed 3028221332: a writer stopped between the ALLOC answer and its own
    WRITING store, the server killed meanwhile; the next server found the extent free,
    granted it again, and the stopped writer later overwrote the value acknowledged in
    it.  The server now writes the WRITING header itself before it answers."""
    stalled = h.alloc("stalled", 100)  # and its writer never stores a byte
    h.svc = h.start()  # a new server recovers from the pool
    assert h.svc.stats()["writes_in_flight"] == 1  # it knows the grant
    fresh = h.put("acknowledged", b"v" * 100, who=(2, 1))
    assert fresh.block != stalled.block


# -- recovery: which copies a restarted server keeps -----------------------------------


def _seal(
    pool: Pool, key: str, block: int, version: int, nbytes: int, done: bool, commit: bool = True
) -> None:
    """Stand a header in the pool as a writer leaves it: PUBLISHED (``done``) with its
    commit word unless not ``commit`` (its COMMIT never came), or WRITING (in flight).
    The version floor is raised above it, as the server that granted it did first."""
    sb, mem = pool.superblock, pool.memory
    floor = int.from_bytes(mem.load(sb.service_offset, 8), "little")
    mem.nt_store(sb.service_offset, max(floor, version + 1).to_bytes(8, "little"))
    args = (sb.block_header_offset(block), sb.block_payload_offset(block), digest(key.encode()))
    if done:
        mem.publish(*args, version, bytes(nbytes), writer=WRITER[0], writer_gen=WRITER[1])
        if commit:
            mem.nt_store(sb.block_commit_offset(block), version.to_bytes(8, "little"))
    else:
        mem.begin_write(*args, version, nbytes, writer=WRITER[0], writer_gen=WRITER[1])
    mem.sfence()


@pytest.mark.leaves("keys", "writes")
def test_recovery_keeps_the_newest_copy_that_fits(small: Pool) -> None:
    """Newer versions win blocks; a key whose newest copy lost its blocks keeps an older
    one; every loser's header and commit word is cleared."""
    bs = small.superblock.block_size
    _seal(small, "a", 0, 10, 2 * bs, True)  # blocks 0-1
    _seal(small, "b", 1, 12, 100, True)  # newer, on block 1: a@0 loses
    _seal(small, "a", 5, 5, 100, True)  # so a's older copy is the one kept
    _seal(small, "c", 7, 3, 100, True)  # an older copy of c ...
    _seal(small, "c", 8, 4, 100, True)  # ... that the newer one replaces
    _seal(small, "e", 11, 21, 2 * bs, False)  # writes in flight on blocks 11-12 ...
    _seal(small, "f", 12, 19, 100, False)  # ... and an older one under it
    _seal(small, "d", 10, 20, 100, False)
    small.memory.nt_store(small.superblock.block_commit_offset(20), (9).to_bytes(8, "little"))
    small.memory.sfence()  # a commit word of no header
    svc = MetadataService(small, clock=Clock(), writer_alive=lambda h, g: True)
    got = {d: (e.block, e.version, e.nblocks) for d, e in svc.index.items()}
    keys = {digest(k): k for k in (b"a", b"b", b"c")}
    assert [keys[d] for d in got] == [b"c", b"a", b"b"]  # oldest first: the LRU order
    assert got == {digest(b"a"): (5, 5, 1), digest(b"b"): (1, 12, 1), digest(b"c"): (8, 4, 1)}
    assert sorted(svc.pending) == [10, 11] and svc.pending[11].nblocks == 2
    assert svc.alloc.used == 6 and svc.version >= 21
    sb, mem = small.superblock, small.memory
    for block in (0, 7, 12):  # the losers' headers
        assert parse_header(mem.load(sb.block_header_offset(block), LINE)) is None
    for block in (0, 7, 20):  # their commit words and the stray one
        assert mem.load(sb.block_commit_offset(block), 8) == bytes(8)
    assert set(svc.ix.where) == set(got) and svc.stats()["recovered_keys"] == 3


def test_reserve_many_decides_as_reserve_one_at_a_time() -> None:
    """Random extents (overlapping, out of range, on taken blocks) against the
    one-at-a-time rule it replaces."""
    rng = random.Random(22)
    for _ in range(300):
        n = rng.randint(1, 64)
        bulk, one = BlockAllocator(n), BlockAllocator(n)
        for first in rng.sample(range(n), rng.randint(0, n // 4)):
            assert bulk.reserve(first, 1) and one.reserve(first, 1)
        runs = [(rng.randint(-2, n + 2), rng.randint(-1, 6)) for _ in range(rng.randint(0, 40))]
        want = [one.reserve(f, c) for f, c in runs]
        firsts = np.array([f for f, _ in runs], dtype=np.int64)
        counts = np.array([c for _, c in runs], dtype=np.int64)
        assert bulk.reserve_many(firsts, counts).tolist() == want
        assert (bulk.free == one.free).all() and bulk.nfree == one.nfree
    with pytest.raises(ValueError, match="two flat arrays"):
        BlockAllocator(4).reserve_many(np.zeros(2, np.int64), np.zeros(3, np.int64))


def test_overlapping_names_every_extent_that_shares_a_block() -> None:
    firsts = np.array([10, 0, 4, 2, 20, 30, 31])
    counts = np.array([5, 1, 1, 10, 1, 1, 1])  # [10,15) [0] [4] [2,12) [20] [30] [31]
    assert overlapping(firsts, counts).tolist() == [True, False, True, True, False, False, False]


def _recovered_one_at_a_time(
    headers: dict[int, tuple[str, int, int, str]], nblocks: int, bs: int
) -> tuple[dict[bytes, tuple[int, int]], set[int], set[int]]:
    """What recovery keeps, by the rule as first written (one header at a time): the
    index (digest -> block, version, oldest first), the writes in flight, the cleared."""
    free = [True] * nblocks
    index: dict[bytes, tuple[int, int]] = {}
    pending, cleared = set(), set()

    def reserve(block: int, n: int) -> bool:
        if block + n > nblocks or not all(free[block : block + n]):
            return False
        free[block : block + n] = [False] * n
        return True

    rows = sorted(headers.items())
    done = [(b, h) for b, h in rows if h[3] == "committed"]
    for block, (key, version, nbytes, _) in sorted(done, key=lambda t: -t[1][1]):
        d, n = digest(key.encode()), max(1, -(-nbytes // bs))
        if d in index or not reserve(block, n):
            cleared.add(block)
        else:
            index[d] = (block, version)
    for block, (_, _, nbytes, _) in sorted(
        [(b, h) for b, h in rows if h[3] != "committed"], key=lambda t: -t[1][1]
    ):
        (pending if reserve(block, max(1, -(-nbytes // bs))) else cleared).add(block)
    return dict(sorted(index.items(), key=lambda kv: kv[1][1])), pending, cleared


@pytest.mark.leaves("keys", "writes")
def test_recovery_decides_as_one_header_at_a_time(small: Pool) -> None:
    """Random pools (copies of a key, overlapping extents, tied versions, writes in
    flight) against the rule written one header at a time."""
    sb, mem = small.superblock, small.memory
    bs, rng = sb.block_size, random.Random(2203)
    for _ in range(25):
        mem.nt_store(sb.headers.offset, bytes(sb.nblocks * LINE))  # an empty pool again
        mem.nt_store(sb.commits.offset, bytes(sb.commits.length))
        headers = {
            rng.randrange(40): (
                rng.choice("abcdefgh"),
                rng.randint(1, 30),
                rng.randint(1, 3 * bs),
                rng.choice(["committed"] * 4 + ["sealed", "writing"]),
            )
            for _ in range(rng.randint(1, 30))
        }
        for block, (key, version, nbytes, state) in headers.items():
            _seal(small, key, block, version, nbytes, state != "writing", state == "committed")
        want_index, want_pending, cleared = _recovered_one_at_a_time(headers, sb.nblocks, bs)
        svc = MetadataService(small, clock=Clock(), writer_alive=lambda h, g: True)
        assert {d: (e.block, e.version) for d, e in svc.index.items()} == want_index
        assert list(svc.index) == list(want_index)  # the same LRU order
        assert set(svc.pending) == want_pending
        for block in cleared:
            assert parse_header(mem.load(sb.block_header_offset(block), LINE)) is None
        kept = {b for b, _ in want_index.values()}
        for block in range(40):
            word = int.from_bytes(mem.load(sb.block_commit_offset(block), 8), "little")
            assert (word != 0) == (block in kept), block
        assert set(svc.ix.where) == set(want_index)


def test_a_server_process_keeps_full_collections_to_what_is_new() -> None:
    """keep_collections_short (``beluga serve`` after recovery): what exists is frozen out
    of the collector, so is what survives each later full collection (not a younger one),
    and a frozen object is still freed by its reference count.  In a child process: the
    test process's own objects must not be frozen."""
    code = """
import gc, weakref
from beluga.server.collector import keep_collections_short
class Obj: pass
kept = [Obj() for _ in range(1000)]
keep_collections_short()
frozen = gc.get_freeze_count()
more = [Obj() for _ in range(500)]
gc.collect(1)
young = gc.get_freeze_count()
gc.collect()
full = gc.get_freeze_count()
gone = weakref.ref(kept[0])
kept.clear()
print(frozen >= 1000, young == frozen, full >= frozen + 500, gone() is None)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"] * 4


@pytest.mark.parametrize("chunk", [3, 16, 1 << 14])
def test_a_search_finds_the_first_free_run_from_the_cursor(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random bitmaps, cursors and run lengths against the rule written out: the first
    block, in order from the cursor and wrapping at the pool's end, that begins ``count``
    free blocks before the end.  Small search windows make runs cross them."""
    monkeypatch.setattr(allocator, "CHUNK", chunk)
    rng = np.random.default_rng(chunk)
    for _ in range(400):
        n = int(rng.integers(1, 80))
        alloc = BlockAllocator(n)
        alloc.used_map[:] = rng.random(n) < rng.choice([0.1, 0.5, 0.8, 0.97])
        alloc._cursor = int(rng.integers(0, n))
        free = ~alloc.used_map
        for count in {1, 2, int(rng.integers(1, n + 1)), n}:
            order = [(alloc._cursor + i) % n for i in range(n)]
            want = next((i for i in order if i + count <= n and free[i : i + count].all()), None)
            assert alloc._find(count) == want, (n, count, alloc._cursor)
