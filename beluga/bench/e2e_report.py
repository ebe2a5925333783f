"""What the end-to-end benchmarks print and draw from their results.

The table's columns, notes in words (why a pass hit less than it could,
what blocks computed twice cost, how requests arrived, the capacity), a
median with its range, and the charts (TTFT per pass and scheduler, the
mean time of each step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

COLUMNS = [
    ("scheduler", "scheduler"),
    ("pass", "pass"),
    ("requests", "requests"),
    ("hit_ratio", "hit ratio"),
    ("ttft_mean_s", "TTFT mean s"),
    ("ttft_p99_s", "TTFT p99 s"),
    ("queue_mean_s", "queue s"),
    ("lookup_mean_ms", "lookup ms"),
    ("load_mean_ms", "load ms"),
    ("compute_mean_s", "compute s"),
    ("save_mean_ms", "save ms"),
    ("imbalance", "imbalance"),
    ("qps", "QPS"),
    ("evictions", "evictions"),
    ("duplicate_blocks", "computed twice"),
]


def hit_shortfall(row: dict[str, Any], want: float | None = None) -> str | None:
    """Why a pass's hit ratio is below ``want`` (default: the best possible); None if not."""
    want = row["best_hit_ratio"] if want is None else want
    if row["hit_ratio"] >= want - 1e-9:
        return None
    causes = [
        f"{row[key]:g} {what}"
        for key, what in (
            ("evictions", "evictions"),
            ("duplicate_blocks", "blocks computed twice"),
            ("refused_blocks", "blocks the store refused"),
        )
        if row.get(key)
    ]
    if row.get("evictions") is None:
        causes.append("evictions not reported by this store")
    if not causes:
        causes = ["no evictions, duplicates or refusals: blocks changed or failed a check"]
    return f"hit ratio {row['hit_ratio']:.3f} is below {want:.3f}: " + ", ".join(causes)


def duplicate_note(row: dict[str, Any]) -> str:
    """A row's blocks computed more than once, what they cost, and what waiting for their
    first writer would save (:func:`duplicate_cost`), in words."""
    text = (
        f"{row['duplicate_blocks']:g} blocks computed twice by {row['duplicate_requests']:g} "
        f"requests ({row['duplicate_compute_s']:.2f} engine-s, "
        f"{100 * row['duplicate_share_of_busy']:.1f}% of busy time)"
    )
    if row.get("wait_would_save_engine_s") is not None:
        saved = row["wait_would_save_engine_s"]
        text += f"; waiting for the first writer would save ~{saved:.2f} engine-s"
    if row.get("wait_ttft_mean_s") is not None:
        text += (
            f" and give those requests a mean TTFT of ~{row['wait_ttft_mean_s']:.3f} s "
            f"instead of {row['duplicate_ttft_mean_s']:.3f} s"
        )
    return text


def arrivals_note(settings: dict[str, Any]) -> str:
    """How requests arrived (from a result's settings), in words."""
    rate = settings["rate"]
    text = f"Poisson arrivals, {rate:.3g} requests/s" if rate else "the whole trace at once"
    found = settings.get("calibration")
    if found:
        text += (
            f" (automatic: {100 * found['utilisation']:.0f}% of what {found['engines']} "
            f"engine{'s' if found['engines'] != 1 else ''} served, {found['service_s']:.3g} s a "
            f"{found['prompt_tokens']}-token prefill at once)"
        )
    if settings["burst"] > 1:
        text += f", each document's first {settings['burst']} questions together"
    return text


def capacity_line(note: dict[str, Any]) -> str:
    """A :func:`capacity_note` in words."""
    return (
        f"capacity: the pool may hold {note['budget_bytes'] / (1 << 20):.1f} MiB of KV before "
        f"it evicts (from {note['from']}; data area {note['beluga_data_bytes'] / (1 << 20):.1f} "
        f"MiB, the server evicts above {100 * note['beluga_evicts_above']:.0f}%)"
    )


def ranged(row: dict[str, Any], key: str, scale: float = 1.0) -> str:
    """A row's median of ``key`` with its range over repetitions, for the printed summary."""
    low, high = row.get("ranges", {}).get(key, (row[key], row[key]))
    if low == high:
        return f"{row[key] * scale:.3g}"
    return f"{row[key] * scale:.3g} ({low * scale:.3g}-{high * scale:.3g})"


def error_bars(rows: Sequence[dict[str, Any]], key: str) -> np.ndarray:
    """Matplotlib's yerr for rows' medians of ``key``: down to the min, up to the max."""
    lows = [r[key] - r.get("ranges", {}).get(key, (r[key], r[key]))[0] for r in rows]
    highs = [r.get("ranges", {}).get(key, (r[key], r[key]))[1] - r[key] for r in rows]
    return np.array([lows, highs])


#: a request's steps as rows report them (key, label, to seconds); TTFT is the first four
STEPS = [
    ("queue_mean_s", "queue", 1.0),
    ("lookup_mean_ms", "lookup", 1e-3),
    ("load_mean_ms", "KV load", 1e-3),
    ("compute_mean_s", "compute", 1.0),
    ("save_mean_ms", "save (after the first token)", 1e-3),
]


def step_bars(ax: Any, rows: Sequence[dict[str, Any]], labels: Sequence[str]) -> None:
    """Each row's mean time per step (:data:`STEPS`), stacked: the first four make its TTFT."""
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for key, name, scale in STEPS:
        part = np.array([r[key] * scale for r in rows])
        after = key == "save_mean_ms"
        ax.bar(x, part, 0.5, bottom=bottom, label=name, hatch="//" if after else None, alpha=0.85)
        bottom += part
    ax.set_xticks(x, labels, fontsize=8)
    ax.set(title="mean time by step", ylabel="seconds")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def chart(doc: dict[str, Any], path: str) -> None:
    """Mean (with its range over repetitions) and p99 TTFT per pass and scheduler, and the
    mean time of each step per pass and scheduler, as a PNG."""
    from beluga.bench.report import pyplot

    plt = pyplot()
    rows = doc["rows"]
    schedulers = list(dict.fromkeys(r["scheduler"] for r in rows))
    fig, (ax, steps) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    try:
        width = 0.35
        for k, pass_no in enumerate((1, 2)):
            by = {r["scheduler"]: r for r in rows if r["pass"] == pass_no}
            x = np.arange(len(schedulers)) + (k - 0.5) * width
            present = [by[s] for s in schedulers if s in by]
            at = [xi for xi, s in zip(x, schedulers, strict=True) if s in by]
            ax.bar(
                at,
                [r["ttft_mean_s"] for r in present],
                width,
                yerr=error_bars(present, "ttft_mean_s"),
                capsize=3,
                label=f"pass {pass_no} mean",
            )
            p99 = [r["ttft_p99_s"] for r in present]
            ax.scatter(at, p99, marker="_", s=400, color="black", zorder=3)
        ax.scatter([], [], marker="_", s=100, color="black", label="p99")
        ax.set_xticks(np.arange(len(schedulers)), schedulers)
        settings = doc["settings"]
        ax.set(
            ylabel="time to first token (s)",
            title=(
                f"TTFT per pass: model {settings['model']}, "
                f"{settings['trace']['context_tokens']}-token contexts, "
                f"{settings['engines']} engines, {settings.get('repeat', 1)} runs"
            ),
        )
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
        step_bars(steps, rows, [f"{r['scheduler']}\npass {r['pass']}" for r in rows])
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
