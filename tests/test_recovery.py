"""Recovery while serving (beluga.server.service, "Recovery"), in-process, a step at a time.

A server that took over serves at once and scans the pool in bounded steps
(``recover_some``); these tests put its operations between the steps, and
check what a one-sided reader gets after each answer, what survives a second
takeover in the middle of a recovery, and that a finished recovery leaves the
same values and no leaked block.  Time and writer liveness are inputs, as in
tests/test_service.py; one test runs the same under the model of
non-coherent hosts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import numpy as np
import pytest

from beluga._native import _core
from beluga.coherence import LINE, ModelConfig, digest, parse_header
from beluga.kv import KVStore
from beluga.kv import protocol as p
from beluga.pool import Geometry, Pool
from beluga.rpc import Request
from beluga.server import MetadataServer
from beluga.server.allocator import BlockAllocator
from beluga.server.index import PoolIndex
from beluga.server.recovery_state import RECOVERY_SLICE_S, GraveLog
from beluga.server.service import MetadataService
from tests.rpc_util import wait_until

GEOMETRY = Geometry(max_hosts=4, rpc_bytes_per_host=64 << 10, block_size=4096)
WRITER = (1, 3)
REGION = 32  # blocks a step scans: 16 regions in a 503-block pool
STEP = 2**-9  # seconds a step takes on a test's timer (a binary fraction: sums are exact)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool(shm_path: str) -> Iterator[Pool]:
    pool = Pool.create(shm_path, 12 << 20, geometry=GEOMETRY)
    yield pool
    pool.close()
    Pool.destroy(shm_path)


def value_of(key: str, n: int = 100) -> bytes:
    return (key.encode() * (n // len(key) + 1))[:n]


class World:
    """A pool, the server serving it (``svc``), a writer and a one-sided reader."""

    def __init__(
        self,
        pool: Pool,
        writer: Pool | None = None,
        reader: Pool | None = None,
        **options: float,
    ) -> None:
        self.pool, self.clock, self.options = pool, Clock(), options
        self.alive = {WRITER}
        self.writer = writer or pool
        self.reader = pool.index_reader((reader or pool).memory)
        self.svc = self.take_over(at_once=True)

    def take_over(self, at_once: bool = False) -> MetadataService:
        """A new server (the one before is gone): recovering in steps unless ``at_once``."""
        self.svc = MetadataService(
            self.pool,
            clock=self.clock,
            writer_alive=lambda h, g: (h, g) in self.alive,
            recovery_region=REGION,
            recover_now=at_once,
            **self.options,
        )
        self.svc.writers_now = lambda: set(self.alive)  # the writers that hold host ids
        return self.svc

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.svc.tick()
            self.svc.recover_some()

    def finish(self) -> None:
        while self.svc.recovering:
            self.step()
        self.svc.tick()

    def request(self, op: p.StoreOp, payload: bytes) -> Request:
        return Request(WRITER[0], int(op), payload, WRITER[1])

    def alloc(self, key: str, n: int, at: int | None = None) -> p.Grant:
        """A grant (``at``: the allocator's next search starts at that block)."""
        if at is not None:
            self.svc.alloc._cursor = at
        raw = self.svc.op_alloc(
            self.request(p.StoreOp.ALLOC, p.encode_alloc([(digest(key.encode()), n, 1)]))
        )
        (grant,) = p.decode_grants(raw)
        return grant

    def publish(self, key: str, g: p.Grant, data: bytes) -> None:
        sb = self.pool.superblock
        self.writer.memory.publish(
            sb.block_header_offset(g.block),
            sb.block_payload_offset(g.block),
            digest(key.encode()),
            g.version,
            data,
            writer=WRITER[0],
            writer_gen=WRITER[1],
        )

    def commit(self, key: str, g: p.Grant) -> bool:
        payload = p.encode_commit([(digest(key.encode()), g.block, g.version)])
        (ok,) = p.decode_flags(self.svc.op_commit(self.request(p.StoreOp.COMMIT, payload)))
        return ok

    def put(self, key: str, data: bytes, at: int | None = None) -> p.Grant:
        g = self.alloc(key, len(data), at)
        self.publish(key, g, data)
        assert self.commit(key, g)
        return g

    def remove(self, key: str) -> bool:
        raw = self.svc.op_remove(
            self.request(p.StoreOp.REMOVE, p.encode_digests([digest(key.encode())]))
        )
        return p.decode_flags(raw)[0]

    def drop(self, key: str, g: p.Grant) -> bool:
        payload = p.encode_commit([(digest(key.encode()), g.block, g.version)])
        return p.decode_flags(self.svc.op_drop(self.request(p.StoreOp.DROP, payload)))[0]

    def landed_commit(self, key: str, data: bytes, at: int) -> p.Grant:
        """A commit in flight when its server died: its commit word landed, its pool index
        slot and the clear of the key's older copy did not."""
        g = self.alloc(key, len(data), at)
        self.publish(key, g, data)
        sb = self.pool.superblock
        self.pool.memory.nt_store(sb.block_commit_offset(g.block), g.version.to_bytes(8, "little"))
        self.pool.memory.sfence()
        return g

    def read(self, key: str) -> bytes | None:
        return self.reader.get(key.encode())

    def header(self, block: int) -> object:
        sb = self.pool.superblock
        return parse_header(self.pool.memory.load(sb.block_header_offset(block), LINE))

    def used_blocks(self) -> int:
        """Blocks in use by the pool's own tables: live extents (committed or in flight)
        and extents held under headers nobody can read."""
        svc = self.svc
        return (
            sum(e.nblocks for e in svc.index.values())
            + sum(w.nblocks for w in svc.pending.values())
            + sum(svc.unreadable.values())
        )

    def writers_leave(self) -> None:
        """Every writer's host id goes and comes back anew (a new generation), and the
        server notices at its next tick."""
        self.alive = {(h, g + 1) for h, g in self.alive}
        self.svc.tick()


@pytest.fixture
def w(pool: Pool) -> World:
    return World(pool)


def fill(w: World, n: int, prefix: str = "k") -> dict[str, p.Grant]:
    return {f"{prefix}{i}": w.put(f"{prefix}{i}", value_of(f"{prefix}{i}")) for i in range(n)}


def clean_up(w: World, keys: set[str]) -> None:
    """Remove what a test stored (the pool is checked for leftovers)."""
    w.finish()
    for key in keys:
        w.remove(key)
    if w.svc.unreadable:  # held under hostile bytes while a writer of before may store there
        w.writers_leave()
    assert not w.svc.index and not w.svc.pending and not w.svc.unreadable
    assert w.svc.alloc.used == 0, "blocks leaked"


# -- the first write -----------------------------------------------------------------


def test_the_first_write_after_a_takeover_scans_only_what_it_needs(w: World) -> None:
    stored = fill(w, 300)
    nblocks = w.pool.superblock.nblocks
    svc = w.take_over()
    assert svc.rec is not None and svc.rec.census == 0 and svc.rec.keys == 0
    g = w.put("new", value_of("new"))
    census = svc.rec.census
    assert census < nblocks and svc.rec.keys == 0, "the first write waited for the scan"
    assert g.block < census
    assert w.read("new") == value_of("new")
    for key in stored:  # readers never waited: every value is there, before any scan
        assert w.read(key) == value_of(key)
    w.finish()
    assert set(svc.index) == {digest(k.encode()) for k in [*stored, "new"]}
    assert svc.alloc.used == len(stored) + 1 == w.used_blocks()
    clean_up(w, {*stored, "new"})


def test_the_census_starts_where_allocation_was_and_holds_what_reaches_into_it(
    w: World,
) -> None:
    """The last server allocated around block 40: the census starts at its region (32),
    and a value begun before it (blocks 30-32) keeps its blocks: the first writes go to
    the free blocks from 32 on, never to block 32."""
    bs = GEOMETRY.block_size
    big = w.put("big", b"B" * 3 * bs, at=30)
    assert big.block == 30
    small = {f"s{i}": w.put(f"s{i}", value_of(f"s{i}")) for i in range(6)}  # 33-38
    svc = w.take_over()
    assert svc.rec is not None and svc.rec.origin == 32
    new = [w.put(f"n{i}", value_of(f"n{i}")) for i in range(4)]
    assert all(g.block >= 39 for g in new), [g.block for g in new]
    assert w.read("big") == b"B" * 3 * bs
    w.finish()
    assert w.read("big") == b"B" * 3 * bs and svc.index[digest(b"big")].block == 30
    assert svc.alloc.used == 3 + 6 + 4 == w.used_blocks()
    clean_up(w, {"big", *small, *(f"n{i}" for i in range(4))})


def test_stats_while_recovering_say_how_far_it_is(w: World) -> None:
    stored = fill(w, 100)
    svc = w.take_over()
    w.put("during", value_of("during"))  # acknowledged while the keys are being scanned
    left = []
    while svc.recovering:
        s = svc.stats()
        assert s["recovering"] == 1 and s["puts_while_recovering"] == 1
        left.append(s["recovery_blocks_left"])
        w.step()
    s = svc.stats()
    assert s["recovering"] == 0 and s["recovery_blocks_left"] == 0 and s["recovery_graves"] == 0
    assert left[0] == w.pool.superblock.nblocks and left == sorted(left, reverse=True)
    assert s["keys"] == s["recovered_keys"] == 101 and s["blocks_used"] == 101
    w.put("after", value_of("after"))
    assert svc.stats()["puts_while_recovering"] == 1
    clean_up(w, {*stored, "during", "after"})


# -- a key's old copy in a region not scanned yet ------------------------------------


@pytest.mark.parametrize("steps", [0, 20, 40])
def test_an_overwrite_retires_the_old_copy_wherever_the_scan_is(w: World, steps: int) -> None:
    stored = fill(w, 200)
    old = stored["k150"]  # near the end: among the last regions scanned
    w.take_over()
    w.step(steps)
    new = w.put("k150", b"new" * 50)
    assert w.read("k150") == b"new" * 50
    assert w.header(old.block) is None, "the old copy is still readable by its block"
    w.finish()
    e = w.svc.index[digest(b"k150")]
    assert (e.block, e.version) == (new.block, new.version)
    assert w.svc.alloc.used == 200 == w.used_blocks()
    assert not w.svc.alloc.used_map[old.block] or old.block == new.block
    clean_up(w, set(stored))


def test_copies_of_a_key_found_apart_leave_the_newest(w: World) -> None:
    """An overwrite in flight at the crash: its commit word landed, its slot did not; the
    scan finds the two copies regions apart, and keeps the newer, as a full recovery."""
    stored = fill(w, 20)
    newer = w.landed_commit("k3", b"newer" * 20, at=400)
    w.take_over()
    assert w.read("k3") == value_of("k3")  # what the pool index names until the scan
    w.finish()
    e = w.svc.index[digest(b"k3")]
    assert (e.block, e.version) == (newer.block, newer.version)
    assert w.header(stored["k3"].block) is None
    assert w.read("k3") == b"newer" * 20  # named once the scan knows it
    assert w.svc.alloc.used == 20 == w.used_blocks()
    clean_up(w, set(stored))


def test_a_value_whose_slot_never_landed_is_named_once_recovery_ends(w: World) -> None:
    """A first write's commit in flight at the crash: its commit word landed, its slot did
    not.  Only recovery's last step (naming) can make it readable; until then it misses."""
    stored = fill(w, 20)
    lone = w.landed_commit("lone", b"lone" * 25, at=400)
    w.take_over()
    assert w.read("lone") is None  # no slot names it
    w.finish()
    e = w.svc.index[digest(b"lone")]
    assert (e.block, e.version) == (lone.block, lone.version)
    assert w.read("lone") == b"lone" * 25
    clean_up(w, {*stored, "lone"})


def test_naming_makes_no_entry_for_keys_named_and_names_a_key_looked_up_meanwhile(
    w: World,
) -> None:
    """Recovery's last step finds the keys no slot names (a crash lost their insertion)
    among every key indexed, in C, and makes Python work only of those: the keys slots
    name stay cold, no ``Entry`` made.  It walks the index as it was when the step began,
    so a key a lookup takes out of the cold part meanwhile is still named."""
    stored = fill(w, 200)
    lost = sorted(stored)[::2]  # every other key's insertion lost in the crash
    for k in lost:
        w.svc.ix.drop(digest(k.encode()))
    w.svc.mem.sfence()
    svc = w.take_over()
    while svc.rec is not None and svc.rec.naming is None:
        w.step()
    assert svc.rec is not None and svc.rec.naming  # a region's keys named, more to come
    waiting = [k for k in lost if digest(k.encode()) not in svc.ix.where]
    assert len(lost) - REGION <= len(waiting) < len(lost)
    looked = waiting[0]
    (loc,) = p.decode_locations(
        svc.op_lookup(w.request(p.StoreOp.LOOKUP, p.encode_digests([digest(looked.encode())])))
    )
    assert loc is not None and digest(looked.encode()) not in svc.ix.where
    w.finish()
    assert all(w.read(k) == value_of(k) for k in stored)  # every key named, the looked-up too
    assert svc.counters["index_repaired"] == len(lost)
    assert svc.index.cold == len(stored) - 1
    # the Entry of each named key but the one looked up (warm now): none of the others'
    assert svc.index.made == len(lost) - 1
    clean_up(w, set(stored))


def test_a_commit_during_recovery_beats_every_older_copy_found_later(w: World) -> None:
    stored = fill(w, 20)
    w.landed_commit("k3", b"inflight" * 10, at=400)
    w.take_over()
    mine = w.put("k3", b"mine" * 10)
    w.finish()
    e = w.svc.index[digest(b"k3")]
    assert (e.block, e.version) == (mine.block, mine.version)
    assert w.read("k3") == b"mine" * 10
    assert w.svc.alloc.used == 20 == w.used_blocks()
    clean_up(w, set(stored))


# -- REMOVE, DROP and evictions of keys not scanned yet --------------------------------


def test_a_remove_before_the_scan_keeps_every_copy_gone(w: World) -> None:
    stored = fill(w, 20)
    w.landed_commit("k5", b"inflight" * 10, at=450)  # a copy no slot names
    w.take_over()
    assert w.remove("k5")
    assert w.read("k5") is None
    w.finish()
    assert digest(b"k5") not in w.svc.index and w.read("k5") is None
    assert w.svc.alloc.used == 19 == w.used_blocks()
    clean_up(w, set(stored) - {"k5"})


def test_a_remove_survives_a_second_takeover_in_the_middle_of_recovery(w: World) -> None:
    stored = fill(w, 20)
    w.landed_commit("k5", b"inflight" * 10, at=450)
    w.take_over()
    assert w.remove("k5") and w.remove("never-stored") is False
    assert w.svc.rec is not None and w.svc.graves.count == 2
    w.step(3)  # the census has not reached block 450
    second = w.take_over()  # the first one is gone before it scanned the copy
    assert second.rec is not None and set(second.rec.graves) == {
        digest(b"k5"),
        digest(b"never-stored"),
    }
    w.finish()
    assert digest(b"k5") not in second.index and w.read("k5") is None
    sb = w.pool.superblock
    assert w.pool.memory.load(sb.service_offset + 8, 8) == bytes(8), "the log was kept"
    assert second.alloc.used == 19 == w.used_blocks(), "the log's blocks leaked"
    clean_up(w, set(stored) - {"k5"})


def test_a_remove_of_a_key_no_slot_names_keeps_its_copy_gone(w: World) -> None:
    """The key's only copy is a commit in flight at the crash (no slot): the REMOVE finds
    nothing, and the copy never shows up, in this recovery or the next one's."""
    stored = fill(w, 10)
    w.landed_commit("ghost", value_of("ghost"), at=460)
    w.take_over()
    assert not w.remove("ghost")
    w.finish()
    assert digest(b"ghost") not in w.svc.index and w.read("ghost") is None
    assert w.svc.alloc.used == 10 == w.used_blocks()
    clean_up(w, set(stored))


def test_a_drop_of_a_value_not_scanned_yet_takes_it_out(w: World) -> None:
    stored = fill(w, 200)
    w.take_over()
    assert not w.drop("k190", p.Grant(stored["k190"].block, stored["k190"].version + 1))
    assert w.read("k190") == value_of("k190")  # another version: kept
    assert w.drop("k190", stored["k190"])
    assert w.read("k190") is None
    w.finish()
    assert digest(b"k190") not in w.svc.index
    assert w.svc.alloc.used == 199 == w.used_blocks()
    clean_up(w, set(stored) - {"k190"})


def test_evictions_while_scanning_are_buried_for_a_successor(pool: Pool) -> None:
    w = World(pool, high_watermark=1.0, low_watermark=1.0)  # evictions only when full
    nblocks = w.pool.superblock.nblocks
    stored = fill(w, nblocks - 10)
    svc = w.take_over()
    while svc.rec is not None and svc.rec.census < nblocks:  # the census done (as writes
        svc._census_step()  # needing room drive it), the keys not
    assert svc.rec is not None and svc.rec.keys < nblocks
    w.step()  # one region's keys known: those are what LRU can evict
    big = w.put("big", b"B" * 25 * GEOMETRY.block_size)  # needs evictions
    evicted = [k for k in stored if digest(k.encode()) in svc.rec.graves]
    assert evicted and svc.counters["evictions"] == len(evicted)
    for key in evicted:
        assert w.read(key) is None
    second = w.take_over()
    assert second.rec is not None
    assert {digest(k.encode()) for k in evicted} <= set(second.rec.graves)
    w.finish()
    for key in evicted:
        assert w.read(key) is None and digest(key.encode()) not in second.index
    assert len(second.index) == len(stored) - len(evicted) + 1
    assert w.read("big") == b"B" * 25 * GEOMETRY.block_size
    assert second.alloc.used == w.used_blocks()
    clean_up(w, (set(stored) - set(evicted)) | {"big"})
    assert big.version > 0


def test_recovered_keys_stay_cold_and_go_first_but_a_key_looked_up_since_stays(
    pool: Pool,
) -> None:
    """Recovery makes no Entry for the keys it finds (keyindex.py): they stay cold, in
    the order recovery gave them, and eviction takes them first, before a key written
    since; a key looked up since the takeover leaves the cold part and outlives them."""
    w = World(pool, high_watermark=1.0, low_watermark=1.0)  # evictions only when full
    nblocks = w.pool.superblock.nblocks
    stored = fill(w, nblocks - 30)
    svc = w.take_over()
    w.finish()
    assert svc.index.cold == len(stored) == len(svc.index)
    order = [d for d in svc.index]  # the LRU order recovery gave them, oldest first
    keys = {digest(k.encode()): k for k in stored}
    looked = order[0]
    (loc,) = p.decode_locations(
        svc.op_lookup(w.request(p.StoreOp.LOOKUP, p.encode_digests([looked])))
    )
    assert loc is not None and svc.index.cold == len(stored) - 1
    w.put("new", value_of("new"))
    big = w.put("big", b"B" * 40 * GEOMETRY.block_size)  # needs evictions
    gone = [d for d in order if w.read(keys[d]) is None]
    assert gone and gone == order[1 : len(gone) + 1]  # oldest first, the looked-up one kept
    assert svc.counters["evictions"] == len(gone)
    assert w.read(keys[looked]) == value_of(keys[looked]) and w.read("new") == value_of("new")
    clean_up(w, {keys[d] for d in order} - {keys[d] for d in gone} | {"new", "big"})
    assert big.version > 0


# -- writes in flight at the takeover --------------------------------------------------


def test_writes_in_flight_at_the_takeover_are_their_writers_before_the_scan(w: World) -> None:
    stored = fill(w, 20)
    late = w.alloc("late", 100, at=420)
    w.publish("late", late, value_of("late"))
    aborted = w.alloc("aborted", 100, at=440)
    gone_writer = (2, 1)
    w.alive.add(gone_writer)
    raw = w.svc.op_alloc(
        Request(2, int(p.StoreOp.ALLOC), p.encode_alloc([(digest(b"orphan"), 100, 1)]), 1)
    )
    (orphan,) = p.decode_grants(raw)
    w.take_over()
    assert w.commit("late", late), "a write granted before the takeover was refused"
    assert w.read("late") == value_of("late")
    payload = p.encode_commit([(digest(b"aborted"), aborted.block, aborted.version)])
    w.svc.op_abort(w.request(p.StoreOp.ABORT, payload))
    assert w.header(aborted.block) is None
    w.alive.discard(gone_writer)
    w.finish()
    assert orphan.block not in w.svc.pending, "a gone writer's grant was kept"
    assert set(w.svc.pending) == set()
    assert w.svc.index[digest(b"late")].block == late.block
    assert w.svc.alloc.used == 21 == w.used_blocks()
    clean_up(w, {*stored, "late"})


def test_a_write_in_flight_the_scan_passed_is_still_its_writers(w: World) -> None:
    stored = fill(w, 10)
    slow = w.alloc("slow", 100, at=100)
    w.take_over()
    w.finish()  # the scan holds its extent for its writer, who is alive
    assert slow.block in w.svc.pending
    w.publish("slow", slow, value_of("slow"))
    assert w.commit("slow", slow) and w.read("slow") == value_of("slow")
    clean_up(w, {*stored, "slow"})


def test_a_header_at_or_above_the_floor_is_a_grant_never_answered(w: World) -> None:
    """A server's grant announced while the floor's raise had not landed: nobody learned
    of it, so the next server clears it and its block is free."""
    stored = fill(w, 10)
    sb = w.pool.superblock
    floor = int.from_bytes(w.pool.memory.load(sb.service_offset, 8), "little")
    w.pool.memory.begin_write(
        sb.block_header_offset(200), sb.block_payload_offset(200), digest(b"x"), floor + 3, 10
    )
    svc = w.take_over()
    w.finish()
    assert w.header(200) is None and 200 not in svc.pending
    assert svc.alloc.used == 10
    clean_up(w, set(stored))


def test_a_write_committed_during_recovery_outlives_a_second_takeover(w: World) -> None:
    """A write granted before the takeover and committed during the recovery beats the
    key's older copies; the next server, taking over before the scan reached them, keeps
    it too (its grave spares it)."""
    stored = fill(w, 10)
    late = w.alloc("k4", 100, at=420)
    w.publish("k4", late, b"late" * 25)
    w.landed_commit("k4", b"crashed" * 10, at=300)  # newer than both, never named
    w.take_over()
    assert w.commit("k4", late)
    assert w.read("k4") == b"late" * 25
    w.take_over()
    w.finish()
    e = w.svc.index[digest(b"k4")]
    assert (e.block, e.version) == (late.block, late.version)
    assert w.read("k4") == b"late" * 25
    assert w.svc.alloc.used == 10 == w.used_blocks()
    clean_up(w, set(stored))


def test_a_commit_sent_again_of_a_value_committed_before_the_takeover_is_acknowledged(
    w: World,
) -> None:
    stored = fill(w, 10)
    g = w.landed_commit("again", value_of("again"), at=470)  # its answer never came
    w.take_over()
    assert w.commit("again", g)
    assert w.read("again") == value_of("again")
    w.finish()
    assert w.svc.index[digest(b"again")].block == g.block
    clean_up(w, {*stored, "again"})


# -- any interleaving agrees with the values acknowledged ------------------------------


def _agree(w: World, model: dict[str, bytes], keys: list[str]) -> None:
    for key in keys:
        assert w.read(key) == model.get(key), key


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_between_steps_and_takeovers_agree_with_the_answers(
    w: World, seed: int
) -> None:
    """Puts, overwrites, removes and drops of random keys, steps and takeovers at random
    points: after every answer a reader gets exactly the last value acknowledged."""
    rng = random.Random(seed)
    keys = [f"r{i}" for i in range(60)]
    model: dict[str, bytes] = {}
    grants: dict[str, p.Grant] = {}
    for key in rng.sample(keys, 40):
        model[key] = value_of(key, rng.randint(1, 3 * GEOMETRY.block_size))
        grants[key] = w.put(key, model[key])
    w.take_over()
    for i in range(150):
        key = rng.choice(keys)
        action = rng.random()
        if action < 0.45:
            model[key] = value_of(f"{key}-{i}", rng.randint(1, 3 * GEOMETRY.block_size))
            grants[key] = w.put(key, model[key])
        elif action < 0.65:
            assert w.remove(key) == (key in model)
            model.pop(key, None)
        elif action < 0.75 and key in model:
            assert w.drop(key, grants[key])
            del model[key]
        elif action < 0.80:
            w.take_over()
        else:
            w.step(rng.randint(1, 4))
        _agree(w, model, [key, *rng.sample(keys, 5)])
    w.finish()
    _agree(w, model, keys)
    assert {d for d in w.svc.index} == {digest(k.encode()) for k in model}
    assert w.svc.alloc.used == w.used_blocks()
    clean_up(w, set(model))


def test_random_operations_on_non_coherent_hosts_agree_with_the_answers(shm_path: str) -> None:
    """The same under the model: the server, the writer and the reader each a host with
    its own cache, stores reaching memory in any order until a fence."""
    pool = Pool.create(shm_path, 12 << 20, geometry=GEOMETRY, coherence="model")
    writer = Pool.attach(shm_path, coherence="model", model=ModelConfig(seed=2))
    reader = Pool.attach(shm_path, coherence="model", model=ModelConfig(seed=3))
    try:
        w = World(pool, writer, reader)
        rng = random.Random(11)
        keys = [f"m{i}" for i in range(30)]
        model: dict[str, bytes] = {}
        for key in keys[:20]:
            model[key] = value_of(key, rng.randint(1, 2 * GEOMETRY.block_size))
            w.put(key, model[key])
        w.take_over()
        for i in range(60):
            key = rng.choice(keys)
            action = rng.random()
            if action < 0.5:
                model[key] = value_of(f"{key}-{i}", rng.randint(1, 2 * GEOMETRY.block_size))
                w.put(key, model[key])
            elif action < 0.7:
                w.remove(key)
                model.pop(key, None)
            elif action < 0.75:
                w.take_over()
            else:
                w.step(rng.randint(1, 3))
            _agree(w, model, [key])
        w.finish()
        _agree(w, model, keys)
        clean_up(w, set(model))
    finally:
        writer.close()
        reader.close()
        pool.close()
        Pool.destroy(shm_path)


def test_a_server_answers_writes_while_it_recovers_between_polls(pool: Pool) -> None:
    """``beluga serve``'s loop: a server taking over a pool of many regions answers a
    client at once and recovers between polls (``RpcServer.background``) to the end."""
    w = World(pool)
    stored = fill(w, 300)
    server = MetadataServer(pool, recovery_region=8, recover_now=False)  # 63 regions, in steps
    try:
        assert server.service.recovering
        assert server.service.heartbeat == server.seat.keep  # operations that recover beat
        server.start_thread()
        with KVStore(pool) as store:
            store.put("after", value_of("after"))
            assert store.get("after") == value_of("after")
            assert store.get("k250") == value_of("k250")
            wait_until(lambda: not store.stats()["recovering"], "the end of recovery")
            s = store.stats()
            assert s["keys"] == 301 and s["blocks_used"] == 301 and s["recovery_graves"] == 0
            for key in [*stored, "after"]:
                store.remove(key)
    finally:
        server.close()


def test_a_busy_server_gives_recovery_its_share_and_an_idle_one_everything(pool: Pool) -> None:
    """``recover_some``'s pace, on a timer the test moves: every step costs ``STEP``, and
    the time between calls is what the server spent serving.  An idle server takes a
    step a call; a busy one, at a share of 0.5, earns a second of steps for a second of
    serving, at most a slice at a time, and pays back a step's overrun; idle time earns
    nothing.  (Until 2026-12-07 a busy server took at most one step a poll.)"""
    w = World(pool)
    stored = fill(w, 200)
    clock = Clock()
    w.svc = svc = MetadataService(
        pool, recovery_region=8, recover_now=False, recovery_share=0.5, timer=clock
    )
    steps = 0
    step = svc._recover_step

    def costly() -> None:
        nonlocal steps
        step()
        steps += 1
        clock.now += STEP

    svc._recover_step = costly  # type: ignore[method-assign]

    def calls(served: int, serving_s: float) -> int:
        """Steps in one call after ``serving_s`` of serving."""
        nonlocal steps
        clock.now += serving_s
        steps = 0
        assert svc.recover_some(served)
        return steps

    assert [calls(0, 0.0) for _ in range(3)] == [1, 1, 1]  # idle: a step a call
    assert calls(0, 5.0) == 1  # a long idle spell earns nothing
    assert calls(4, 3 * STEP) == 3  # 3 steps' time of serving: 3 steps
    assert calls(4, STEP / 2) == 1  # half a step's: a step, half a step owed
    assert calls(4, STEP / 4) == 0  # still owed
    assert calls(4, STEP / 4) == 0  # paid back to 0: nothing owed, nothing earned
    assert calls(4, 1.0) == math.ceil(RECOVERY_SLICE_S / STEP)  # a long poll: a slice
    assert calls(4, 0.0) == 0
    with pytest.raises(ValueError, match="share"):
        MetadataService(pool, recover_now=False, recovery_share=1.0)
    svc.recover()
    clean_up(w, set(stored))


def test_an_operation_that_recovers_heartbeats_before_each_step(
    w: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ALLOC that finds no room runs census steps itself, and a COMMIT whose grave finds
    no room for the log scans every key left at once: recovery steps inside one
    operation, minutes at the pod.  Each is preceded by a heartbeat (a server's is its
    seat's), so no standby takes the server for a stalled one and fences it."""
    from beluga.errors import CapacityError

    stored = fill(w, 40)
    svc = w.take_over()
    steps: list[str] = []
    beats: list[int] = []
    svc.heartbeat = lambda: beats.append(len(steps))
    for name in ("_census_step", "_keys_step"):

        def counted(*args: object, _f: object = getattr(svc, name), _n: str = name) -> object:
            steps.append(_n)
            return _f(*args)  # type: ignore[operator]

        monkeypatch.setattr(svc, name, counted)

    def full(*_: object) -> None:
        raise CapacityError("no room for the log (a full pool)")

    monkeypatch.setattr(svc.graves, "append", full)
    w.put("new", value_of("new"))  # its ALLOC runs the census; its grave finds no room
    assert not svc._scanning(), "the scan of keys was not finished: nothing tested"
    assert {"_census_step", "_keys_step"} <= set(steps)
    assert beats == list(range(len(steps))), "a step inside an operation had no heartbeat"
    monkeypatch.undo()
    assert w.read("new") == value_of("new")
    clean_up(w, {*stored, "new"})


# -- the parts ---------------------------------------------------------------------------


def test_the_allocator_allocates_below_its_frontier_and_reserves_beyond() -> None:
    alloc = BlockAllocator(10, frontier=0)
    assert alloc.nfree == 0 and alloc.allocate(1) is None
    assert alloc.reserve(6, 2) and alloc.used == 2 and alloc.nfree == 0
    alloc.advance(7)  # block 6 is known in use, blocks 0-5 free
    assert alloc.nfree == 6
    assert [alloc.allocate(2), alloc.allocate(4)] == [0, 2] and alloc.allocate(1) is None
    alloc.advance(10)  # block 7 was reserved beyond; 8 and 9 are free
    assert alloc.nfree == 2 and alloc.allocate(2) == 8
    alloc.release(6, 2)
    assert alloc.nfree == 2 and alloc.used == 8
    with pytest.raises(ValueError, match="forward"):
        alloc.advance(5)
    gaps = BlockAllocator(10, frontier=4)  # blocks 1 and 3 free: no run of two below 4
    assert gaps.reserve(0, 1) and gaps.reserve(2, 1) and gaps.nfree == 2
    assert gaps.allocate(2) is None, "a run was taken beyond the frontier, in unknown blocks"


def test_the_pool_index_loads_a_bucket_only_when_touched_and_keeps_its_other_slots(
    pool: Pool,
) -> None:
    w = World(pool)
    stored = fill(w, 50)
    ix = PoolIndex(pool.memory, pool.superblock)  # a new server's mirror: nothing loaded
    assert ix.loaded is not None and not ix.loaded.any()
    d = digest(b"k7")
    assert ix.find(d) == (stored["k7"].block, stored["k7"].version)
    _, b1, b2 = _core.ix_hash(d, ix.nbuckets)
    assert set(np.flatnonzero(ix.loaded).tolist()) == {b1, b2}
    # a new key put into a loaded bucket: every other key of those buckets stays readable
    assert ix.put(digest(b"fresh"), 5, 10**6)
    pool.memory.sfence()
    for key in stored:
        assert w.read(key) == value_of(key)
    w.svc = w.take_over(at_once=True)  # repairs the slot naming nothing
    clean_up(w, set(stored))


def test_an_unresolved_slot_whose_header_does_not_confirm_it_is_dropped(pool: Pool) -> None:
    w = World(pool)
    stored = fill(w, 5)
    sb = pool.superblock
    pool.memory.nt_store(sb.block_header_offset(stored["k2"].block), bytes(LINE))  # cleared
    pool.memory.sfence()
    ix = PoolIndex(pool.memory, sb)
    assert ix.find(digest(b"k2")) is None and ix.unconfirmed == 1
    _, b1, _ = _core.ix_hash(digest(b"k2"), ix.nbuckets)
    got = _core.ix_unpack(pool.memory.load(ix.base + b1 * LINE, LINE))
    assert got is not None and stored["k2"].block not in [s[1] for s in got[1] if s[0]]
    w.svc = w.take_over(at_once=True)
    pool.memory.nt_store(sb.block_commit_offset(stored["k2"].block), bytes(8))
    pool.memory.sfence()
    clean_up(w, set(stored) - {"k2"})


def test_the_grave_log_moves_when_full_and_ends_at_a_torn_entry(pool: Pool) -> None:
    sb, mem = pool.superblock, pool.memory
    alloc = BlockAllocator(sb.nblocks)
    log = GraveLog(mem, sb, lambda n: alloc.allocate(n) or 0, alloc.release)  # 0 is a block
    per_block = sb.block_size // LINE
    graves = [(digest(b"g%d" % i), 1000, i) for i in range(per_block + 3)]
    for g in graves:
        log.append(*g)
    mem.sfence()
    assert log.nblocks == 2 and alloc.used == 2  # moved once, the first extent freed
    again = GraveLog(mem, sb, alloc.allocate, alloc.release)  # type: ignore[arg-type]
    assert again.read(lambda m, at, n: m.invalidate(at, n)) == graves
    torn = sb.block_payload_offset(log.first) + 10 * LINE + 20
    mem.nt_store(torn, b"\xff")
    mem.sfence()
    assert again.read(lambda m, at, n: m.invalidate(at, n)) == graves[:10]
    log.close()
    assert mem.load(sb.service_offset + 8, 8) == bytes(8) and alloc.used == 0
    assert (
        GraveLog(mem, sb, alloc.allocate, alloc.release).read(  # type: ignore[arg-type]
            lambda m, at, n: m.invalidate(at, n)
        )
        == []
    )


def test_a_write_the_census_read_torn_is_held_when_committed_or_refused(w: World) -> None:
    """A write in flight whose header the census read torn (its writer's seal racing the
    read: here, a line of garbage) is freed by the census, which held nothing there.  Its
    writer then seals and commits: the server acknowledges it only if it holds the extent
    again (reserved, its blocks still free), so the writes after it never land there and
    the value stays readable to the end of the recovery."""
    stored = fill(w, 10)
    late = w.alloc("late", 100, at=40)  # granted by the server about to die
    svc = w.take_over()
    sb = w.pool.superblock
    w.pool.memory.nt_store(sb.block_header_offset(late.block), b"\xff" * LINE)
    w.pool.memory.sfence()
    while not svc.rec.censused(late.block):
        svc._census_step(svc.rec.region)  # as an ALLOC that found no room does
    w.publish("late", late, value_of("late"))  # the seal: the header is whole again
    acked = w.commit("late", late)
    more = {f"n{i}": w.put(f"n{i}", value_of(f"n{i}")) for i in range(40)}
    w.finish()
    assert w.read("late") == (value_of("late") if acked else None)
    assert all(w.read(k) == value_of(k) for k in [*stored, *more])
    clean_up(w, {*stored, *more, *(["late"] if acked else [])})


def test_a_write_met_on_blocks_the_census_freed_is_reserved_before_it_is_adopted(
    w: World,
) -> None:
    """A header that appears on blocks the census passed and freed (a stray host's bytes,
    or hostile ones: no grant of a server put it there) with a COMMIT naming it: the
    server adopts the write only with its blocks reserved again, so no later grant hands
    them out under it and every value written after stays readable."""
    stored = fill(w, 10)
    svc = w.take_over()
    block = 40  # never granted: its header line is zeros, and the census frees it
    while not svc.rec.censused(block):
        svc._census_step(svc.rec.region)
    assert not svc.rec.held[block] and svc.alloc.used == 10
    forged = p.Grant(block, svc.rec.first - 1)  # a version of before the takeover
    w.publish("forged", forged, value_of("forged"))
    assert w.commit("forged", forged), "its blocks were free: the write is adopted"
    more = {f"n{i}": w.put(f"n{i}", value_of(f"n{i}"), at=block - 5) for i in range(20)}
    assert all(g.block != block for g in more.values()), "a grant reused the adopted block"
    w.finish()
    assert w.read("forged") == value_of("forged")
    assert all(w.read(k) == value_of(k) for k in [*stored, *more])
    clean_up(w, {*stored, *more, "forged"})


def test_a_server_recovers_while_serving_unless_told_to_recover_at_once(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recovery while serving is the default (since 2026-12-07): a server of a pool of many
    regions answers before it has recovered; ``BELUGA_RECOVER_WHILE_SERVING=0`` makes it
    recover everything before its first answer, as before."""
    w = World(pool)
    stored = fill(w, 30)
    monkeypatch.setenv("BELUGA_RECOVER_WHILE_SERVING", "0")
    server = MetadataServer(pool, recovery_region=8)
    try:
        assert not server.service.recovering and len(server.service.index) == 30
    finally:
        server.close()
    monkeypatch.delenv("BELUGA_RECOVER_WHILE_SERVING")
    server = MetadataServer(pool, recovery_region=8)
    try:
        assert server.service.recovering
        server.start_thread()
        with KVStore(pool) as store:
            wait_until(lambda: not store.stats()["recovering"], "the end of recovery")
            for key in stored:
                store.remove(key)
    finally:
        server.close()
