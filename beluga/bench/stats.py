"""Timing helpers shared by every benchmark: percentiles, never bare means."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

from beluga._native import _core


def time_calls(fn: Callable[[], object], iterations: int, warmup: int = 10) -> list[int]:
    """Wall time of each call in ns (after a warm-up)."""
    for _ in range(warmup):
        fn()
    clock = time.perf_counter_ns
    out = []
    for _ in range(iterations):
        start = clock()
        fn()
        out.append(clock() - start)
    return out


def iterations_for(
    nbytes: int, budget_bytes: int = 256 << 20, lo: int = 50, hi: int = 20000
) -> int:
    """Enough repetitions for stable percentiles without moving more than a budget."""
    return max(lo, min(hi, budget_bytes // max(nbytes, 1)))


def percentile(sorted_ns: Sequence[int], q: float) -> float:
    """Nearest-rank percentile of sorted samples, in ns."""
    if not sorted_ns:
        raise ValueError("no samples")
    k = min(len(sorted_ns) - 1, max(0, round(q / 100 * len(sorted_ns)) - 1))
    return float(sorted_ns[k])


def summarize(samples_ns: Sequence[int], nbytes: int = 0) -> dict[str, float]:
    """p50/p99 in µs, and throughput at the median when bytes moved are known."""
    s = sorted(samples_ns)
    p50 = percentile(s, 50)
    out = {"p50_us": p50 / 1e3, "p99_us": percentile(s, 99) / 1e3, "n": float(len(s))}
    if nbytes:
        out["gbps_at_p50"] = nbytes / p50 if p50 else float("inf")
    return out


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "selected": _core.selected(),
    }


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A plain aligned text table; columns are (key, heading)."""
    cells = [[h for _, h in columns]]
    for row in rows:
        cells.append([_fmt(row.get(k)) for k, _ in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if v < 100 else f"{v:.1f}"
    return "" if v is None else str(v)


def write_json(doc: dict[str, Any], path: str | None) -> str:
    """Serialise a benchmark document; write it to ``path`` when given."""
    text = json.dumps(doc, indent=2, sort_keys=True)
    if path and path != "-":
        with open(path, "w") as f:
            f.write(text + "\n")
    return text
