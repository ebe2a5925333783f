"""Tests aimed at the logic that mutants survived (tests/logic_mutants.py names them).

Each builds the one situation the logic exists for and asserts the promise it
keeps, so a wrong comparison, order, key or position fails here for its own
reason, not by luck:

- a reader given a slot whose version or digest disagrees with the block header;
- a key the writer placed in its second bucket;
- a cuckoo move interrupted between its two writes (the model's crash on demand);
- index repair of slots of another version, or in a bucket not the key's;
- a restart after removes and refused writes, versions checked for reuse;
- a live holder on one kernel whose heartbeat stops moving;
- an extent ending at the pool's last block, surviving a restart;
- a save over several ALLOC/COMMIT batches with a lease lost in the second;
- a tier hit for the second key of a request;
- a writer of an id's older generation, and namespaced keys of any length;
- an ALLOC batch that skips keys (committed, or in flight elsewhere) among its grants;
- index slots forged to name a block past the pool's last, read by every read path;
- a request whose tier holds some of the keys the pool missed, not all.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import random
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from beluga import KVStore
from beluga._native import _core
from beluga.chaos.roles import Midway
from beluga.child import server_process
from beluga.coherence import LINE, BlockState, digest, parse_header
from beluga.kv import protocol as p
from beluga.kv.identity import KVNamespace, ModelIdentity
from beluga.kv.store import MAX_KEY_BYTES, key_bytes
from beluga.kv.tier import MooncakeTier
from beluga.pool import Geometry, Pool
from beluga.pool.hosts import HostRegistry, HostTable
from beluga.server.allocator import BlockAllocator
from beluga.server.index import SLOTS, PoolIndex
from beluga.server.server import serve
from beluga.transfer import Buffers
from tests.conftest import serving
from tests.test_index import reader
from tests.test_service import GEOMETRY, WRITER, Clock, Harness

# (tests/test_store.py's helpers, repeated: importing that module costs torch's import,
# and the cheap logic mutants run these tests in fresh processes on every pytest run)


def value_of(key: str, size: int) -> bytes:
    """The bytes every test writes under a key: checkable by any reader."""
    return random.Random(hashlib.sha256(key.encode()).digest()).randbytes(size)


def _serve(spec: str, options: dict[str, Any], ready: Any) -> None:
    serve(spec, ready=ready, **options)


@contextmanager
def server(spec: str) -> Iterator[Any]:
    """A metadata server in a process of its own."""
    with server_process(_serve, spec, {"refresh_s": 0.02}) as proc:
        yield proc


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


#: a small RPC area, so that a save of a few dozen keys spans several batches
BATCHED = Geometry(max_hosts=4, rpc_bytes_per_host=4 << 10, block_size=16 << 10)


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


def test_the_scrub_rewrites_a_whole_bucket_that_names_the_wrong_slots(h: Harness) -> None:
    """A bucket line that is whole (its CRC matches) but not the mirror's is rewritten."""
    h.put("k", value_of("k", 3000))
    b, s = slot_of(h, "k")
    _, slots = bucket(h.pool, b)
    slots[s] = (0, 0, 0)
    rewrite_bucket(h.pool, b, slots)
    ix = reader(h.pool)
    assert ix.get(b"k") is None
    h.svc.ix._scrub_at = b
    h.svc.tick()
    assert ix.get(b"k") == value_of("k", 3000)
    _remove(h, "k")


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


# -- the version floor ------------------------------------------------------------------------


def _remove(h: Harness, key: str) -> None:
    raw = h.svc.op_remove(h.request(p.StoreOp.REMOVE, p.encode_digests([digest(key.encode())])))
    assert p.decode_flags(raw) == [True]


@pytest.mark.leaves("keys", "writes")  # it ends holding grants: WRITING headers
def test_a_restart_after_removes_and_refused_writes_reuses_no_version(h: Harness) -> None:
    handed: list[int] = []
    for i in range(4):
        handed.append(h.put(f"kept{i}", b"k" * 100).version)
    for i in range(3):
        handed.append(h.put(f"gone{i}", b"g" * 100).version)
        _remove(h, f"gone{i}")
    late = h.alloc("refused", 100)
    handed.append(late.version)
    h.write("refused", late, b"r" * 100)
    h.clock.now += 5  # past its write lease: cancelled, its COMMIT refused
    h.svc.tick()
    assert not h.commit("refused", late)
    aborted = h.alloc("aborted", 100)
    handed.append(aborted.version)
    h.svc.op_abort(
        h.request(
            p.StoreOp.ABORT, p.encode_commit([(digest(b"aborted"), aborted.block, aborted.version)])
        )
    )
    assert len(set(handed)) == len(handed)
    # the newest versions named nothing in the pool: only the floor remembers them
    h.svc = h.start()
    after = [h.alloc(f"new{i}", 100).version for i in range(5)]
    assert min(after) > max(handed), f"versions {sorted(set(after) & set(handed))} repeat"
    h.svc = h.start()  # and once more, with writes in flight at the restart
    again = [h.alloc(f"newer{i}", 100).version for i in range(3)]
    assert min(again) > max(after)


# -- liveness of a holder on one kernel ------------------------------------------------


def test_a_stalled_heartbeat_of_a_live_process_on_one_kernel_keeps_its_id(pool: Pool) -> None:
    """This process holds an id and never beats: on its kernel it is alive however long."""
    clock = Clock()
    with serving(pool):
        entry = pool.claim_host(1)
        try:
            table = HostTable(
                pool.memory, pool.superblock.hosts, pool.superblock.max_hosts, clock=clock
            )
            registry = HostRegistry(table, stale_s=1.0)
            assert registry.alive(1) is not None
            clock.now += 3600.0  # the heartbeat has not moved for an hour of the observer
            grant = registry.alive(1)
            assert grant is not None and grant.generation == entry.generation
        finally:
            pool.hosts.release(entry)


# -- the allocator at the pool's last block -------------------------------------------------


@pytest.mark.leaves("keys")
def test_an_extent_ending_at_the_last_block_survives_a_restart(small: Pool) -> None:
    """The pool is filled to its last block (no watermark eviction): the extent that ends
    there is found free, granted, and recovered."""
    opts = {"write_lease_s": 1.0, "high_watermark": 1.0, "low_watermark": 1.0}
    h = Harness(small, Clock(), {WRITER}, **opts)
    sb = h.pool.superblock
    n, bs = sb.nblocks, sb.block_size
    big = h.put("big", b"B" * ((n - 2) * bs))
    assert big.block == 0
    last = h.put("last", value_of("last", 2 * bs - 100))  # the two blocks left, at the end
    assert last.block + 2 == n, f"extent at {last.block}, not ending at block {n - 1}"
    assert h.lookup("big") is not None, "the pool's free end was not found: 'big' was evicted"
    h.svc = h.start()
    assert h.read("last") == value_of("last", 2 * bs - 100)
    loc = h.lookup("big")
    assert loc is not None and loc.block == 0
    assert h.svc.alloc.nfree == 0


def test_a_run_as_long_as_the_pool_is_found() -> None:
    """The search window is exactly the run: the whole pool, then the last two blocks."""
    alloc = BlockAllocator(8)
    assert alloc.allocate(8) == 0
    alloc.release(0, 8)
    assert alloc.allocate(6) == 0 and alloc.allocate(2) == 6
    assert alloc.nfree == 0 and alloc.allocate(1) is None


@pytest.mark.leaves("keys")
def test_a_drop_of_an_old_version_at_a_reused_block_keeps_the_new_value(h: Harness) -> None:
    """A reader found version 1 corrupt; the key was removed and written again into the
    same block since: its DROP names the old version, so the new value stays."""
    old = h.put("k", b"old" * 100)
    _remove(h, "k")
    h.svc.alloc._cursor = old.block  # the allocator's next search starts at the freed block
    new = h.put("k", b"new" * 100)
    assert new.block == old.block and new.version != old.version
    drop = p.encode_commit([(digest(b"k"), old.block, old.version)])
    assert p.decode_flags(h.svc.op_drop(h.request(p.StoreOp.DROP, drop))) == [False]
    assert h.read("k") == b"new" * 100


# -- store batching: positions across several batches ------------------------------------------


@pytest.mark.leaves("writes")  # the extent taken back is sealed by its writer anyway
def test_a_lease_lost_in_the_second_batch_is_named_at_its_position(shm_path: str) -> None:
    pool = Pool.create(shm_path, 24 << 20, geometry=BATCHED)
    try:
        with server(pool.spec), KVStore(pool) as s:
            per = (s.rpc.max_payload - p.HEADER_BYTES) // p.RECORD_BYTES[p.StoreOp.ALLOC]
            per_commit = (s.rpc.max_payload - p.HEADER_BYTES) // p.RECORD_BYTES[p.StoreOp.COMMIT]
            n = max(per, per_commit) + 4
            assert n * 2 < pool.superblock.nblocks, "the pool holds the whole save"
            keys = [f"b{i}" for i in range(n)]
            values = [value_of(k, 1000 + i) for i, k in enumerate(keys)]
            lost = max(per, per_commit) + 1  # in the second ALLOC and COMMIT batch

            def take_back(mem: Any, places: Sequence[Any]) -> None:
                s._abort([places[lost]])

            saved = s.save(keys, Midway(values, take_back), replace=True)
            assert saved.lost == [lost]
            assert saved.stored == [i for i in range(n) if i != lost]
            got = s.get_batch(keys)
            assert got == [None if i == lost else v for i, v in enumerate(values)]
            for k in keys:
                s.remove(k)
    finally:
        pool.close()
        Pool.destroy(shm_path)


# -- tier promotion ---------------------------------------------------------------------------


class FakeTier(MooncakeTier):
    """A tier in this process holding values by pool digest (no Mooncake cluster)."""

    def __init__(self, values: dict[str, bytes]) -> None:
        digests = _core.key_digests(list(values))
        self.held = {bytes(d): v for d, v in zip(digests, values.values(), strict=True)}
        self.config = types.SimpleNamespace(write_through=False)
        self.asked: list[bytes] = []

    def fetch(self, digests: Sequence[bytes]) -> list[bytes | None]:
        self.asked += [bytes(d) for d in digests]
        return [self.held.get(bytes(d)) for d in digests]

    def exists(self, digests: Sequence[bytes]) -> list[bool]:
        return [bytes(d) in self.held for d in digests]

    def submit(self, digest: bytes, value: bytes, why: str) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def test_a_tier_hit_for_the_second_key_is_promoted_under_that_key(pool: Pool) -> None:
    """The pool holds a request's first key; the tier its second and third (and, for a
    batch get, another): each is read, and promoted into the pool under its own key."""
    tiered = {k: value_of(k, 1500 + i) for i, k in enumerate(["t1", "t2", "t3"])}
    tier = FakeTier(tiered)
    with server(pool.spec), KVStore(pool, tier=tier) as s, KVStore(pool) as plain:
        s.put("t0", value_of("t0", 1400))
        keys = ["t0", "t1", "t2"]
        refs = s.locate(keys)
        assert all(r is not None for r in refs), refs
        bufs = [bytearray(r.length) for r in refs if r is not None]
        assert s.load(refs, Buffers(bufs)) == [True, True, True]
        assert [bytes(b) for b in bufs] == [value_of("t0", 1400), tiered["t1"], tiered["t2"]]
        assert plain.get_batch(keys) == [value_of("t0", 1400), tiered["t1"], tiered["t2"]]
        assert s.get_batch(["t0", "t3"]) == [value_of("t0", 1400), tiered["t3"]]
        assert plain.get("t3") == tiered["t3"]
        for k in ["t0", *tiered]:
            assert plain.remove(k)


# -- the server's view of writers -----------------------------------------------------------


def test_a_writer_of_an_older_generation_is_gone(pool: Pool) -> None:
    """A write's owner is an id *and* its generation: the id's next holder is not it."""
    with serving(pool) as srv:
        entry = pool.claim_host(1)
        try:
            assert srv.holder_alive(1, entry.generation)
            assert not srv.holder_alive(1, entry.generation - 1)
            assert not srv.holder_alive(1, entry.generation + 1)
        finally:
            pool.hosts.release(entry)
        assert not srv.holder_alive(1, entry.generation)


# -- identity -------------------------------------------------------------------------------


def test_a_namespaced_key_of_any_length_fits() -> None:
    ns = KVNamespace(ModelIdentity.explicit("m", "r1"), "layout-1")
    for n in (1, MAX_KEY_BYTES - 16, MAX_KEY_BYTES, 10 * MAX_KEY_BYTES):
        key = ns.key(b"x" * n)
        assert len(key_bytes(key)) <= MAX_KEY_BYTES
    long_a, long_b = ns.key(b"a" * 4000 + b"1"), ns.key(b"a" * 4000 + b"2")
    assert long_a != long_b


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


# -- grants of a batch that skips keys ------------------------------------------------------


def _header(pool: Pool, block: int) -> Any:
    sb = pool.superblock
    return parse_header(pool.memory.load(sb.block_header_offset(block), LINE))


def _alloc_skipping(h: Harness, keys: Sequence[str], lengths: Sequence[int]) -> list[p.Grant]:
    """One ALLOC with ALLOC_SKIP_PRESENT, as a save without ``replace`` sends it."""
    items = [(digest(k.encode()), n, len(k)) for k, n in zip(keys, lengths, strict=True)]
    req = h.request(p.StoreOp.ALLOC, p.encode_alloc(items, p.ALLOC_SKIP_PRESENT))
    return p.decode_grants(h.svc.op_alloc(req))


@pytest.mark.leaves("keys")
def test_every_grant_of_a_batch_that_skips_keys_is_written_before_the_answer(h: Harness) -> None:
    """One ALLOC_SKIP_PRESENT batch whose keys are new, committed, in flight on another
    host, and repeated, in that mix: before its writer stores a byte, the header of each
    grant is WRITING with its key, version, length, writer and generation.  The server
    restarts then, the write leases run out, and the writer (alive, stalled) has stored
    nothing: the new server holds every grant, reuses none of their blocks, grants their
    keys again to a new save (a write whose lease ran out never commits), and frees them
    once the writer is seen gone."""
    other = (2, 3)
    h.alive.add(other)
    h.put("committed", b"c" * 100)
    elsewhere = h.alloc("elsewhere", 100, who=other)
    keys = ["n0", "committed", "n1", "elsewhere", "n2", "n2", "n3"]
    lengths = [1000 + 100 * i for i in range(len(keys))]
    grants = _alloc_skipping(h, keys, lengths)
    skipped = {1: p.PRESENT_COMMITTED, 3: p.PRESENT_WRITING, 5: p.PRESENT_WRITING}
    assert [g.present for g in grants] == [skipped.get(i, 0) for i in range(len(keys))]
    granted = {i: g for i, g in enumerate(grants) if not g.present}
    for i, g in granted.items():
        hd = _header(h.pool, g.block)
        assert hd is not None, f"no header for the grant of {keys[i]}"
        assert (hd.state, hd.digest, hd.version, hd.length, hd.key_len) == (
            BlockState.WRITING,
            digest(keys[i].encode()),
            g.version,
            lengths[i],
            len(keys[i]),
        ), keys[i]
        assert (hd.writer, hd.writer_gen) == WRITER, keys[i]
    h.svc = h.start()  # the server dies before the writer's first store
    h.clock.now += 5  # past every write lease; the writers live (stopped)
    h.svc.tick()
    held = {g.block for g in granted.values()} | {elsewhere.block}
    assert set(h.svc.pending) == held, "a grant was lost with its server"
    fresh = h.put("acknowledged", b"v" * 100, who=other)
    assert fresh.block not in held
    # a write whose lease ran out never commits: a save of its key writes it again
    (again,) = _alloc_skipping(h, ["n0"], [1000])
    assert again.present == 0 and again.block not in held
    h.alive.clear()
    h.svc.tick()
    assert not h.svc.pending and h.svc.stats()["blocks_used"] == 2


@pytest.mark.leaves("keys")
def test_a_batch_that_skips_keys_then_fails_gives_every_grant_back_and_says_why(
    h: Harness,
) -> None:
    """A batch that granted some keys and skipped a committed one, then meets a value larger
    than the pool: the value's own error, and no grant held or announced."""
    h.put("committed", b"c" * 100)
    limit = h.pool.superblock.nblocks * h.pool.superblock.block_size
    with pytest.raises(ValueError, match="exceeds the pool"):
        _alloc_skipping(h, ["n0", "committed", "n1", "huge"], [100, 100, 100, limit + 1])
    assert not h.svc.pending and h.svc.stats()["blocks_used"] == 1
    assert [g.present for g in _alloc_skipping(h, ["n0", "committed"], [10, 10])] == [
        0,
        p.PRESENT_COMMITTED,
    ]
    h.alive.clear()
    h.svc.tick()


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


# -- tier promotion: a tier that holds some of the missed keys --------------------------


def test_a_request_whose_tier_holds_some_of_its_missed_keys_promotes_each_under_its_own_key(
    pool: Pool,
) -> None:
    """The pool holds a request's first key; of the keys it misses, the tier holds every
    other one.  Each read path returns the tier's value for those and a miss for the rest,
    and each promoted value lands in the pool under its own key; a prefix ends at the first
    key neither holds, and an existence check counts only what one of them holds."""
    names = [f"s{i}" for i in range(18)]
    value = {k: value_of(k, 1200 + 10 * i) for i, k in enumerate(names)}
    in_tier = {k: value[k] for k in names[1:] if int(k[1:]) % 2 == 0}
    tier = FakeTier(in_tier)
    with server(pool.spec), KVStore(pool, tier=tier) as s, KVStore(pool) as plain:
        s.put("s0", value["s0"])

        def want(keys: list[str]) -> list[bytes | None]:
            return [value[k] if k == "s0" or k in in_tier else None for k in keys]

        batch = ["s0", "s1", "s2", "s3", "s4"]
        assert s.get_batch(batch) == want(batch)
        refs = s.locate(["s0", "s5", "s6", "s7", "s8"], prefix=False)
        assert [r is not None for r in refs] == [True, False, True, False, True]
        bufs = [bytearray(r.length if r else 1) for r in refs]
        assert s.load(refs, Buffers(bufs)) == [True, False, True, False, True]
        assert [bytes(b) for b, r in zip(bufs, refs, strict=True) if r] == [
            value["s0"],
            value["s6"],
            value["s8"],
        ]
        into = [bytearray(2000) for _ in range(4)]
        got = s.batch_get_into(["s9", "s10", "s11", "s12"], into)
        assert got == [-1, len(value["s10"]), -1, len(value["s12"])]
        assert bytes(into[1][: got[1]]) == value["s10"] and bytes(into[3][: got[3]]) == value["s12"]
        promoted = ["s2", "s4", "s6", "s8", "s10", "s12"]
        assert plain.get_batch(names[:13]) == [
            value[k] if k in ["s0", *promoted] else None for k in names[:13]
        ]
        assert s.lookup_prefix(["s0", "s14", "s13", "s16"]) == 2  # s13 is nowhere
        assert s.batch_is_exist(["s13", "s14", "s15"]) == [False, True, False]
        for k in ["s0", *promoted]:
            assert plain.remove(k)


# -- recovery of a write in flight at a restart ------------------------------------------


@pytest.mark.leaves("keys")
def test_a_write_in_flight_at_a_restart_is_still_its_writers_after_the_new_servers_tick(
    h: Harness,
) -> None:
    """Host 1 in generation 7 (alive) has sealed "a"; a write of "b" by the id's previous
    generation (gone) is in flight too.  The server restarts, and the new server ticks
    within the write lease, judging each recovered writer by the id and generation its
    header names: "a" stays its writer's and commits, "b"'s extent is freed at once."""
    gone = (WRITER[0], WRITER[1] - 1)
    a = h.alloc("a", 10)
    h.write("a", a, b"0123456789")
    h.begin("b", h.alloc("b", 10, who=gone), 10, who=gone)
    h.svc = h.start()
    assert h.svc.stats()["writes_in_flight"] == 2
    h.clock.now += 0.5  # within the write lease of 1 s
    h.svc.tick()
    assert h.svc.stats()["writes_in_flight"] == 1, "a dead generation's write was kept"
    assert h.commit("a", a), "the live writer's recovered write was taken from it"
    assert h.read("a") == b"0123456789"
    assert h.svc.stats()["blocks_used"] == 1
