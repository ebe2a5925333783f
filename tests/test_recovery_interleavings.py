"""Recovery while serving against random interleavings: writes that span takeovers.

tests/test_recovery.py puts single operations between a recovery's steps;
this file draws whole histories (seeded) of what crashes leave behind and
checks a one-sided reader after every operation, for every key:

- writes granted by one server and committed to the next (adopted ahead of
  the scan), sent again, aborted, left in flight by a writer that dies;
- a COMMIT that landed without its answer (the commit word in the pool, the
  server killed before its pool index slot and the clear of the older copy):
  either copy may be read, never none, and never an older one once a newer
  write is acknowledged;
- removes, takeovers in the middle of a recovery (graves a successor applies),
  recovery steps between all of it;
- a pool kept full, so grants evict while the scan has not found every key.

The reader must get the last acknowledged value of each key (or, after a
landed commit, either of the two; or a miss for a key the service evicted).
BELUGA_STRESS=full runs many more histories.  The four bugs these found on
2026-12-05 are caught here: a copy the census cleared that the pool index
named, and a grave's kept copy losing to a newer copy it buried (a test
each); an older copy put over the slot of a newer one not scanned yet (most
histories); the look-back dropping the slot of a copy it had not settled
(seed 481).  And in a full pool: grants refused while unscanned values could
be evicted, and a REMOVE failing half done when the log of graves had no room.

The rich histories (``RichHistory``) add what the chaos tier does and these
did not: batches of keys per ALLOC and COMMIT, DROP, write leases running out
under live writers, grants nobody learned of (``forget_unanswered``), RPC
lookups read back, and hostile bytes in headers and index buckets.  They found
three more on 2026-12-05, a test each: hostile bytes in the header of a write
acknowledged while recovering let a successor bring back the older copy it
had replaced (a stale read; seed 5), an extent the census held stayed in use
when hostile bytes took its header before the scan of keys (seed 90), and a
grant nobody learned of that the census's look-back met stayed pending after
its writer's ring was adopted (seed 150).

``CrashingHistory`` (2026-12-06) runs them under the model with the server's
host dying inside operations: after any number of the lines a COMMIT (of one
key or a batch), REMOVE, DROP, ALLOC, recovery step or tick stores, its
unfenced lines lost or torn, a successor on a new host.  Each bug it found has
a test in tests/test_dying_servers.py (that file's docstring lists them).
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from beluga._native import _core
from beluga.coherence import LINE, BlockState, ModelConfig, digest, parse_header
from beluga.errors import CapacityError
from beluga.kv import protocol as p
from beluga.pool import Pool
from beluga.rpc import Request
from tests.test_recovery import GEOMETRY, REGION, WRITER, World, clean_up, value_of

FULL = os.environ.get("BELUGA_STRESS") == "full"
#: 481 (of the first 600) is the one history that met the look-back's bug (the module doc)
SEEDS = range(400) if FULL else [*range(10), 481]
FULL_POOL_SEEDS = range(60) if FULL else range(3)
MODEL_SEEDS = range(300) if FULL else range(5)
RICH_SEEDS = range(400) if FULL else range(12)
CRASH_SEEDS = range(300) if FULL else range(8)


@pytest.fixture
def pool(shm_path: str) -> Iterator[Pool]:
    pool = Pool.create(shm_path, 12 << 20, geometry=GEOMETRY)
    yield pool
    pool.close()
    Pool.destroy(shm_path)


@dataclass
class Write:
    key: str
    grant: p.Grant
    data: bytes
    writer: tuple[int, int]
    published: bool
    damaged: bool = False  # hostile bytes hit its header after it was sealed
    #: a COMMIT of it had no answer: it may be the key's value already, and its writer
    #: only sends the COMMIT again or an ABORT (it stores nothing more)
    maybe: bool = False


@dataclass
class History:
    """One seeded history against a :class:`World`, with what a reader may get."""

    w: World
    rng: random.Random
    keys: list[str]
    writers: list[tuple[int, int]] = field(default_factory=lambda: [WRITER, (2, 1)])
    allowed: dict[str, set[bytes | None]] = field(default_factory=dict)
    evicted: set[bytes] = field(default_factory=set)
    #: values of a key whose COMMIT landed unanswered since its last acknowledged change
    landed_values: dict[str, set[bytes | None]] = field(default_factory=dict)
    inflight: list[Write] = field(default_factory=list)
    refused: int = 0  # grants refused for want of room (a full pool)
    #: keys whose copy or bucket took hostile bytes since their last acknowledged write:
    #: a miss stays allowed until that write (RichHistory)
    hostile: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.w.alive = set(self.writers)
        self._watch()

    def _watch(self) -> None:
        self.w.svc.on_evict = lambda d, _value: self.evicted.add(d)

    def take_over(self) -> None:
        self.w.take_over()
        self._watch()

    def _request(self, op: p.StoreOp, payload: bytes, who: tuple[int, int]) -> Request:
        return Request(who[0], int(op), payload, who[1])

    def alloc(self, key: str, n: int, who: tuple[int, int]) -> p.Grant | None:
        req = self._request(p.StoreOp.ALLOC, p.encode_alloc([(digest(key.encode()), n, 1)]), who)
        try:
            (grant,) = p.decode_grants(self.w.svc.op_alloc(req))
        except CapacityError:  # everything in use is being written: a refusal, not a loss
            self.refused += 1
            return None
        return grant

    def publish(self, x: Write) -> None:
        sb = self.w.pool.superblock
        self.w.writer.memory.publish(
            sb.block_header_offset(x.grant.block),
            sb.block_payload_offset(x.grant.block),
            digest(x.key.encode()),
            x.grant.version,
            x.data,
            writer=x.writer[0],
            writer_gen=x.writer[1],
        )
        x.published = True

    def _commit_payload(self, x: Write) -> bytes:
        return p.encode_commit([(digest(x.key.encode()), x.grant.block, x.grant.version)])

    def commit(self, x: Write) -> bool:
        req = self._request(p.StoreOp.COMMIT, self._commit_payload(x), x.writer)
        (ok,) = p.decode_flags(self.w.svc.op_commit(req))
        if ok:
            self._acknowledged(x)
        return ok

    def _acknowledged(self, x: Write) -> None:
        """A COMMIT of ``x`` was acknowledged: the key reads its value from now on."""
        self.allowed[x.key] = {x.data}
        self.landed_values.pop(x.key, None)
        self.evicted.discard(digest(x.key.encode()))

    def abort(self, x: Write) -> None:
        self.w.svc.op_abort(self._request(p.StoreOp.ABORT, self._commit_payload(x), x.writer))

    def landed(self, x: Write) -> None:
        """The COMMIT's commit word lands and its server dies before anything else."""
        if x.maybe:  # sent before, maybe committed (its block maybe freed since): again
            self.commit(x)
            return
        sb, mem = self.w.pool.superblock, self.w.pool.memory
        mem.nt_store(sb.block_commit_offset(x.grant.block), x.grant.version.to_bytes(8, "little"))
        mem.sfence()
        self.take_over()
        self.allowed[x.key] = self.allowed.get(x.key, {None}) | {x.data}
        self.landed_values.setdefault(x.key, set()).add(x.data)

    def start(
        self, key: str, step: int, publish: bool, who: tuple[int, int] | None = None
    ) -> Write | None:
        data = value_of(f"{key}-{step}", self.rng.randint(1, 3 * GEOMETRY.block_size))
        who = who or self.rng.choice(self.writers)
        grant = self.alloc(key, len(data), who)
        if grant is None:
            return None
        x = Write(key, grant, data, who, False)
        if publish:
            self.publish(x)
        return x

    def remove(self, key: str) -> None:
        self.w.remove(key)
        self.allowed.pop(key, None)
        self.landed_values.pop(key, None)

    def writer_dies(self) -> None:
        """A writer's host id goes (its writes in flight with it) and comes back anew."""
        dead = self.rng.choice(self.writers)
        self.w.alive.discard(dead)
        self.w.clock.now += 40  # past the write lease
        self.inflight = [x for x in self.inflight if x.writer != dead]
        again = (dead[0], dead[1] + 1)
        self.writers = [*(x for x in self.writers if x != dead), again]
        self.w.alive.add(again)

    def step(self, i: int) -> None:
        rng, key = self.rng, self.rng.choice(self.keys)
        a = rng.random()
        if a < 0.25:  # a put
            x = self.start(key, i, publish=True)
            if x is not None:
                self.commit(x)
        elif a < 0.40:  # a write begins (its header published or not yet)
            x = self.start(key, i, publish=rng.random() < 0.5)
            if x is not None:
                self.inflight.append(x)
        elif a < 0.55 and self.inflight:  # it ends: committed (maybe again, maybe to a
            x = self.inflight.pop(rng.randrange(len(self.inflight)))  # new server) or aborted
            if not x.published:
                self.publish(x)
            if rng.random() < 0.8:
                if self.commit(x) and rng.random() < 0.3:
                    if rng.random() < 0.5:
                        self.take_over()
                    self.commit(x)  # sent again: acknowledged or not, nothing changes
            else:
                self.abort(x)
        elif a < 0.60 and self.inflight:
            x = self.inflight.pop(rng.randrange(len(self.inflight)))
            if not x.published:
                self.publish(x)
            self.landed(x)
        elif a < 0.70:
            self.remove(key)
        elif a < 0.76:
            self.take_over()
        elif a < 0.78:
            self.writer_dies()
        else:
            self.w.step(rng.randint(1, 4))

    def check(self, where: str) -> None:
        for key in self.keys:
            got = self.w.read(key)
            allowed = self.allowed.get(key, {None})
            if got is None and digest(key.encode()) in self.evicted:
                # evicted: a miss from now on, or a landed value a scan finds later
                self.allowed[key] = {None, *self.landed_values.get(key, ())}
                continue
            assert got in allowed, (
                f"{where}: {key} read {got[:24] if got else None!r}, the last acknowledged "
                f"value is one of {[a[:24] if a else None for a in allowed]}"
            )
            if (
                len(allowed) > 1
                and got is not None
                and not self.w.svc.recovering
                and key not in self.hostile
            ):
                self.allowed[key] = {got}  # a landed commit is decided once recovered
                self.landed_values.pop(key, None)

    def run(self, steps: int) -> None:
        for i in range(steps):
            self.step(i)
            self.check(f"step {i}")
        for x in self.inflight:
            self.abort(x)
        self.w.finish()
        self.check("recovered")
        retiring = sum(n for _, _, n in self.w.svc.retiring)  # under read leases
        assert self.w.svc.alloc.used == self.w.used_blocks() + retiring, (
            "blocks leaked or held twice"
        )
        if self.w.svc.unreadable:  # held while a writer of before may still store there
            self.w.writers_leave()
            assert not self.w.svc.unreadable, "held after every writer of before left"
        self.w.clock.now += 3  # past every read lease: clean_up frees every extent
        clean_up(self.w, set(self.keys))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_histories_across_takeovers_read_the_last_acknowledged_value(
    pool: Pool, seed: int
) -> None:
    History(World(pool), random.Random(seed), [f"r{i}" for i in range(60)]).run(300)


@pytest.mark.parametrize("seed", MODEL_SEEDS)
def test_random_histories_on_non_coherent_hosts_read_the_last_acknowledged_value(
    shm_path: str, seed: int
) -> None:
    """The same under the model: the server, the writer and the reader each a host with
    its own cache, stores reaching memory in any order until a fence."""
    pool = Pool.create(shm_path, 12 << 20, geometry=GEOMETRY, coherence="model")
    writer = Pool.attach(shm_path, coherence="model", model=ModelConfig(seed=2 * seed + 1))
    reader = Pool.attach(shm_path, coherence="model", model=ModelConfig(seed=2 * seed + 2))
    try:
        w = World(pool, writer, reader)
        History(w, random.Random(seed), [f"m{i}" for i in range(40)]).run(300)
    finally:
        writer.close()
        reader.close()
        pool.close()
        Pool.destroy(shm_path)


@pytest.mark.parametrize("seed", FULL_POOL_SEEDS)
def test_random_histories_in_a_full_pool_evict_and_remove_while_recovering(
    pool: Pool, seed: int
) -> None:
    """Keys enough to fill the pool: grants evict while the scan has not found every key
    (it scans more keys for something to evict), and a REMOVE whose grave finds no room
    in the full pool for the log of graves finishes the scan instead of failing."""
    h = History(World(pool), random.Random(seed), [f"f{i}" for i in range(700)])
    h.run(1500)
    assert h.evicted, "the pool never filled: nothing tested"
    assert h.refused == 0, f"{h.refused} grants refused while values could be evicted"


@dataclass
class RichHistory(History):
    """A :class:`History` with what the chaos tier does and the plain one does not:
    batches of keys in one ALLOC (``ALLOC_SKIP_PRESENT`` or not) and one COMMIT, DROP of
    an acknowledged value, write leases running out under live writers (their COMMIT
    refused), grants whose answer never reached their writer (``forget_unanswered`` at
    every takeover, as an adopted ring asks), RPC lookups (with read leases) read back,
    and hostile bytes in a value's header or in an index bucket.

    A corrupted header or bucket lets a key read as a miss until its next acknowledged
    write, never as other bytes; that write must read back.  At the end no write is
    left in flight: a grant nobody learned of was freed, not quarantined.
    """

    acked: dict[str, Write] = field(default_factory=dict)  # the write each key reads
    unanswered: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    seq: int = 0
    corrupted: int = 0  # hostile stores made

    def take_over(self) -> None:
        super().take_over()
        for (host, gen), seqs in self.unanswered.items():
            self.w.svc.forget_unanswered(host, gen, lambda s, seqs=seqs: s in seqs)

    def _acknowledged(self, x: Write) -> None:
        super()._acknowledged(x)
        self.hostile.discard(x.key)
        self.acked[x.key] = x
        if x.damaged:  # acknowledged with a header nobody can read: a miss, never other bytes
            self._may_miss(x.key)

    def batch_put(self, i: int) -> None:
        """Two or three keys granted in one ALLOC and committed in one COMMIT."""
        rng = self.rng
        keys = rng.sample(self.keys, rng.randint(2, 3))
        who = rng.choice(self.writers)
        datas = [value_of(f"{k}-{i}", rng.randint(1, 2 * GEOMETRY.block_size)) for k in keys]
        flags = p.ALLOC_SKIP_PRESENT if rng.random() < 0.5 else 0
        items = [(digest(k.encode()), len(d), 1) for k, d in zip(keys, datas, strict=True)]
        req = self._request(p.StoreOp.ALLOC, p.encode_alloc(items, flags), who)
        try:
            grants = p.decode_grants(self.w.svc.op_alloc(req))
        except CapacityError:
            self.refused += 1
            return
        writes = [
            Write(k, g, d, who, False)
            for k, g, d in zip(keys, grants, datas, strict=True)
            if g.block != p.NO_BLOCK
        ]
        for x in writes:
            self.publish(x)
        if not writes:
            return
        payload = p.encode_commit(
            [(digest(x.key.encode()), x.grant.block, x.grant.version) for x in writes]
        )
        flags_back = p.decode_flags(
            self.w.svc.op_commit(self._request(p.StoreOp.COMMIT, payload, who))
        )
        for x, ok in zip(writes, flags_back, strict=True):
            if ok:
                self._acknowledged(x)

    def drop(self, key: str) -> None:
        """A reader drops the key's acknowledged value as corrupt: gone if it is still the
        one the index holds (a miss from then on), else nothing changes."""
        x = self.acked.get(key)
        if x is None:
            return
        payload = p.encode_commit([(digest(key.encode()), x.grant.block, x.grant.version)])
        (ok,) = p.decode_flags(self.w.svc.op_drop(self._request(p.StoreOp.DROP, payload, WRITER)))
        if ok:
            self.allowed[key] = {None}
            self.landed_values.pop(key, None)
            del self.acked[key]

    def time_passes(self) -> None:
        """Past the write lease: writes in flight under live writers are cancelled (their
        COMMIT is refused, unless a takeover granted a fresh lease first)."""
        self.w.clock.now += 31
        self.w.svc.tick()

    def grant_nobody_learned(self, key: str) -> None:
        """An ALLOC granted and announced, its server dead before the answer went out: the
        writer never learns of it, and every later server is told so as it adopts the
        writer's ring (the ring keeps the request)."""
        who = self.rng.choice(self.writers)
        self.seq += 1
        items = [(digest(key.encode()), self.rng.randint(1, 3 * GEOMETRY.block_size), 1)]
        req = Request(who[0], int(p.StoreOp.ALLOC), p.encode_alloc(items), who[1], self.seq)
        try:
            self.w.svc.op_alloc(req)
        except CapacityError:
            self.refused += 1
            return
        self.unanswered.setdefault(who, set()).add(self.seq)
        self.take_over()

    def lookup(self, key: str) -> None:
        """An RPC LOOKUP (a read lease half the time), its location read back."""
        d = digest(key.encode())
        flags = p.LOOKUP_LEASE if self.rng.random() < 0.5 else 0
        req = self._request(p.StoreOp.LOOKUP, p.encode_digests([d], flags), WRITER)
        (loc,) = p.decode_locations(self.w.svc.op_lookup(req))
        got = None
        if loc is not None:
            sb, mem = self.w.pool.superblock, self.w.pool.memory
            got = mem.read_bytes(
                sb.block_header_offset(loc.block),
                sb.block_payload_offset(loc.block),
                self.w.svc.extent(loc.length) * sb.block_size,
                d,
                loc.version,
            )
            got = got if isinstance(got, bytes) else None
        allowed = self.allowed.get(key, {None})
        if got is None and d in self.evicted:
            return
        assert got in allowed, f"lookup of {key} read {got[:24] if got else None!r}"

    def _garbage(self, offset: int) -> None:
        at = self.rng.randrange(LINE)
        data = self.rng.randbytes(self.rng.randint(1, LINE - at))
        mem = self.w.writer.memory
        mem.nt_store(offset + at, data)
        mem.sfence()
        self.corrupted += 1

    def corrupt_header(self, key: str) -> None:
        """Hostile bytes in the header of the key's acknowledged copy (if it is still
        there): a miss from then on is no loss, other bytes would be."""
        x = self.acked.get(key)
        if x is None:
            return
        sb = self.w.pool.superblock
        off = sb.block_header_offset(x.grant.block)
        h = parse_header(self.w.pool.memory.load(off, LINE))
        if (
            h is None
            or h.state != BlockState.PUBLISHED
            or h.digest != digest(key.encode())
            or h.version != x.grant.version
        ):
            return
        self._garbage(off)
        self._may_miss(key)

    def corrupt_write_in_flight(self) -> None:
        """Hostile bytes in the header of a write in flight (its writer lives on and may
        still store there, seal it and COMMIT): no later grant may take its blocks while
        that writer can, whatever takes over meanwhile."""
        storing = [x for x in self.inflight if not x.maybe]
        if not storing:
            return
        x = self.rng.choice(storing)
        self._garbage(self.w.pool.superblock.block_header_offset(x.grant.block))
        x.damaged = x.published  # else its seal, still to come, writes the header anew

    def _may_miss(self, key: str) -> None:
        self.allowed[key] = self.allowed.get(key, {None}) | {None}
        self.hostile.add(key)

    def corrupt_bucket(self, key: str) -> None:
        """Hostile bytes in one of the key's index buckets: every key placed there may miss
        until its next acknowledged write."""
        sb = self.w.pool.superblock
        bucket = self.rng.choice(_core.ix_hash(digest(key.encode()), sb.nbuckets)[1:])
        self._garbage(sb.index.offset + bucket * LINE)
        for k in self.keys:
            if bucket in _core.ix_hash(digest(k.encode()), sb.nbuckets)[1:]:
                self._may_miss(k)

    def step(self, i: int) -> None:
        rng, key = self.rng, self.rng.choice(self.keys)
        a = rng.random()
        if a < 0.07:
            self.batch_put(i)
        elif a < 0.10:
            self.drop(key)
        elif a < 0.13:
            self.time_passes()
        elif a < 0.16:
            self.grant_nobody_learned(key)
        elif a < 0.22:
            self.lookup(key)
        elif a < 0.25:
            self.corrupt_header(key)
        elif a < 0.27:
            self.corrupt_bucket(key)
        elif a < 0.30:
            self.corrupt_write_in_flight()
        else:
            super().step(i)


@pytest.mark.parametrize("seed", RICH_SEEDS)
def test_rich_histories_with_batches_drops_expiries_lost_grants_and_hostile_bytes(
    pool: Pool, seed: int
) -> None:
    h = RichHistory(World(pool), random.Random(seed), [f"x{i}" for i in range(60)])
    h.run(400)
    assert h.corrupted and h.acked, "no hostile bytes or no acknowledged write: nothing tested"


@pytest.mark.parametrize("seed", MODEL_SEEDS)
def test_rich_histories_on_non_coherent_hosts(shm_path: str, seed: int) -> None:
    """The rich histories under the model: hostile bytes, like every store, reach the
    others' view only through their fences and flushes."""
    pool = Pool.create(shm_path, 12 << 20, geometry=GEOMETRY, coherence="model")
    writer = Pool.attach(shm_path, coherence="model", model=ModelConfig(seed=2 * seed + 11))
    reader = Pool.attach(shm_path, coherence="model", model=ModelConfig(seed=2 * seed + 12))
    try:
        w = World(pool, writer, reader)
        RichHistory(w, random.Random(1000 + seed), [f"m{i}" for i in range(40)]).run(300)
    finally:
        writer.close()
        reader.close()
        pool.close()
        Pool.destroy(shm_path)


@pytest.mark.parametrize("seed", RICH_SEEDS[: len(RICH_SEEDS) // 4 or 1])
def test_rich_histories_in_a_full_pool(pool: Pool, seed: int) -> None:
    h = RichHistory(World(pool), random.Random(seed), [f"y{i}" for i in range(700)])
    h.run(1500)
    assert h.evicted, "the pool never filled: nothing tested"


@dataclass
class CrashingHistory(RichHistory):
    """A :class:`RichHistory` on non-coherent hosts whose server's host also dies inside
    an operation: after any number of the lines it stores (the model's ``crash_after``),
    and with every line it had not fenced lost.  The next server runs on a new host.

    Whatever the dead server was doing had no answer: a COMMIT may have landed or not
    (either value reads, until the commit is sent again to the next server), a REMOVE
    or DROP too (the value or a miss), a grant reached nobody (its writer's ring says
    so to every later server), and a recovery step or a tick is simply redone.  The
    takeovers of :class:`History` still happen between operations as well.
    """

    shm_path: str = ""
    hosts: list[Pool] = field(default_factory=list)  # every server host of the history
    crashes: int = 0
    _evicted_before: set[bytes] = field(default_factory=set)
    #: crashes that fell inside the operation (not after its last store)
    inside: int = 0

    def _die_within(self, i: int) -> None:
        """Arm the server's host to die once a few more of its lines land (none, late in a
        history where no host has died inside an operation yet)."""
        late = self.inside == 0 and i >= 150
        self.w.pool.memory.crash_after(0 if late else self.rng.randint(0, 10))
        self._evicted_before = set(self.evicted)

    def _unfinished_evictions(self) -> None:
        """Evictions the dead server made had no answer either: their clears may not have
        landed, and a value evicted may read again (the committed bytes of its key)."""
        by_digest = {digest(k.encode()): k for k in self.keys}
        for d in self.evicted - self._evicted_before:
            x = self.acked.get(by_digest[d])
            if x is not None:
                self._maybe(x)

    def _next_server(self) -> None:
        """The server's host is dead (if the operation stored fewer lines than it was
        armed for, it dies now, its lines not fenced yet lost): a new server takes over
        on a new host."""
        self.crashes += 1
        self.inside += bool(self.w.pool.memory.model_stats()["crashed"])
        self._unfinished_evictions()
        host = Pool.attach(
            self.shm_path, coherence="model", model=ModelConfig(seed=self.rng.randrange(1 << 30))
        )
        self.hosts.append(host)
        self.w.pool = host
        self.take_over()

    def _maybe(self, x: Write) -> None:
        """A COMMIT of ``x`` got no answer: it may have landed."""
        self.allowed[x.key] = self.allowed.get(x.key, {None}) | {x.data}
        self.landed_values.setdefault(x.key, set()).add(x.data)

    def crash(self, i: int) -> None:
        rng, key = self.rng, self.rng.choice(self.keys)
        a = rng.random()
        if a < 0.35:  # inside a COMMIT of one write, or of two or three (one writer's)
            who = rng.choice(self.writers)
            keys = [key] if a < 0.2 else rng.sample(self.keys, rng.randint(2, 3))
            xs = [x for k in keys if (x := self.start(k, i, publish=True, who=who))]
            if not xs:
                return
            self._die_within(i)
            payload = p.encode_commit(
                [(digest(x.key.encode()), x.grant.block, x.grant.version) for x in xs]
            )
            self.w.svc.op_commit(self._request(p.StoreOp.COMMIT, payload, who))
            for x in xs:
                self._maybe(x)
            self._next_server()
            for x in xs:
                if rng.random() < 0.5:  # its RPC ring sends it again to the new server
                    self.commit(x)
                else:  # later (or its writer aborts it, or dies)
                    x.maybe = True
                    self.inflight.append(x)
        elif a < 0.50:  # inside a REMOVE
            self._die_within(i)
            self.w.remove(key)
            self.allowed[key] = self.allowed.get(key, {None}) | {None}
            self._next_server()
        elif a < 0.60:  # inside a DROP of the acknowledged value
            x = self.acked.get(key)
            self._die_within(i)
            if x is not None:
                payload = p.encode_commit([(digest(key.encode()), x.grant.block, x.grant.version)])
                self.w.svc.op_drop(self._request(p.StoreOp.DROP, payload, WRITER))
                self.allowed[key] = self.allowed.get(key, {None}) | {None}
            self._next_server()
        elif a < 0.70:  # inside an ALLOC: the grant reaches nobody
            who = rng.choice(self.writers)
            self.seq += 1
            items = [(digest(key.encode()), rng.randint(1, 3 * GEOMETRY.block_size), 1)]
            req = Request(who[0], int(p.StoreOp.ALLOC), p.encode_alloc(items), who[1], self.seq)
            self._die_within(i)
            with contextlib.suppress(CapacityError):
                self.w.svc.op_alloc(req)
            self.unanswered.setdefault(who, set()).add(self.seq)
            self._next_server()
        else:  # inside recovery's steps or a tick
            self._die_within(i)
            self.w.step(rng.randint(1, 4))
            self._next_server()

    def step(self, i: int) -> None:
        if self.rng.random() < 0.08:
            self.crash(i)
        else:
            super().step(i)


def _run_crashing(shm_path: str, seed: int, keys: list[str], steps: int) -> CrashingHistory:
    """A seeded :class:`CrashingHistory` on model hosts over a new pool, run to its end
    (every host closed and the pool destroyed after, whatever happened)."""
    pool = Pool.create(shm_path, 12 << 20, geometry=GEOMETRY, coherence="model")
    writer = Pool.attach(shm_path, coherence="model", model=ModelConfig(seed=2 * seed + 21))
    reader = Pool.attach(shm_path, coherence="model", model=ModelConfig(seed=2 * seed + 22))
    h = None
    try:
        h = CrashingHistory(
            World(pool, writer, reader), random.Random(seed), keys, shm_path=shm_path
        )
        h.run(steps)
        return h
    finally:
        for host in h.hosts if h is not None else []:
            host.close()
        writer.close()
        reader.close()
        pool.close()
        Pool.destroy(shm_path)


@pytest.mark.parametrize("seed", CRASH_SEEDS)
def test_rich_histories_with_server_hosts_dying_inside_operations(shm_path: str, seed: int) -> None:
    """A server's host dies after any of the lines an operation stores (its unfenced
    stores lost), then a new one takes over: readers still get the last acknowledged
    value of every key, or a value whose COMMIT had no answer."""
    h = _run_crashing(shm_path, 5000 + seed, [f"c{i}" for i in range(40)], 300)
    assert h.inside, "no host died inside an operation: nothing tested"


@pytest.mark.parametrize("seed", range(40) if FULL else range(1))
def test_server_hosts_dying_inside_operations_in_a_full_pool(shm_path: str, seed: int) -> None:
    """The same with keys enough to fill the pool: evictions inside operations that die
    (their clears may not land: the value may read again), a scan that drops named
    copies for newer ones it indexed (it cleared the copy first: seed 23 of these), and
    a grave with no room for the log (seeds 53, 138 and 142)."""
    h = _run_crashing(shm_path, 9000 + seed, [f"f{i}" for i in range(700)], 1200)
    assert h.inside and h.evicted, "no death inside an operation, or no eviction"


@pytest.fixture
def w(pool: Pool) -> World:
    return World(pool)


def test_a_landed_commit_beside_its_acknowledged_copy_never_hides_the_key(w: World) -> None:
    """The census meets both copies of a key in one region: the acknowledged one the pool
    index names and a newer one whose COMMIT landed unanswered.  It keeps the newer and
    clears the older, and readers get one of them at every step, never a miss."""
    h = History(w, random.Random(0), ["k"])
    acked = h.start("k", 0, publish=True)
    assert acked is not None and h.commit(acked)
    newer = h.start("k", 1, publish=True)
    assert newer is not None
    h.landed(newer)  # takes over: recovering in steps
    while w.svc.recovering:
        h.check("recovering")
        w.step()
    assert w.read("k") == newer.data
    assert w.svc.alloc.used == w.used_blocks()
    clean_up(w, {"k"})


def test_a_graves_kept_copy_beats_a_newer_copy_the_grave_buried(w: World) -> None:
    """Two writes of a key in flight; the newer one's COMMIT lands unanswered at a
    takeover; the older one is then committed to the new server (adopted, acknowledged,
    with a grave keeping it).  That server dies before its scan came near: its
    successor's census must keep the grave's copy, not the newer one it buries."""
    h = History(w, random.Random(0), ["k"])
    older = h.start("k", 0, publish=True)
    newer = h.start("k", 1, publish=True)
    assert older is not None and newer is not None and older.grant.version < newer.grant.version
    h.landed(newer)
    assert h.commit(older)
    h.allowed["k"] = {older.data}  # acknowledged after the newer one's COMMIT was lost
    h.take_over()
    while w.svc.recovering:
        h.check("the successor recovering")
        w.step()
    assert w.read("k") == older.data
    assert w.svc.alloc.used == w.used_blocks()
    clean_up(w, {"k"})


def test_hostile_bytes_in_a_new_copys_header_bring_back_no_older_copy(w: World) -> None:
    """A key's older write lands unanswered (its commit word, not its slot) far from where
    the next server's census starts; that server, recovering, acknowledges a new write of
    the key (a version above every copy of before it).  Hostile bytes then hit the new
    copy's header and a successor takes over before any scan met the older copy: the key
    must read as a miss, never as the value the acknowledged write replaced.  Without a
    grave for the new write the successor's scan found the older copy the newest and
    brought it back (the hostile-header histories above)."""
    sb, mem = w.pool.superblock, w.pool.memory
    w.put("k", value_of("k-0"), at=0)
    older = w.alloc("k", 100, at=300)
    w.publish("k", older, value_of("k-1"))
    w.put("z", value_of("z"), at=100)  # the last grant before the takeover: the census starts here
    mem.nt_store(sb.block_commit_offset(older.block), older.version.to_bytes(8, "little"))
    mem.sfence()  # the older write's COMMIT lands, and its server dies
    svc = w.take_over()
    new = w.put("k", value_of("k-2"))
    assert svc.rec is not None and new.version >= svc.rec.first
    assert not svc.rec.scanned(older.block), "the census reached the older copy: nothing tested"
    assert w.read("k") == value_of("k-2")
    mem.nt_store(sb.block_header_offset(new.block) + 8, b"hostile bytes")
    mem.sfence()
    assert w.read("k") is None
    w.take_over()
    while w.svc.recovering:
        assert w.read("k") is None, "an overwritten value came back"
        w.step()
    assert w.read("k") is None, "an overwritten value came back"
    assert w.svc.alloc.used == w.used_blocks()
    clean_up(w, {"k", "z"})


def test_hostile_bytes_in_a_held_extents_header_hold_it_until_its_writers_are_gone(
    w: World,
) -> None:
    """The census holds a value's extent; hostile bytes hit its header before the scan of
    keys reaches it.  The key reads as a miss, and the extent stays held while a writer
    of before the takeover may still store there (the header nobody can read may have
    been a write's), then is freed (before 2026-12-05 its blocks stayed in use until the
    next takeover, the rich histories' seed 90; until 2026-12-06 they were freed at once)."""
    sb, mem = w.pool.superblock, w.pool.memory
    w.put("big", b"B" * 3 * GEOMETRY.block_size, at=300)
    w.put("z", value_of("z"), at=100)  # the census starts here
    svc = w.take_over()
    assert svc.rec is not None
    while not svc.rec.censused(300):
        svc._census_step()
    assert not svc.rec.scanned(300) and svc.alloc.used_map[300:303].all()
    mem.nt_store(sb.block_header_offset(300) + 8, b"hostile bytes")
    mem.sfence()
    w.finish()
    assert w.read("big") is None
    assert svc.counters["held_extents_lost"] == 1
    assert svc.unreadable == {300: 3} and svc.alloc.used_map[300:303].all()
    assert svc.alloc.used == w.used_blocks()
    w.writers_leave()
    assert not svc.alloc.used_map[300:303].any(), "the held extent leaked"
    assert svc.alloc.used == w.used_blocks()
    clean_up(w, {"big", "z"})


@pytest.mark.parametrize("at_once", [True, False], ids=["recovering-at-once", "while-serving"])
@pytest.mark.parametrize("sealed", [False, True], ids=["writing", "sealed"])
def test_hostile_bytes_in_a_writes_header_keep_its_blocks_from_a_new_grant(
    w: World, at_once: bool, sealed: bool
) -> None:
    """A write in flight (its WRITING header announced, or its own seal stored) takes
    hostile bytes in its header, and its server dies.  Its writer lives on: the next
    server must not grant its blocks to anyone, or the writer's late stores overwrite an
    acknowledged value (docs/protocol.md, a hole until 2026-12-06).  The blocks stay
    held until that writer is gone; a COMMIT after its seal reads the header again and is
    acknowledged; a COMMIT of a header still unreadable is refused."""
    sb, mem = w.pool.superblock, w.pool.memory
    w.put("z", value_of("z"), at=100)
    x = w.alloc("x", 3 * GEOMETRY.block_size, at=300)
    if sealed:
        w.publish("x", x, b"X" * 3 * GEOMETRY.block_size)
    mem.nt_store(sb.block_header_offset(x.block) + 8, b"hostile bytes")
    mem.sfence()
    svc = w.take_over(at_once=at_once)
    w.finish()
    assert svc.unreadable.get(x.block, 0) >= 3
    assert svc.alloc.used_map[x.block : x.block + 3].all()
    n = w.put("n", value_of("n"), at=x.block)  # the allocator looks there first
    assert not x.block <= n.block < x.block + 3, "the blocks of a write in flight granted again"
    if not sealed:  # the writer stores its payload and seals: the header reads again
        w.publish("x", x, b"X" * 3 * GEOMETRY.block_size)
        assert w.commit("x", x)
        assert w.read("x") == b"X" * 3 * GEOMETRY.block_size
        assert not svc.unreadable
    else:  # the seal came before the hostile bytes: nobody can tell the write is whole
        assert not w.commit("x", x)
        assert w.read("x") is None
        assert svc.unreadable
        w.writers_leave()
        assert not svc.unreadable and not svc.alloc.used_map[x.block : x.block + 3].any()
        assert w.header(x.block) is None
    assert w.read("n") == value_of("n") and w.read("z") == value_of("z")
    assert svc.alloc.used == w.used_blocks()
    clean_up(w, {"x", "n", "z"})


def test_a_held_copy_dropped_ahead_of_the_scan_is_not_freed_twice(w: World) -> None:
    """A key's acknowledged copy and a copy whose COMMIT landed unanswered; the next
    server's census holds the landed one, the key is removed (a grave), and the landed
    copy's COMMIT, sent again, makes the server drop it ahead of the scan, freeing its
    extent.  A new value then takes those blocks: the scan of keys, reaching them, must
    not free them again under it (the extent was the census's, and is no longer)."""
    sb, mem = w.pool.superblock, w.pool.memory
    w.put("k", value_of("k-0"), at=0)
    landed = w.alloc("k", 100, at=300)
    w.publish("k", landed, value_of("k-1"))
    w.put("z", value_of("z"), at=100)  # the census starts here
    mem.nt_store(sb.block_commit_offset(landed.block), landed.version.to_bytes(8, "little"))
    mem.sfence()
    svc = w.take_over()
    assert svc.rec is not None
    while not svc.rec.censused(300):
        svc._census_step()
    assert svc.rec.held[300] and not svc.rec.scanned(300)
    assert w.remove("k")
    assert not w.commit("k", landed)  # sent again: the copy is dead (the grave), dropped
    assert not svc.alloc.used_map[300]
    new = w.put("n", value_of("n"), at=300)
    assert new.block == 300
    w.finish()
    assert w.read("n") == value_of("n") and w.read("k") is None
    assert svc.alloc.used_map[300] and svc.alloc.used == w.used_blocks(), (
        "the new value's blocks were freed under it"
    )
    clean_up(w, {"k", "z", "n"})


def test_an_unreadable_write_reaching_past_the_census_start_is_held(
    w: World,
) -> None:
    """A write in flight begins just before the region where the next server's census
    starts and reaches into it; hostile bytes hit its header.  The look-back, which
    decides the extents reaching into the census's start, cannot read it: the blocks
    from the start on are held all the same, before the census's first region is
    allocated from (the rest when the census comes round)."""
    n = 3
    w.svc.alloc._cursor = REGION * 8 - 1  # the extent's last blocks open the next region
    x = w.alloc("x", n * GEOMETRY.block_size)
    assert x.block == REGION * 8 - 1
    sb, mem = w.pool.superblock, w.pool.memory
    mem.nt_store(sb.block_header_offset(x.block) + 8, b"hostile bytes")
    mem.sfence()
    svc = w.take_over()
    assert svc.rec is not None and svc.rec.origin == REGION * 8
    new = w.put("n", value_of("n"), at=REGION * 8)  # from the census's first region
    assert not x.block <= new.block < x.block + n, "a block of a write in flight granted again"
    w.finish()
    assert svc.alloc.used_map[x.block : x.block + n].all()
    w.publish("x", x, b"X" * n * GEOMETRY.block_size)  # the writer goes on
    assert w.commit("x", x) and w.read("x") == b"X" * n * GEOMETRY.block_size
    assert w.read("n") == value_of("n")
    assert svc.alloc.used == w.used_blocks()
    clean_up(w, {"x", "n"})


def test_a_grant_nobody_learned_of_is_freed_when_the_look_back_meets_it(w: World) -> None:
    """A grant whose answer never went out reaches across the region where the next
    server's census starts; that server adopts the writer's ring (``forget_unanswered``)
    before its census, whose look-back then meets the grant ahead of the scan: freed,
    not pending until its writer leaves (the rich histories' seed 150)."""
    n = 3
    w.svc.alloc._cursor = REGION * 8 - 2  # the extent's last block opens the next region
    seq = 7
    payload = p.encode_alloc([(digest(b"g"), n * GEOMETRY.block_size, 1)])
    (grant,) = p.decode_grants(
        w.svc.op_alloc(Request(WRITER[0], int(p.StoreOp.ALLOC), payload, WRITER[1], seq))
    )
    assert grant.block == REGION * 8 - 2
    svc = w.take_over()  # its server died before the answer
    assert svc.rec is not None and svc.rec.origin == REGION * 8
    svc.forget_unanswered(*WRITER, lambda s: s == seq)  # the ring is adopted
    w.step()  # the census's first step looks back
    assert grant.block not in svc.pending, "a grant nobody learned of is pending"
    w.finish()
    assert not svc.pending and svc.alloc.used == 0
    assert svc.counters["unanswered_grants_freed"] == 1
