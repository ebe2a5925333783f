"""One pool of a size, filled: the server's recovery, takeover, fill, full GC and tick.

(:func:`measure`; the package's doc says what each figure is.)  A server that takes over
is a process of its own, so each recovery and each takeover is measured in a new process
(``_fresh``): every object it builds is in memory it takes from the system then.  In the
process that filled the pool the last server's objects would still be there (cycles wait
for a collection), or, collected, would leave the allocator's memory warm: recovery took
~2x as long the first way, ~0.8x the second (2026-12-07, 195,776 blocks).
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from beluga.bench.scale.pools import BATCH, GEOMETRY, WRITER, fill, request
from beluga.coherence import digest
from beluga.kv import protocol as p
from beluga.pool import Pool
from beluga.server.collector import keep_collections_short
from beluga.server.service import MetadataService


def _write_one(pool: Pool, svc: MetadataService, key: bytes) -> None:
    """ALLOC, publish and COMMIT of one one-block value: the first write of a takeover."""
    sb, d = pool.superblock, digest(key)
    (g,) = p.decode_grants(svc.op_alloc(request(p.StoreOp.ALLOC, p.encode_alloc([(d, 64, 1)]))))
    pool.memory.publish(
        sb.block_header_offset(g.block),
        sb.block_payload_offset(g.block),
        d,
        g.version,
        d * 4,
        writer=WRITER[0],
        writer_gen=WRITER[1],
    )
    answer = svc.op_commit(request(p.StoreOp.COMMIT, p.encode_commit([(d, g.block, g.version)])))
    if p.decode_flags(answer) != [True]:
        raise AssertionError("the first write after a takeover was refused")


def _remove(svc: MetadataService, keys: Sequence[bytes]) -> None:
    svc.op_remove(request(p.StoreOp.REMOVE, p.encode_digests([digest(k) for k in keys])))


#: the longest a measurement in a process of its own may take (a 12 GiB pool's: seconds)
FRESH_TIMEOUT_S = 1800.0
_SPAWN = multiprocessing.get_context("spawn")


def _run_child(conn: Connection, fn: Callable[..., Any], args: tuple) -> None:
    try:
        conn.send((True, fn(*args)))
    except BaseException as e:  # the parent raises it: a child's traceback alone is lost
        conn.send((False, f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def _fresh(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a new process, as a server that takes over runs (the module doc);
    its result, or RuntimeError with its error.  The child is gone when this returns."""
    here, there = _SPAWN.Pipe(duplex=False)
    child = _SPAWN.Process(target=_run_child, args=(there, fn, args), daemon=True)
    child.start()
    there.close()
    try:
        if not here.poll(FRESH_TIMEOUT_S):
            raise TimeoutError(f"a measurement took over {FRESH_TIMEOUT_S:.0f} s")
        ok, value = here.recv()
    except EOFError:
        raise RuntimeError(f"a measurement's process died (exit {child.exitcode})") from None
    finally:
        here.close()
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()
    if not ok:
        raise RuntimeError(f"a measurement failed: {value}")
    return value


#: recovery_lost_s: a crash lost the pool index's slot of one key in this many
LOST_EVERY = 1000


def _recover_once(path: str) -> tuple[float, int]:
    """A takeover that recovers at once: its seconds, and the keys it found."""
    pool = Pool.attach(path, coherence="native")
    try:
        t = time.perf_counter()
        svc = MetadataService(pool, writer_alive=lambda host, gen: True)
        return time.perf_counter() - t, len(svc.index)
    finally:
        pool.close()


def _recover_after_lost(path: str, every: int) -> tuple[float, int]:
    """A takeover that recovers at once after a crash lost the pool index's slot of one
    key in ``every`` (their COMMITs' commit words landed, their slots did not): its
    seconds, and the keys it named again.  The slots are dropped by a server first, so
    each run starts from the same state."""
    pool = Pool.attach(path, coherence="native")
    try:
        svc = MetadataService(pool, writer_alive=lambda host, gen: True)
        lost = list(itertools.islice(iter(svc.index), 0, None, every))
        for d in lost:
            svc.ix.drop(d)
        pool.memory.sfence()
        del svc
        gc.collect()
        t = time.perf_counter()
        svc = MetadataService(pool, writer_alive=lambda host, gen: True)
        took = time.perf_counter() - t
        if svc.counters["index_repaired"] != len(lost):
            raise AssertionError(
                f"recovery named {svc.counters['index_repaired']} keys of the {len(lost)} lost"
            )
        return took, len(lost)
    finally:
        pool.close()


def _first_write(path: str, key: bytes, recover_now: bool) -> float:
    """Takeover to its first acknowledged write; the write is removed again after."""
    pool = Pool.attach(path, coherence="native")
    try:
        t = time.perf_counter()
        svc = MetadataService(pool, writer_alive=lambda host, gen: True, recover_now=recover_now)
        _write_one(pool, svc, key)
        took = time.perf_counter() - t
        svc.recover()
        _remove(svc, [key])
        return took
    finally:
        pool.close()


def first_writes(path: str, repeats: int) -> dict[str, list[float]]:
    """Takeover to the first acknowledged write, recovering at once (before) and while
    serving (after), alternated, each in a process of its own."""
    before, after = [], []
    for r in range(repeats):
        for mode, times in ((True, before), (False, after)):
            times.append(_fresh(_first_write, path, f"first-{r}-{mode}".encode(), mode))
    return {"before": before, "after": after}


def _takeover_rate(path: str, prefix: str, keys: int, after_s: float) -> dict[str, Any]:
    keep_collections_short()  # as `beluga serve` does: full collections scan what is new
    pool = Pool.attach(path, coherence="native")
    try:
        names = [f"{prefix}-{i}".encode() for i in range(keys)]
        return write_rate(pool, names, after_s=after_s)
    finally:
        pool.close()


def write_rate(
    pool: Pool, names: Sequence[bytes], window_s: float = 0.25, after_s: float = 2.0
) -> dict[str, Any]:
    """Writers overwriting stored keys from a takeover on (the module doc, "takeover").

    Keys are drawn in a shuffled order, each once a pass: at the pod nearly every key
    written while the server recovers is one no write has touched since the takeover (and
    the scan has not reached), so a draw with replacement, meeting keys settled before,
    would flatter the rate while recovering.  (With replacement until 2026-12-07.)"""
    sb, mem = pool.superblock, pool.memory
    rng = np.random.default_rng(36)
    size = min(BATCH, len(names))
    order, at = rng.permutation(len(names)), 0
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
        if at + size > len(order):  # a new pass
            order, at = rng.permutation(len(names)), 0
        keys = [names[i] for i in order[at : at + size].tolist()]
        at += size
        digests = [digest(k) for k in keys]
        payload = p.encode_alloc([(d, 64, 1) for d in digests])
        grants = p.decode_grants(svc.op_alloc(request(p.StoreOp.ALLOC, payload)))
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
        if not all(p.decode_flags(svc.op_commit(request(p.StoreOp.COMMIT, payload)))):
            raise AssertionError("an overwrite was refused during recovery")
        marks.append((time.perf_counter() - t0, len(keys)))
        if now >= next_tick:  # the server's loop ticks every refresh (0.1 s)
            svc.tick()
            next_tick = now + 0.1
        svc.recover_some(served=1)
    assert done_at is not None
    return {**_rates(marks, done_at, window_s), "recovery_share": svc.recovery_share}


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
        del svc
        recovery = []
        for _ in range(repeats):
            seconds, found = _fresh(_recover_once, path)
            if found != keys:
                raise AssertionError(f"recovery found {found} keys of the {keys} stored")
            recovery.append(seconds)
        lost = [_fresh(_recover_after_lost, path, LOST_EVERY) for _ in range(repeats)]
        first = first_writes(path, repeats)
        rate = _fresh(_takeover_rate, path, prefix, keys, after_s)
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
            "recovery_lost_s": statistics.median(s for s, _ in lost),
            "lost_insertions": lost[0][1],
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
