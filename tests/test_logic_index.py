"""Tests aimed at the index logic that mutants survived (tests/logic_mutants/ names them).

Each builds the one situation the logic exists for and asserts the promise it
keeps, so a wrong comparison, order, key or position fails here for its own
reason, not by luck:

- a reader given a slot whose version, digest or header checksum disagrees with
  the block header, alone and wherever it falls in a batch;
- a key the writer placed in its second bucket, and a prefix of many such keys;
- a cuckoo move interrupted between its two writes (the model's crash on demand),
  and a key placed through a chain of two moves;
- the scrub of a whole bucket line that names the wrong slots;
- index repair of slots of another version, or in a bucket not the key's;
- index slots forged to name a block past the pool's last, read by every read path.
"""

from __future__ import annotations

import multiprocessing as mp
import random
from collections.abc import Iterator
from typing import Any

import pytest

from beluga._native import _core
from beluga.coherence import LINE, digest
from beluga.kv import protocol as p
from beluga.pool import Pool
from beluga.server.index import SLOTS, PoolIndex
from tests.logic_util import reader, remove_key, value_of
from tests.test_service import GEOMETRY, WRITER, Clock, Harness


def crowded_digests(nbuckets: int, n: int, seed: int, pool_of: int = 4) -> list[bytes]:
    """n digests whose buckets all fall among `pool_of` buckets: every insertion collides."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        d = rng.randbytes(16)
        _, b1, b2 = _core.ix_hash(d, nbuckets)
        if b1 < pool_of and b2 < pool_of:
            out.append(d)
    return out


@pytest.fixture
def small(shm_path: str) -> Iterator[Pool]:
    pool = Pool.create(shm_path, 12 << 20, geometry=GEOMETRY)
    yield pool
    pool.close()
    Pool.destroy(shm_path)


@pytest.fixture
def h(small: Pool) -> Harness:
    return Harness(small, Clock(), {WRITER}, write_lease_s=1.0, read_lease_s=0.0)


def bucket(pool: Pool, b: int) -> tuple[int, list[tuple[int, int, int]]]:
    got = _core.ix_unpack(pool.memory.load(pool.superblock.index.offset + b * LINE, LINE))
    assert got is not None
    return got[0], list(got[1])


def rewrite_bucket(pool: Pool, b: int, slots: list[tuple[int, int, int]]) -> None:
    """What a stale, stray or hostile writer of the index could leave in bucket ``b``."""
    seq, _ = bucket(pool, b)
    pool.memory.nt_store(pool.superblock.index.offset + b * LINE, _core.ix_pack(seq + 1, slots))
    pool.memory.sfence()


def slot_of(h: Harness, key: str) -> tuple[int, int]:
    """(bucket, slot) of a key in the server's mirror of the index."""
    at = h.svc.ix.where[digest(key.encode())]
    return at // SLOTS, at % SLOTS


# -- the index reader's confirmation against the header ---------------------------------


@pytest.mark.leaves("keys", "writes")  # the late seal stays, as a stopped writer leaves it
def test_a_slot_whose_version_disagrees_with_the_header_is_a_miss(h: Harness) -> None:
    """The slot names version 1 of a block whose header holds a later, uncommitted seal of
    the same key (a write refused at its commit, sealed anyway): never those bytes."""
    grant = h.put("k", value_of("k", 5000))
    assert h.put("other", b"o" * 100)
    late = p.Grant(grant.block, grant.version + 1000)
    h.write("k", late, b"not committed" * 300)  # PUBLISHED, same key, another version
    ix = reader(h.pool)
    assert ix.get(b"k") is None
    assert ix.exists([b"k", b"other"]) == [False, True]
    assert ix.locate([b"k"])[0] is None
    got = ix.get_many_into([b"k", b"other"], [bytearray(8000), bytearray(100)])
    assert got[0] < 0 and got[1] == 100


@pytest.mark.leaves("keys")
def test_a_header_whose_checksum_fails_is_a_miss_wherever_it_falls_in_a_batch(
    h: Harness,
) -> None:
    """A header with every field right but one flipped bit (its CRC then fails): a miss for
    its key, at each place of the batched probe's groups (its four-at-a-time CRC checks and
    the leftovers after them), and a hit for every other key."""
    keys = [f"crc-{i}" for i in range(22)]
    grants = [h.put(k, value_of(k, 300)) for k in keys]
    sb, mem = h.pool.superblock, h.pool.memory
    ix = reader(h.pool)
    for torn in range(len(keys)):
        at = sb.block_header_offset(grants[torn].block)
        line = bytearray(mem.load(at, LINE))
        line[50] ^= 0x10  # in the stamp: every field a probe or a read checks stays
        mem.store(at, bytes(line))
        try:
            truth = [i != torn for i in range(len(keys))]
            assert ix.exists([k.encode() for k in keys]) == truth, f"header {torn} torn"
            assert ix.prefix([k.encode() for k in keys]) == torn
            got = ix.get_many_into([k.encode() for k in keys], [bytearray(300) for _ in keys])
            assert [g >= 0 for g in got] == truth
        finally:
            line[50] ^= 0x10
            mem.store(at, bytes(line))
    assert ix.exists([k.encode() for k in keys]) == [True] * len(keys)


@pytest.mark.leaves("keys")
def test_a_slot_whose_digest_disagrees_with_the_header_is_a_miss(h: Harness) -> None:
    """A slot with the key's tag names another key's block and version: a miss for the key."""
    h.put("k", value_of("k", 5000))
    j = h.put("j", value_of("j", 4000))
    b, s = slot_of(h, "k")
    _, slots = bucket(h.pool, b)
    slots[s] = (slots[s][0], j.block, j.version)
    rewrite_bucket(h.pool, b, slots)
    ix = reader(h.pool)
    assert ix.get(b"k") is None
    assert ix.exists([b"k", b"j"]) == [False, True]
    assert ix.locate([b"k"])[0] is None
    bufs = [bytearray(5000), bytearray(4000)]
    got = ix.get_many_into([b"k", b"j"], bufs)
    assert got[0] < 0 and got[1] == 4000 and bytes(bufs[1]) == value_of("j", 4000)


@pytest.mark.leaves("keys")
def test_a_key_in_its_second_bucket_is_found(h: Harness) -> None:
    """Four keys share a first bucket of three slots: the fourth lives in its second one."""
    nb = h.pool.superblock.nbuckets
    by_first: dict[int, list[str]] = {}
    for i in range(100_000):
        key = f"c{i}"
        _, b1, _ = _core.ix_hash(digest(key.encode()), nb)
        by_first.setdefault(b1, []).append(key)
        if len(by_first[b1]) == SLOTS + 1:
            break
    keys = by_first[b1]
    for key in keys:
        h.put(key, value_of(key, 2000))
    last = digest(keys[-1].encode())
    _, first, second = _core.ix_hash(last, nb)
    assert slot_of(h, keys[-1])[0] == second != first, "the fourth key is not in its second"
    ix = reader(h.pool)
    assert ix.get(keys[-1].encode()) == value_of(keys[-1], 2000)
    assert ix.get_many([k.encode() for k in keys]) == [value_of(k, 2000) for k in keys]
    assert ix.exists(keys) == [True] * len(keys) and ix.prefix(keys) == len(keys)  # batched


@pytest.mark.leaves("keys")
def test_a_prefix_settles_its_open_keys_round_by_round_up_to_its_first_miss(
    h: Harness,
) -> None:
    """Forty first buckets of four keys each: every fourth key lives in its second bucket,
    so a chain of them has more open keys (no first-bucket candidate) than two of a
    prefix's rounds take.  A chain stored whole is counted whole; one with an absent key
    at `cut` is counted to `cut`, wherever the rounds fall."""
    nb = h.pool.superblock.nbuckets
    by_first: dict[int, list[str]] = {}
    groups: list[list[str]] = []
    for i in range(1_000_000):
        key = f"r{i}"
        _, b1, _ = _core.ix_hash(digest(key.encode()), nb)
        by_first.setdefault(b1, []).append(key)
        if len(by_first[b1]) == SLOTS + 1:
            groups.append(by_first[b1])
            if len(groups) == 40:
                break
    for key in (k for g in groups for k in g):
        assert h.put(key, value_of(key, 100))
    where = h.svc.ix.where  # a key the crowding pushed out of both its buckets is not in it
    keys = [k for g in groups for k in g if digest(k.encode()) in where]
    seconds = [k for k in keys if slot_of(h, k)[0] == _core.ix_hash(digest(k.encode()), nb)[2]]
    assert len(seconds) > 2 * 16, "too few keys in their second buckets for two rounds"
    ix = reader(h.pool)
    raw = [k.encode() for k in keys]
    assert ix.prefix(raw) == len(keys) and ix.exists(raw, prefix=True) == [True] * len(keys)
    for cut in sorted({0, 3, 31, 32, 33, len(keys) // 2, len(keys) - 1, len(keys)}):
        chain = [*raw[:cut], b"absent", *raw[cut:]]
        assert ix.prefix(chain) == cut, f"absent key at {cut}"
        assert ix.exists(chain, prefix=True) == [True] * cut + [False]
        assert ix.exists(chain) == [True] * cut + [False] + [True] * (len(keys) - cut)


# -- cuckoo moves ---------------------------------------------------------------------------


def _holds(pool: Pool, d: bytes, block: int, version: int) -> bool:
    tag, b1, b2 = _core.ix_hash(d, pool.superblock.nbuckets)
    return any((tag, block, version) in bucket(pool, b)[1] for b in (b1, b2))


def test_a_move_interrupted_between_its_two_writes_keeps_every_key(small: Pool) -> None:
    """The server dies after each line a put with moves lands (crash on demand, under the
    model): every key placed before it is still in one of its own buckets."""
    sb = small.superblock
    keys = crowded_digests(sb.nbuckets, 4 * SLOTS, seed=3)
    dry = PoolIndex(small.memory, sb)
    moving = next(i for i, d in enumerate(keys) if dry.put(d, i, i + 1) and dry.moves)
    blank = bytes(sb.nbuckets * LINE)
    interrupted, total = 0, 0
    for k in [None, *range(8)]:
        small.memory.nt_store(sb.index.offset, blank)
        small.memory.sfence()
        with Pool.attach(small.spec, coherence="model") as host:
            ix = PoolIndex(host.memory, host.superblock)
            for i, d in enumerate(keys[:moving]):
                assert ix.put(d, i, i + 1)
            host.memory.sfence()
            if k is not None:
                host.memory.crash_after(k)
            landed = host.memory.model_stats()["landed"]
            assert ix.put(keys[moving], moving, moving + 1)
            host.memory.sfence()
            if k is None:
                total = host.memory.model_stats()["landed"] - landed
            assert ix.moves > 0
        lost = [i for i, d in enumerate(keys[:moving]) if not _holds(small, d, i, i + 1)]
        assert not lost, f"keys {lost} in no bucket after a crash at line {k} of the put"
        interrupted += k is not None and 0 < k < total
    assert interrupted, "no crash fell between a move's writes"
    small.memory.nt_store(sb.index.offset, blank)
    small.memory.sfence()


def _digest_in(b1: int, b2: int, n: int) -> bytes:
    """A digest whose first bucket is b1 and second b2 (bl_ix_hash: bytes 4..7 and 8..11)."""
    return (0x1000 + n).to_bytes(4, "little") + b1.to_bytes(4, "little") + b2.to_bytes(8, "little")


def test_a_key_placed_through_a_chain_of_two_moves_keeps_every_key(small: Pool) -> None:
    """Buckets A, B and C are full, D is empty; A's and B's entries sit in their second
    bucket, whose first is C; C's entries can go to D.  A key of A and B is placed by
    moving an entry C -> D, then one A -> C (or B -> C): every key stays in its buckets."""
    a, b, c, d = 0, 1, 2, 3
    ix = PoolIndex(small.memory, small.superblock)
    keys = [_digest_in(c, d, i) for i in range(SLOTS)]  # placed in C
    keys += [_digest_in(c, a, 10 + i) for i in range(SLOTS)]  # C is full: placed in A
    keys += [_digest_in(c, b, 20 + i) for i in range(SLOTS)]  # placed in B
    for i, k in enumerate(keys):
        assert ix.put(k, i, i + 1)
    assert ix.moves == 0
    new = _digest_in(a, b, 99)
    assert ix.put(new, 99, 100), "no chain of moves found for a key of two full buckets"
    assert ix.moves == 2
    small.memory.sfence()
    placed = [*enumerate(keys), (99, new)]
    lost = [i for i, k in placed if not _holds(small, k, i, i + 1)]
    assert not lost, f"keys {lost} are in none of their buckets"
    small.memory.nt_store(small.superblock.index.offset, bytes(small.superblock.nbuckets * LINE))
    small.memory.sfence()


def test_the_scrub_rewrites_a_whole_bucket_that_names_the_wrong_slots(h: Harness) -> None:
    """A bucket line that is whole (its CRC matches) but not the mirror's is rewritten."""
    h.put("k", value_of("k", 3000))
    b, s = slot_of(h, "k")
    _, slots = bucket(h.pool, b)
    slots[s] = (0, 0, 0)
    rewrite_bucket(h.pool, b, slots)
    ix = reader(h.pool)
    assert ix.get(b"k") is None
    h.svc.ix.mirror.scrub_at = b
    h.svc.tick()
    assert ix.get(b"k") == value_of("k", 3000)
    remove_key(h, "k")


# -- index repair -----------------------------------------------------------------------------


@pytest.mark.leaves("keys")
def test_repair_drops_slots_of_another_version_or_bucket(h: Harness) -> None:
    """The pool index names "stale" at an older version and "astray" in a bucket that is
    neither of its own; a restarted server repairs both: readers hit both values."""
    h.put("stale", value_of("stale", 3000))
    h.put("astray", value_of("astray", 3000))
    b, s = slot_of(h, "stale")
    _, slots = bucket(h.pool, b)
    slots[s] = (slots[s][0], slots[s][1], slots[s][2] - 1)
    rewrite_bucket(h.pool, b, slots)
    b, s = slot_of(h, "astray")
    _, slots = bucket(h.pool, b)
    moved, slots[s] = slots[s], (0, 0, 0)
    rewrite_bucket(h.pool, b, slots)
    nb = h.pool.superblock.nbuckets
    own = _core.ix_hash(digest(b"astray"), nb)[1:]
    foreign = next(x for x in range(nb) if x not in own and (0, 0, 0) in bucket(h.pool, x)[1])
    _, slots = bucket(h.pool, foreign)
    slots[slots.index((0, 0, 0))] = moved
    rewrite_bucket(h.pool, foreign, slots)
    ix = reader(h.pool)
    assert ix.get_many([b"stale", b"astray"]) == [None, None]  # what a restart must fix
    h.svc = h.start()
    h.pool.memory.sfence()
    assert ix.get_many([b"stale", b"astray"]) == [value_of("stale", 3000), value_of("astray", 3000)]
    assert ix.get(b"astray") == value_of("astray", 3000)
    assert moved not in bucket(h.pool, foreign)[1], "the slot astray was kept"
    assert len(h.svc.ix) == 2  # one slot a key in the mirror


# -- index slots naming a block past the pool --------------------------------------------


def _in_a_child(fn: Any) -> Any:
    """``fn()`` run in a forked child; its answer, after the child exited cleanly (a read that
    crashes the process must fail the test, not end the test run)."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def main() -> None:
        try:
            send.send(("ok", fn()))
        except BaseException as e:  # reported, the parent fails
            send.send(("raised", repr(e)))

    proc = ctx.Process(target=main)
    proc.start()
    send.close()
    try:
        got = recv.recv() if recv.poll(60) else ("no answer", None)
    except EOFError:
        got = ("died", None)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(30)
        recv.close()
    assert proc.exitcode == 0 and got[0] == "ok", f"the reads ended {got}, exit {proc.exitcode}"
    return got[1]


def _every_read_path(ix: Any, keys: list[bytes], size: int) -> dict[str, Any]:
    """What every one-sided read path answers for ``keys`` (KVStore's reads call these)."""
    one = bytearray(size)
    bufs = [bytearray(size) for _ in keys]
    return {
        "get": [ix.get(k) for k in keys],
        "get_into": [ix.get_into(k, one) for k in keys],
        "get_many": ix.get_many(keys),
        "get_many_into": ix.get_many_into(keys, bufs),
        "exists": ix.exists(keys),
        "exists_one": [ix.exists_one(k) for k in keys],
        "locate": ix.locate(keys, False),
        "prefix": ix.prefix(keys),
        "exists_prefix": ix.exists(keys, prefix=True),
    }


@pytest.mark.leaves("keys")
def test_a_slot_naming_a_block_past_the_pools_last_is_a_miss_on_every_read_path(
    h: Harness,
) -> None:
    """Slots of three keys forged to name the block just past the pool's last, the one
    after, and one far past the mapping (with the key's tag and version): each of those
    keys is a miss on every read path, alone and in batches that span the probe's groups,
    and every other key is read whole."""
    size = 700
    keys = [f"far-{i}" for i in range(40)]
    grants = [h.put(k, value_of(k, size)) for k in keys]
    nblocks = h.pool.superblock.nblocks
    forged = {3: nblocks, 17: nblocks + 1, 33: 0xFFFFFF00}
    for i, block in forged.items():
        b, s = slot_of(h, keys[i])
        _, slots = bucket(h.pool, b)
        slots[s] = (slots[s][0], block, grants[i].version)
        rewrite_bucket(h.pool, b, slots)
    raw = [k.encode() for k in keys]
    got = _in_a_child(lambda: _every_read_path(reader(h.pool), raw, size))
    there = [i not in forged for i in range(len(keys))]
    values = [value_of(k, size) if t else None for k, t in zip(keys, there, strict=True)]
    assert got["get"] == got["get_many"] == values
    assert got["get_into"] == got["get_many_into"] == [size if t else -1 for t in there]
    assert got["exists"] == got["exists_one"] == there
    assert [r is not None for r in got["locate"]] == there
    assert got["prefix"] == min(forged) and got["exists_prefix"][: min(forged) + 1] == [
        *([True] * min(forged)),
        False,
    ]
