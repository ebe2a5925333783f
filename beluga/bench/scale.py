"""``beluga bench scale``: how the metadata server's costs grow with the pool (partial).

Measured here, in one process, with the metadata service driven directly (no
RPC, as tests/test_service.py drives it), on pools of a few sizes filled to
a fraction with one-block values:

recovery      a restarted server's ``recover()``: load and parse every block
              header and commit word, rebuild the index and the allocator,
              repair the pool index; against block count and key count
fill          ALLOC and COMMIT batches of 256 (the server's side only: the
              payload publish between them is the writer's and is not timed)
tick          one ``tick()`` of the server (hint folding, one index scrub
              step of 64 buckets, lease checks) and the scrub step alone

Each curve is fitted as cost = a + b x (least squares over the sizes run)
and extrapolated to the paper's pod: 8 TB of 64 KiB blocks (128 M blocks),
with the assumptions stated in the report (``ASSUMPTIONS``).  Not measured
yet (issue 22): ALLOC/COMMIT against 1..16 writing hosts, read p50/p99
against the index load factor.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from beluga.coherence import digest
from beluga.kv import protocol as p
from beluga.kv.service import MetadataService
from beluga.pool import Geometry, Pool
from beluga.rpc import Request
from beluga.units import GiB, MiB, TiB

GEOMETRY = Geometry(max_hosts=16)
BATCH = 256
WRITER = (1, 1)
POD_BYTES = 8 * TiB
ASSUMPTIONS = (
    "recovery and fill cost grow linearly in blocks and keys (the fit's b); the fit is over "
    "pools of this machine's sizes, so caches that 8 TB would overflow (the header table is "
    "64 B a block: 8 GiB at 128 M blocks, loaded into one Python list) make the real figure "
    "larger, not smaller",
    "recovery runs single-threaded in Python at this machine's speed (2 shared vCPUs)",
    "readers do not wait for recovery: they read the pool index with loads; writers wait "
    "(ALLOC and COMMIT are served after recover() returns)",
    "a tick's cost does not grow with the pool: it scrubs a fixed 64 buckets, so a full "
    "scrub pass takes (buckets / 64) ticks, which does grow linearly",
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


def measure(size: int, fraction: float, repeats: int = 3) -> dict[str, Any]:
    """One pool of ``size`` bytes filled to ``fraction`` of its blocks: every figure."""
    path = f"/dev/shm/beluga-scale-{uuid.uuid4().hex[:8]}"
    pool = Pool.create(path, size, geometry=GEOMETRY, coherence="native")
    try:
        svc = MetadataService(pool, writer_alive=lambda host, gen: True)
        keys = int(pool.superblock.nblocks * fraction)
        filled = fill(pool, svc, keys, uuid.uuid4().hex[:8])
        recovery = []
        for _ in range(repeats):
            del svc  # the last server's teardown is not the next one's recovery
            t = time.perf_counter()
            svc = MetadataService(pool, writer_alive=lambda host, gen: True)
            recovery.append(time.perf_counter() - t)
        if len(svc.index) != keys:
            raise AssertionError(f"recovery found {len(svc.index)} keys of the {keys} stored")
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
            "alloc_us_per_key": 1e6 * filled["alloc_s"] / max(keys, 1),
            "commit_us_per_key": 1e6 * filled["commit_s"] / max(keys, 1),
            "tick_us": statistics.median(ticks) / 1e3,
            "scrub_us": statistics.median(scrubs) / 1e3,
        }
    finally:
        pool.close()
        Pool.destroy(path)


def _fit(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares a, b of y = a + b x (b alone through the origin with one point)."""
    if len(x) < 2:
        return 0.0, y[0] / x[0]
    b, a = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return float(a), float(b)


def run(sizes: Sequence[int], fraction: float = 0.5) -> dict[str, Any]:
    """Measure every size; fit and extrapolate each curve to the paper's 8 TB pod."""
    rows = [measure(s, fraction) for s in sizes]
    pod_blocks = POD_BYTES // GEOMETRY.block_size
    pod_keys = int(pod_blocks * fraction)
    blocks = [r["blocks"] for r in rows]
    a, b = _fit(blocks, [r["recovery_s"] for r in rows])
    per_key = statistics.median(r["alloc_us_per_key"] + r["commit_us_per_key"] for r in rows)
    extrapolated = {
        "pod_bytes": POD_BYTES,
        "pod_blocks": pod_blocks,
        "pod_keys": pod_keys,
        "recovery_s": a + b * pod_blocks,
        "recovery_us_per_block": 1e6 * b,
        "fill_alloc_commit_s": per_key * pod_keys / 1e6,
        "tick_us": statistics.median(r["tick_us"] for r in rows),
        "full_scrub_pass_s": statistics.median(r["scrub_us"] for r in rows)
        * (rows[-1]["index_buckets"] / rows[-1]["blocks"])
        * pod_blocks
        / 64
        / 1e6,
    }
    return {"rows": rows, "extrapolated": extrapolated, "assumptions": list(ASSUMPTIONS)}


def columns() -> list[tuple[str, str]]:
    return [
        ("pool", "pool"),
        ("blocks", "blocks"),
        ("keys", "keys"),
        ("recovery_s", "recovery s"),
        ("recovery_us_per_block", "µs/block"),
        ("alloc_us_per_key", "ALLOC µs/key"),
        ("commit_us_per_key", "COMMIT µs/key"),
        ("tick_us", "tick µs"),
        ("scrub_us", "scrub(64) µs"),
    ]


def format_extrapolation(doc: dict[str, Any]) -> str:
    e = doc["extrapolated"]
    lines = [
        f"extrapolated to {e['pod_bytes'] / TiB:g} TiB ({e['pod_blocks']:,} blocks, "
        f"{e['pod_keys']:,} keys):",
        f"  recovery {e['recovery_s']:,.0f} s ({e['recovery_us_per_block']:.2f} µs a block)",
        f"  filling it through ALLOC + COMMIT, server side: {e['fill_alloc_commit_s']:,.0f} s",
        f"  one tick {e['tick_us']:.0f} µs; one full pass of the index scrub "
        f"{e['full_scrub_pass_s']:,.1f} s of server CPU (64 buckets a tick)",
        "assumptions:",
        *[f"  - {a}" for a in doc["assumptions"]],
    ]
    return "\n".join(lines)


DEFAULT_SIZES = (256 * MiB, 1 * GiB)
