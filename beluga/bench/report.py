"""The certification report: ``report.json``, ``summary.md`` and PNG charts in one folder.

Every figure that the paper also measured is set beside it as a ratio
(ours / paper), together with the ratios *within* each run (flush+load over
a non-temporal store, say), which survive a change of machine far better
than absolute times do.  The paper measured an XConn XC50256 CXL 2.0 switch
(see ``PAPER_MACHINE``); a run anywhere else is a different machine, and the
summary says so.

Charts need matplotlib (the ``certify`` extra); without it the JSON and the
Markdown are still written and the report says why there are no charts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from beluga.units import human_bytes

PAPER_MACHINE = (
    "the paper (Beluga, arXiv 2511.20172) measured hosts on an XConn XC50256 CXL 2.0 switch "
    "(~750 ns minimum 64 B latency, 22.5 GB/s per memory device, GPU paths bound at ~26 GB/s "
    "by the root complex)"
)
CHARTS_EXTRA = "pip install 'beluga-kvcache[report]' (matplotlib)"


@dataclass(frozen=True)
class PaperFigure:
    label: str
    paper: float
    unit: str
    note: str = ""


PAPER: dict[str, PaperFigure] = {
    "nt_store_16k": PaperFigure("16 KiB write, non-temporal store (CPU)", 2.41, "µs"),
    "store_flush_16k": PaperFigure("16 KiB write, store + flush (CPU)", 8.50, "µs"),
    "flush_load_16k": PaperFigure("16 KiB read, flush + load (CPU)", 5.98, "µs"),
    "line_64": PaperFigure(
        "64 B read, flush + load",
        750.0,
        "ns",
        "paper: the switch's minimum 64 B latency; ours includes a Python call",
    ),
    "rpc_qd1": PaperFigure("RPC round trip, queue depth 1", 2.11, "µs", "64 B ping-pong"),
    "rpc_qd128": PaperFigure("RPC throughput, queue depth 128, one server thread", 12.13, "Mops"),
    "write_per_device": PaperFigure(
        "write bandwidth per device, best thread count",
        22.5,
        "GB/s",
        "paper: a CXL memory device's ceiling",
    ),
    "read_per_device": PaperFigure(
        "read bandwidth per device, best thread count",
        22.5,
        "GB/s",
        "paper: a CXL memory device's ceiling",
    ),
    "gpu_4m": PaperFigure(
        "pool -> GPU copy, 4 MiB", 26.0, "GB/s", "paper: root-complex bound per GPU path"
    ),
}

#: ratios inside one run: (label, numerator key, denominator key, the paper's ratio)
SHAPE = [
    ("flush + load ÷ non-temporal store, 16 KiB", "flush_load_16k", "nt_store_16k", 5.98 / 2.41),
    ("store + flush ÷ non-temporal store, 16 KiB", "store_flush_16k", "nt_store_16k", 8.50 / 2.41),
    ("RPC throughput at depth 128 ÷ at depth 1", "rpc_qd128", "rpc_qd1_mops", 12.13 * 2.11),
]


def _ok(doc: dict[str, Any], name: str) -> dict[str, Any] | None:
    sec = doc["sections"].get(name)
    return sec if sec and sec["status"] == "ok" else None


def devices(doc: dict[str, Any]) -> int:
    return len(doc["target"].get("children", [])) or 1


def ours(doc: dict[str, Any]) -> dict[str, float]:
    """Our figures under the keys of PAPER (and a few helpers), where measured."""
    out: dict[str, float] = {}
    if lat := _ok(doc, "latency"):
        f = lat["figures"]
        for key, name, size, scale in (
            ("nt_store_16k", "nt_store", "16KiB", 1),
            ("store_flush_16k", "store_flush", "16KiB", 1),
            ("flush_load_16k", "invalidate_load", "16KiB", 1),
            ("line_64", "invalidate_load", "64B", 1000),
        ):
            if (v := f.get(f"memops.{name}.{size}.p50_us")) is not None:
                out[key] = v * scale
    if rpc := _ok(doc, "rpc"):
        by_depth = {d["depth"]: d for d in rpc["depths"]}
        if 1 in by_depth:
            out["rpc_qd1"] = by_depth[1]["us_per_request"]
            out["rpc_qd1_mops"] = by_depth[1]["mops"]
        if 128 in by_depth:
            out["rpc_qd128"] = by_depth[128]["mops"]
    if bw := _ok(doc, "bandwidth"):
        for direction in ("write", "read"):
            best = max((r["gbps"] for r in bw["rows"] if r["direction"] == direction), default=0)
            if best:
                out[f"{direction}_per_device"] = best / devices(doc)
    if gpu := _ok(doc, "gpu"):
        for r in gpu["rows"]:
            if r["direction"] == "pool_to_gpu" and r["bytes"] == 4 << 20:
                out["gpu_4m"] = r["gbps_at_p50"]
    return out


def comparisons(doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Our figures beside the paper's, and the within-run ratios beside the paper's."""
    here = ours(doc)
    beside = [
        {
            "figure": p.label,
            "here": here[key],
            "paper": p.paper,
            "unit": p.unit,
            "ratio": here[key] / p.paper,
            "note": p.note,
        }
        for key, p in PAPER.items()
        if key in here
    ]
    shape = [
        {"ratio": label, "here": here[a] / here[b], "paper": paper}
        for label, a, b, paper in SHAPE
        if a in here and here.get(b)
    ]
    return {"beside_paper": beside, "shape": shape}


# -- charts ---------------------------------------------------------------------------


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend: every bench chart draws with it.

    Raises ImportError when matplotlib is not installed (a caller says so and skips
    its charts).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _latency_chart(plt: Any, doc: dict[str, Any], ax: Any) -> None:
    rows = doc["sections"]["latency"]["rows"]
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = [(r["bytes"], r["p50_us"]) for r in rows if r["method"] == method]
        ax.plot(*zip(*pts, strict=True), marker="o", label=method)
    for key, name in (
        ("nt_store_16k", "NT store"),
        ("store_flush_16k", "store+flush"),
        ("flush_load_16k", "flush+load"),
    ):
        ax.scatter([16 << 10], [PAPER[key].paper], marker="x", s=60, color="black")
        ax.annotate(
            f"paper {name}",
            (16 << 10, PAPER[key].paper),
            fontsize=7,
            xytext=(4, 2),
            textcoords="offset points",
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="access size (bytes)",
        ylabel="p50 per call (µs)",
        title="Latency by access size and method",
    )
    ax.set_xscale("log", base=2)


def _bandwidth_chart(plt: Any, doc: dict[str, Any], ax: Any) -> None:
    n = devices(doc)
    for direction in ("write", "read"):
        pts = [
            (r["threads"], r["gbps"])
            for r in doc["sections"]["bandwidth"]["rows"]
            if r["direction"] == direction
        ]
        ax.plot(*zip(*pts, strict=True), marker="o", label=f"{direction}, all {n} device(s)")
    if inter := _ok(doc, "interleave"):
        for direction in ("write", "read"):
            pts = [(r["threads"], r["gbps"]) for r in inter["rows"] if r["direction"] == direction]
            ax.plot(
                *zip(*pts, strict=True),
                marker="s",
                linestyle="--",
                label=f"{direction}, one device",
            )
    ceiling = f"paper: 22.5 GB/s per device, {n} device(s)"
    ax.axhline(22.5 * n, color="gray", linestyle=":", label=ceiling)
    ax.set_xticks(sorted({r["threads"] for r in doc["sections"]["bandwidth"]["rows"]}))
    ax.set(xlabel="threads", ylabel="GB/s", title="Bandwidth against threads")


def _rpc_chart(plt: Any, doc: dict[str, Any], ax: Any) -> None:
    depths = doc["sections"]["rpc"]["depths"]
    ax.plot([d["depth"] for d in depths], [d["mops"] for d in depths], marker="o", label="here")
    ax.scatter(
        [1, 128],
        [1 / PAPER["rpc_qd1"].paper, PAPER["rpc_qd128"].paper],
        marker="x",
        s=60,
        color="black",
        label="paper",
    )
    ax.set(
        yscale="log",
        xlabel="queue depth",
        ylabel="Mops (64 B echo)",
        title="RPC throughput, one server thread",
    )
    ax.set_xscale("log", base=2)


def _gpu_chart(plt: Any, doc: dict[str, Any], ax: Any) -> None:
    rows = doc["sections"]["gpu"]["rows"]
    for direction in ("pool_to_gpu", "gpu_to_pool"):
        pts = [(r["bytes"], r["gbps_at_p50"]) for r in rows if r["direction"] == direction]
        ax.plot(*zip(*pts, strict=True), marker="o", label=direction.replace("_", " "))
    ax.axhline(26, color="gray", linestyle=":", label="paper: ~26 GB/s per GPU path")
    ax.set(xlabel="copy size (bytes)", ylabel="GB/s at p50", title="GPU copies")
    ax.set_xscale("log", base=2)


CHARTS: dict[str, tuple[str, Callable[[Any, dict[str, Any], Any], None]]] = {
    "latency.png": ("latency", _latency_chart),
    "bandwidth.png": ("bandwidth", _bandwidth_chart),
    "rpc.png": ("rpc", _rpc_chart),
    "gpu.png": ("gpu", _gpu_chart),
}


def draw_charts(doc: dict[str, Any], out_dir: str) -> list[str]:
    """One PNG per measured section that has a chart; names of the files written."""
    wanted = [(name, draw) for name, (sec, draw) in CHARTS.items() if _ok(doc, sec)]
    if not wanted:
        return []
    plt = pyplot()
    written = []
    for name, draw in wanted:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
        try:
            draw(plt, doc, ax)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(os.path.join(out_dir, name))
        finally:
            plt.close(fig)
        written.append(name)
    return written


# -- Markdown -------------------------------------------------------------------------


def _num(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _table(headings: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(headings) + " |", "|" + " --- |" * len(headings)]
    out += ["| " + " | ".join(_num(c) for c in row) + " |" for row in rows]
    return [*out, ""]


Chart = Callable[[str], list[str]]


def _latency_lines(lat: dict[str, Any], chart: Chart) -> list[str]:
    methods = list(dict.fromkeys(r["method"] for r in lat["rows"]))
    cell = {(r["size"], r["method"]): r["p50_us"] for r in lat["rows"]}
    sizes = list(dict.fromkeys(r["size"] for r in lat["rows"]))
    return [
        "## Latency by access size (p50 µs per call)",
        "",
        *chart("latency.png"),
        *_table(["size", *methods], [[s, *(cell[s, m] for m in methods)] for s in sizes]),
    ]


def _bandwidth_lines(bw: dict[str, Any], chart: Chart) -> list[str]:
    return [
        "## Bandwidth against threads (GB/s)",
        "",
        *chart("bandwidth.png"),
        f"The threads split a {human_bytes(bw['working_set_bytes'])} working set into "
        f"regions of their own and copy {human_bytes(bw['chunk_bytes'])} at a time "
        "(writes: non-temporal stores; reads: plain loads).",
        "",
        *_table(
            ["direction", "threads", "GB/s"],
            [[r["direction"], r["threads"], r["gbps"]] for r in bw["rows"]],
        ),
    ]


def _interleave_lines(inter: dict[str, Any], chart: Chart) -> list[str]:
    return [
        f"## Interleaving every {human_bytes(inter['stripe'])} across "
        f"{len(inter['devices'])} devices",
        "",
        *_table(
            ["direction", "threads", "one device GB/s", "interleaved GB/s", "gain"],
            [
                [r["direction"], r["threads"], r["gbps"], r["interleaved_gbps"], r["gain"]]
                for r in inter["rows"]
            ],
        ),
    ]


def _rpc_lines(rpc: dict[str, Any], chart: Chart) -> list[str]:
    c = rpc["call"]
    return [
        f"## RPC (64 B messages, {rpc['payload_bytes']} B echoed; one server thread in C)",
        "",
        *chart("rpc.png"),
        *_table(
            ["queue depth", "Mops", "µs per request (1 / rate)"],
            [[d["depth"], d["mops"], d["us_per_request"]] for d in rpc["depths"]],
        ),
        f"`RpcClient.call` round trip through Python: p50 {c['p50_us']:.2f} µs, "
        f"p99 {c['p99_us']:.2f} µs over {int(c['n'])} calls.",
        "",
    ]


def _gpu_lines(gpu: dict[str, Any], chart: Chart) -> list[str]:
    return [
        f"## GPU copies ({gpu['device']}, pool pinned: {gpu['pinned']})",
        "",
        *chart("gpu.png"),
        *_table(
            ["direction", "size", "p50 µs", "GB/s at p50"],
            [[r["direction"], r["size"], r["p50_us"], r["gbps_at_p50"]] for r in gpu["rows"]],
        ),
    ]


def _litmus_lines(title: str) -> Callable[[dict[str, Any], Chart], list[str]]:
    def lines(sec: dict[str, Any], chart: Chart) -> list[str]:
        head = [f"## Coherence litmus ({title}, {sec['mode']} mode)", ""]
        if sec.get("role") == "writer":
            return [
                *head,
                "This host played the writer; the observer host's report holds the verdicts.",
                "",
                *_table(
                    ["pattern", "trials written"],
                    [[r["pattern"], r["trials_written"]] for r in sec["rows"]],
                ),
            ]
        rows = [
            [
                r["pattern"],
                "bug" if r["is_bug"] else "correct",
                r["trials"],
                r["violations"],
                r["verdict"],
            ]
            for r in sec["rows"]
        ]
        return [*head, *_table(["pattern", "kind", "trials", "violations", "verdict"], rows)]

    return lines


#: each section of the report that ran, in this order, and how it is written
_SECTION_WRITERS: dict[str, Callable[[dict[str, Any], Chart], list[str]]] = {
    "latency": _latency_lines,
    "bandwidth": _bandwidth_lines,
    "interleave": _interleave_lines,
    "rpc": _rpc_lines,
    "gpu": _gpu_lines,
    "litmus": _litmus_lines("single host, local processes"),
    "litmus_cross_host": _litmus_lines("across two hosts"),
}


def _section_lines(doc: dict[str, Any]) -> list[str]:
    charts = set(doc.get("charts", []))

    def chart(name: str) -> list[str]:
        return [f"![{name[:-4]}]({name})", ""] if name in charts else []

    lines: list[str] = []
    for name, write in _SECTION_WRITERS.items():
        if sec := _ok(doc, name):
            lines += write(sec, chart)
    return lines


def markdown(doc: dict[str, Any]) -> str:
    t, m, v = doc["target"], doc["machine"], doc["verdict"]
    lines = [
        "# Beluga certification report",
        "",
        f"- target: `{t['spec']}` ({t['backend']}, pool of {human_bytes(t['pool_bytes'])})",
        f"- run: {'quick' if doc['quick'] else 'full'}, started {doc['started']}, "
        f"{doc['seconds']} s",
        f"- machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, instructions "
        + ", ".join(f"{k} {v}" for k, v in m["selected"].items()),
        f"- verdict: **{'PASS' if v['ok'] else 'FAIL'}**",
        *(f"  - {p}" for p in v["problems"]),
        "",
    ]
    paper = doc.get("paper", {})
    if paper.get("beside_paper"):
        lines += [
            "## Beside the paper",
            "",
            f"This machine is not the paper's: {PAPER_MACHINE}. Read the ratios; the shape "
            "table below compares ratios measured within one run, which carry across machines "
            "better than absolute figures.",
            "",
        ]
        lines += _table(
            ["figure", "here", "paper", "unit", "here ÷ paper", "note"],
            [
                [r["figure"], r["here"], r["paper"], r["unit"], r["ratio"], r["note"]]
                for r in paper["beside_paper"]
            ],
        )
    if paper.get("shape"):
        lines += ["### Shape: ratios within one run", ""]
        lines += _table(
            ["ratio", "here", "paper"],
            [[r["ratio"], r["here"], r["paper"]] for r in paper["shape"]],
        )
    lines += _section_lines(doc)
    skipped = [(n, s["reason"]) for n, s in doc["sections"].items() if s["status"] == "skipped"]
    if doc.get("charts_skipped"):
        skipped.append(("charts", doc["charts_skipped"]))
    if skipped:
        lines += ["## Skipped", "", *(f"- {n}: {reason}" for n, reason in skipped), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def write_report(doc: dict[str, Any], out_dir: str) -> list[str]:
    """Write the charts, report.json and summary.md into ``out_dir``; the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    doc["paper"] = comparisons(doc)
    try:
        doc["charts"] = draw_charts(doc, out_dir)
    except ImportError:
        doc["charts"] = []
        doc["charts_skipped"] = f"matplotlib is not installed: {CHARTS_EXTRA}"
    paths = [os.path.join(out_dir, name) for name in doc["charts"]]
    for name, text in (
        ("report.json", json.dumps(doc, indent=2, sort_keys=True) + "\n"),
        ("summary.md", markdown(doc)),
    ):
        path = os.path.join(out_dir, name)
        with open(path, "w") as f:
            f.write(text)
        paths.append(path)
    return paths
