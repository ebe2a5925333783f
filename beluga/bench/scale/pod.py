"""``beluga bench scale``: how the metadata server's costs grow with the pool.

Measured here, in one process, with the metadata service driven directly (no
RPC, as tests/test_service.py drives it), on pools of a few sizes filled to
a fraction with one-block values:

recovery      a restarted server's whole recovery at once (``recover()``): load
              and parse every block header and commit word, rebuild the index
              and the allocator, repair the pool index; against block count and
              key count.  Until issue 36 a server answered no write before it
              was done, so this was also the takeover's write outage
takeover      a server taking over as ``beluga serve`` does now (recovery while
              serving): takeover to its first acknowledged write, with recovery
              at once as the baseline ("before"); then writers overwriting
              random stored keys in batches, the service's recovery steps
              between them as the server's loop runs them, against time: the
              write rate while recovering and after, how long until the rate
              stays at 90% of its rate after recovery ("full throughput"), and
              how long until recovery is done
fill          ALLOC and COMMIT batches of 256 (the server's side only: the
              payload publish between them is the writer's and is not timed)
full GC       one full ``gc.collect()`` with the recovered server alive (it
              scans every object the server holds: a pause of every RPC)
tick          one ``tick()`` of the server (hint folding, one index scrub
              step of 64 buckets, lease checks) and the scrub step alone
writers       ALLOC/COMMIT batch throughput and p50/p99 against 1..16 hosts
              writing at once, each with its own host id (``writers``), and
              ``put_batch`` through the real server the same way (``writers_rpc``)
reads         one-sided read p50/p99, hits and misses, against the pool
              index's load factor, 10..90% (``reads``)

Each size curve is fitted as cost = a + b x (least squares over the sizes
run) and extrapolated to the paper's pod: 8 TB of 64 KiB blocks (128 M
blocks) and 16 hosts, with the assumptions stated in the report
(``ASSUMPTIONS``).
"""

from __future__ import annotations

import gc
import statistics
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from beluga._native import _core
from beluga.bench.store import serve_in_child
from beluga.child import server_process
from beluga.coherence import digest
from beluga.kv import KVStore
from beluga.kv import protocol as p
from beluga.pool import Geometry, Pool
from beluga.rpc import Request
from beluga.server.index import SLOTS
from beluga.server.service import MetadataService
from beluga.units import GiB, MiB, TiB

GEOMETRY = Geometry(max_hosts=16)
RPC_GEOMETRY = Geometry(max_hosts=17)  # 16 writing hosts and the server
BATCH = 256
HOSTS = (1, 2, 4, 8, 16)
LOADS = (0.1, 0.3, 0.5, 0.7, 0.9)
WRITER = (1, 1)
POD_BYTES = 8 * TiB
POD_HOSTS = 16
WRITER_POOL = 1 * GiB  # 16 hosts' batches of 256 one-block keys fit its 15,982 blocks
READ_POOL = 256 * MiB
ASSUMPTIONS = (
    "recovery and fill cost grow linearly in blocks and keys (the fit's b); the fit is over "
    "pools of this machine's sizes, so caches that 8 TB would overflow make the real figure "
    "larger, not smaller; recovery loads the whole header table at once (64 B a block: "
    "8 GiB at 128 M blocks) and parses it into numpy columns (50 B a valid header), and "
    "the server keeps a few Python objects a key",
    "recovery runs single-threaded in Python at this machine's speed (2 shared vCPUs)",
    "readers do not wait for recovery: they read the pool index with loads; writers waited "
    "for the whole recovery before issue 36 (recovery_s, 'before'); now a server answers "
    "once it has read the service line (the version floor and the log of graves) and the "
    "census has found a free extent, so its first write costs a constant, not a scan "
    "(takeover_first_write_s, 'after'), fitted as a + b blocks like the rest",
    "full throughput: writers overwrite random stored one-block keys in batches of "
    f"{BATCH} (the fill stays put), the service driven directly by one thread, with "
    "recover_some() between batches as the server's loop calls it (recovery takes at most "
    "its share of a busy loop's time); the steady rate is the rate after recovery is done; "
    "time to full throughput is when every later window of the run is at 90% of it; both "
    "times are fitted against blocks and extrapolated, and recovery_done_s grows with the "
    "pool (all of recovery's work at its share)",
    "a tick's cost does not grow with the pool: it scrubs a fixed 64 buckets, so a full "
    "scrub pass takes (buckets / 64) ticks, which does grow linearly",
    "writers: the service is driven directly by one thread (no RPC transport: add the slot "
    "RPC's round trip per batch), each host's ALLOC then COMMIT batch served in turn as the "
    "server's loop serves rings; its keys/s does not grow with hosts (one server thread), "
    "and a host's batch waits behind the others', so the p99 at the pod's 16 hosts is scaled "
    "from the most hosts measured by 16 / hosts; a p99 includes any full garbage collection "
    "that fell in a batch, whose pause grows with the keys the server holds (full GC)",
    "writers through the server: one thread a host in one process, each with its own "
    "KVStore and host id, on the same 2 vCPUs as the server (the clients' digests, publishes "
    "and encodings compete with it), so its keys/s is a floor for hosts of their own",
    "reads: one process reading a 64-byte value with loads (no RPC); a read's cost does not "
    "depend on the pool's size (two bucket lines and a header), only on the index's load, "
    "which at the pod is at most (keys / blocks) / 3 (a bucket a block, 3 slots each); "
    "filler entries stand in for other keys; several readers at once contend only for the "
    "memory system, not measured here",
    "full GC frozen: right after recovery, as `beluga serve` freezes what it built "
    "(collector.keep_collections_short); a running server's full collection then scans what "
    "was made since the last one, so its pause grows with the keys written between two, "
    "not with the keys held",
)


def _request(op: p.StoreOp, payload: bytes) -> Request:
    return Request(WRITER[0], int(op), payload, WRITER[1])


def fill(pool: Pool, svc: MetadataService, keys: int, prefix: str) -> dict[str, float]:
    """Store ``keys`` one-block values through the service in batches; server-side seconds."""
    sb, mem = pool.superblock, pool.memory
    alloc_s = commit_s = 0.0
    for start in range(0, keys, BATCH):
        names = [f"{prefix}-{i}".encode() for i in range(start, min(keys, start + BATCH))]
        digests = [digest(k) for k in names]
        t = time.perf_counter()
        grants = p.decode_grants(
            svc.op_alloc(_request(p.StoreOp.ALLOC, p.encode_alloc([(d, 64, 1) for d in digests])))
        )
        alloc_s += time.perf_counter() - t
        for d, g in zip(digests, grants, strict=True):
            mem.publish(
                sb.block_header_offset(g.block),
                sb.block_payload_offset(g.block),
                d,
                g.version,
                d * 4,
                writer=WRITER[0],
                writer_gen=WRITER[1],
            )
        t = time.perf_counter()
        payload = p.encode_commit(
            [(d, g.block, g.version) for d, g in zip(digests, grants, strict=True)]
        )
        svc.op_commit(_request(p.StoreOp.COMMIT, payload))
        commit_s += time.perf_counter() - t
    return {"alloc_s": alloc_s, "commit_s": commit_s}


def _write_one(pool: Pool, svc: MetadataService, key: bytes) -> None:
    """ALLOC, publish and COMMIT of one one-block value: the first write of a takeover."""
    sb, d = pool.superblock, digest(key)
    (g,) = p.decode_grants(svc.op_alloc(_request(p.StoreOp.ALLOC, p.encode_alloc([(d, 64, 1)]))))
    pool.memory.publish(
        sb.block_header_offset(g.block),
        sb.block_payload_offset(g.block),
        d,
        g.version,
        d * 4,
        writer=WRITER[0],
        writer_gen=WRITER[1],
    )
    answer = svc.op_commit(_request(p.StoreOp.COMMIT, p.encode_commit([(d, g.block, g.version)])))
    if p.decode_flags(answer) != [True]:
        raise AssertionError("the first write after a takeover was refused")


def _remove(svc: MetadataService, keys: Sequence[bytes]) -> None:
    svc.op_remove(_request(p.StoreOp.REMOVE, p.encode_digests([digest(k) for k in keys])))


def first_writes(pool: Pool, repeats: int) -> dict[str, list[float]]:
    """Takeover to the first acknowledged write, recovering at once (before) and while
    serving (after), alternated; each write removed again by a finished server."""
    before, after = [], []
    for r in range(repeats):
        for mode, times in ((True, before), (False, after)):
            key = f"first-{r}-{mode}".encode()
            t = time.perf_counter()
            svc = MetadataService(pool, writer_alive=lambda host, gen: True, recover_now=mode)
            _write_one(pool, svc, key)
            times.append(time.perf_counter() - t)
            svc.recover()
            _remove(svc, [key])
            del svc
    return {"before": before, "after": after}


def write_rate(
    pool: Pool, names: Sequence[bytes], window_s: float = 0.25, after_s: float = 2.0
) -> dict[str, Any]:
    """Writers overwriting stored keys from a takeover on (the module doc, "takeover")."""
    sb, mem = pool.superblock, pool.memory
    rng = np.random.default_rng(36)
    t0 = time.perf_counter()
    svc = MetadataService(pool, writer_alive=lambda host, gen: True, recover_now=False)
    marks: list[tuple[float, int]] = []
    done_at = None
    next_tick = 0.0
    while True:
        now = time.perf_counter() - t0
        if done_at is None and not svc.recovering:
            done_at = now
        if done_at is not None and now > done_at + after_s:
            break
        keys = [names[i] for i in rng.choice(len(names), min(BATCH, len(names)), replace=False)]
        digests = [digest(k) for k in keys]
        payload = p.encode_alloc([(d, 64, 1) for d in digests])
        grants = p.decode_grants(svc.op_alloc(_request(p.StoreOp.ALLOC, payload)))
        for d, g in zip(digests, grants, strict=True):
            mem.publish(
                sb.block_header_offset(g.block),
                sb.block_payload_offset(g.block),
                d,
                g.version,
                d * 4,
                writer=WRITER[0],
                writer_gen=WRITER[1],
            )
        payload = p.encode_commit(
            [(d, g.block, g.version) for d, g in zip(digests, grants, strict=True)]
        )
        if not all(p.decode_flags(svc.op_commit(_request(p.StoreOp.COMMIT, payload)))):
            raise AssertionError("an overwrite was refused during recovery")
        marks.append((time.perf_counter() - t0, len(keys)))
        if now >= next_tick:  # the server's loop ticks every refresh (0.1 s)
            svc.tick()
            next_tick = now + 0.1
        svc.recover_some(served=1)
    assert done_at is not None
    return _rates(marks, done_at, window_s)


def _rates(marks: Sequence[tuple[float, int]], done_at: float, window_s: float) -> dict[str, Any]:
    """Keys per second in whole windows of ``window_s``; the steady rate is the median of
    the windows after recovery ended; full throughput from the end of the last window
    below 90% of it."""
    ends = np.array([t for t, _ in marks])
    keys = np.array([n for _, n in marks])
    whole = max(1, int(ends[-1] // window_s))
    edges = np.arange(whole + 1) * window_s
    per = np.histogram(ends, bins=edges, weights=keys)[0] / window_s
    after_windows = per[edges[:-1] >= done_at]
    after = (
        float(np.median(after_windows))
        if after_windows.size
        else float(keys[ends > done_at].sum() / max(ends[-1] - done_at, 1e-9))
    )
    during = keys[ends <= done_at].sum() / max(done_at, 1e-9)
    low = np.flatnonzero(per < 0.9 * after)
    return {
        "first_write_s": float(ends[0]),
        "recovery_done_s": done_at,
        "full_throughput_s": float(edges[low[-1] + 1]) if low.size else 0.0,
        "keys_per_s_recovering": float(during),
        "keys_per_s_after": after,
        "rate_windows": per.round(1).tolist(),
        "window_s": window_s,
    }


def measure(size: int, fraction: float, repeats: int = 3, after_s: float = 2.0) -> dict[str, Any]:
    """One pool of ``size`` bytes filled to ``fraction`` of its blocks: every figure."""
    path = f"/dev/shm/beluga-scale-{uuid.uuid4().hex[:8]}"
    pool = Pool.create(path, size, geometry=GEOMETRY, coherence="native")
    try:
        svc = MetadataService(pool, writer_alive=lambda host, gen: True)
        keys = int(pool.superblock.nblocks * fraction)
        prefix = uuid.uuid4().hex[:8]
        filled = fill(pool, svc, keys, prefix)
        recovery = []
        for _ in range(repeats):
            del svc  # the last server's teardown is not the next one's recovery
            t = time.perf_counter()
            svc = MetadataService(pool, writer_alive=lambda host, gen: True)
            recovery.append(time.perf_counter() - t)
        if len(svc.index) != keys:
            raise AssertionError(f"recovery found {len(svc.index)} keys of the {keys} stored")
        del svc
        first = first_writes(pool, repeats)
        names = [f"{prefix}-{i}".encode() for i in range(keys)]
        rate = write_rate(pool, names, after_s=after_s)
        svc = MetadataService(pool, writer_alive=lambda host, gen: True)
        collections, frozen = [], []
        for _ in range(repeats):  # a full collection scans every object the server holds
            t = time.perf_counter()
            gc.collect()
            collections.append(time.perf_counter() - t)
        gc.freeze()  # what `beluga serve` does after recovery (collector.keep_collections_short)
        try:
            for _ in range(repeats):
                t = time.perf_counter()
                gc.collect()
                frozen.append(time.perf_counter() - t)
        finally:
            gc.unfreeze()
        ticks, scrubs = [], []
        for _ in range(50):
            t = time.perf_counter_ns()
            svc.tick()
            ticks.append(time.perf_counter_ns() - t)
            t = time.perf_counter_ns()
            svc.ix.scrub()
            scrubs.append(time.perf_counter_ns() - t)
        return {
            "pool_bytes": size,
            "blocks": pool.superblock.nblocks,
            "keys": keys,
            "index_buckets": svc.ix.nbuckets,
            "recovery_s": statistics.median(recovery),
            "recovery_us_per_block": 1e6 * statistics.median(recovery) / pool.superblock.nblocks,
            "first_write_before_s": statistics.median(first["before"]),
            "first_write_after_s": statistics.median(first["after"]),
            "takeover": rate,
            "alloc_us_per_key": 1e6 * filled["alloc_s"] / max(keys, 1),
            "commit_us_per_key": 1e6 * filled["commit_s"] / max(keys, 1),
            "full_gc_ms": 1e3 * statistics.median(collections),
            "full_gc_frozen_ms": 1e3 * statistics.median(frozen),
            "tick_us": statistics.median(ticks) / 1e3,
            "scrub_us": statistics.median(scrubs) / 1e3,
        }
    finally:
        pool.close()
        Pool.destroy(path)


def _scratch(size: int) -> tuple[str, Pool]:
    path = f"/dev/shm/beluga-scale-{uuid.uuid4().hex[:8]}"
    return path, Pool.create(path, size, geometry=GEOMETRY, coherence="native")


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
    path, pool = _scratch(size)
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
    path, pool = _scratch(size)
    sb = pool.superblock
    try:
        svc = MetadataService(pool, writer_alive=lambda host, gen: True)
        prefix = uuid.uuid4().hex[:8]
        fill(pool, svc, min(values, sb.nblocks), prefix)
        real = [f"{prefix}-{i}".encode() for i in range(min(values, sb.nblocks))]
        absent = [f"absent-{i}".encode() for i in range(len(real))]
        index = _core.Index(
            pool.memory,
            sb.index.offset,
            sb.nbuckets,
            sb.headers.offset,
            sb.payloads.offset,
            sb.block_size,
            sb.nblocks,
        )
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


def _fit(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares a, b of y = a + b x (b alone through the origin with one point)."""
    if len(x) < 2:
        return 0.0, y[0] / x[0]
    b, a = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return float(a), float(b)


def _at_pod(blocks: Sequence[int], seconds: Sequence[float]) -> float:
    """A time fitted as a + b blocks, at the pod's blocks (never below 0)."""
    a, b = _fit(blocks, seconds)
    return max(0.0, a + b * (POD_BYTES // GEOMETRY.block_size))


def run(
    sizes: Sequence[int],
    fraction: float = 0.5,
    hosts: Sequence[int] = HOSTS,
    loads: Sequence[float] = LOADS,
    *,
    writer_pool: int = WRITER_POOL,
    writer_batch: int = BATCH,
    read_pool: int = READ_POOL,
    through_rpc: bool = True,
    rate_after_s: float = 2.0,
) -> dict[str, Any]:
    """Measure every size, the writers against hosts and the reads against the index's
    load; fit and extrapolate each curve to the paper's 8 TB pod."""
    rows = [measure(s, fraction, after_s=rate_after_s) for s in sizes]
    by_hosts = writers(writer_pool, hosts, writer_batch) if hosts else []
    by_hosts_rpc = writers_rpc(writer_pool, hosts, writer_batch) if hosts and through_rpc else []
    by_load = reads(read_pool, loads) if loads else []
    pod_blocks = POD_BYTES // GEOMETRY.block_size
    pod_keys = int(pod_blocks * fraction)
    blocks = [r["blocks"] for r in rows]
    a, b = _fit(blocks, [r["recovery_s"] for r in rows])
    per_key = statistics.median(r["alloc_us_per_key"] + r["commit_us_per_key"] for r in rows)
    gc_a, gc_b = _fit([r["keys"] for r in rows], [r["full_gc_ms"] for r in rows])
    fz_a, fz_b = _fit([r["keys"] for r in rows], [r["full_gc_frozen_ms"] for r in rows])
    takeover = [r["takeover"] for r in rows]
    extrapolated = {
        "pod_bytes": POD_BYTES,
        "pod_blocks": pod_blocks,
        "pod_keys": pod_keys,
        "recovery_s": a + b * pod_blocks,
        "recovery_us_per_block": 1e6 * b,
        "fill_alloc_commit_s": per_key * pod_keys / 1e6,
        "full_gc_s": (gc_a + gc_b * pod_keys) / 1e3,
        "full_gc_frozen_s": max(0.0, (fz_a + fz_b * pod_keys) / 1e3),
        "tick_us": statistics.median(r["tick_us"] for r in rows),
        "takeover": {
            "first_write_before_s": _at_pod(blocks, [r["first_write_before_s"] for r in rows]),
            "first_write_after_s": _at_pod(blocks, [r["first_write_after_s"] for r in rows]),
            "full_throughput_s": _at_pod(blocks, [t["full_throughput_s"] for t in takeover]),
            "recovery_done_s": _at_pod(blocks, [t["recovery_done_s"] for t in takeover]),
            "keys_per_s_recovering_over_after": statistics.median(
                t["keys_per_s_recovering"] / t["keys_per_s_after"] for t in takeover
            ),
        },
        "full_scrub_pass_s": statistics.median(r["scrub_us"] for r in rows)
        * (rows[-1]["index_buckets"] / rows[-1]["blocks"])
        * pod_blocks
        / 64
        / 1e6,
    }
    if by_hosts:
        most = max(by_hosts, key=lambda r: r["hosts"])
        extrapolated["writers"] = {
            # one server serves every host in turn: its keys/s is the pod's, whatever the hosts
            "hosts": most["hosts"],
            "keys_per_s": most["keys_per_s"],
            "fill_s": pod_keys / most["keys_per_s"],
            "pod_hosts": POD_HOSTS,
            # each of the pod's hosts waits behind the others' batches: p99 grows with hosts
            "alloc_batch_p99_us": most["alloc_batch_p99_us"] * POD_HOSTS / most["hosts"],
            "commit_batch_p99_us": most["commit_batch_p99_us"] * POD_HOSTS / most["hosts"],
        }
    if by_hosts_rpc:
        most = max(by_hosts_rpc, key=lambda r: r["hosts"])
        extrapolated["writers_rpc"] = {
            "hosts": most["hosts"],
            "keys_per_s": most["keys_per_s"],
            "fill_s": pod_keys / most["keys_per_s"],
        }
    if by_load:
        # the pod's index holds one key a value in >= one bucket a block (3 slots each)
        pod_load = fraction / SLOTS
        at = [r["load"] for r in by_load]  # measured in rising order; held flat outside them
        extrapolated["reads"] = {
            "pod_load": pod_load,
            **{
                k: float(np.interp(pod_load, at, [r[k] for r in by_load]))
                for k in ("hit_p50_us", "hit_p99_us", "miss_p50_us", "miss_p99_us")
            },
        }
    return {
        "rows": rows,
        "writers": by_hosts,
        "writers_rpc": by_hosts_rpc,
        "reads": by_load,
        "extrapolated": extrapolated,
        "assumptions": list(ASSUMPTIONS),
    }


def columns() -> list[tuple[str, str]]:
    return [
        ("pool", "pool"),
        ("blocks", "blocks"),
        ("keys", "keys"),
        ("recovery_s", "recovery s"),
        ("recovery_us_per_block", "µs/block"),
        ("first_write_before_s", "1st write s (before)"),
        ("first_write_after_s", "1st write s (after)"),
        ("alloc_us_per_key", "ALLOC µs/key"),
        ("commit_us_per_key", "COMMIT µs/key"),
        ("full_gc_ms", "full GC ms"),
        ("full_gc_frozen_ms", "frozen ms"),
        ("tick_us", "tick µs"),
        ("scrub_us", "scrub(64) µs"),
    ]


def _table(rows: Sequence[dict[str, Any]], cols: Sequence[tuple[str, str, str]]) -> list[str]:
    """Plain text rows of (key, heading, format) columns."""
    cells = [[h for _, h, _ in cols]] + [[format(r[k], f) for k, _, f in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]


def format_extrapolation(doc: dict[str, Any]) -> str:
    e = doc["extrapolated"]
    t = e["takeover"]
    lines = ["takeover against pool size (writers overwriting stored keys meanwhile):"]
    lines += _table(
        [{**r["takeover"], "blocks": r["blocks"]} for r in doc["rows"]],
        [
            ("blocks", "blocks", ",d"),
            ("first_write_s", "1st write s", ".4f"),
            ("keys_per_s_recovering", "keys/s recovering", ",.0f"),
            ("keys_per_s_after", "keys/s after", ",.0f"),
            ("full_throughput_s", "full at s", ".3f"),
            ("recovery_done_s", "recovered at s", ".3f"),
        ],
    )
    if doc.get("writers"):
        lines += ["ALLOC/COMMIT against hosts writing at once (service driven directly):"]
        lines += _table(
            doc["writers"],
            [
                ("hosts", "hosts", "d"),
                ("keys_per_s", "keys/s", ",.0f"),
                ("alloc_batch_p50_us", "ALLOC p50 µs", ".0f"),
                ("alloc_batch_p99_us", "ALLOC p99 µs", ".0f"),
                ("commit_batch_p50_us", "COMMIT p50 µs", ".0f"),
                ("commit_batch_p99_us", "COMMIT p99 µs", ".0f"),
            ],
        )
    if doc.get("writers_rpc"):
        lines += ["put_batch through the real server against hosts writing at once (threads):"]
        lines += _table(
            doc["writers_rpc"],
            [
                ("hosts", "hosts", "d"),
                ("keys_per_s", "keys/s", ",.0f"),
                ("put_batch_p50_us", "put_batch p50 µs", ",.0f"),
                ("put_batch_p99_us", "put_batch p99 µs", ",.0f"),
            ],
        )
    if doc.get("reads"):
        lines += ["one-sided reads against the pool index's load:"]
        lines += _table(
            doc["reads"],
            [
                ("load", "load", ".2f"),
                ("hit_p50_us", "hit p50 µs", ".2f"),
                ("hit_p99_us", "hit p99 µs", ".2f"),
                ("miss_p50_us", "miss p50 µs", ".2f"),
                ("miss_p99_us", "miss p99 µs", ".2f"),
                ("insert_failures", "full", "d"),
            ],
        )
    lines += [
        f"extrapolated to {e['pod_bytes'] / TiB:g} TiB ({e['pod_blocks']:,} blocks, "
        f"{e['pod_keys']:,} keys):",
        f"  recovery {e['recovery_s']:,.0f} s ({e['recovery_us_per_block']:.2f} µs a block)",
        f"  takeover to the first acknowledged write: {t['first_write_before_s']:,.3f} s "
        f"recovering at once (before), {t['first_write_after_s']:,.3f} s recovering while "
        f"serving (after); writes at {t['keys_per_s_recovering_over_after']:.0%} of their "
        f"rate while it recovers, at 90% for good after {t['full_throughput_s']:,.1f} s; "
        f"recovery done after {t['recovery_done_s']:,.0f} s",
        f"  filling it through ALLOC + COMMIT, server side: {e['fill_alloc_commit_s']:,.0f} s",
        f"  one full garbage collection: {e['full_gc_s']:,.1f} s (a pause of every RPC; Python "
        "starts one when enough objects outlived the younger ones); "
        f"{e['full_gc_frozen_s']:,.2f} s with what recovery built frozen out of the collector, "
        "as `beluga serve` does",
        f"  one tick {e['tick_us']:.0f} µs; one full pass of the index scrub "
        f"{e['full_scrub_pass_s']:,.1f} s of server CPU (64 buckets a tick)",
    ]
    if "writers" in e:
        w = e["writers"]
        lines.append(
            f"  writers: {w['keys_per_s']:,.0f} keys/s for the pod whatever its hosts (fill "
            f"{w['fill_s']:,.0f} s); with {w['pod_hosts']} hosts a batch's p99 ALLOC "
            f"{w['alloc_batch_p99_us']:,.0f} µs, COMMIT {w['commit_batch_p99_us']:,.0f} µs"
        )
    if "writers_rpc" in e:
        w = e["writers_rpc"]
        lines.append(
            f"  through the server with {w['hosts']} hosts: {w['keys_per_s']:,.0f} keys/s "
            f"end to end (fill {w['fill_s']:,.0f} s)"
        )
    if "reads" in e:
        r = e["reads"]
        lines.append(
            f"  reads at the pod's index load {r['pod_load']:.2f} (interpolated): hit p50 "
            f"{r['hit_p50_us']:.2f} µs, p99 {r['hit_p99_us']:.2f} µs; miss p50 "
            f"{r['miss_p50_us']:.2f} µs, p99 {r['miss_p99_us']:.2f} µs"
        )
    lines += ["assumptions:", *[f"  - {a}" for a in doc["assumptions"]]]
    return "\n".join(lines)


DEFAULT_SIZES = (256 * MiB, 1 * GiB)
