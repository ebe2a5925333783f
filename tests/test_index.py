"""The pool-resident index: its format, its writer, and reads that need no server.

Readers probe the index with loads and confirm every entry against the block
header, so a stale, torn or hostile bucket costs a miss, never other bytes.
The server is the index's only writer; it survives restarts (the index is
repaired in place) and readers keep reading while it is gone.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator

import blake3
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from beluga import KVStore
from beluga._native import _core
from beluga.coherence import LINE, digest
from beluga.errors import CoherenceError, RpcError
from beluga.pool import Geometry, Pool
from beluga.pool.layout import LAYOUT_VERSION
from beluga.server.index import SLOTS, PoolIndex
from beluga.server.service import MetadataService

from .test_native import crc32c_reference
from .test_store import server, value_of

#: the index is tested with values committed to be found (tests/conftest.py)
pytestmark = pytest.mark.leaves("keys")
GEOMETRY = Geometry(max_hosts=8, rpc_bytes_per_host=256 << 10, block_size=16 << 10)


@pytest.fixture
def pool(shm_path: str) -> Iterator[Pool]:
    p = Pool.create(shm_path, 48 << 20, geometry=GEOMETRY)
    yield p
    p.close()
    Pool.destroy(shm_path)


def reader(pool: Pool) -> object:
    """A one-sided reader with no hint lines."""
    return pool.index_reader()


# -- format ------------------------------------------------------------------------


@given(st.binary(min_size=1, max_size=256))
def test_key_digest_is_blake3_128(key: bytes) -> None:
    assert _core.key_digest(key) == blake3.blake3(key).digest(16) == digest(key)


@pytest.mark.parametrize("length", [1, 63, 64, 65, 127, 128, 129, 192, 193, 255, 256])
def test_key_digest_at_every_block_edge(length: int) -> None:
    """One to four 64-byte blocks: each edge, alone and in a batch of mixed lengths."""
    keys = [bytes((i * 7 + length) % 256 for i in range(n)) for n in (length, 1, 256, 64, length)]
    assert _core.key_digest(keys[0]) == blake3.blake3(keys[0]).digest(16)
    assert _core.key_digests(keys) == [blake3.blake3(k).digest(16) for k in keys]


@given(st.lists(st.one_of(st.binary(min_size=1, max_size=256), st.text(min_size=1, max_size=60))))
def test_batched_digests_equal_one_by_one(keys: list[bytes | str]) -> None:
    """Eight at a time in AVX2 lanes (any mix of lengths), the rest one by one."""
    want = [blake3.blake3(k if isinstance(k, bytes) else k.encode()).digest(16) for k in keys]
    assert _core.key_digests(keys) == want


def test_digest_lanes_off_give_the_same_digests() -> None:
    """BELUGA_NO_BLAKE3_X8: one key at a time, the same answers as the lanes."""
    keys = [os.urandom(n) for n in range(1, 257)]
    code = (
        "import sys; from beluga._native import _core; "
        "sys.stdout.write(b''.join(_core.key_digests(eval(sys.stdin.read()))).hex())"
    )
    env = dict(os.environ, BELUGA_NO_BLAKE3_X8="1")
    out = subprocess.run(
        [sys.executable, "-c", code], input=repr(keys), env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert bytes.fromhex(out.stdout) == b"".join(_core.key_digests(keys))


def test_key_digest_refuses_bad_keys() -> None:
    for bad in (b"", "", b"x" * 257):
        with pytest.raises(ValueError, match=r"a key is 1\.\.256 bytes"):
            _core.key_digest(bad)
    with pytest.raises(ValueError, match=r"a key is 1\.\.256 bytes"):
        digest(b"x" * 257)  # the write path's digest is the C core's too
    with pytest.raises(ValueError, match="a key is str or bytes"):
        _core.key_digest(12)  # type: ignore[arg-type]


@given(st.binary(min_size=16, max_size=16), st.sampled_from([2, 8, 1024, 1 << 20]))
def test_a_key_has_two_distinct_buckets_and_a_tag(d: bytes, nbuckets: int) -> None:
    tag, b1, b2 = _core.ix_hash(d, nbuckets)
    assert tag != 0 and b1 != b2 and 0 <= b1 < nbuckets and 0 <= b2 < nbuckets


def _whole_bucket(line: bytes) -> bool:
    """A bucket line by the format's definition (index.c): never written (all zeros), or
    a CRC32C of bytes 0..59 in bytes 60..63 that matches, computed here bit by bit."""
    return line == bytes(LINE) or crc32c_reference(line[:60]) == int.from_bytes(line[60:], "little")


@given(st.binary(min_size=64, max_size=64))
def test_a_bucket_line_of_random_bytes_is_refused(line: bytes) -> None:
    """Refused unless the bytes happen to be a whole bucket (zeros, or a 1 in 2**32 CRC)."""
    got = _core.ix_unpack(line)
    assert (got is not None) == _whole_bucket(line)
    if line == bytes(LINE):
        assert got == (0, [(0, 0, 0)] * SLOTS)  # an empty bucket
    packed = _core.ix_pack(7, [(1, 2, 3)] * SLOTS)
    assert _whole_bucket(packed) and _core.ix_unpack(packed) == (7, [(1, 2, 3)] * SLOTS)
    flipped = bytearray(packed)
    flipped[random.randrange(60)] ^= 1 << random.randrange(8)
    assert _core.ix_unpack(bytes(flipped)) is None


def test_old_layouts_are_refused_with_a_message(shm_path: str) -> None:
    Pool.create(shm_path, 16 << 20, geometry=GEOMETRY).close()
    with open(shm_path, "r+b") as f:
        f.seek(8)
        f.write((LAYOUT_VERSION - 1).to_bytes(4, "little"))
    with pytest.raises(Exception, match=r"old layout version .* recreate the pool"):
        Pool.attach(shm_path)
    Pool.destroy(shm_path)


# -- the writer ----------------------------------------------------------------------


def crowded_digests(nbuckets: int, n: int, seed: int, pool_of: int = 4) -> list[bytes]:
    """n digests whose buckets all fall among `pool_of` buckets: every insertion collides."""
    rng = random.Random(seed)
    want = set(range(pool_of))
    out = []
    while len(out) < n:
        d = rng.randbytes(16)
        _, b1, b2 = _core.ix_hash(d, nbuckets)
        if b1 in want and b2 in want:
            out.append(d)
    return out


def test_the_mirror_refuses_misuse_with_an_error_never_a_crash(pool: Pool) -> None:
    """The C mirror's Python face: bad digests, blocks, counts and ranges, a second init, an
    uninitialised object and a released Memory each raise; none of them writes the pool."""
    sb = pool.superblock
    ix = PoolIndex(pool.memory, sb)
    m = ix.mirror
    d = os.urandom(16)
    assert ix.put(d, 1, 2)
    pool.memory.sfence()
    table = pool.memory.load(ix.base, ix.nbuckets * LINE)
    for call in (
        lambda: m.put(b"short", 1, 1),
        lambda: m.put(d, 2**32, 1),
        lambda: m.find(bytes(17)),
        lambda: m.crowd(b""),
        lambda: m.drop(bytes(15)),
        lambda: m.placed(bytes(17)),  # not whole 16-byte records
        lambda: m.scrub(-1),
        lambda: m.reconcile(0, 2, bytes(LINE), b"", b""),  # two buckets, one line
        lambda: m.reconcile(2, 1, b"", b"", b""),
        lambda: m.reconcile(0, ix.nbuckets + 1, bytes((ix.nbuckets + 1) * LINE), b"", b""),
        lambda: m.reconcile(0, 1, bytes(LINE), np.array([SLOTS], np.int64).tobytes(), d),
        lambda: m.reconcile(0, 1, bytes(LINE), np.array([0], np.int64).tobytes(), b""),
    ):
        with pytest.raises(ValueError):
            call()
    with pytest.raises(TypeError):
        m.placed(3)
    with pytest.raises(CoherenceError, match="in use"):
        m.__init__(pool.memory, ix.base, ix.nbuckets, 0, 0, 1, 1, 0)
    with pytest.raises(CoherenceError, match="geometry"):
        _core.IndexMirror(pool.memory, ix.base, 3, sb.headers.offset, sb.payloads.offset,
                          sb.block_size, sb.nblocks, sb.commits.offset)  # fmt: skip
    bare = _core.IndexMirror.__new__(_core.IndexMirror)
    with pytest.raises(CoherenceError, match="not initialised"):
        bare.find(d)
    with pytest.raises(CoherenceError, match="not initialised"):
        bare.placed(d)
    assert len(bare) == 0 and bare.digests() == [] and bare.loaded is None
    assert d in ix.where and bytes(3) not in ix.where and len(ix) == 1
    assert set(ix.where) == {d}
    assert pool.memory.load(ix.base, ix.nbuckets * LINE) == table
    mem = _core.Memory(bytearray(1 << 20))
    alone = _core.IndexMirror(mem, 0, 64, 64 * LINE, 0, 4096, 16, 128 * LINE)
    mem.release()
    with pytest.raises(CoherenceError, match="released"):
        alone.put(d, 1, 1)
    assert alone.slot_of(d) is None  # the mirror alone: no memory touched
    assert alone.placed(d + d) == bytes(2) and alone.placed(b"") == b""


def test_cuckoo_moves_keep_every_key_findable(pool: Pool) -> None:
    """12 keys in 4 buckets (every slot full) each still found by a one-sided reader."""
    ix = PoolIndex(pool.memory, pool.superblock)
    keys = crowded_digests(ix.nbuckets, 4 * SLOTS, seed=1)
    placed = {d: (i, i + 100) for i, d in enumerate(keys)}
    for d, (block, version) in placed.items():
        assert ix.put(d, block, version)
    pool.memory.sfence()
    assert ix.moves > 0, "the crowded keys never needed a move"
    # the mirror and the pool agree, and each key sits in one of its own buckets
    for d, (block, version) in placed.items():
        at = ix.where[d]
        _, b1, b2 = _core.ix_hash(d, ix.nbuckets)
        assert at // SLOTS in (b1, b2)
        _, slots = _core.ix_unpack(pool.memory.load(ix.base + (at // SLOTS) * LINE, LINE))
        assert slots[at % SLOTS][1:] == (block, version)
    extra = crowded_digests(ix.nbuckets, 4 * SLOTS + 1, seed=1)[-1]
    assert not ix.put(extra, 99, 999), "a 13th key cannot fit 12 slots"
    assert ix.failed == 1 and len(ix) == 4 * SLOTS
    for d in keys[:3]:
        ix.drop(d)
    assert ix.put(extra, 99, 999) and len(ix) == 4 * SLOTS - 2


def test_repair_keeps_good_slots_and_drops_the_rest(pool: Pool) -> None:
    ix = PoolIndex(pool.memory, pool.superblock)
    good = {os.urandom(16): (b, b + 1) for b in range(20)}
    for d, (block, version) in good.items():
        ix.put(d, block, version)
    stale = os.urandom(16)
    ix.put(stale, 50, 7)  # not in the recovered entries: must go
    hostile = next(iter(good))
    _, b1, _ = _core.ix_hash(hostile, ix.nbuckets)
    pool.memory.store(ix.base + ((b1 + 1) % ix.nbuckets) * LINE, os.urandom(LINE))  # torn line
    pool.memory.sfence()
    again = PoolIndex(pool.memory, pool.superblock)
    missing = os.urandom(16)
    entries = {**good, missing: (60, 61)}
    blocks, versions = zip(*entries.values(), strict=True)
    counts = again.repair(list(entries), np.array(blocks), np.array(versions, dtype=np.uint64))
    assert counts["kept"] == len(good) and counts["dropped"] >= 1 and counts["inserted"] == 1
    assert set(again.where) == {*good, missing}


# -- one-sided reads ---------------------------------------------------------------------


def test_reads_need_no_rpc(pool: Pool) -> None:
    with server(pool.spec), KVStore(pool) as s:
        keys = [f"k{i}" for i in range(40)]
        s.put_batch(keys, [value_of(k, 3000 + i) for i, k in enumerate(keys)])
        sent: list[int] = []
        call = s.rpc.call
        s.rpc.call = lambda op, *a, **k: sent.append(op) or call(op, *a, **k)  # type: ignore[method-assign]
        assert s.get("k3") == value_of("k3", 3003)
        assert s.get_batch(["k1", "nope"]) == [value_of("k1", 3001), None]
        buf = bytearray(5000)
        assert s.get_into("k2", buf) == 3002 and bytes(buf[:3002]) == value_of("k2", 3002)
        assert s.batch_get_into(["k4", "nope"], [bytearray(4000), bytearray(10)]) == [3004, -1]
        assert s.is_exist("k5") and not s.is_exist("nope")
        assert s.batch_is_exist(["k5", "nope", "k6"]) == [True, False, True]
        assert s.lookup_prefix(["k0", "k1", "k2", "nope", "k3"]) == 3
        refs = s.locate(["k0", "nope", "k1"], prefix=False)
        assert refs[1] is None and refs[0] is not None and refs[0].length == 3000
        assert not sent, f"reads went through the server: ops {sent}"
        s.put("k0", b"a write still does")
        assert sent, "the counting wrapper saw nothing"


def _second_bucket_keys(pool: Pool, keys: list[str]) -> list[str]:
    """The stored keys whose entry sits in their second bucket (read from the pool)."""
    sb = pool.superblock
    out = []
    for k in keys:
        d = digest(k.encode())
        tag, _, b2 = _core.ix_hash(d, sb.nbuckets)
        got = _core.ix_unpack(pool.memory.load(sb.index.offset + b2 * LINE, LINE))
        if got is not None and any(slot[0] == tag for slot in got[1] if slot[2]):
            out.append(k)
    return out


def test_batched_probes_agree_with_what_is_stored(shm_path: str) -> None:
    """exists / locate / prefix / batch_get_into over 700 keys (three probe chunks, many
    pipeline groups), first-bucket, second-bucket and absent keys mixed, agree with the
    keys stored and with the one-key probe."""
    geometry = Geometry(max_hosts=4, rpc_bytes_per_host=64 << 10, block_size=4096)
    pool = Pool.create(shm_path, 16 << 20, geometry=geometry)
    try:
        rng = random.Random(7)
        keys = [f"probe-{i}" for i in range(700)]
        stored = set(rng.sample(keys, 520))
        with server(pool.spec), KVStore(pool) as s:
            in_order = [k for k in keys if k in stored]
            for at in range(0, len(in_order), 100):
                part = in_order[at : at + 100]
                s.put_batch(part, [value_of(k, 40) for k in part])
            assert _second_bucket_keys(pool, in_order), "no key went to its second bucket"
            truth = [k in stored for k in keys]
            assert s.batch_is_exist(keys) == truth == [s.is_exist(k) for k in keys]
            assert [r is not None for r in s.locate(keys, prefix=False)] == truth
            first_absent = truth.index(False)
            assert s.lookup_prefix(keys) == first_absent
            assert s.lookup_prefix(in_order) == len(in_order)
            absent = next(k for k in keys if k not in stored)
            for cut in (0, 1, 31, 32, 33, 255, 256, 257, 288, 289, 511, 512, 519):
                chain = [*in_order[:cut], absent, *in_order[cut:]]  # the miss ends it at cut
                assert s.lookup_prefix(chain) == cut, f"a chain whose key {cut} is absent"
                assert len(s.locate(chain)) == cut + 1 and s.locate(chain)[-1] is None
            assert s.index.prefix([]) == 0 and s.index.exists([]) == []
            bufs = [bytearray(64) for _ in keys]
            got = s.batch_get_into(keys, bufs)
            assert got == [40 if t else -1 for t in truth]
            for k, b, t in zip(keys, bufs, truth, strict=True):
                assert not t or bytes(b[:40]) == value_of(k, 40)
    finally:
        pool.close()
        Pool.destroy(shm_path)


def test_a_batch_of_keys_ending_at_a_page_edge_reads_nothing_past_them(pool: Pool) -> None:
    """Buffer keys are digested in the batch's lanes (masked loads): a key whose last byte
    is the last of its page, before an unmapped one, digests right and does not fault."""
    guard = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    edge = ctypes.addressof(ctypes.c_char.from_buffer(guard)) + mmap.PAGESIZE
    assert ctypes.CDLL(None).mprotect(ctypes.c_void_p(edge), mmap.PAGESIZE, 0) == 0
    view = memoryview(guard)
    try:
        with server(pool.spec), KVStore(pool) as s:
            for n in (1, 3, 4, 5, 31, 32, 33, 63, 64, 65, 100, 255, 256):
                raw = os.urandom(n)
                guard[mmap.PAGESIZE - n : mmap.PAGESIZE] = raw
                key = view[mmap.PAGESIZE - n : mmap.PAGESIZE]
                want = blake3.blake3(raw).digest(16)
                assert _core.key_digests([key] * 9) == [want] * 9
                s.put(raw, b"v")
                assert s.batch_is_exist([key] * 9) == [True] * 9
                assert s.lookup_prefix([key, raw, key]) == 3
                key.release()
    finally:
        view.release()
        guard.close()


def test_a_too_small_buffer_is_refused_with_the_size(pool: Pool) -> None:
    with server(pool.spec), KVStore(pool) as s:
        s.put("k", b"x" * 100)
        with pytest.raises(ValueError, match="holds 10 bytes but the value is 100"):
            s.get_into("k", bytearray(10))
        with pytest.raises(ValueError, match="holds 10 bytes but the value is 100"):
            s.batch_get_into(["k"], [bytearray(10)])
        with pytest.raises(ValueError, match="writable"):
            s.get_into("k", b"read-only")


def test_repeated_keys_in_one_batch_read_both(pool: Pool) -> None:
    with server(pool.spec), KVStore(pool) as s:
        s.put("k", b"abc" * 1000)
        got = s.batch_get_into(["k", "k"], [bytearray(3000), bytearray(3000)])
        assert got == [3000, 3000]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.data())
def test_hostile_buckets_never_give_other_bytes(pool: Pool, data: st.DataObject) -> None:
    """Random lines, and forged entries naming other keys' blocks: a miss or the key's value."""
    svc = MetadataService(pool)
    sb = pool.superblock
    keys = [f"key-{i}".encode() for i in range(6)]
    for k in keys:
        n = 2000 + len(k)
        (g,) = _grant(svc, k, n)
        pool.memory.publish(
            sb.block_header_offset(g[0]),
            sb.block_payload_offset(g[0]),
            digest(k),
            g[1],
            value_of(k.decode(), n),
            writer=1,
            writer_gen=1,
        )
        assert _commit(svc, k, g)
    r = reader(pool)
    victim = data.draw(st.sampled_from(keys))
    tag, b1, b2 = _core.ix_hash(digest(victim), sb.nbuckets)
    for b in (b1, b2):
        kind = data.draw(st.sampled_from(["random", "forged", "torn"]))
        off = sb.index.offset + b * LINE
        if kind == "random":
            line = data.draw(st.binary(min_size=64, max_size=64))
        elif kind == "forged":  # the victim's tag pointing at another key's block
            other = data.draw(st.sampled_from([k for k in keys if k != victim]))
            o = svc.index[digest(other)]
            line = _core.ix_pack(
                data.draw(st.integers(0, 1 << 40)), [(tag, o.block, o.version)] * 3
            )
        else:
            line = bytes(_core.ix_pack(1, [(tag, 0, 1)] * 3)[:32]) + os.urandom(32)
        pool.memory.store(off, line)
    pool.memory.sfence()
    for k in keys:
        got = r.get(k)
        assert got is None or got == value_of(k.decode(), 2000 + len(k))
        assert got is not None or k == victim or _shares_bucket(k, victim, sb.nbuckets)


def _shares_bucket(a: bytes, b: bytes, nbuckets: int) -> bool:
    _, a1, a2 = _core.ix_hash(digest(a), nbuckets)
    _, b1, b2 = _core.ix_hash(digest(b), nbuckets)
    return bool({a1, a2} & {b1, b2})


def _grant(svc: MetadataService, key: bytes, n: int) -> list[tuple[int, int]]:
    from beluga.kv import protocol as p
    from beluga.rpc import Request

    raw = svc.op_alloc(Request(1, int(p.StoreOp.ALLOC), p.encode_alloc([(digest(key), n, 1)]), 1))
    return [(g.block, g.version) for g in p.decode_grants(raw)]


def _commit(svc: MetadataService, key: bytes, g: tuple[int, int]) -> bool:
    from beluga.kv import protocol as p
    from beluga.rpc import Request

    raw = p.encode_commit([(digest(key), g[0], g[1])])
    (ok,) = p.decode_flags(svc.op_commit(Request(1, int(p.StoreOp.COMMIT), raw, 1)))
    return ok


def test_a_model_reader_sees_each_commit_and_remove(shm_path: str) -> None:
    """The server native, the reader a model host that keeps stale lines unless it invalidates."""
    with (
        Pool.create(shm_path, 48 << 20, geometry=GEOMETRY) as p,
        server(p.spec),
        KVStore(p.spec, coherence="model") as r,
        KVStore(p) as w,
    ):
        for round_ in range(30):
            k = f"k{round_ % 5}"
            v = value_of(f"{k}/{round_}", 1000 + round_)
            w.put(k, v)
            assert r.get(k) == v
            assert r.lookup_prefix([k]) == 1
            if round_ % 7 == 0:
                assert w.remove(k)
                assert r.get(k) is None and not r.is_exist(k)
    Pool.destroy(shm_path)


# -- reads survive the server ------------------------------------------------------------


# the put tried while the server is down stays in its RPC slot: the restarted server
# answers it RESTARTED, unrun, so no grant is made for a caller that gave up (the fixture
# checks that nothing is left reserved)
def test_reads_survive_the_server_killed_and_restarted(pool: Pool) -> None:
    keys = [f"k{i}" for i in range(200)]
    values = {k: value_of(k, 1000 + 37 * i) for i, k in enumerate(keys)}
    with server(pool.spec) as proc:
        s = KVStore(pool, timeout=2.0)
        s.put_batch(keys, [values[k] for k in keys])
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert not proc.is_alive()
        got = s.get_batch(keys)  # the server is gone: every committed key, right
        assert got == [values[k] for k in keys]
        bufs = [bytearray(len(values[k])) for k in keys]
        assert s.batch_get_into(keys, bufs) == [len(values[k]) for k in keys]
        assert [bytes(b) for b in bufs] == [values[k] for k in keys]
        assert s.lookup_prefix(keys) == len(keys) and all(s.batch_is_exist(keys))
        with pytest.raises(RpcError):
            s.put("new", b"while the server is down")
    stop = threading.Event()
    wrong: list[str] = []
    reads = [0]

    def keep_reading() -> None:  # through the restart: recovery repairs the index in place
        while not stop.is_set():
            for k in random.sample(keys, 20):
                v = s.get(k)
                reads[0] += 1
                if v != values[k]:
                    wrong.append(k)

    t = threading.Thread(target=keep_reading)
    t.start()
    try:
        with server(pool.spec):
            s.put("after", b"the server is back")
            assert s.get("after") == b"the server is back"
    finally:
        stop.set()
        t.join(10)
        s.close()
    assert reads[0] > 0 and not wrong, f"{len(wrong)} of {reads[0]} reads were wrong or missed"


def test_the_scrub_rewrites_a_damaged_bucket(pool: Pool) -> None:
    """Hostile bytes in a bucket: its key misses (never other bytes) until the scrub."""
    svc = MetadataService(pool, clock=lambda: 0.0)
    sb = pool.superblock
    k = b"scrubbed"
    (g,) = _grant(svc, k, 4000)
    pool.memory.publish(
        sb.block_header_offset(g[0]),
        sb.block_payload_offset(g[0]),
        digest(k),
        g[1],
        value_of("scrubbed", 4000),
        writer=1,
        writer_gen=1,
    )
    assert _commit(svc, k, g)
    r = reader(pool)
    assert r.get(k) == value_of("scrubbed", 4000)
    at = svc.ix.where[digest(k)] // SLOTS
    pool.memory.nt_store(sb.index.offset + at * LINE, os.urandom(LINE))
    pool.memory.sfence()
    assert r.get(k) is None
    for _ in range(-(-sb.nbuckets // 64)):  # one full round of the scrub
        svc.tick()
    assert svc.stats()["index_scrub_repairs"] == 1
    assert r.get(k) == value_of("scrubbed", 4000)


def test_a_forked_child_reads_but_writes_no_hints_of_its_parent(pool: Pool) -> None:
    """The parent's hint lines have one writer: an Index inherited across fork stops writing."""
    with server(pool.spec), KVStore(pool) as s:
        s.put("k", b"value")
        s.index.flush_hints()
        off = pool.superblock.hint_offset(s.rpc.host_id)
        before = pool.memory.load(off, LINE)
        pid = os.fork()
        if pid == 0:  # the child: many reads (each would store hints every 8 probes)
            ok = all(s.index.get("k") == b"value" for _ in range(100))
            s.index.flush_hints()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child read other bytes"
        assert pool.memory.load(off, LINE) == before, "the child wrote its parent's hint line"


# -- hints ------------------------------------------------------------------------------


def test_hints_decode_as_block_and_the_low_half_of_the_version_oldest_first() -> None:
    ring_len = _core.IX_HINT_RING
    hints = [(b, (b * 7 + (1 << 33)) & 0xFFFFFFFF) for b in range(ring_len)]
    raw = struct.pack(f"<{ring_len}Q", *(b | (v << 32) for b, v in hints))
    # seq 70 means hints 6..69, the oldest in slot 6: ring slots wrap around
    assert _core.ix_hints(raw, 6, 70) == hints[6:] + hints[:6]
    assert _core.ix_hints(raw, 69, 70) == [hints[5]] and _core.ix_hints(raw, 9, 9) == []
    for bad in ((raw, 5, 70), (raw, 3, 2), (raw[:-8], 0, 1)):
        with pytest.raises(ValueError, match="a ring of 64 hints"):
            _core.ix_hints(*bad)


def test_a_readers_hints_fold_back_as_the_blocks_and_versions_it_hit(pool: Pool) -> None:
    """index.c writes a reader's hint ring; the server's fold reads the same hits back."""
    with server(pool.spec), KVStore(pool) as s:
        s.put_batch(["a", "b"], [b"1", b"2"])
        a, b = s.locate(["a", "b"], prefix=False)
        assert a is not None and b is not None
        assert s.get("b") == b"2" and s.get("a") == b"1" and s.get("nope") is None
        s.index.flush_hints()
        folded = PoolIndex(pool.memory, pool.superblock).fold_hints([s.rpc.host_id])
    assert folded[-2:] == [(b.block, b.version & 0xFFFFFFFF), (a.block, a.version & 0xFFFFFFFF)]
