"""Prefill/decode disaggregation end to end: ``beluga bench e2e --pd P:D``.

``P`` prefill engines (``kv_producer``) and ``D`` decode engines
(``kv_consumer``) share one pool (:func:`beluga.bench.e2e.pool_cluster`).
Each request of the trace goes to a prefill engine, which computes the
prompt (through the pool's prefix cache, as any engine does), saves every
full block and answers only once all are committed; then to a decode engine,
which loads the whole prompt's KV from the pool, computes only the last
partial block (and any block missing or invalid: recomputed and counted) and
generates ``max_tokens`` tokens greedily.  Both are chosen by load alone
(:meth:`beluga.serving.cluster.Cluster.run_disaggregated`).

With ``baseline="mooncake"`` the same engines, trace and model move the KV
through Mooncake Store instead (:func:`beluga.bench.e2e_mooncake.mooncake_cluster`:
staging buffer, ``batch_put_from`` on the prefill side, ``batch_get_into``
on the decode side), as Mooncake's vLLM and SGLang integrations do, under
the same capacity budget.  Repetitions run from scratch, the systems
interleaved within each (Beluga, Mooncake, then the next repetition).

Per system (:func:`summarize`): handoff time (prefill committed to the
decode engine's first token), TTFT (arrival to the first output token:
prefill, then handoff), time per output token, QPS, and the share of TTFT
spent moving KV (the prefill side's save, the decode side's load); with the
baseline, the ratios with their ranges (:func:`headline`) beside the paper's
3.41-9.47x QPS over Mooncake.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from beluga.bench import e2e, e2e_figures, e2e_mooncake, e2e_report, e2e_settings
from beluga.bench.mooncake_engine import TRANSPORT
from beluga.bench.stats import percentile
from beluga.serving.cluster import Handoff, Record
from beluga.serving.scheduler import make_scheduler

PAPER_QPS_RATIO = (3.41, 9.47)  # the paper's PD QPS over Mooncake; grows with context length
SCHEDULER = "locality-free"  # both sides, both systems: by load alone

COLUMNS = [
    ("system", "system"),
    ("pd", "P:D"),
    ("requests", "requests"),
    ("ttft_mean_s", "TTFT mean s"),
    ("ttft_p99_s", "TTFT p99 s"),
    ("handoff_mean_ms", "handoff ms"),
    ("handoff_p99_ms", "handoff p99 ms"),
    ("prefill_queue_mean_ms", "P queue ms"),
    ("prefill_lookup_load_mean_ms", "P lookup+load ms"),
    ("prefill_compute_mean_ms", "P compute ms"),
    ("prefill_save_mean_ms", "P save ms"),
    ("decode_wait_mean_ms", "D wait ms"),
    ("decode_lookup_mean_ms", "D lookup ms"),
    ("decode_load_mean_ms", "D load ms"),
    ("decode_compute_mean_ms", "D compute ms"),
    ("kv_share_of_ttft", "KV/TTFT"),
    ("tpot_mean_ms", "TPOT ms"),
    ("qps", "QPS"),
    ("recomputed_blocks", "recomputed"),
    ("evictions", "evictions"),
    ("duplicate_blocks", "computed twice"),
]


def summarize(handoffs: Sequence[Handoff], block_tokens: int) -> dict[str, Any]:
    """One system's row: TTFT, handoff and its parts, TPOT, QPS, the KV share of TTFT."""
    prefill = [h.prefill for h in handoffs]
    decode = [h.decode for h in handoffs]
    ttft = sorted(h.ttft for h in handoffs)
    handoff = sorted(h.handoff for h in handoffs)
    tpot = [t for r in decode if (t := r.served.tpot) is not None]
    kv = sum(h.prefill.served.timings.save + h.decode.served.timings.load for h in handoffs)
    loadable = sum((r.served.num_tokens - 1) // block_tokens for r in decode)
    loaded = sum(r.served.cached_tokens // block_tokens for r in decode)
    makespan = max(r.end for r in decode)
    # what the engines could sustain: the busier side's requests per second of busy time
    sides = [
        len(records) * len({r.engine for r in records}) / busy
        for records in (prefill, decode)
        if (busy := sum(r.served.timings.busy for r in records)) > 0
    ]

    def mean_ms(values: Any) -> float:
        return 1e3 * float(np.mean(list(values)))

    return {
        "requests": len(handoffs),
        "ttft_mean_s": float(np.mean(ttft)),
        "ttft_p99_s": percentile(ttft, 99),
        "handoff_mean_ms": mean_ms(handoff),
        "handoff_p99_ms": 1e3 * percentile(handoff, 99),
        "prefill_queue_mean_ms": mean_ms(r.queue for r in prefill),
        "prefill_lookup_load_mean_ms": mean_ms(
            r.served.timings.lookup + r.served.timings.load for r in prefill
        ),
        "prefill_hit_ratio": sum(r.served.cached_tokens for r in prefill)
        / sum(r.served.num_tokens for r in prefill),
        "prefill_compute_mean_ms": mean_ms(r.served.timings.compute for r in prefill),
        # the save includes waiting for blocks another prefill engine was writing
        "prefill_save_mean_ms": mean_ms(r.served.timings.save for r in prefill),
        # the handoff's parts: the driver hearing of the commit and a decode engine freeing up,
        # then the decode engine's lookup, load and compute of the prompt's last tokens
        "decode_wait_mean_ms": mean_ms(h.decode.start - h.committed for h in handoffs),
        "decode_lookup_mean_ms": mean_ms(r.served.timings.lookup for r in decode),
        "decode_load_mean_ms": mean_ms(r.served.timings.load for r in decode),
        "decode_load_ms_per_block": 1e3 * sum(r.served.timings.load for r in decode) / loaded
        if loaded
        else None,
        "decode_compute_mean_ms": mean_ms(r.served.timings.compute for r in decode),
        "kv_share_of_ttft": kv / sum(ttft),
        "tpot_mean_ms": mean_ms(tpot) if tpot else None,
        "output_tokens": sum(len(r.served.output) for r in decode),
        "loaded_blocks": loaded,
        "recomputed_blocks": loadable - loaded,  # missing or invalid at the decode engine
        "saved_blocks": sum(r.served.saved_blocks for r in prefill),
        "duplicate_blocks": sum(r.served.duplicate_blocks for r in prefill),
        "refused_blocks": sum(r.served.refused_blocks for r in prefill),
        "makespan_s": makespan,
        "qps": len(handoffs) / makespan,
        "service_qps": min(sides) if len(sides) == 2 else None,
    }


def system_row(
    system: str,
    handoffs: Sequence[Handoff],
    documents: Sequence[int],
    settings: e2e_settings.Settings,
    counters: dict[str, int | None],
) -> dict[str, Any]:
    """:func:`summarize`, what duplicate prefills cost, and the store's counts."""
    assert settings.pd is not None
    bs = settings.shape.block_tokens
    prefill = [h.prefill for h in handoffs]
    return {
        "system": system,
        "pd": f"{settings.pd[0]}:{settings.pd[1]}",
        **summarize(handoffs, bs),
        **e2e_figures.duplicate_cost(prefill, documents, bs),
        "evictions": counters.get("evictions"),
        "store_duplicate_writes_skipped": counters.get("duplicate_writes_skipped"),
    }


def headline(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Beluga beside Mooncake: QPS (x), mean TTFT and handoff (fractions), TPOT (fraction)."""
    b, m = (next(r for r in rows if r["system"] == s) for s in ("beluga", "mooncake"))
    return {
        "qps_ratio": b["qps"] / m["qps"],
        "ttft_fraction": b["ttft_mean_s"] / m["ttft_mean_s"],
        "handoff_fraction": b["handoff_mean_ms"] / m["handoff_mean_ms"],
        "kv_share_of_ttft_beluga": b["kv_share_of_ttft"],
        "kv_share_of_ttft_mooncake": m["kv_share_of_ttft"],
        "tpot_fraction": e2e_mooncake.ratio(b["tpot_mean_ms"], m["tpot_mean_ms"]),
        "service_qps_ratio": e2e_mooncake.ratio(b.get("service_qps"), m.get("service_qps")),
        "paper_qps_ratio": list(PAPER_QPS_RATIO),
    }


def run(
    settings: e2e_settings.Settings,
    pool: str | None = None,
    baseline: str | None = None,
    on_record: Callable[[str, Record], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Serve the trace disaggregated ``settings.repeat`` times, with the baseline when asked;
    ``on_record(system, decode record)`` follows progress."""
    if settings.pd is None:
        raise ValueError("a disaggregated run needs settings.pd = (prefill, decode) engines")
    say = on_phase or (lambda _: None)
    trace = settings.requests()
    prompts = [r.token_ids for r in trace]
    documents = [r.document for r in trace]
    pd_settings = dataclasses.replace(settings, schedulers=(SCHEDULER,))
    if baseline == "mooncake":
        capacity = e2e_mooncake.capacity_budget(pd_settings)
    else:
        capacity = e2e.capacity_budget(pd_settings, 1)
    pd_settings.check_gpu((2 if baseline else 1) * settings.engines)  # all up at once
    calibration = None
    runs = []
    for rep in range(settings.repeat):
        rows = []
        with contextlib.ExitStack() as stack:
            systems = {
                "beluga": stack.enter_context(e2e.pool_cluster(pd_settings, pool, say, capacity))
            }
            if baseline == "mooncake":
                systems["mooncake"] = stack.enter_context(
                    e2e_mooncake.mooncake_cluster(pd_settings, say, capacity)
                )
            if pd_settings.rate is None:  # measured once, on Beluga's engines, for both
                say("measuring a rate below saturation")
                pd_settings, calibration = e2e.with_rate(pd_settings, systems["beluga"])
            for system, started in systems.items():
                say(f"run {rep + 1}/{settings.repeat}, {system}: disaggregated")
                before = started.counters()
                handoffs = started.cluster.run_disaggregated(
                    prompts,
                    make_scheduler(SCHEDULER, settings.pd[0]),
                    make_scheduler(SCHEDULER, settings.pd[1]),
                    max_tokens=settings.max_tokens,
                    salt=system,
                    arrivals=pd_settings.arrivals(settings.seed + 1),
                    on_record=on_record and functools.partial(on_record, system),
                )
                counts = e2e.counted(started, before)
                rows.append(system_row(system, handoffs, documents, pd_settings, counts))
        runs.append({"rows": rows, **({"headline": headline(rows)} if baseline else {})})
    note = (
        e2e_mooncake.capacity_note(pd_settings, capacity)
        if baseline
        else e2e.capacity_note(pd_settings, capacity)
    )
    doc = {
        "settings": {
            **dataclasses.asdict(pd_settings),
            "kv_format": settings.format.fingerprint,
            "kv_dtype": settings.kv_dtype,
            "block_bytes": settings.format.nbytes,
            "engine_memory_bytes": settings.memory_bytes,
            "calibration": calibration,
            "baseline": baseline,
            "capacity": note,
            **(
                {
                    "mooncake_transport": TRANSPORT,
                    "mooncake_staging": e2e_mooncake.staging_note(settings),
                }
                if baseline
                else {}
            ),
        },
        "model_params": settings.shape.num_params,
        "requests_per_run": len(prompts),
        "rows": e2e_figures.median_rows([r["rows"] for r in runs]),
        "runs": runs,
    }
    if baseline:
        doc["headline"] = e2e_figures.median_fields([r["headline"] for r in runs])
    return doc


def summary(doc: dict[str, Any]) -> str:
    """Per system, the handoff and what it is made of; with the baseline, the ratios with
    their ranges beside the paper's; capacity, evictions and duplicate prefills."""
    s = doc["settings"]
    runs = len(doc["runs"])
    lines = [
        f"disaggregated {s['pd'][0]}:{s['pd'][1]}, model {s['model']} "
        f"({s['block_bytes'] >> 10} KiB blocks), {doc['requests_per_run']} requests "
        f"({e2e_report.arrivals_note(s)}), "
        f"{s['max_tokens']} output tokens each; medians (range) over {runs} runs",
    ]
    for row in doc["rows"]:
        lines.append(
            f"  {row['system']}: TTFT {e2e_report.ranged(row, 'ttft_mean_s')} s, handoff "
            f"{e2e_report.ranged(row, 'handoff_mean_ms')} ms "
            f"(wait {row['decode_wait_mean_ms']:.1f} + "
            f"lookup {row['decode_lookup_mean_ms']:.1f} + load {row['decode_load_mean_ms']:.1f} + "
            f"compute {row['decode_compute_mean_ms']:.1f}), KV moves "
            f"{e2e_report.ranged(row, 'kv_share_of_ttft', 100)}% of TTFT (save "
            f"{row['prefill_save_mean_ms']:.1f} ms + load {row['decode_load_mean_ms']:.1f} ms), "
            f"TPOT {_ms(row['tpot_mean_ms'])} ms, QPS {e2e_report.ranged(row, 'qps')}; "
            f"{row['recomputed_blocks']:g} blocks recomputed at decode"
        )
    if "headline" in doc:
        h = doc["headline"]
        low, high = PAPER_QPS_RATIO
        lines.append(
            f"Beluga over Mooncake: QPS {e2e_report.ranged(h, 'qps_ratio')}x "
            f"(paper {low}-{high}x), "
            f"mean TTFT {e2e_report.ranged(h, 'ttft_fraction', 100)}%, handoff "
            f"{e2e_report.ranged(h, 'handoff_fraction', 100)}% of Mooncake's"
        )
        lines.append(
            f"  throughput the engines could sustain (requests per second of the busier side's "
            f"busy time): {e2e_mooncake.times(h.get('service_qps_ratio'))} Beluga over Mooncake"
        )
        lines.append(e2e_mooncake.capacity_line(doc))
        lines.append(e2e_mooncake.transport_line(doc, scaled=False))
    else:
        lines.append(e2e_report.capacity_line(s["capacity"]))
    for row in doc["rows"]:
        evictions = "n/a" if row["evictions"] is None else f"{row['evictions']:g}"
        lines.append(
            f"  {row['system']}: {evictions} evictions; prefill: {e2e_report.duplicate_note(row)}"
        )
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def chart(doc: dict[str, Any], path: str) -> None:
    """TTFT and handoff, TTFT by step, and QPS per system, with ranges over repetitions."""
    from beluga.bench.report import pyplot

    plt = pyplot()
    rows = doc["rows"]
    systems = [r["system"] for r in rows]
    x = np.arange(len(systems))
    fig, (times, split, qps) = plt.subplots(1, 3, figsize=(13, 4.5), dpi=100)
    try:
        width = 0.35
        for k, (key, name, scale) in enumerate(
            (("ttft_mean_s", "TTFT", 1.0), ("handoff_mean_ms", "handoff", 1e-3))
        ):
            bars = np.array([r[key] * scale for r in rows])
            times.bar(
                x + (k - 0.5) * width,
                bars,
                width,
                yerr=e2e_report.error_bars(rows, key) * scale,
                capsize=3,
                label=f"{name} mean",
            )
        bottom = np.zeros(len(rows))
        for key, name in (
            ("prefill_queue_mean_ms", "prefill queue"),
            ("prefill_lookup_load_mean_ms", "prefill lookup + load"),
            ("prefill_compute_mean_ms", "prefill compute"),
            ("prefill_save_mean_ms", "prefill save (KV)"),
            ("decode_wait_mean_ms", "handoff wait"),
            ("decode_lookup_mean_ms", "decode lookup"),
            ("decode_load_mean_ms", "decode load (KV)"),
            ("decode_compute_mean_ms", "decode last block"),
        ):
            part = np.array([r[key] / 1e3 for r in rows])
            split.bar(x, part, 0.5, bottom=bottom, label=name)
            bottom += part
        qps.bar(
            x,
            [r["qps"] for r in rows],
            0.5,
            yerr=e2e_report.error_bars(rows, "qps"),
            capsize=3,
            label="served",
        )
        sustained = [(xi, r.get("service_qps")) for xi, r in zip(x, rows, strict=True)]
        sustained = [(xi, v) for xi, v in sustained if v is not None]
        if sustained:
            qps.scatter(*zip(*sustained, strict=True), marker="D", s=20, color="black")
        qps.scatter([], [], marker="D", s=20, color="black", label="sustainable (busy time)")
        qps.legend(fontsize=8)
        title = "throughput"
        if "headline" in doc:
            low, high = PAPER_QPS_RATIO
            title += f" ({doc['headline']['qps_ratio']:.2f}x; paper {low}-{high}x)"
        for ax, name, ylabel in (
            (times, "TTFT and handoff", "seconds"),
            (split, "mean TTFT by step", "seconds"),
            (qps, title, "requests / s"),
        ):
            ax.set_xticks(x, systems)
            ax.set(title=name, ylabel=ylabel)
            ax.grid(True, axis="y", alpha=0.3)
        times.legend(fontsize=8)
        split.legend(fontsize=7)
        s = doc["settings"]
        fig.suptitle(
            f"Prefill/decode {s['pd'][0]}:{s['pd'][1]}: model {s['model']} "
            f"({s['block_bytes'] >> 10} KiB blocks), {s['trace']['context_tokens']}-token "
            f"contexts, {s['max_tokens']} output tokens; median of {len(doc['runs'])} runs "
            "(bars: range)"
        )
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
