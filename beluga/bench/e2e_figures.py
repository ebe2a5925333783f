"""The figures of an end-to-end pass, and their medians over repetitions.

Per pass: hits (beside the best a cache that kept every block could do),
time to first token, the mean of each step, load imbalance, and the blocks
computed more than once across engines with what they cost
(:func:`pass_row`).  Over repetitions: each number's median with its range
(:func:`median_fields`), and each scheduler's pass-2 over pass-1 TTFT
against its target (:func:`targets`, :func:`median_targets`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from beluga.bench.e2e_settings import Settings
from beluga.bench.stats import percentile
from beluga.serving.cluster import Record
from beluga.serving.trace import (
    TraceRequest,
    TraceShape,
)

TARGET_PASS2_RATIO = 0.2  # pass-2 mean TTFT at most 20% of pass 1's


def blocks_needed(trace: Sequence[TraceRequest], shape: TraceShape, block_tokens: int) -> int:
    """Distinct full engine blocks a trace stores: each document's once, then each question's."""
    shared = shape.context_tokens // block_tokens
    documents = len({r.document for r in trace})
    return documents * shared + sum(len(r.token_ids) // block_tokens - shared for r in trace)


def summarize(records: Sequence[Record], engines: int, block_tokens: int = 16) -> dict[str, Any]:
    """One row of the table: hits, TTFT, the mean of each step, load imbalance, and the
    blocks engines computed that another had stored, or was storing, already."""
    ttft = sorted(r.ttft for r in records)
    busy = np.zeros(engines)
    for r in records:
        busy[r.engine] += r.served.timings.busy
    makespan = max(r.end for r in records)
    tokens = sum(r.served.num_tokens for r in records)

    def mean(values: Any) -> float:
        return float(np.mean(list(values)))

    return {
        "requests": len(records),
        "hit_ratio": sum(r.served.cached_tokens for r in records) / tokens,
        # a cache that kept every block: all full blocks but the one holding the last token
        "best_hit_ratio": sum((r.served.num_tokens - 1) // block_tokens for r in records)
        * block_tokens
        / tokens,
        "ttft_mean_s": mean(ttft),
        "ttft_p99_s": percentile(ttft, 99),
        "queue_mean_s": mean(r.queue for r in records),
        "lookup_mean_ms": 1e3 * mean(r.served.timings.lookup for r in records),
        "load_mean_ms": 1e3 * mean(r.served.timings.load for r in records),
        "compute_mean_s": mean(r.served.timings.compute for r in records),
        "save_mean_ms": 1e3 * mean(r.served.timings.save for r in records),
        "saved_blocks": sum(r.served.saved_blocks for r in records),
        "duplicate_blocks": sum(r.served.duplicate_blocks for r in records),
        "refused_blocks": sum(r.served.refused_blocks for r in records),
        "busy_s": busy.tolist(),
        "imbalance": float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
        "makespan_s": makespan,
        "qps": len(records) / makespan,
        # what the engines could sustain: requests per second of their busy time, all engines
        "service_qps": len(records) * engines / busy.sum() if busy.sum() > 0 else None,
    }


def duplicate_cost(
    records: Sequence[Record], documents: Sequence[int], block_tokens: int
) -> dict[str, Any]:
    """What the blocks computed more than once cost, and what waiting for them would save.

    A request that computed blocks another engine had committed, or was
    writing, when it saved (``Served.duplicate_blocks``: a burst of one
    document routed by load alone) spent on them its compute time's share of
    the tokens it computed.  Were it to wait for the first writer of its
    document to commit them (a wait-for-pending the store does not have), it
    would load them instead, at this pass's load time per block, once that
    writer was done: the ``wait_*`` estimates.  They leave out what the freed
    engine time would do for the requests behind (less queueing), so they
    understate the saving under load.  ``documents[i]``: request ``i``'s document.
    """
    loaded = sum(r.served.cached_tokens // block_tokens for r in records)
    load_s = sum(r.served.timings.load for r in records)
    per_block = load_s / loaded if loaded else None
    first_writer: dict[int, Record] = {}  # document: the first request to commit its blocks
    for r in records:
        if r.served.saved_blocks and not r.served.duplicate_blocks:
            doc = documents[r.index]
            if doc not in first_writer or r.end < first_writer[doc].end:
                first_writer[doc] = r
    twice = [r for r in records if r.served.duplicate_blocks]
    spent = saved = 0.0
    waited = []
    for r in twice:
        blocks = r.served.duplicate_blocks
        computed = r.served.num_tokens - r.served.cached_tokens
        own = r.served.timings.compute * min(1.0, blocks * block_tokens / computed)
        spent += own
        if per_block is None:
            continue
        saved += own - blocks * per_block
        writer = first_writer.get(documents[r.index])
        if writer is not None:
            ready = max(r.start, writer.end) + r.served.timings.lookup + blocks * per_block
            waited.append(ready + r.served.timings.compute - own - r.arrival)
    busy = sum(r.served.timings.busy for r in records)
    return {
        "duplicate_requests": len(twice),
        "duplicate_compute_s": spent,
        "duplicate_share_of_busy": spent / busy if busy > 0 else 0.0,
        "duplicate_ttft_mean_s": float(np.mean([r.ttft for r in twice])) if twice else None,
        "wait_ttft_mean_s": float(np.mean(waited)) if waited else None,
        "wait_would_save_engine_s": saved if twice and per_block is not None else None,
    }


def pass_row(
    records: Sequence[Record],
    trace: Sequence[TraceRequest],
    settings: Settings,
    counters: dict[str, int | None],
) -> dict[str, Any]:
    """:func:`summarize` and :func:`duplicate_cost` of one pass, with the store's counts."""
    bs = settings.shape.block_tokens
    return {
        **summarize(records, settings.engines, bs),
        **duplicate_cost(records, [r.document for r in trace], bs),
        "evictions": counters.get("evictions"),
        "store_duplicate_writes_skipped": counters.get("duplicate_writes_skipped"),
    }


def spread(values: Sequence[float | None]) -> dict[str, Any] | None:
    """The median and range of one figure over repetitions (None where none was measured)."""
    have = [float(v) for v in values if v is not None]
    if not have:
        return None
    return {"median": float(np.median(have)), "min": min(have), "max": max(have), "runs": have}


def median_fields(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One dict of the same shape: numbers are medians over ``items`` (lists and dicts
    element by element), anything else the first item's; ``ranges`` holds each top-level
    number's [min, max]."""
    out: dict[str, Any] = {}
    ranges: dict[str, list[float]] = {}
    for key, first in items[0].items():
        if key == "ranges":
            continue
        values = [item.get(key) for item in items]
        if _number(first) or first is None:
            s = spread(values)
            out[key] = None if s is None else s["median"]
            if s is not None:
                ranges[key] = [s["min"], s["max"]]
                if all(isinstance(v, int) for v in values) and s["median"].is_integer():
                    out[key] = int(s["median"])  # counts stay counts
        elif isinstance(first, list) and first and all(_number(v) for v in first):
            out[key] = np.median(np.array(values, dtype=float), axis=0).tolist()
        elif isinstance(first, dict):
            out[key] = median_fields(values)
            out[key].pop("ranges")
        else:
            out[key] = first
    return {**out, "ranges": ranges}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def median_rows(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each row's median over repetitions (every run's rows in the same order)."""
    return [median_fields([rows[i] for rows in runs]) for i in range(len(runs[0]))]


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pass-2 mean TTFT over pass 1's, per scheduler, against the 20% target."""
    out = []
    by_key = {(r["scheduler"], r["pass"]): r for r in rows}
    for scheduler in dict.fromkeys(r["scheduler"] for r in rows):
        first, second = by_key.get((scheduler, 1)), by_key.get((scheduler, 2))
        if first and second:
            ratio = second["ttft_mean_s"] / first["ttft_mean_s"]
            out.append(
                {
                    "scheduler": scheduler,
                    "pass2_over_pass1_ttft": ratio,
                    "target": TARGET_PASS2_RATIO,
                    "met": ratio <= TARGET_PASS2_RATIO,
                }
            )
    return out


def median_targets(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each scheduler's target over repetitions: the median ratio, its range, and the
    verdict on the median."""
    out = []
    for i, first in enumerate(runs[0]):
        s = spread([run[i]["pass2_over_pass1_ttft"] for run in runs])
        assert s is not None
        out.append(
            {
                **first,
                "pass2_over_pass1_ttft": s["median"],
                "range": [s["min"], s["max"]],
                "met": s["median"] <= first["target"],
            }
        )
    return out
