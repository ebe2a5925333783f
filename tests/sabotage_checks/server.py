"""The server's state in the pool: the metadata service's tables (server/service.py)
and the index (index.c, server/index.py)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from beluga import litmus
from beluga._native import _core
from beluga.coherence import LINE, ModelConfig, digest
from beluga.kv import protocol as p
from beluga.litmus import Seen
from beluga.pool import Pool
from beluga.rpc import Request
from beluga.server.service import MetadataService
from tests.sabotage_checks.base import SEEDS, Violation, _pool_file, _window_seen

# -- metadata service (server/service.py) -----------------------------------------------


def _alloc(svc: MetadataService, key: bytes, n: int) -> p.Grant:
    raw = svc.op_alloc(Request(1, int(p.StoreOp.ALLOC), p.encode_alloc([(digest(key), n, 1)]), 1))
    (grant,) = p.decode_grants(raw)
    return grant


def _commit(svc: MetadataService, key: bytes, g: p.Grant) -> bool:
    raw = p.encode_commit([(digest(key), g.block, g.version)])
    (ok,) = p.decode_flags(svc.op_commit(Request(1, int(p.StoreOp.COMMIT), raw, 1)))
    return ok


def _publish(writer: Pool, key: bytes, g: p.Grant, data: bytes) -> None:
    sb = writer.superblock
    writer.memory.publish(
        sb.block_header_offset(g.block),
        sb.block_payload_offset(g.block),
        digest(key),
        g.version,
        data,
        writer=1,
        writer_gen=1,
    )


def service_restart_on_a_caching_host(model: ModelConfig) -> None:
    """A server restarted on a host that cached the tables recovers every commit since."""
    with _pool_file(model) as host:
        stale = host(1)
        MetadataService(stale)  # its recovery scan caches the (empty) tables
        elsewhere, writer = MetadataService(host(2)), host(3)
        keys = [f"key-{i}".encode() for i in range(4)]
        for key in keys:
            g = _alloc(elsewhere, key, 5000)
            _publish(writer, key, g, key * 100)
            if not _commit(elsewhere, key, g):
                raise Violation("a commit was refused")
        again = MetadataService(stale)
        lost = [k for k in keys if digest(k) not in again.index]
        if lost:
            raise Violation(f"a server restarted on a caching host lost {len(lost)} commits")


def service_answers_durable(model: ModelConfig) -> None:
    """At the moment each answer leaves, a server restarted on another host agrees with it,
    and a reader on another host gets what it committed."""
    with _pool_file(model) as host:
        svc, writer = MetadataService(host(1, drain_rate=0.0)), host(2)
        seed = iter(range(10, 1000))

        def restarted() -> MetadataService:
            return MetadataService(host(next(seed)))

        granted = []
        for i, key in enumerate([b"a", b"b", b"c"]):
            g = _alloc(svc, key, 3000)
            granted.append(g.version)
            if restarted().version < max(granted):
                raise Violation(f"a restarted server would hand out version {g.version} again")
            _publish(writer, key, g, key * 3000)
            if not _commit(svc, key, g):
                raise Violation(f"commit {i} was refused")
            # the reader first: a restarted server names what it recovers itself
            if host(next(seed)).index_reader().get(key) != key * 3000:
                raise Violation(f"commit {i} was answered before the pool index named it")
            if digest(key) not in restarted().index:
                raise Violation(f"commit {i} was answered before it was in the pool")
        removed = svc.op_remove(
            Request(1, int(p.StoreOp.REMOVE), p.encode_digests([digest(b"b")]), 1)
        )
        if p.decode_flags(removed) != [True] or digest(b"b") in restarted().index:
            raise Violation("a REMOVE was answered while the key could still come back")


def service_commit_sweep(model: ModelConfig) -> None:
    """Every state inside a COMMIT: the pool index never names a copy whose commit word is
    not in the pool (a successor would take it for a write in flight)."""
    key = b"commit sweep"

    def attempt(k: int | None, seed: int) -> tuple[Seen, int]:
        with _pool_file(model) as host:
            server, writer = host(seed), host(seed + 100)
            svc = MetadataService(server)
            g = _alloc(svc, key, 3000)
            _publish(writer, key, g, key * 200)
            before = server.memory.model_stats()["landed"]
            if k is not None:
                server.memory.crash_after(k)
            _commit(svc, key, g)
            landed = server.memory.model_stats()["landed"] - before
            other = host(seed + 200)
            sb, mem = other.superblock, other.memory
            tag, b1, b2 = _core.ix_hash(digest(key), sb.nbuckets)
            named = False
            for b in (b1, b2):
                mem.invalidate(sb.index.offset + b * LINE, LINE)
                mem.invalidate(sb.block_commit_offset(g.block), 8)
                mem.mfence()
                got = _core.ix_unpack(mem.load(sb.index.offset + b * LINE, LINE))
                named |= got is not None and (tag, g.block, g.version) in got[1]
            word = int.from_bytes(mem.load(sb.block_commit_offset(g.block), 8), "little")
            if named and word != g.version:
                return Seen.WRONG, landed
            return (Seen.RIGHT if named else Seen.NOTHING), landed

    for seed in SEEDS:
        r = litmus.sweep_crashes(lambda k, s=seed: attempt(k, s), name="commit")
        if r.caught:
            raise Violation(
                f"a slot named a copy whose commit word was not in the pool (seed {seed})"
            )
        _window_seen(r)


# -- the pool index (index.c, server/index.py) -----------------------------------------------


def _reader_index(pool: Pool) -> object:
    """A one-sided reader over a pool (no hints)."""
    return pool.index_reader()


def index_probe_on_a_caching_host(model: ModelConfig) -> None:
    """A reader that cached a key's buckets finds what the server committed since."""
    _probe_on_a_caching_host(model, lambda reader, key, grant: reader.get(key))


def index_batch_probe_on_a_caching_host(model: ModelConfig) -> None:
    """The batched probes (the pipeline of exists / prefix / locate, and get_many_into)
    find what the server committed since the reader cached the lines they read."""
    fillers = [b"absent-%d" % i for i in range(20)]  # the key lands in the pipeline's 2nd group

    def look(reader: Any, key: bytes, grant: p.Grant | None) -> bytes | None:
        located = reader.locate([*fillers, key])  # first: its stale lines would show
        found = reader.exists([*fillers, key])
        if any(found[:-1]) or any(located[:-1]):
            raise Violation("a batched probe found a key never written")
        at = located[-1]
        if at is not None and (grant is None or at[1:3] != (grant.block, grant.version)):
            raise Violation(f"a batched probe located {at[1:3]}, not the committed {grant}")
        buf = bytearray(4096)
        (got,) = reader.get_many_into([key], [buf])
        if not found[-1] == (at is not None) == (got >= 0) == (reader.prefix([key]) == 1):
            raise Violation("the batched probes disagree about a key")
        return bytes(buf[:got]) if got >= 0 else None

    for seed in SEEDS:  # every invalidated line refilled at once: a stale copy to load
        _probe_on_a_caching_host(replace(model, seed=seed, refill_rate=1.0), look)


def _probe_on_a_caching_host(
    model: ModelConfig, look: Callable[[Any, bytes, p.Grant | None], bytes | None]
) -> None:
    """A reader that cached a key's lines (through ``look``) finds what was committed since;
    ``look`` gets the grant of the key's last commit (None before the first)."""
    with _pool_file(model) as host:
        svc, writer = MetadataService(host(1)), host(2)
        reader = _reader_index(host(3))
        committed: dict[bytes, p.Grant] = {}

        def put(key: bytes, data: bytes) -> None:
            g = _alloc(svc, key, len(data))
            _publish(writer, key, g, data)
            if not _commit(svc, key, g):
                raise Violation("a commit was refused")
            committed[key] = g

        def get(key: bytes) -> bytes | None:
            return look(reader, key, committed.get(key))

        put(b"k", b"first" * 500)
        if get(b"k") != b"first" * 500:
            raise Violation("a committed key was not found by a reader")
        if get(b"later") is not None:  # caches the buckets of a key not there yet
            raise Violation("a key never written was found")
        put(b"later", b"third" * 500)  # the reader's next look is its first since
        if get(b"later") != b"third" * 500:
            raise Violation("a reader holding a key's buckets missed the key committed since")
        put(b"k", b"second" * 500)  # a new version, at another block
        if get(b"k") != b"second" * 500:
            raise Violation("a reader holding a key's old buckets missed its new version")


def _digest_in(ix: object, bucket: int, rng: random.Random, taken: set[int]) -> bytes:
    """A digest whose first bucket is ``bucket`` and whose second is empty and not taken."""
    while True:
        d = rng.randbytes(16)
        _, b1, b2 = _core.ix_hash(d, ix.nbuckets)  # type: ignore[attr-defined]
        if b1 == bucket and b2 not in taken:
            taken.add(b2)
            return d


def index_move_sweep(model: ModelConfig) -> None:
    """Every state inside a cuckoo move: an entry is always in one of its two buckets."""
    from beluga.server.index import PoolIndex

    def look(pool: Pool, d: bytes, ix: PoolIndex) -> bool | None:
        """Whether d is in one of its buckets; None if a bucket is torn (being written)."""
        _, b1, b2 = _core.ix_hash(d, ix.nbuckets)
        found = False
        for b in (b1, b2):
            off = ix.base + b * LINE
            pool.memory.invalidate(off, LINE)
            pool.memory.mfence()
            got = _core.ix_unpack(pool.memory.load(off, LINE))
            if got is None:
                return None
            tag = _core.ix_hash(d, ix.nbuckets)[0]
            found |= any(t == tag for t, _, _ in got[1])
        return found

    def attempt(k: int | None, seed: int) -> tuple[Seen, int]:
        with _pool_file(model) as host:
            server = host(seed)
            ix = PoolIndex(server.memory, server.superblock)
            rng = random.Random(seed)
            key = rng.randbytes(16)
            _, x, z = _core.ix_hash(key, ix.nbuckets)
            taken = {x, z}
            crowd = [_digest_in(ix, b, rng, taken) for b in (x, z) for _ in range(3)]
            for i, d in enumerate(crowd):
                ix.put(d, i, i + 1)
            server.memory.sfence()
            before = server.memory.model_stats()["landed"]
            if k is not None:
                server.memory.crash_after(k)
            ix.put(key, 99, 100)
            server.memory.sfence()  # as the service's commit fence
            landed = server.memory.model_stats()["landed"] - before
            if ix.moves != 1:
                raise RuntimeError(f"the insertion made {ix.moves} moves, not one")
            other = host(seed + 100)
            seen = [look(other, d, ix) for d in crowd]
            if any(s is False for s in seen):
                return Seen.WRONG, landed
            new = look(other, key, ix)
            return (Seen.RIGHT if new else Seen.NOTHING), landed

    for seed in range(4):
        r = litmus.sweep_crashes(lambda k, s=seed: attempt(k, s), name="index move")
        if r.caught:
            raise Violation(f"a cuckoo move left an entry in neither bucket (seed {seed})")
        _window_seen(r)
