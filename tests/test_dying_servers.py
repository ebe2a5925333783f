"""A server whose host dies in the middle of an operation: what its stores leave behind.

A killed process's stores all land, in program order; a host that dies (a
power cut, a CXL host failing) loses what it had not fenced, in any order, and
can leave a line torn in 8-byte pieces.  The pool outlives the host, so every
state between two fences is one a successor, and every reader meanwhile, may
meet.  tests/test_recovery_interleavings.py draws whole histories of such deaths
(``CrashingHistory``); each bug they found on 2026-12-06 has a test here that
fails on the code before:

- a bucket line torn by a dying server read as empty, to readers and to the
  next server that touched it: every key it named was a miss until recovery's
  last step;
- a key's slot rewritten in place could tear into a slot naming neither value;
- a grave written before the new copy's slot let a successor clear the copy
  readers got while the new one was named nowhere;
- a second slot of a key, left by a replacement that died half done, outlived
  the key's next acknowledged write (a stale read) or, confirmed without its
  commit word, made the key's value unnamed;
- a COMMIT sent again to the successor and acknowledged there neither named the
  copy a scan had indexed nor left a grave for older copies;
- a scan that dropped a named copy for a newer one it had indexed cleared the
  copy before it named the newer one;
- a grave that found no room for the log in a full pool finished the scan but
  left the log, whose older grave of the key a successor then applied over
  the acknowledged copy (an acknowledged write lost);
- a hold under a header hostile bytes took was one block long while no server
  knew the longest extent, and a grant took the rest of a live write's blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from beluga._native import _core
from beluga.coherence import LINE, ModelConfig, digest
from beluga.kv import protocol as p
from beluga.pool import Pool
from tests.test_recovery import GEOMETRY, World, clean_up, value_of


@pytest.fixture
def pool(shm_path: str) -> Iterator[Pool]:
    pool = Pool.create(shm_path, 12 << 20, geometry=GEOMETRY)
    yield pool
    pool.close()
    Pool.destroy(shm_path)


@pytest.fixture
def w(pool: Pool) -> World:
    return World(pool)


def _bucket_of(w: World, key: str, block: int) -> tuple[int, int]:
    """The bucket and slot (0..2) of the pool index naming ``key`` at ``block``."""
    sb, mem = w.pool.superblock, w.pool.memory
    tag, b1, b2 = _core.ix_hash(digest(key.encode()), sb.nbuckets)
    for b in (b1, b2):
        got = _core.ix_unpack(mem.load(sb.index.offset + b * LINE, LINE))
        assert got is not None
        for i, (t, at, _) in enumerate(got[1]):
            if t == tag and at == block:
                return b, i
    raise AssertionError(f"no slot names {key} at block {block}")


def _lookup(w: World, key: str) -> None:
    """An RPC LOOKUP of the key (the server settles it first while it recovers)."""
    w.svc.op_lookup(w.request(p.StoreOp.LOOKUP, p.encode_digests([digest(key.encode())], 0)))


def _abort(w: World, key: str, g: p.Grant) -> None:
    payload = p.encode_commit([(digest(key.encode()), g.block, g.version)])
    w.svc.op_abort(w.request(p.StoreOp.ABORT, payload))


@contextmanager
def _model_pool(shm_path: str, seed: int) -> Iterator[tuple[Pool, list[Pool]]]:
    """A new pool on model hosts whose lines drain early and in pieces often (so a line
    rewritten in place tears at some crash point), and three more hosts (a writer, a
    reader, a successor); all closed and the pool destroyed after."""
    model = ModelConfig(seed=seed, drain_rate=0.9)
    pool = Pool.create(shm_path, 12 << 20, geometry=GEOMETRY, coherence="model", model=model)
    hosts = [
        Pool.attach(shm_path, coherence="model", model=ModelConfig(seed=100 + seed + i))
        for i in range(3)
    ]
    try:
        yield pool, hosts
    finally:
        for h in hosts:
            h.close()
        pool.close()
        Pool.destroy(shm_path)


def _land_commit_word(w: World, g: p.Grant) -> None:
    """A COMMIT's commit word lands and its server dies before anything else."""
    sb, mem = w.pool.superblock, w.pool.memory
    mem.nt_store(sb.block_commit_offset(g.block), g.version.to_bytes(8, "little"))
    mem.sfence()


def test_a_bucket_line_a_dying_server_tore_still_names_its_keys(w: World) -> None:
    """A server dies while it rewrites a bucket line: the line's CRC fails, its slots are
    the old line's or the new one's.  Readers must still find the keys it names (they
    confirm every slot against the header anyway), and so must the next server when it
    first touches the bucket.  Before, a torn line read as empty to both, and the next
    server rewrote it empty: a miss of acknowledged values until recovery's last step."""
    sb, mem = w.pool.superblock, w.pool.memory
    g = w.put("k", value_of("k"))
    b, _ = _bucket_of(w, "k", g.block)
    off = sb.index.offset + b * LINE
    line = bytearray(mem.load(off, LINE))
    line[56:64] = bytes(x ^ 0xA5 for x in line[56:64])  # the last piece: another rewrite's
    mem.nt_store(off, bytes(line))
    mem.sfence()
    assert _core.ix_unpack(mem.load(off, LINE)) is None, "the line is not torn: nothing tested"
    assert w.read("k") == value_of("k")
    svc = w.take_over()
    _lookup(w, "k")  # the new server loads the bucket
    assert svc.recovering
    assert w.read("k") == value_of("k")
    assert _core.ix_unpack(mem.load(off, LINE)) is not None, "the torn line was left torn"
    clean_up(w, {"k"})


@pytest.mark.parametrize("first", ["committed", "in-flight"])
def test_a_second_slot_a_dying_replacement_left_neither_hides_nor_outlives_the_key(
    w: World, first: str
) -> None:
    """A server replacing a key's value writes the new copy's slot, then clears the old
    one.  It died between them, its new copy's commit word not landed (a host that dies
    loses unfenced stores in any order): the key's bucket holds a slot of the committed
    copy and one of a write in flight.  The next server must neither take the slot in
    flight for the key's value (it names the committed one: with the slot in flight first,
    a LOOKUP unnamed the key) nor let it outlive the next acknowledged write (with the
    committed slot first, the replacement kept the other: a stale read)."""
    sb, mem = w.pool.superblock, w.pool.memory
    g1 = w.put("k", value_of("k-1"))
    g2 = w.alloc("k", 100)
    w.publish("k", g2, value_of("k-2"))
    b, i = _bucket_of(w, "k", g1.block)
    off = sb.index.offset + b * LINE
    seq, slots = _core.ix_unpack(mem.load(off, LINE))
    assert i == 0 and slots[1:] == [(0, 0, 0)] * 2, "the key's bucket is not empty besides"
    tag = slots[0][0]
    named = [slots[0], (tag, g2.block, g2.version)]
    if first == "in-flight":
        named.reverse()
    mem.nt_store(off, _core.ix_pack(seq + 1, [*named, (0, 0, 0)]))
    mem.sfence()
    assert w.read("k") in (value_of("k-1"), value_of("k-2"))
    w.take_over()
    _lookup(w, "k")
    assert w.read("k") in (value_of("k-1"), value_of("k-2")), "the key's value is unnamed"
    w.put("k", value_of("k-3"))
    assert w.read("k") == value_of("k-3"), "a slot of before the acknowledged write is read"
    _abort(w, "k", g2)
    w.finish()
    assert w.read("k") == value_of("k-3")
    clean_up(w, {"k"})


@pytest.mark.parametrize("seed", range(4))
def test_a_server_dying_inside_an_overwrite_while_recovering_keeps_the_key_readable(
    shm_path: str, seed: int
) -> None:
    """A recovering server commits a new value of a key whose acknowledged copy the pool
    index names, and its host dies after any number of the lines it stores (the model:
    unfenced lines lost, lines torn in pieces).  From then on, through a successor's whole
    recovery, readers get the old value or the new one, never a miss.  Before: a slot
    rewritten in place could tear into neither, and the grave the COMMIT writes landed
    ahead of the new slot, so a successor's census cleared the old copy (dead by the grave)
    while the new one was named nowhere."""
    total: int | None = None
    k, died = 0, 0
    while total is None or k < total:
        with _model_pool(shm_path, seed) as (pool, hosts):
            w = World(pool, hosts[0], hosts[1])
            w.put("k", value_of("k-1", 3000), at=0)
            w.put("z", value_of("z"), at=200)
            svc = w.take_over()  # recovering: the COMMIT below writes a grave
            while svc.rec is not None and svc.rec.census < 340:
                w.step()  # far from k's copy: the successor's census starts there
            g = w.alloc("k", 6000, at=300)
            assert g.block >= 300
            w.publish("k", g, value_of("k-2", 6000))
            before = pool.memory.model_stats()["landed"]
            if total is not None:
                pool.memory.crash_after(k)
            assert svc.recovering
            w.commit("k", g)  # its answer never goes out
            landed = pool.memory.model_stats()["landed"] - before
            if total is None:
                total = landed
                clean_up(w, {"k", "z"})
                continue
            died += bool(pool.memory.model_stats()["crashed"])
            w.pool = hosts[2]
            w.take_over()
            allowed = (value_of("k-1", 3000), value_of("k-2", 6000))
            while w.svc.recovering:
                assert w.read("k") in allowed, f"a miss after {k} of {total} lines landed"
                w.step()
            assert w.read("k") in allowed, f"a miss after {k} of {total} lines landed"
            _abort(w, "k", g)  # if its COMMIT did not land, its writer gives up
            w.writers_leave()  # a retired copy half cleared is a write in flight under its writer
            clean_up(w, {"k", "z"})
            k += 1
    assert total and died == total, "the sweep did not die inside the COMMIT at every line"


@pytest.mark.parametrize("seed", range(3))
def test_a_server_dying_as_its_scan_drops_a_named_copy_keeps_the_key_readable(
    shm_path: str, seed: int
) -> None:
    """A key's newer copy landed unanswered (its commit word, not its slot), so the pool
    index still names the older one.  A recovering server's scan indexes the newer copy
    first, then meets the older, named one and drops it, and its host dies after any
    number of the lines that step stores.  Readers must get one of the two copies through
    the successor's whole recovery.  The step cleared the older copy before it named the
    newer one: a death between them left the key named nowhere."""
    total: int | None = None
    k, died = 0, 0
    while total is None or k < total:
        with _model_pool(shm_path, seed) as (pool, hosts):
            w = World(pool, hosts[0], hosts[1])
            w.put("k", value_of("k-1", 3000), at=40)
            w.take_over(at_once=True)  # its first grant is where the next census starts
            newer = w.alloc("k", 6000, at=300)
            w.publish("k", newer, value_of("k-2", 6000))
            _land_commit_word(w, newer)  # its server dies before the slot
            svc = w.take_over()
            while svc.rec is not None and not svc.rec.scanned(newer.block):
                w.step()
            assert svc.rec is not None and not svc.rec.scanned(40)
            assert w.read("k") == value_of("k-1", 3000)
            while svc.rec is not None and not svc.rec.scanned(31):
                w.step()  # up to the step that meets the older copy
            assert svc.rec is not None and not svc.rec.scanned(40)
            before = pool.memory.model_stats()["landed"]
            if total is not None:
                pool.memory.crash_after(k)
            w.step()
            assert svc.rec is not None and svc.rec.scanned(40)
            landed = pool.memory.model_stats()["landed"] - before
            allowed = (value_of("k-1", 3000), value_of("k-2", 6000))
            if total is None:
                total = landed
                w.finish()
                assert w.read("k") == value_of("k-2", 6000)
                clean_up(w, {"k"})
                continue
            died += bool(pool.memory.model_stats()["crashed"])
            w.pool = hosts[2]
            w.take_over()
            while w.svc.recovering:
                assert w.read("k") in allowed, f"a miss after {k} of {total} lines landed"
                w.step()
            assert w.read("k") in allowed, f"a miss after {k} of {total} lines landed"
            w.writers_leave()
            clean_up(w, {"k"})
            k += 1
    assert total and died == total, "the sweep did not die inside the step at every line"


def test_a_commit_sent_again_names_the_copy_a_scan_indexed_unnamed(w: World) -> None:
    """A COMMIT's commit word lands, its server dies before the slot.  The successor's
    scan indexes the copy (committed) where no slot names it; the writer's COMMIT, sent
    again, is acknowledged: readers must get the value at once, not at recovery's end."""
    g = w.alloc("k", 100, at=40)
    w.publish("k", g, value_of("k"))
    _land_commit_word(w, g)
    svc = w.take_over()
    while svc.rec is not None and not svc.rec.scanned(g.block):
        w.step()
    assert svc.recovering, "recovery ended: nothing tested"
    assert w.read("k") is None  # no slot names it yet (its COMMIT had no answer)
    assert w.commit("k", g)
    assert w.read("k") == value_of("k"), "an acknowledged value is named nowhere"
    clean_up(w, {"k"})


def test_a_commit_sent_again_while_recovering_buries_the_older_copies(w: World) -> None:
    """As test_recovery_interleavings' test of hostile bytes in a new copy's header, with
    the new copy's COMMIT landed unanswered and sent again to the recovering server, which
    acknowledges it by adopting the copy: that acknowledgment needs the grave as much as
    any COMMIT's, or a successor's scan brings back the older copy once hostile bytes hit
    the new one's header."""
    sb, mem = w.pool.superblock, w.pool.memory
    older = w.alloc("k", 100, at=300)
    w.publish("k", older, value_of("k-1"))
    _land_commit_word(w, older)
    w.put("z", value_of("z"), at=100)  # the census starts here
    new = w.alloc("k", 100, at=110)
    w.publish("k", new, value_of("k-2"))
    _land_commit_word(w, new)
    svc = w.take_over()
    assert svc.rec is not None and not svc.rec.scanned(new.block)
    assert w.commit("k", new)  # sent again: adopted and acknowledged
    assert not svc.rec.scanned(older.block), "the scan reached the older copy: nothing tested"
    assert w.read("k") == value_of("k-2")
    mem.nt_store(sb.block_header_offset(new.block) + 8, b"hostile bytes")
    mem.sfence()
    w.take_over()
    while w.svc.recovering:
        assert w.read("k") is None, "an overwritten value came back"
        w.step()
    assert w.read("k") is None, "an overwritten value came back"
    clean_up(w, {"k", "z"})


def test_a_grave_with_no_room_closes_the_log_so_no_older_grave_outlives_it(
    w: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recovering server acknowledges a new write of a key (a grave: every copy of before
    it is dead), then a write of the key granted before the takeover (a grave keeping that
    copy).  The second grave finds no room for the log in a full pool, so the server
    scans every key at once instead.  The log must go then: it still held the first
    grave, and a successor applied it over the acknowledged copy (a full pool's crash
    histories, seeds 53, 138 and 142: an acknowledged write lost)."""
    from beluga.errors import CapacityError

    w.put("k", value_of("k-1"))
    old = w.alloc("k", 100)  # granted before the takeover, committed after it
    w.publish("k", old, value_of("k-2"))
    svc = w.take_over()
    w.put("k", value_of("k-3"))  # its grave: every copy of before the takeover is dead
    assert svc.graves.nblocks, "no log of graves: nothing tested"

    def full(*_: object) -> None:
        raise CapacityError("no room for the log (a full pool)")

    monkeypatch.setattr(svc.graves, "append", full)
    assert w.commit("k", old)  # its grave (keeping it) finds no room: the scan finishes
    assert not svc._scanning()
    assert w.read("k") == value_of("k-2")
    monkeypatch.undo()
    w.take_over()
    w.finish()
    assert w.read("k") == value_of("k-2"), "an acknowledged write was lost"
    clean_up(w, {"k"})


def test_a_write_hostile_bytes_hit_keeps_its_blocks_while_no_server_knows_the_longest_extent(
    w: World,
) -> None:
    """The first server recovered an empty pool: the service line knows no extent (0).
    A write of three blocks is granted, hostile bytes take its header, and the next
    server's census holds its blocks while its writer lives.  With no longest extent
    known the hold must reach as far as the write could (to the next header or used
    block), not one block: the next grant took the write's other blocks."""
    w.take_over()
    x = w.alloc("x", 3 * GEOMETRY.block_size, at=0)
    w.publish("x", x, b"X" * 3 * GEOMETRY.block_size)
    sb, mem = w.pool.superblock, w.pool.memory
    w.put("y", value_of("y"), at=10)
    mem.nt_store(sb.block_header_offset(x.block) + 8, b"hostile bytes")
    mem.sfence()
    svc = w.take_over()
    n = w.put("n", value_of("n", 2 * GEOMETRY.block_size), at=x.block)
    assert not x.block <= n.block < x.block + 3, "the blocks of a write in flight granted again"
    assert svc.unreadable.get(x.block, 0) >= 3
    assert w.read("y") == value_of("y") and w.read("n") == value_of("n", 2 * GEOMETRY.block_size)
    clean_up(w, {"y", "n"})
