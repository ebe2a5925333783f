"""Tests aimed at the client and host logic that mutants survived (tests/logic_mutants/
names them).

Each builds the one situation the logic exists for and asserts the promise it
keeps, so a wrong comparison, order, key or position fails here for its own
reason, not by luck:

- a live holder on one kernel whose heartbeat stops moving;
- a save over several ALLOC/COMMIT batches with a lease lost in the second;
- a tier hit for the second key of a request, and a request whose tier holds some
  of the keys the pool missed, not all;
- a writer of an id's older generation, and namespaced keys of any length.
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from beluga import KVStore
from beluga._native import _core
from beluga.chaos.roles import Midway
from beluga.child import server_process
from beluga.kv import protocol as p
from beluga.kv.identity import KVNamespace, ModelIdentity
from beluga.kv.store import MAX_KEY_BYTES, key_bytes
from beluga.kv.tier import MooncakeTier
from beluga.pool import Geometry, Pool
from beluga.pool.hosts import HostRegistry, HostTable
from beluga.server.server import serve
from beluga.transfer import Buffers
from tests.conftest import serving
from tests.logic_util import value_of
from tests.test_service import Clock


def _serve(spec: str, options: dict[str, Any], ready: Any) -> None:
    serve(spec, ready=ready, **options)


@contextmanager
def server(spec: str) -> Iterator[Any]:
    """A metadata server in a process of its own."""
    with server_process(_serve, spec, {"refresh_s": 0.02}) as proc:
        yield proc


#: a small RPC area, so that a save of a few dozen keys spans several batches
BATCHED = Geometry(max_hosts=4, rpc_bytes_per_host=4 << 10, block_size=16 << 10)


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


# -- identity -------------------------------------------------------------------------------


def test_a_namespaced_key_of_any_length_fits() -> None:
    ns = KVNamespace(ModelIdentity.explicit("m", "r1"), "layout-1")
    for n in (1, MAX_KEY_BYTES - 16, MAX_KEY_BYTES, 10 * MAX_KEY_BYTES):
        key = ns.key(b"x" * n)
        assert len(key_bytes(key)) <= MAX_KEY_BYTES
    long_a, long_b = ns.key(b"a" * 4000 + b"1"), ns.key(b"a" * 4000 + b"2")
    assert long_a != long_b
