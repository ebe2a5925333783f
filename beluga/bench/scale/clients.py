"""The clients' side: hosts writing at once (the service driven directly, and through the real
server), and one-sided reads against the pool index's load."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from beluga.bench.scale.pools import BATCH, RPC_GEOMETRY, fill, scratch_pool
from beluga.bench.store import serve_in_child
from beluga.child import server_process
from beluga.coherence import digest
from beluga.kv import KVStore
from beluga.kv import protocol as p
from beluga.pool import Pool
from beluga.rpc import Request
from beluga.server.index import SLOTS
from beluga.server.service import MetadataService

HOSTS = (1, 2, 4, 8, 16)
LOADS = (0.1, 0.3, 0.5, 0.7, 0.9)


def _percentiles(ns: Sequence[int]) -> tuple[float, float]:
    """p50 and p99 in µs of timings in ns."""
    p50, p99 = np.percentile(np.asarray(ns, dtype=float), [50, 99])
    return float(p50) / 1e3, float(p99) / 1e3


def _serve(svc: MetadataService, reqs: Sequence[Request], handler: str) -> list[tuple[int, bytes]]:
    """Serve one batch of each host, in turn as the server's loop does: each host's
    latency is its wait behind the hosts before it plus its own batch, in ns."""
    out, waited = [], 0
    for req in reqs:
        t = time.perf_counter_ns()
        answer = getattr(svc, handler)(req)
        waited += time.perf_counter_ns() - t
        out.append((waited, answer))
    return out


def writers(size: int, hosts: Sequence[int] = HOSTS, batch: int = BATCH) -> list[dict[str, Any]]:
    """ALLOC and COMMIT batches against the number of hosts writing at once.

    The metadata service is driven directly (no RPC transport), by one thread in
    rounds: each of ``n`` hosts (own host id, generation 1) has one ALLOC batch of
    ``batch`` one-block keys outstanding, served in turn; then the publishes (the
    writers' work, not timed) and one COMMIT batch each, in turn.  The round's keys
    are then removed (not timed), so every round starts from the same pool.
    """
    path, pool = scratch_pool(size)
    sb, mem = pool.superblock, pool.memory
    try:
        if max(hosts) * batch > sb.nblocks:
            raise ValueError(
                f"{max(hosts)} hosts with {batch} keys each do not fit a {size}-byte pool's "
                f"{sb.nblocks} blocks: pass a larger pool or a smaller batch"
            )
        svc = MetadataService(pool, writer_alive=lambda host, gen: True)
        rows = []
        for n in hosts:
            alloc_ns: list[int] = []
            commit_ns: list[int] = []
            busy = 0
            keys = 0
            for r in range(max(8, 128 // n)):  # at least 128 host-batches a point
                digests = {
                    h: [digest(f"w{n}-{r}-{h}-{i}".encode()) for i in range(batch)]
                    for h in range(1, n + 1)
                }
                ask = [
                    Request(h, int(p.StoreOp.ALLOC), p.encode_alloc([(d, 64, 1) for d in ds]), 1)
                    for h, ds in digests.items()
                ]
                served = _serve(svc, ask, "op_alloc")
                alloc_ns += [w for w, _ in served]
                busy += served[-1][0]
                commits = []
                for (h, ds), (_, answer) in zip(digests.items(), served, strict=True):
                    grants = p.decode_grants(answer)
                    for d, g in zip(ds, grants, strict=True):
                        mem.publish(
                            sb.block_header_offset(g.block),
                            sb.block_payload_offset(g.block),
                            d,
                            g.version,
                            d * 4,
                            writer=h,
                            writer_gen=1,
                        )
                    payload = p.encode_commit(
                        [(d, g.block, g.version) for d, g in zip(ds, grants, strict=True)]
                    )
                    commits.append(Request(h, int(p.StoreOp.COMMIT), payload, 1))
                served = _serve(svc, commits, "op_commit")
                commit_ns += [w for w, _ in served]
                busy += served[-1][0]
                if not all(all(p.decode_flags(a)) for _, a in served):
                    raise AssertionError(f"a COMMIT of {n} hosts' batches was refused")
                keys += n * batch
                everything = [d for ds in digests.values() for d in ds]
                svc.op_remove(Request(1, int(p.StoreOp.REMOVE), p.encode_digests(everything), 1))
            a50, a99 = _percentiles(alloc_ns)
            c50, c99 = _percentiles(commit_ns)
            rows.append(
                {
                    "hosts": n,
                    "batch": batch,
                    "keys": keys,
                    "keys_per_s": keys / (busy / 1e9),
                    "alloc_batch_p50_us": a50,
                    "alloc_batch_p99_us": a99,
                    "commit_batch_p50_us": c50,
                    "commit_batch_p99_us": c99,
                }
            )
        if svc.index or svc.pending:
            raise AssertionError("the writers' rounds left keys or writes behind")
        return rows
    finally:
        pool.close()
        Pool.destroy(path)


def writers_rpc(
    size: int, hosts: Sequence[int] = HOSTS, batch: int = BATCH, batches: int = 32
) -> list[dict[str, Any]]:
    """``put_batch`` of one-block keys through the real server, against hosts writing at once.

    For each number of hosts: a fresh pool, ``beluga serve`` in a child process, and
    one thread a host, each with its own ``KVStore`` (its own host id), all storing
    batches of ``batch`` 64-byte values at once (``batches`` in all, shared between
    the hosts).  A put is the whole protocol: ALLOC RPC, publish, COMMIT RPC.  The
    clients are threads of one process on the same CPUs as the server.
    """
    rows = []
    for n in hosts:
        path, pool = _scratch_rpc(size)
        try:
            with server_process(serve_in_child, pool.spec):
                stores = [KVStore(pool.spec) for _ in range(n)]
                try:
                    rows.append(_put_at_once(stores, batch, max(1, batches // n)))
                finally:
                    for store in stores:
                        store.close()
        finally:
            pool.close()
            Pool.destroy(path)
    return rows


def _put_at_once(stores: Sequence[KVStore], batch: int, rounds: int) -> dict[str, Any]:
    """Every store puts ``rounds`` batches in its own thread, all started together."""
    start = threading.Barrier(len(stores))
    took: list[list[int]] = [[] for _ in stores]
    failed: list[BaseException] = []

    def write(i: int) -> None:
        try:
            start.wait(timeout=30)
            for r in range(rounds):
                keys = [f"h{i}-{r}-{k}" for k in range(batch)]
                t = time.perf_counter_ns()
                stores[i].put_batch(keys, [digest(k.encode()) * 4 for k in keys])
                took[i].append(time.perf_counter_ns() - t)
        except BaseException as e:  # re-raised below, in the caller's thread
            failed.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(stores))]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    wall = time.perf_counter() - t
    if failed or any(th.is_alive() for th in threads):
        raise AssertionError(f"a writer failed or hung: {failed[:1]}")
    p50, p99 = _percentiles([ns for per in took for ns in per])
    keys = len(stores) * rounds * batch
    return {
        "hosts": len(stores),
        "host_ids": sorted(s.rpc.host_id for s in stores),
        "batch": batch,
        "keys": keys,
        "keys_per_s": keys / wall,
        "put_batch_p50_us": p50,
        "put_batch_p99_us": p99,
    }


def _scratch_rpc(size: int) -> tuple[str, Pool]:
    path = f"/dev/shm/beluga-scale-{uuid.uuid4().hex[:8]}"
    return path, Pool.create(path, size, geometry=RPC_GEOMETRY, coherence="native")


def reads(
    size: int, loads: Sequence[float] = LOADS, values: int = 512, lookups: int = 4000
) -> list[dict[str, Any]]:
    """One-sided reads (``_core.Index.get_into``, the read path of every client: two bucket
    lines and a header with loads, the payload copied with its checksum) against the
    load factor of the pool index (keys / slots).

    ``values`` real one-block values of 64 bytes are stored through the service; the
    index is then filled, load by load, with entries of random keys (tags and slots
    taken, pointing at no header of theirs) placed by the server's own cuckoo insert,
    which also moves the real keys to their other bucket as a full index does.  Hits
    time the real keys, misses keys never stored.
    """
    path, pool = scratch_pool(size)
    sb = pool.superblock
    try:
        svc = MetadataService(pool, writer_alive=lambda host, gen: True)
        prefix = uuid.uuid4().hex[:8]
        fill(pool, svc, min(values, sb.nblocks), prefix)
        real = [f"{prefix}-{i}".encode() for i in range(min(values, sb.nblocks))]
        absent = [f"absent-{i}".encode() for i in range(len(real))]
        index = pool.index_reader()
        ix, slots = svc.ix, sb.nbuckets * SLOTS
        rng = np.random.default_rng(22)
        buf = bytearray(sb.block_size)
        rows = []
        for load in sorted(loads):
            while len(ix) < load * slots:
                block = int(rng.integers(sb.nblocks))
                if not ix.put(rng.bytes(16), block, int(rng.integers(1, 1 << 62))):
                    break  # no cuckoo path within the insert's bounds: the index is full
            pool.memory.sfence()
            hits, misses = [], []
            for i in range(lookups):
                t = time.perf_counter_ns()
                got = index.get_into(real[i % len(real)], buf)
                hits.append(time.perf_counter_ns() - t)
                if got < 0:
                    raise AssertionError(f"a stored key missed at index load {len(ix) / slots:.2f}")
                t = time.perf_counter_ns()
                got = index.get_into(absent[i % len(absent)], buf)
                misses.append(time.perf_counter_ns() - t)
                if got >= 0:
                    raise AssertionError("a key never stored was found")
            h50, h99 = _percentiles(hits)
            m50, m99 = _percentiles(misses)
            rows.append(
                {
                    "target_load": load,
                    "load": len(ix) / slots,
                    "index_slots": slots,
                    "hit_p50_us": h50,
                    "hit_p99_us": h99,
                    "miss_p50_us": m50,
                    "miss_p99_us": m99,
                    "insert_failures": ix.failed,
                }
            )
        return rows
    finally:
        pool.close()
        Pool.destroy(path)
