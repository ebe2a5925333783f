"""The scale benchmark in words: its table's columns and the extrapolation's summary."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from beluga.units import TiB


def columns() -> list[tuple[str, str]]:
    return [
        ("pool", "pool"),
        ("blocks", "blocks"),
        ("keys", "keys"),
        ("recovery_s", "recovery s"),
        ("recovery_us_per_block", "µs/block"),
        ("recovery_lost_s", "recovery s (lost)"),
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
        f"  recovery {e['recovery_s']:,.0f} s ({e['recovery_us_per_block']:.2f} µs a block); "
        f"{e['recovery_lost_s']:,.0f} s after a crash lost the index slot of one key in "
        f"{e['lost_every']:,}",
        f"  takeover to the first acknowledged write: {t['first_write_before_s']:,.3f} s "
        f"recovering at once (before), {t['first_write_after_s']:,.3f} s recovering while "
        f"serving (after); writes at {t['keys_per_s_recovering_over_after']:.0%} of their "
        f"rate while it recovers, at 90% for good after {t['full_throughput_s']:,.1f} s; "
        f"recovery done after {t['recovery_done_s']:,.0f} s",
        f"  an operation on a key recovery adopted ahead of its scan: "
        f"{e['index_adopt']['pod_us']:.1f} µs of key-index work with the pod's "
        f"{e['index_adopt']['pod_regions']:,} regions ("
        f"{e['index_adopt']['measured_us']:.1f} µs with the largest pool's "
        f"{e['index_adopt']['measured_regions']:,}; measured, not fitted); an eviction "
        f"{e['index_evict']['pod_us']:.1f} µs of it ({e['index_evict']['measured_us']:.1f})",
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
