"""The checks that catch each sabotage point, and the runner a mutation run spawns.

A *check* is a small protocol scenario between model hosts (each a Memory of
its own over one buffer or pool file, in this one process) that raises
:class:`Violation` when a promise of the protocol breaks: wrong or stale
bytes, a lost acknowledged write, a removed key back, a live host taken for
dead.  Every check passes on the correct core (tests/test_mutation.py runs
them all, with model eviction off and on); with a point armed, the checks
that :data:`CATCHERS` lists for it must raise.  They are deterministic: the
model is seeded and nothing depends on timing.  Windows inside one C call
are opened by crash sweeps (``litmus.sweep_crashes``): the writer's host dies
once k of its writes have landed, for every k, and another host looks at
what is left, which is any state a concurrent reader could have caught.

Four kinds of check, by the step they pin down:

- *a caching host*: a host reads, another rewrites, the first reads again:
  every invalidate and MFENCE a reader needs;
- *visible at return*: right after a call returns another host must see its
  effect (nothing leaves a write-combining buffer early: drain rate 0);
- *crash sweeps*: every state inside a write: every SFENCE that orders two
  stores (payload before header, grant before answer, clear before format);
- *the memops self-check*: native instruction choices, which the model
  replaces and so cannot see.

Run as ``python -m tests.sabotage_checks [CHECK ...]`` it runs the named
checks (default: the catchers of the point armed in ``BELUGA_SABOTAGE``, or
every check when none is) and prints one JSON line per check.  A catcher may
also be a pytest node id (a protocol test across processes), which the
mutation run runs with pytest.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np

from beluga import litmus
from beluga._native import POINTS, _core
from beluga.coherence import (
    LINE,
    Memory,
    ModelConfig,
    attach,
    digest,
    read_line,
    write_line,
)
from beluga.errors import PoolError
from beluga.kv import protocol as p
from beluga.litmus import Seen
from beluga.pool import Geometry, HostState, Pool
from beluga.pool.host_records import ClaimAnswer, ClaimRequest, Grant, HostEntry, Identity
from beluga.pool.hosts import HostRegistry, HostTable
from beluga.pool.layout import Region, host_region_lines, plan, unpack
from beluga.pool.pool import format_pool
from beluga.rpc import Request
from beluga.server.service import MetadataService


class Violation(AssertionError):
    """A check saw a promise of the protocol broken."""


#: the model a mutation run uses: no random eviction, so a stale line stays stale
MUTATION_MODEL = ModelConfig(evict_rate=0.0)
SEEDS = range(8)
KEY = digest(b"sabotage check")
GEOMETRY = Geometry(max_hosts=4, rpc_bytes_per_host=64 << 10, block_size=16 << 10)


def _host(shared: object, model: ModelConfig, seed: int, **knobs: float) -> Memory:
    """One more model host over a shared buffer."""
    return attach(shared, "model", replace(model, seed=seed, **knobs))


def _still(model: ModelConfig) -> ModelConfig:
    """The model with nothing drained early: a store is in memory only once fenced."""
    return replace(model, drain_rate=0.0)


# -- blocks (block.c, blockio.c) ---------------------------------------------------

HDR, PAYLOAD, CAP = 0, 4096, 8192


def _sweep(name: str) -> Callable[[ModelConfig], None]:
    def check(model: ModelConfig) -> None:
        r = litmus.run_sweep(name, model, SEEDS)
        if r.caught:
            raise Violation(
                f"{name}: a reader took another version's bytes (equal CRC32C) in "
                f"{r.violations} of {r.trials} crash states"
            )
        if not (r.raced and r.confirmed):
            raise Violation(f"{name}: the sweep never met a write in progress")

    check.__name__ = f"sweep_{name}"
    check.__doc__ = f"Every state inside a {name} write reads as a miss or as a whole version."
    return check


def _window_seen(r: litmus.LitmusResult) -> None:
    """A sweep must have seen states before and after the write: else it proved nothing."""
    if not r.confirmed or r.trials == r.confirmed:
        raise RuntimeError(f"the {r.pattern} sweep never crossed its write ({r})")


def block_visible_at_return(model: ModelConfig) -> None:
    """A block published (whole, in place, or through write_blocks) is readable at return."""
    shared = bytearray(1 << 16)
    writer = _host(shared, _still(model), 1)
    for version, how in enumerate(("publish", "seal", "write_blocks"), start=1):
        data = random.Random(version).randbytes(3000)
        if how == "publish":
            writer.publish(HDR, PAYLOAD, KEY, version, data)
        else:
            writer.begin_write(HDR, PAYLOAD, KEY, version, len(data))
            if how == "seal":
                writer.nt_store(PAYLOAD, data)
                writer.seal(HDR, PAYLOAD, KEY, version, len(data))
            else:
                rows = np.array([(0, 0, PAYLOAD, len(data))], dtype=np.uint64)
                block = (HDR, PAYLOAD, KEY, version, len(data), 0, 0, 0)
                writer.write_blocks([data], rows, [block])
        out = bytearray(CAP)
        n = _host(shared, model, 10 + version).read_validated(HDR, PAYLOAD, CAP, KEY, version, out)
        if n != len(data) or bytes(out[:n]) != data:
            raise Violation(f"a block sealed by {how} was not readable when it returned ({n})")


def _republish(model: ModelConfig, read: Callable[[Memory, int, bytearray], int]) -> None:
    """A reader caches version 1, the writer publishes version 2, the reader reads it."""
    shared = bytearray(1 << 16)
    writer, reader = _host(shared, model, 1), _host(shared, model, 2)
    old, new = b"A" * 3000, b"B" * 2000
    writer.publish(HDR, PAYLOAD, KEY, 1, old)
    out = bytearray(CAP)
    if read(reader, 1, out) != len(old):
        raise Violation("the first version was not readable")
    writer.publish(HDR, PAYLOAD, KEY, 2, new)
    n = read(reader, 2, out)
    if n != len(new) or bytes(out[:n]) != new:
        raise Violation(f"a host that had read version 1 did not read version 2 ({n})")


def block_reread_on_a_caching_host(model: ModelConfig) -> None:
    """read_validated on a host holding the older version's lines returns the new one."""
    _republish(model, lambda m, v, out: m.read_validated(HDR, PAYLOAD, CAP, KEY, v, out))


def read_blocks_on_a_caching_host(model: ModelConfig) -> None:
    """read_blocks on a host holding the older version's lines returns the new one."""

    def read(m: Memory, version: int, out: bytearray) -> int:
        length = {1: 3000, 2: 2000}[version]
        rows = np.array([(0, 0, PAYLOAD, length)], dtype=np.uint64)
        (n,) = m.read_blocks([out], rows, [(HDR, PAYLOAD, CAP, KEY, version)])
        return n

    _republish(model, read)


def block_seal_of_a_foreign_payload(model: ModelConfig) -> None:
    """A payload another agent (the GPU's kernel) wrote is sealed right by a stale host."""
    shared = bytearray(1 << 16)
    host, gpu = _host(shared, model, 1), _host(shared, model, 2)
    old, new = b"O" * 3000, b"N" * 3000
    host.publish(HDR, PAYLOAD, KEY, 1, old)
    if host.read_validated(HDR, PAYLOAD, CAP, KEY, 1, bytearray(CAP)) != len(old):
        raise Violation("the first version was not readable")  # the host now caches it
    host.begin_write(HDR, PAYLOAD, KEY, 2, len(new))
    gpu.nt_store(PAYLOAD, new)
    gpu.sfence()
    host.seal(HDR, PAYLOAD, KEY, 2, len(new))
    out = bytearray(CAP)
    n = _host(shared, model, 3).read_validated(HDR, PAYLOAD, CAP, KEY, 2, out)
    if n != len(new) or bytes(out[:n]) != new:
        raise Violation(f"a payload written by another agent was sealed wrong ({n})")


def gather_and_scatter(model: ModelConfig) -> None:
    """gather_write's rows are in memory at return; scatter_read of a caching host sees them."""
    shared = bytearray(1 << 16)
    writer, reader = _host(shared, _still(model), 1), _host(shared, model, 2)
    rows = np.array([(0, 0, 4096, 900), (0, 900, 9000, 1100)], dtype=np.uint64)
    for n, fill in enumerate((b"x", b"y", b"z")):
        data = fill * 2000
        writer.gather_write([data], rows)
        out = bytearray(2000)
        reader.scatter_read([out], rows)
        if bytes(out) != data:
            raise Violation(f"round {n}: scatter_read did not see what gather_write returned from")


def device_read_on_a_caching_host(model: ModelConfig) -> None:
    """A GPU's load (the stand-in runtime: pool bytes as a device reads them through its host)
    of a block whose older version this host's CPU cached gets the newer version's bytes,
    which carry the same CRC32C, so only the invalidation can tell them apart (record.c)."""
    from beluga.transfer.gpu import GpuPool
    from tests.gpu_standin import StandInCuda

    old, new = litmus.TWINS
    with _pool_file(model) as host:
        writer, reader = host(1), host(2)
        with GpuPool(reader, runtime=StandInCuda()) as gpu:
            sb = reader.superblock
            hdr, pay, cap = sb.block_header_offset(0), sb.block_payload_offset(0), sb.block_size
            writer.memory.publish(hdr, pay, KEY, 1, old)
            if reader.memory.read_validated(hdr, pay, cap, KEY, 1, bytearray(cap)) != len(old):
                raise Violation("the first version was not readable")  # the CPU caches it now
            writer.memory.publish(hdr, pay, KEY, 2, new)
            out = np.zeros(len(new), np.uint8)
            rows = np.array([(0, 0, pay, len(new))], dtype=np.uint64)
            (n,) = gpu.read_blocks([out], rows, [(hdr, pay, cap, KEY, 2)])
            if n != len(new) or out.tobytes() != new:
                raise Violation(
                    f"a GPU load on a host that had cached version 1 did not get version 2 ({n}, "
                    f"{'the old bytes' if out.tobytes() == old else 'other bytes'})"
                )


# -- RPC (rpc.c) ----------------------------------------------------------------

AREA, RING, DEPTH, GEN = 64 << 10, 64 << 10, 2, 1


def _ring_pair(client_mem: Memory, server_mem: Memory) -> tuple:
    """A client's ring (two slots) and a server that serves it, on two hosts."""
    client = _core.RingClient(client_mem, AREA, RING, DEPTH, GEN)
    server = _core.RingServer(server_mem, AREA, RING, 1)
    server.set_ring(0, GEN, DEPTH, 1)
    return client, server


def _payload(i: int) -> bytes:
    """Alternately out of line and inline, each different."""
    rng = random.Random(i)
    return rng.randbytes(rng.choice([300, 1999, 7, 40, 777]) if i % 3 else 41 + i)


def rpc_ring_round_trips(model: ModelConfig) -> None:
    """Requests and responses through reused slots, out of line and inline: exact both ways."""
    shared = bytearray(AREA + RING)
    client, server = _ring_pair(_host(shared, model, 1), _host(shared, model, 2))
    for i in range(12):
        request, reply = _payload(i), _payload(100 + i)
        seq = client.submit_many([(7, request)])
        got = server.poll(4, 0.0)
        if got != [(0, seq, 7, request)] or server.rejected:
            raise Violation(f"call {i}: the server saw {got!r:.80} ({server.rejected} rejected)")
        server.respond([(0, seq, 0, reply)])
        done = client.complete(1, 0.0)
        if done != [(0, reply)]:
            raise Violation(f"call {i}: the client got {done!r:.80}")


def rpc_payload_sweep(model: ModelConfig) -> None:
    """Every state inside a request and a response: a line never lands before its payload."""
    request, reply = _payload(1), _payload(2)

    def attempt(k: int | None, seed: int, side: str) -> tuple[Seen, int]:
        shared = bytearray(AREA + RING)
        cm, sm = _host(shared, model, seed), _host(shared, model, seed + 1)
        client, server = _ring_pair(cm, sm)
        writer = cm if side == "request" else sm
        if side == "response":
            client.submit_many([(7, request)])
            server.poll(4, 0.0)
        before = writer.model_stats()["landed"]
        if k is not None:
            writer.crash_after(k)
        if side == "request":
            client.submit_many([(7, request)])
        else:
            server.respond([(0, 1, 0, reply)])
        landed = writer.model_stats()["landed"] - before
        if side == "response":
            done = client.complete(1, 0.0)
            if done not in ([], [(0, reply)]):
                return Seen.WRONG, landed
            return (Seen.RIGHT if done else Seen.NOTHING), landed
        fresh = _core.RingServer(_host(shared, model, seed + 2), AREA, RING, 1)
        fresh.set_ring(0, GEN, DEPTH, 1)
        got = fresh.poll(4, 0.0)
        if fresh.rejected or got not in ([], [(0, 1, 7, request)]):
            return Seen.WRONG, landed
        return (Seen.RIGHT if got else Seen.NOTHING), landed

    for side in ("request", "response"):
        for seed in SEEDS:
            r = litmus.sweep_crashes(lambda k, s=seed, w=side: attempt(k, s, w), name=side)
            if r.caught:
                raise Violation(
                    f"a {side} line landed before its out-of-line payload (seed {seed})"
                )
            _window_seen(r)


# -- host table (pool/hosts.py) ---------------------------------------------------

HOSTS = 4
ELSEWHERE = Identity(4242, 1, b"elsewher")  # a process of another machine (boot id)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _tables(model: ModelConfig, n: int, clock: _Clock, seed: int = 1) -> list[HostTable]:
    """n model hosts' views of one host table, their wall clocks ticking on every stamp."""
    region = Region(0, host_region_lines(HOSTS) * LINE)
    shared = bytearray(region.length)
    beats = iter(range(100, 10**9))
    return [
        HostTable(
            _host(shared, model, seed + i), region, HOSTS, clock=clock, wall=lambda: next(beats)
        )
        for i in range(n)
    ]


def _grant_elsewhere(server: HostTable, holder: HostTable, host_id: int) -> HostEntry:
    """The server grants an id to a process of another machine, which confirms it."""
    g = Grant(host_id, 3, ELSEWHERE, 99)
    write_line(server.mem, server._grant_off(host_id), g.pack())
    entry = HostEntry(host_id, HostState.ALIVE, 4242, 1, b"elsewher", 100, 3, 99)
    write_line(holder.mem, holder._host_off(host_id), entry.pack())
    return entry


def hosts_remote_heartbeat(model: ModelConfig) -> None:
    """Two model hosts: the server sees a remote holder's heartbeat move, so it stays alive."""
    clock = _Clock()
    server, holder = _tables(model, 2, clock)
    registry = HostRegistry(server, stale_s=10.0)
    entry = _grant_elsewhere(server, holder, 1)
    for beat in range(12):
        clock.now += 4.0
        entry = holder.heartbeat(entry)
        seen = server.read(1)
        if seen != entry:
            raise Violation(f"beat {beat}: the server read a stale host line")
        if registry.alive(1) is None:
            raise Violation(f"beat {beat}: a live remote holder was taken for dead")


def hosts_grant_gone(model: ModelConfig) -> None:
    """A holder taken for dead (another host's claim) finds its grant gone."""
    clock = _Clock()
    server, holder, claimant = _tables(model, 3, clock)
    registry = HostRegistry(server, stale_s=10.0)
    entry = _grant_elsewhere(server, holder, 0)
    if not holder.holds(entry) or registry.alive(0) is None:
        raise Violation("a fresh grant was not seen by its holder and the server")
    clock.now += 30  # its heartbeat never moved: taken for dead
    write_line(claimant.mem, claimant._lobby_off(0), ClaimRequest(0, Identity.mine(), 7).pack())
    if registry.serve_lobby() != 1:
        raise Violation("the server did not grant the dead holder's id again")
    if holder.holds(entry):
        raise Violation("a holder whose id was granted again still reads its old grant")


def hosts_grant_sweep(model: ModelConfig) -> None:
    """Every state inside answering a claim: an answer never lands before its grant."""
    request = ClaimRequest(-1, Identity.mine(), 0x5EED)

    def attempt(k: int | None, seed: int) -> tuple[Seen, int]:
        server, claimant, look = _tables(model, 3, _Clock(), seed)
        write_line(claimant.mem, claimant._lobby_off(3), request.pack())
        registry = HostRegistry(server, stale_s=10.0)
        before = server.mem.model_stats()["landed"]
        if k is not None:
            server.mem.crash_after(k)
        registry.serve_lobby()
        landed = server.mem.model_stats()["landed"] - before
        answer = ClaimAnswer.unpack(read_line(look.mem, look._answer_off(3)))
        if answer is None or answer.nonce != request.nonce:
            return Seen.NOTHING, landed
        grant = look.grant(answer.result)
        ok = grant is not None and (grant.nonce, grant.generation) == (
            request.nonce,
            answer.generation,
        )
        return litmus.judge(ok), landed

    for seed in SEEDS:
        r = litmus.sweep_crashes(lambda k, s=seed: attempt(k, s), name="grant")
        if r.caught:
            raise Violation(f"a claim's answer landed before its grant (seed {seed})")
        _window_seen(r)


# -- pool format (pool/pool.py) ----------------------------------------------------

FORMAT_SIZE = 12 << 20


_OLD_POOL = bytearray(b"\xa5" * FORMAT_SIZE)  # a device holding an old pool: a valid
_OLD_POOL[:4096] = plan(FORMAT_SIZE, GEOMETRY, "old").pack()  # superblock over its state


def format_sweep(model: ModelConfig) -> None:
    """Every state inside formatting a device: a new superblock never shows old regions."""
    new = plan(FORMAT_SIZE, GEOMETRY, "new")

    def attempt(k: int | None, seed: int) -> tuple[Seen, int]:
        shared = bytearray(_OLD_POOL)
        fmt = _host(shared, model, seed)
        if k is not None:
            fmt.crash_after(k)
        format_pool(fmt, new, clear=True)
        landed = fmt.model_stats()["landed"]
        fmt.release()
        try:
            sb = unpack(bytes(shared[:4096]), FORMAT_SIZE)
        except PoolError:
            return Seen.NOTHING, landed  # no pool at all: nothing to trust
        if sb.uuid != new.uuid:
            return Seen.NOTHING, landed  # still the old pool, untouched
        view = np.frombuffer(shared, dtype=np.uint8)
        regions = (sb.hosts, sb.rpc, sb.index, sb.headers)
        clear = not any(view[r.offset : r.end].any() for r in regions)
        return litmus.judge(clear), landed

    for seed in range(2):
        r = litmus.sweep_crashes(lambda k, s=seed: attempt(k, s), last=30, name="format")
        if r.caught:
            raise Violation(f"a new superblock landed over the old pool's regions (seed {seed})")
        _window_seen(r)


def format_visible_at_return(model: ModelConfig) -> None:
    """A formatted pool is there for every host when format_pool returns."""
    sb = plan(FORMAT_SIZE, GEOMETRY, "new")
    shared = bytearray(FORMAT_SIZE)
    fmt = _host(shared, _still(model), 1)
    format_pool(fmt, sb, clear=False)
    look = _host(shared, model, 2)
    try:
        if unpack(look.load(0, 4096), FORMAT_SIZE).uuid != sb.uuid:
            raise Violation("another host found an old superblock after format returned")
    except PoolError as e:
        raise Violation(f"another host found no pool after format returned: {e}") from e
    fmt.release(), look.release()


# -- metadata service (server/service.py) -----------------------------------------------


@contextmanager
def _pool_file(model: ModelConfig) -> Iterator[Callable[..., Pool]]:
    """A pool file and a way to attach more model hosts to it (each closed at the end)."""
    pools: list[Pool] = []
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="beluga-check-") as d:
        path = os.path.join(d, "pool")

        def host(seed: int, **knobs: float) -> Pool:
            cfg = replace(model, seed=seed, **knobs)
            if not pools:
                pool = Pool.create(path, 12 << 20, geometry=GEOMETRY, coherence="model", model=cfg)
            else:
                pool = Pool.attach(path, coherence="model", model=cfg)
            pools.append(pool)
            return pool

        try:
            yield host
        finally:
            for pool in pools:
                pool.close()


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
    """At the moment each answer leaves, a server restarted on another host agrees with it."""
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
            if not _commit(svc, key, g) or digest(key) not in restarted().index:
                raise Violation(f"commit {i} was answered before it was in the pool")
        removed = svc.op_remove(
            Request(1, int(p.StoreOp.REMOVE), p.encode_digests([digest(b"b")]), 1)
        )
        if p.decode_flags(removed) != [True] or digest(b"b") in restarted().index:
            raise Violation("a REMOVE was answered while the key could still come back")


# -- the pool index (index.c, server/index.py) -----------------------------------------------


def _reader_index(pool: Pool) -> object:
    """A one-sided reader over a pool (no hints)."""
    sb = pool.superblock
    return _core.Index(
        pool.memory,
        sb.index.offset,
        sb.nbuckets,
        sb.headers.offset,
        sb.payloads.offset,
        sb.block_size,
        sb.nblocks,
    )


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


# -- native instructions (memops.c) ---------------------------------------------------


def memops_selfcheck(model: ModelConfig) -> None:
    """The native table flushes what plain stores wrote and never invalidates with CLWB."""
    problems = _core.memops_selfcheck()
    if problems:
        raise Violation("; ".join(problems))
    if _core.selected()["invalidate"] == "clwb":
        raise Violation("invalidate is CLWB, which keeps a stale line")


# -- the registry ------------------------------------------------------------------

sweep_publish, sweep_in_place, sweep_write_blocks = (_sweep(n) for n in litmus.SWEEPS)

CHECKS: dict[str, Callable[[ModelConfig], None]] = {
    f.__name__: f
    for f in (
        sweep_publish,
        sweep_in_place,
        sweep_write_blocks,
        block_visible_at_return,
        block_reread_on_a_caching_host,
        read_blocks_on_a_caching_host,
        block_seal_of_a_foreign_payload,
        gather_and_scatter,
        device_read_on_a_caching_host,
        rpc_ring_round_trips,
        rpc_payload_sweep,
        hosts_remote_heartbeat,
        hosts_grant_gone,
        hosts_grant_sweep,
        format_sweep,
        format_visible_at_return,
        service_restart_on_a_caching_host,
        service_answers_durable,
        index_probe_on_a_caching_host,
        index_batch_probe_on_a_caching_host,
        index_move_sweep,
        memops_selfcheck,
    )
}

_READERS = ("HEADER_INVALIDATE", "HEADER_MFENCE", "PAYLOAD_INVALIDATE", "PAYLOAD_MFENCE")
_RPC_READS = (
    "REQUEST_INVALIDATE",
    "REQUEST_MFENCE",
    "REQUEST_BUFFER_INVALIDATE",
    "REQUEST_BUFFER_MFENCE",
    "RESPONSE_INVALIDATE",
    "RESPONSE_MFENCE",
    "RESPONSE_BUFFER_INVALIDATE",
    "RESPONSE_BUFFER_MFENCE",
)

#: the cross-process test a mutation run also runs for the buffer points (R9/R10 and the client's)
RPC_SLOT_REUSE = (
    "tests/test_rpc.py::"
    "test_a_model_server_reusing_slots_reads_every_out_of_line_payload_fresh[evict-off]"
)

#: point -> the checks (or pytest node ids) that must catch it, cheapest first
CATCHERS: dict[str, list[str]] = {
    "BLOCK_WRITING_FENCE": ["sweep_publish", "sweep_in_place"],
    "BLOCK_PAYLOAD_FENCE": ["sweep_publish"],
    "BLOCK_PUBLISHED_FENCE": ["block_visible_at_return"],
    **{f"BLOCK_{s}": ["block_reread_on_a_caching_host"] for s in _READERS},
    "BLOCK_CHECKSUM_INVALIDATE": ["block_seal_of_a_foreign_payload"],
    "BLOCK_CHECKSUM_MFENCE": ["block_seal_of_a_foreign_payload", "sweep_in_place"],
    "BLOCKIO_WRITE_FENCE": ["sweep_write_blocks"],
    **{f"BLOCKIO_{s}": ["read_blocks_on_a_caching_host"] for s in _READERS},
    "GATHER_FENCE": ["gather_and_scatter"],
    "SCATTER_INVALIDATE": ["gather_and_scatter"],
    "SCATTER_MFENCE": ["gather_and_scatter"],
    "DEVICE_READ_INVALIDATE": ["device_read_on_a_caching_host"],
    "DEVICE_READ_MFENCE": ["device_read_on_a_caching_host"],
    "RPC_REQUEST_PAYLOAD_FENCE": ["rpc_payload_sweep"],
    "RPC_RESPONSE_PAYLOAD_FENCE": ["rpc_payload_sweep"],
    **{f"RPC_{s}": ["rpc_ring_round_trips"] for s in _RPC_READS},
    **{f"RPC_{s}": ["rpc_ring_round_trips", RPC_SLOT_REUSE] for s in _RPC_READS if "BUFFER" in s},
    "MEMOPS_NT_EDGE_FLUSH": ["memops_selfcheck"],
    "MEMOPS_INVALIDATE_FLUSHES": ["memops_selfcheck"],
    "HOSTS_SERVER_READ_INVALIDATE": ["hosts_remote_heartbeat"],
    "HOSTS_SERVER_READ_MFENCE": ["hosts_remote_heartbeat"],
    "HOSTS_HOLDER_READ_INVALIDATE": ["hosts_grant_gone"],
    "HOSTS_HOLDER_READ_MFENCE": ["hosts_grant_gone"],
    "HOSTS_GRANT_FENCE": ["hosts_grant_sweep"],
    "FORMAT_CLEAR_FENCE": ["format_sweep"],
    "FORMAT_FENCE": ["format_visible_at_return"],
    "SERVICE_RECOVER_INVALIDATE": ["service_restart_on_a_caching_host"],
    "SERVICE_RECOVER_MFENCE": ["service_restart_on_a_caching_host"],
    "SERVICE_COMMIT_FENCE": ["service_answers_durable"],
    "SERVICE_CLEAR_FENCE": ["service_answers_durable"],
    "INDEX_BUCKET_INVALIDATE": [
        "index_probe_on_a_caching_host",
        "index_batch_probe_on_a_caching_host",
    ],
    "INDEX_BUCKET_MFENCE": ["index_probe_on_a_caching_host", "index_batch_probe_on_a_caching_host"],
    "INDEX_MOVE_FENCE": ["index_move_sweep"],
}


def run(name: str, model: ModelConfig = MUTATION_MODEL) -> dict[str, str]:
    """Run one check: {"check", "outcome": passed | caught | error, "detail"}."""
    try:
        CHECKS[name](model)
    except Violation as e:
        return {"check": name, "outcome": "caught", "detail": str(e)}
    except Exception as e:  # the check itself broke: never counted as a catch
        detail = "".join(traceback.format_exception_only(e)).strip()
        return {"check": name, "outcome": "error", "detail": detail}
    return {"check": name, "outcome": "passed", "detail": ""}


def main(argv: list[str]) -> int:
    armed = _core.armed()
    names = argv or [n for n in (CATCHERS[armed] if armed else CHECKS) if n in CHECKS]
    for name in names:
        print(json.dumps({"point": armed, **run(name)}), flush=True)
    return 0


__all__ = ["CATCHERS", "CHECKS", "MUTATION_MODEL", "POINTS", "Violation", "run"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
