"""``beluga bench memops``: the coherence recipes by access size, native mode.

Every method moves the same bytes between a local buffer and the pool, and
the plain memcpy into the pool is measured beside it in the same run:

memcpy           plain stores into the pool (the baseline; no coherence at all;
                 in native mode Memory.store is exactly memcpy); the same place
                 every time, so large copies land in a warm cache
memcpy_cold      the same memcpy, each call to the next place of a ring that
                 spans the data area (up to 64 MiB), as pool writes really land
load             plain loads from the pool (may hit this host's cache: no coherence)
store_flush      stores, then CLFLUSHOPT each line, then SFENCE
nt_store         non-temporal stores, then SFENCE
invalidate_load  CLFLUSHOPT each line, MFENCE, then loads
publish          the block protocol's write side (header, payload, CRC32C)
read_validated   the block protocol's read side (two header checks, CRC32C)

Times are per call from Python, so they include the call itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from beluga.bench.stats import iterations_for, summarize, time_calls
from beluga.coherence import Memory, digest
from beluga.pool import Pool
from beluga.units import human_bytes

DEFAULT_SIZES = [64 << s for s in range(0, 17, 2)]  # 64 B .. 4 MiB
METHODS = [
    "memcpy",
    "memcpy_cold",
    "load",
    "store_flush",
    "nt_store",
    "invalidate_load",
    "publish",
    "read_validated",
]
_KEY = digest(b"bench-memops")


def _methods(
    mem: Memory, src: np.ndarray, dst: np.ndarray, hdr: int, payload: int, cap: int
) -> dict[str, Callable[[], object]]:
    n = len(src)
    span = max(n, min(cap, 64 << 20))
    mem.store(payload, bytes(span))  # fault the ring's pages in before anything is timed
    ring = itertools.cycle(range(payload, payload + span - n + 1, n))

    def memcpy_cold() -> None:
        mem.store(next(ring), src)

    def store_flush() -> None:
        mem.store(payload, src)
        mem.flush(payload, n)
        mem.sfence()

    def nt_store() -> None:
        mem.nt_store(payload, src)
        mem.sfence()

    def invalidate_load() -> None:
        mem.invalidate(payload, n)
        mem.mfence()
        mem.load_into(payload, dst)

    mem.publish(hdr, payload, _KEY, 1, src)
    return {
        "memcpy": lambda: mem.store(payload, src),
        "memcpy_cold": memcpy_cold,
        "load": lambda: mem.load_into(payload, dst),
        "store_flush": store_flush,
        "nt_store": nt_store,
        "invalidate_load": invalidate_load,
        "publish": lambda: mem.publish(hdr, payload, _KEY, 1, src),
        "read_validated": lambda: mem.read_validated(hdr, payload, cap, _KEY, 1, dst),
    }


def run(
    pool: Pool,
    sizes: list[int] | None = None,
    methods: list[str] | None = None,
    budget_bytes: int = 256 << 20,
) -> dict[str, Any]:
    """Measure every method at every size; returns rows and named figures."""
    sizes = sizes or DEFAULT_SIZES
    methods = methods or METHODS
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown memops methods {sorted(unknown)}; choose from {METHODS}")
    mem = pool.memory
    if mem.mode != "native":
        raise ValueError("memops measures the native instructions; attach with coherence=native")
    sb = pool.superblock
    largest = max(sizes)
    if largest > sb.payloads.length:
        raise ValueError(
            f"size {largest} does not fit the pool's {sb.payloads.length}-byte data area"
        )
    hdr, payload = sb.headers.offset, sb.payloads.offset
    rng = np.random.default_rng(0)
    rows, figures = [], {}
    for n in sizes:
        src = rng.integers(0, 256, n, dtype=np.uint8)
        dst = np.empty(n, dtype=np.uint8)
        calls = _methods(mem, src, dst, hdr, payload, sb.payloads.length)
        iters = iterations_for(n, budget_bytes)
        base = None
        for name in methods:
            s = summarize(time_calls(calls[name], iters), n)
            base = s["p50_us"] if name == "memcpy" else base
            row = {"size": human_bytes(n), "bytes": n, "method": name, **s}
            if base:
                row["vs_memcpy"] = s["p50_us"] / base
            rows.append(row)
            for k, v in s.items():
                if k != "n":
                    figures[f"memops.{name}.{human_bytes(n)}.{k}"] = v
    return {"rows": rows, "figures": figures}


COLUMNS = [
    ("size", "size"),
    ("method", "method"),
    ("p50_us", "p50 µs"),
    ("p99_us", "p99 µs"),
    ("gbps_at_p50", "GB/s@p50"),
    ("vs_memcpy", "x memcpy"),
]
