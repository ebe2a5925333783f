"""Every figure measured, each curve fitted and extrapolated to the paper's pod, with the
assumptions stated (:func:`run`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from beluga.bench.scale.clients import HOSTS, LOADS, reads, writers, writers_rpc
from beluga.bench.scale.keyindex import adopt_us, evict_us
from beluga.bench.scale.pools import BATCH, GEOMETRY
from beluga.bench.scale.server import LOST_EVERY, measure
from beluga.server.index import SLOTS
from beluga.server.recovery_state import RECOVERY_REGION
from beluga.units import GiB, MiB, TiB

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
    "full throughput: writers overwrite stored one-block keys in batches of "
    f"{BATCH}, in a shuffled order, each key once a pass (at the pod nearly every key "
    "written while recovering is one nothing touched since the takeover; the fill stays "
    "put), the service driven directly by one thread, with "
    "recover_some() between batches as the server's loop calls it (recovery takes its "
    "share, RECOVERY_SHARE, of a busy loop's time, at most RECOVERY_SLICE_S between two "
    "polls: one batch of one writer is shorter; 16 hosts' polls can be longer, and then "
    "recovery gets less), the collector kept short as `beluga serve` keeps it; the steady "
    "rate is the rate after recovery is done; "
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
    "a key adopted ahead of the scan (index_adopt) and an eviction (index_evict, what it "
    "spends in the index): measured, not fitted, in a key index "
    "holding as many cold chunks as the pod has recovery regions (one key each: the "
    "order's structure pays for their count, not their size)",
    "full GC frozen: right after recovery, as `beluga serve` freezes what it built "
    "(collector.keep_collections_short); a running server's full collection then scans what "
    "was made since the last one, so its pause grows with the keys written between two, "
    "not with the keys held",
)


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
    regions = -(-rows[-1]["blocks"] // RECOVERY_REGION)  # the largest pool's, and the pod's
    pod_regions = pod_blocks // RECOVERY_REGION
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
        "recovery_lost_s": _at_pod(blocks, [r["recovery_lost_s"] for r in rows]),
        "lost_every": LOST_EVERY,
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
        **{
            name: {
                "measured_regions": regions,
                "measured_us": cost(regions),
                "pod_regions": pod_regions,
                "pod_us": cost(pod_regions),
            }
            for name, cost in (("index_adopt", adopt_us), ("index_evict", evict_us))
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


DEFAULT_SIZES = (256 * MiB, 1 * GiB)
