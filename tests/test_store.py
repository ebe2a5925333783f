"""The KV store end to end: API, capacity, crash safety and a multi-process stress test.

The metadata server runs in its own process (``beluga.server.server.serve``) so
that it can be killed with SIGKILL like a real one; clients are this process
or forked ones, each attached on its own (one emulated host each).
"""

from __future__ import annotations

import ctypes
import hashlib
import multiprocessing as mp
import os
import pickle
import random
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from beluga import KVStore
from beluga.chaos.roles import Midway, read_in_place
from beluga.child import server_process
from beluga.errors import CapacityError, RpcError
from beluga.kv import hash_block, prefix_hashes, seed_hash, sha256
from beluga.pool import Geometry, Pool
from beluga.server.server import serve

#: a store test puts values to read them back; the pool keeps them (tests/conftest.py)
pytestmark = pytest.mark.leaves("keys")
CTX = mp.get_context("fork")
GEOMETRY = Geometry(max_hosts=8, rpc_bytes_per_host=256 << 10, block_size=16 << 10)


def value_of(key: str, size: int) -> bytes:
    """The bytes every test writes under a key: checkable by any reader."""
    return random.Random(hashlib.sha256(key.encode()).digest()).randbytes(size)


@pytest.fixture
def pool(shm_path: str) -> Iterator[Pool]:
    p = Pool.create(shm_path, 48 << 20, geometry=GEOMETRY)
    yield p
    p.close()
    Pool.destroy(shm_path)


def _serve(spec: str, mode: str, options: dict, ready: Any) -> None:
    serve(spec, coherence=mode, ready=ready, **options)


@contextmanager
def server(spec: str, mode: str = "native", **options: Any) -> Iterator[mp.Process]:
    with server_process(_serve, spec, mode, {"refresh_s": 0.02, **options}) as proc:
        yield proc


@pytest.mark.parametrize("mode", ["native", "model"])
def test_api_round_trips(pool: Pool, mode: str) -> None:
    with server(pool.spec, mode), KVStore(pool.spec, coherence=mode) as s:
        s.put("a", b"hello")
        assert s.get("a") == b"hello" and s.get("missing") is None
        assert s.is_exist("a") and not s.is_exist("missing")
        s.put("a", b"replaced")  # a new version, out of place
        assert s.get("a") == b"replaced"
        s.put(b"\x00bin", b"")
        assert s.get(b"\x00bin") == b""
        big = value_of("big", 100_000)  # spans an extent of 7 blocks
        s.put_from("big", np.frombuffer(big, dtype=np.uint8))
        out = np.zeros(120_000, dtype=np.uint8)
        assert s.get_into("big", out) == 100_000 and out[:100_000].tobytes() == big
        t = torch.arange(1000, dtype=torch.bfloat16)
        s.put_from("tensor", t)
        back = torch.empty_like(t)
        assert s.get_into("tensor", back) == 2000 and torch.equal(back, t)
        raw = ctypes.create_string_buffer(b"raw bytes!", 10)
        s.put_from("raw", (ctypes.addressof(raw), 10))
        assert s.get("raw") == b"raw bytes!"
        keys = [f"k{i}" for i in range(100)]
        s.put_batch(keys, [value_of(k, 3000) for k in keys])
        assert s.get_batch([*keys[:3], "nope"]) == [*(value_of(k, 3000) for k in keys[:3]), None]
        bufs = [bytearray(3000) for _ in range(4)]
        assert s.batch_get_into([keys[5], "nope", keys[7], keys[9]], bufs) == [3000, -1, 3000, 3000]
        assert bytes(bufs[2]) == value_of(keys[7], 3000)
        assert s.batch_is_exist(["a", "nope", "k99"]) == [True, False, True]
        assert s.lookup_prefix(["k0", "k1", "k2", "nope", "k3"]) == 3
        assert s.remove("a") and not s.remove("a") and s.get("a") is None
        stats = s.stats()
        assert stats["keys"] == 104 and stats["hits"] > 0 and stats["misses"] > 0
        assert stats["writes_in_flight"] == 0


def test_bad_input_is_refused_and_nothing_is_lost(pool: Pool) -> None:
    with server(pool.spec), KVStore(pool) as s:
        s.put("keep", b"safe")
        with pytest.raises(ValueError, match=r"1\.\.256 bytes"):
            s.put("x" * 257, b"v")
        with pytest.raises(ValueError, match=r"1\.\.256 bytes"):
            s.get("")
        with pytest.raises(ValueError, match="buffer holds 2 bytes"):
            s.get_into("keep", bytearray(2))
        with pytest.raises(ValueError, match="writable"):
            s.get_into("keep", b"read-only")
        with pytest.raises(ValueError, match="buffer protocol"):
            s.put("k", 12345)
        with pytest.raises(ValueError, match="3 keys but 2 values"):
            s.put_batch(["a", "b", "c"], [b"1", b"2"])
        with pytest.raises(ValueError, match="exceeds the pool"):
            s.put("huge", bytes(pool.superblock.payloads.length + 1))
        with pytest.raises(ValueError, match="contiguous"):
            s.put("strided", np.arange(10)[::2])
        assert s.get("keep") == b"safe"
        assert s.stats()["writes_in_flight"] == 0


def test_a_pool_without_a_server(pool: Pool) -> None:
    with pytest.raises(RpcError, match="beluga serve"):
        KVStore(pool, connect_timeout=0.2)


def test_lru_eviction_and_capacity_error(pool: Pool) -> None:
    nblocks = pool.superblock.nblocks
    with server(pool.spec), KVStore(pool) as s:
        for i in range(nblocks + 50):  # more values than blocks: the oldest go
            s.put(f"v{i}", value_of(f"v{i}", 1000))
        stats = s.stats()
        assert stats["evictions"] >= 50 and stats["blocks_used"] <= nblocks
        assert s.get(f"v{nblocks + 49}") == value_of(f"v{nblocks + 49}", 1000)
        assert s.get("v0") is None  # least recently used, evicted
        survivors = [f"v{i}" for i in range(nblocks + 50) if s.is_exist(f"v{i}")]
        assert s.get_batch(survivors) == [value_of(k, 1000) for k in survivors]

        # every block reserved by writes in flight: nothing can be evicted
        class Refused(Exception):
            pass

        def full(mem: Any, places: Any) -> None:
            with pytest.raises(CapacityError, match="nothing can be evicted"):
                s.put("one-too-many", b"x")
            raise Refused  # the save gives its extents back

        with pytest.raises(Refused):
            s.save([f"w{i}" for i in range(nblocks)], Midway([bytes(1000)] * nblocks, full))
        s.put("one-more", b"y")
        assert s.get("one-more") == b"y"  # still serving
        assert not any(s.batch_is_exist([f"w{i}" for i in range(nblocks)]))


def test_reads_without_rpc_still_order_eviction(pool: Pool) -> None:
    """Hits recorded in the reader's own hint lines reach the server's LRU order."""
    nblocks = pool.superblock.nblocks
    with server(pool.spec), KVStore(pool) as s:
        first = int(nblocks * 0.8)  # below the server's high watermark
        for i in range(first):
            s.put(f"v{i}", value_of(f"v{i}", 1000))
        assert s.get("v0") == value_of("v0", 1000)  # v0 is now the most recently used
        before = s.stats()  # stores this host's hints; the server folds them in
        assert before["hits"] >= 1 and before["evictions"] == 0
        for i in range(first, nblocks + 40):  # pushes out the least recently used
            s.put(f"v{i}", value_of(f"v{i}", 1000))
        assert s.stats()["evictions"] >= 40
        assert s.get("v1") is None and s.get("v0") == value_of("v0", 1000)


def _doomed_writer(spec: str, mode: str, ready: Any) -> None:
    def die(mem: Any, places: Any) -> None:
        mem.nt_store(places[0].payload_offset, bytes(20_000))  # half a payload ...
        ready.set()
        os.kill(os.getpid(), signal.SIGKILL)  # ... and the writer dies mid-put

    with KVStore(spec, coherence=mode) as s:
        s.save(["never-visible"], Midway([bytes(50_000)], die))


@pytest.mark.parametrize("mode", ["native", "model"])
def test_a_writer_killed_mid_put_never_becomes_visible(pool: Pool, mode: str) -> None:
    with server(pool.spec, mode), KVStore(pool.spec, coherence=mode) as s:
        base = s.stats()["blocks_used"]
        ready = CTX.Event()
        w = CTX.Process(target=_doomed_writer, args=(pool.spec, mode, ready))
        w.start()
        w.join(30)
        assert ready.is_set() and w.exitcode == -signal.SIGKILL
        assert s.get("never-visible") is None
        deadline = time.monotonic() + 10
        while s.stats()["blocks_used"] != base:  # reclaimed once the host is seen dead
            assert time.monotonic() < deadline, "the dead writer's extent was never reclaimed"
            time.sleep(0.02)
        assert s.stats()["dead_writer_reclaims"] == 1 and s.get("never-visible") is None


def _first_writer(spec: str, mode: str, ready: Any, go: Any, fate: str) -> None:
    """Reserve "dup", store half of it, tell the parent, then die (or stop) there when told."""

    def stop(mem: Any, places: Any) -> None:
        mem.nt_store(places[0].payload_offset, bytes(500))
        ready.set()
        go.wait(60)
        os.kill(os.getpid(), signal.SIGKILL if fate == "killed" else signal.SIGSTOP)

    with KVStore(spec, coherence=mode) as s:
        s.save(["dup"], Midway([b"first" * 200], stop))


# a killed writer's extent stays WRITING until the server sees its host gone
@pytest.mark.leaves("writes")
@pytest.mark.parametrize("fate", ["killed", "stopped"])
@pytest.mark.parametrize("mode", ["native", "model"])
def test_a_save_waiting_for_a_writer_that_dies_or_stops_writes_the_key_itself(
    pool: Pool, mode: str, fate: str
) -> None:
    """The second writer of a key waits for the first; the first is SIGKILLed (the server
    sees its host gone) or SIGSTOPped (its write lease runs out) mid-payload: the wait
    ends, the second writes the key, and the stopped one, resumed, changes nothing."""
    with server(pool.spec, mode, write_lease_s=0.5), KVStore(pool.spec, coherence=mode) as s:
        ready, go = CTX.Event(), CTX.Event()
        first = CTX.Process(target=_first_writer, args=(pool.spec, mode, ready, go, fate))
        first.start()
        answers: list[Any] = []
        second = threading.Thread(
            target=lambda: answers.append(
                s.save(["dup"], Midway([b"second" * 100], None), wait_s=60)
            )
        )
        try:
            assert ready.wait(30)
            second.start()
            deadline = time.monotonic() + 30
            while s.stats()["duplicate_writes_skipped"] < 1:  # the second waits for the first
                assert time.monotonic() < deadline, "the second save never met the first"
                time.sleep(0.005)
            go.set()  # now the first dies, or stops
            second.join(60)
            assert not second.is_alive()
            (saved,) = answers
            assert (saved.stored, saved.in_flight) == ([0], [])
            assert s.get("dup") == b"second" * 100
        finally:
            go.set()
            if fate == "stopped":
                os.kill(first.pid, signal.SIGCONT)  # resumes: its late commit is refused
            first.join(30)
        assert s.get("dup") == b"second" * 100


def test_an_expired_write_lease_returns_the_space(pool: Pool) -> None:
    with server(pool.spec, write_lease_s=0.2), KVStore(pool) as s:
        base = s.stats()["blocks_used"]

        def outlive_the_lease(mem: Any, places: Any) -> None:
            expiries = s.stats()["lease_expiries"]
            deadline = time.monotonic() + 10
            while s.stats()["lease_expiries"] == expiries:
                assert time.monotonic() < deadline, "the write lease never expired"
                time.sleep(0.01)
            assert s.stats()["blocks_used"] == base + 1  # quarantined: its writer still lives

        saved = s.save(["slow"], Midway([b"s" * 1000], outlive_the_lease))
        assert (saved.stored, saved.present, saved.lost) == ([], [], [0])
        assert s.get("slow") is None and s.stats()["blocks_used"] == base
        # a second attempt (a fresh reservation) stores what the first lost
        saved = s.save(["slow"], Midway([b"s" * 1000], outlive_the_lease), attempts=2)
        assert (saved.stored, saved.lost) == ([0], []) and s.get("slow") == b"s" * 1000
        assert s.stats()["blocks_used"] == base + 1


# "slow"'s extent, taken back behind the writer, is sealed by it anyway and never committed
@pytest.mark.leaves("writes")
def test_a_commit_that_loses_some_leases_names_them_and_keeps_the_rest(pool: Pool) -> None:
    # One commit of two writes, one of them refused: before, the call raised a bare
    # RpcError for both, so a caller (the chaos tier among them) took the committed one
    # for refused although it was readable.  The server refuses "slow" because its
    # reservation is taken back (as a server does once a lease ran out) before the copy.
    with server(pool.spec), KVStore(pool) as s:
        values = [value_of("slow", 1000), value_of("fast", 1000)]

        def take_back_the_first(mem: Any, places: Any) -> None:
            s._abort(places[:1])

        saved = s.save(["slow", "fast"], Midway(values, take_back_the_first), replace=True)
        assert (saved.stored, saved.lost) == ([1], [0])
        assert s.get("slow") is None
        assert s.get("fast") == values[1]  # committed, as the answer says


def _writer(spec: str, mode: str, prefix: str, n: int, size: int, out: Any) -> None:
    try:
        with KVStore(spec, coherence=mode) as s:
            for i in range(n):
                key = f"{prefix}{i}"
                s.put(key, value_of(key, size))
                out.put(("committed", key))
        out.put(("done", prefix))
    except BaseException as e:
        out.put(("error", repr(e)))


@pytest.mark.parametrize("mode", ["native", "model"])
def test_server_killed_and_restarted_rebuilds_the_index(pool: Pool, mode: str) -> None:
    out = CTX.Queue()
    with server(pool.spec, mode) as first:
        w = CTX.Process(target=_writer, args=(pool.spec, mode, "w", 10_000, 5000, out))
        w.start()
        committed: list[str] = []
        while len(committed) < 60:
            kind, key = out.get(timeout=30)
            assert kind == "committed", key
            committed.append(key)
        os.kill(first.pid, signal.SIGKILL)
        first.join(10)
        w.join(30)  # the writer fails: its server died
    while not out.empty():
        kind, key = out.get(timeout=5)
        if kind == "committed":
            committed.append(key)
    out.close()
    out.join_thread()
    with server(pool.spec, mode), KVStore(pool.spec, coherence=mode) as s:
        assert s.stats()["recovered_keys"] >= len(committed)
        assert s.get_batch(committed) == [value_of(k, 5000) for k in committed]
        assert s.stats()["writes_in_flight"] <= 1  # at most the put cut short, held by lease


def _reader(spec: str, mode: str, prefixes: list[str], n: int, seconds: float, out: Any) -> None:
    try:
        rng = random.Random(os.getpid())
        hits = misses = 0
        with KVStore(spec, coherence=mode) as s:
            # at least `seconds` of racing, and enough hits to mean something (a busy
            # machine reads slower): the hard deadline only bounds a broken run
            end, hard = time.monotonic() + seconds, time.monotonic() + 120
            while time.monotonic() < end or (hits < 100 and time.monotonic() < hard):
                keys = [f"{rng.choice(prefixes)}{rng.randrange(n)}" for _ in range(8)]
                for key, got in zip(keys, s.get_batch(keys), strict=True):
                    if got is None:
                        misses += 1
                    elif got != value_of(key, len(got)) or len(got) not in (5000, 20000):
                        out.put(("wrong", key))
                        return
                    else:
                        hits += 1
        out.put(("ok", hits, misses))
    except BaseException as e:
        out.put(("error", repr(e)))


@pytest.mark.parametrize("mode", ["native", "model"])
def test_stress_writers_and_readers_racing_eviction(pool: Pool, mode: str) -> None:
    """Several writers overfill the pool while readers check every byte they read."""
    out = CTX.Queue()
    with server(pool.spec, mode, read_lease_s=0.05):
        procs = [
            CTX.Process(target=_writer, args=(pool.spec, mode, "a", 700, 20000, out)),
            CTX.Process(target=_writer, args=(pool.spec, mode, "b", 1500, 5000, out)),
            CTX.Process(target=_reader, args=(pool.spec, mode, ["a", "b"], 700, 4.0, out)),
            CTX.Process(target=_reader, args=(pool.spec, mode, ["a", "b"], 700, 4.0, out)),
        ]
        for p in procs:
            p.start()
        results = []
        deadline = time.monotonic() + 120
        while sum(1 for r in results if r[0] != "committed") < len(procs):
            results.append(out.get(timeout=max(1, deadline - time.monotonic())))
        for p in procs:
            p.join(30)
        with KVStore(pool) as s:
            stats = s.stats()
    out.close()
    out.join_thread()
    final = [r for r in results if r[0] != "committed"]
    assert not [r for r in final if r[0] in ("wrong", "error")], final
    reads = [r for r in final if r[0] == "ok"]
    assert sum(r[1] for r in reads) > 100, "readers must really read data"
    assert stats["evictions"] > 0, "the test must exercise eviction and reuse"


def _vllm_sha256(obj: object) -> bytes:
    """vLLM's ``sha256`` (vllm/utils/hashing.py, 0.33): SHA-256 of the highest-protocol pickle."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _vllm_chain(tokens: list[int], seed: str, extra: tuple[object, ...] | None) -> list[bytes]:
    """vLLM's block hashes, written out from vllm/v1/core/kv_cache_utils.py (0.33).

    ``init_none_hash``: NONE_HASH = sha256(the seed); ``hash_block_tokens``: a
    full block's hash is sha256((its parent's hash, or NONE_HASH for the first
    block, tuple(its token ids), extra_keys)).
    """
    parent, out = _vllm_sha256(seed), []
    for start in range(0, len(tokens) - 15, 16):
        parent = _vllm_sha256((parent, tuple(tokens[start : start + 16]), extra))
        out.append(parent)
    return out


def test_prefix_hashes_chain_like_vllm() -> None:
    tokens = list(range(100))
    keys = prefix_hashes(tokens, block_tokens=16, seed="s")
    assert len(keys) == 6  # only full blocks
    assert keys == _vllm_chain(tokens, "s", None)
    assert seed_hash(sha256, "s") == _vllm_sha256("s")
    assert hash_block(sha256, keys[0], tokens[16:32]) == keys[1]
    lora = prefix_hashes(tokens, seed="s", extra_keys=("lora-1",))
    assert lora == _vllm_chain(tokens, "s", ("lora-1",)) and lora[0] != keys[0]
    assert prefix_hashes(tokens[:64] + [7] * 36, seed="s")[:4] == keys[:4]  # shared prefix
    assert prefix_hashes(tokens[:64] + [7] * 36, seed="s")[4] != keys[4]
    assert prefix_hashes(tokens, seed="other") == _vllm_chain(tokens, "other", None)
    with pytest.raises(ValueError, match="unknown block hash"):
        prefix_hashes(tokens, hash_fn="md5")


def test_a_server_refuses_a_pool_of_another_layout(pool: Pool, shm_path: str) -> None:
    from beluga.errors import LayoutVersionError
    from beluga.pool.layout import LAYOUT_VERSION

    from .test_pool import reseal_file

    reseal_file(shm_path, 8, "<I", LAYOUT_VERSION + 1)
    with pytest.raises(LayoutVersionError, match="upgrade Beluga"):
        serve(shm_path)


# -- a stalled writer, and threads sharing one store -----------------------------------


def read_every_path(s: KVStore, key: str, size: int) -> dict[str, bytes | None]:
    """One key through every read path: get, get_into, batch_get_into, get_batch, and the
    in-place path of the data path (locate, then one validated load)."""
    out: dict[str, bytes | None] = {"get": s.get(key), "get_batch": s.get_batch([key])[0]}
    buf = bytearray(size)
    n = s.get_into(key, buf)
    out["get_into"] = None if n < 0 else bytes(buf[:n])
    buf = bytearray(size)
    (n,) = s.batch_get_into([key], [buf])
    out["batch_get_into"] = None if n < 0 else bytes(buf[:n])
    (out["in_place"],) = read_in_place(s, [key])
    return out


def _stalled_writer(spec: str, size: int, ready: Any, go: Any, out: Any) -> None:
    """An in-place write that stops half way (the parent SIGSTOPs it there), then finishes."""
    try:
        data = value_of("stalled", size)

        def stop_half_way(mem: Any, places: Any) -> None:
            mem.nt_store(places[0].payload_offset, data[: size // 2])  # half its copy landed ...
            ready.set()
            go.wait(60)  # ... then it stopped, past its lease, while others reuse the pool

        with KVStore(spec) as s:  # the copy goes on, seal, commit
            saved = s.save(["stalled"], Midway([data], stop_half_way), replace=True)
            out.put("sealed" if saved.stored else "refused: its write lease was lost")
    except BaseException as e:
        out.put(f"error: {e!r}")


@pytest.mark.parametrize("restart_while_stopped", [False, True])
def test_a_writer_stopped_past_its_lease_corrupts_nothing(
    shm_path: str, restart_while_stopped: bool
) -> None:
    """Reproduction 4 of the trust issue: writer A stops mid-payload past its write lease;
    the pool is full, so B's put needs space; A resumes, writes the rest and seals; the
    server restarts.  Every read path returns each key's committed bytes or a miss, and
    no acknowledged value is lost."""
    geometry = Geometry(max_hosts=4, rpc_bytes_per_host=64 << 10, block_size=16 << 10)
    pool = Pool.create(shm_path, 12 << 20, geometry=geometry)
    size = 3 * geometry.block_size  # an extent of three blocks
    opts = {"write_lease_s": 0.3, "high_watermark": 1.0, "low_watermark": 1.0}
    ready, go, out = CTX.Event(), CTX.Event(), CTX.Queue()
    try:
        first = server_process(_serve, pool.spec, "native", {"refresh_s": 0.02, **opts})
        proc = first.__enter__()
        a = CTX.Process(target=_stalled_writer, args=(pool.spec, size, ready, go, out))
        a.start()
        assert ready.wait(30)
        os.kill(a.pid, signal.SIGSTOP)
        with KVStore(pool) as s:
            acked = []
            while True:  # fill the pool with acknowledged values of the same size
                key = f"acked{len(acked)}"
                try:
                    s.put(key, value_of(key, size))
                except Exception:
                    break
                acked.append(key)
                if s.stats()["blocks_used"] > s.stats()["blocks_total"] - 3:
                    break
            deadline = time.monotonic() + 10
            while s.stats()["lease_expiries"] < 1:  # A's lease has run out
                assert time.monotonic() < deadline, "the stalled write's lease never expired"
                time.sleep(0.02)
            assert s.stats()["quarantined_extents"] == 1
            s.put("B", value_of("B", size))  # needs space: evicts, never takes A's extent
            acked.append("B")
            evictions = s.stats()["evictions"]
            assert evictions >= 1  # B's space came from an acknowledged value, not from A
        if restart_while_stopped:
            os.kill(proc.pid, signal.SIGKILL)
            first.__exit__(None, None, None)
            first = server_process(_serve, pool.spec, "native", {"refresh_s": 0.02, **opts})
            first.__enter__()
        os.kill(a.pid, signal.SIGCONT)
        go.set()
        verdict = out.get(timeout=30)
        a.join(30)
        # a restarted server forgot the cancellation: A's commit may land, with A's bytes
        assert verdict.startswith("sealed" if restart_while_stopped else "refused"), verdict
        first.__exit__(None, None, None)
        with (
            server_process(_serve, pool.spec, "native", {"refresh_s": 0.02, **opts}),
            KVStore(pool) as s,
        ):
            for key in [*acked, "stalled"]:
                for path, got in read_every_path(s, key, size).items():
                    assert got is None or got == value_of(key, size), (key, path)
            assert s.get("B") == value_of("B", size)  # the last acknowledged value
            lost = [k for k in acked if s.get(k) is None]
            assert len(lost) == evictions, lost  # every miss is an eviction, nothing else
            assert (s.get("stalled") is not None) == restart_while_stopped
            assert s.stats()["writes_in_flight"] == 0
    finally:
        out.close()
        out.join_thread()
        pool.close()
        Pool.destroy(shm_path)


def test_threads_share_one_store(pool: Pool) -> None:
    """8 threads on one KVStore, mixed put / get / batches / remove: byte-exact answers."""
    errors: list[str] = []

    def work(t: int) -> None:
        rng = random.Random(t)
        mine: dict[str, bytes | None] = {}
        try:
            for i in range(150):
                key = f"t{t}-{rng.randrange(12)}"
                op = rng.random()
                if op < 0.3:
                    value = value_of(f"{key}/{i}", rng.choice([10, 3000, 40_000]))
                    s.put(key, value)
                    mine[key] = value
                elif op < 0.45:
                    keys = [f"t{t}-b{j}" for j in range(rng.randrange(1, 6))]
                    values = [value_of(f"{k}/{i}", rng.choice([8, 5000])) for k in keys]
                    s.put_batch(keys, values)
                    mine.update(zip(keys, values, strict=True))
                elif op < 0.55:
                    assert s.remove(key) == (mine.get(key) is not None), key
                    mine[key] = None
                elif op < 0.8:
                    keys = list(mine)[:8]
                    for k, got in zip(keys, s.get_batch(keys), strict=True):
                        if got != mine[k]:
                            errors.append(f"thread {t}: {k} read {got!r:.40} not {mine[k]!r:.40}")
                else:
                    want = mine.get(key)
                    buf = bytearray(40_000)
                    n = s.get_into(key, buf)
                    if (None if n < 0 else bytes(buf[:n])) != want:
                        errors.append(f"thread {t}: get_into {key}")
        except BaseException as e:
            errors.append(f"thread {t}: {e!r}")

    with server(pool.spec), KVStore(pool) as s:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not any(th.is_alive() for th in threads)
        assert not errors, errors[:5]
        stats = s.stats()
        assert stats["writes_in_flight"] == 0 and stats["puts"] > 8 * 30
