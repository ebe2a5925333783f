"""End to end beside Mooncake: one trace, one model, two KV stores, in one run.

``beluga bench e2e --baseline mooncake`` runs the experiment of
:mod:`beluga.bench.e2e` for two systems, both up for the whole run and
taking turns pass by pass, each on a store of its own:

beluga
    engines share one pool (:class:`beluga.serving.engine.ServingEngine`:
    one C call moves a request's blocks between the pool and the KV cache),
    routed by the locality-free scheduler, as on a CXL pool;
mooncake
    the same engines with Mooncake Store as their KV store
    (:class:`beluga.bench.mooncake_engine.MooncakeServingEngine`): real
    ``mooncake_master`` and storage processes on loopback
    (:class:`beluga.bench.mooncake.MooncakeBaseline`), each engine gathering
    its blocks into a registered staging buffer (pinned and registered with
    CUDA when the engines are on a GPU, as Mooncake's own vLLM and SGLang
    integrations stage) and moving them with ``batch_put_from`` /
    ``batch_get_into`` through Mooncake's transfer engine, routed by the
    locality-aware scheduler Mooncake deployments use.  Its transport here is
    TCP on loopback (:data:`~beluga.bench.mooncake_engine.TRANSPORT`; the
    wheel has no RDMA, and the paper's Mooncake ran over RDMA): the output
    says so, and :func:`paper_scale` carries the per-byte costs measured here
    to the paper's block sizes rather than claiming its network.

Each replays the trace twice (pass 1 fills its store, pass 2 hits it).  Per
system and pass the report gives what :func:`beluga.bench.e2e_figures.pass_row`
does plus the cost per block of each step and the share of TTFT spent loading
KV; the headline is the paper's table: pass-2 mean TTFT of Beluga as a
fraction of Mooncake's, and the pass-2 QPS ratio.  :func:`paper_scale` then
carries the measured per-block costs to the paper's Qwen-32B / 15K-token
setting.  Everything started is stopped, and everything created removed,
however the run ends.

Figures that compare: the two systems run ``settings.repeat`` times, each
repetition from scratch and interleaved (Beluga's pass 1, Mooncake's pass 1,
Beluga's pass 2, Mooncake's pass 2, then the next repetition); rows and the
headline are medians, each with its range.  Both stores get one capacity
budget (:func:`capacity_budget`): the bytes of KV each may hold before it
evicts, so Beluga's data area is sized to its server's high watermark and
Mooncake's segment to its master's.  Evictions come from each store's own
count (the server's stats; the master's Prometheus counters).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from beluga.bench import e2e, e2e_figures, e2e_report, e2e_settings
from beluga.bench.mooncake import MooncakeBaseline
from beluga.bench.mooncake_engine import TRANSPORT, MooncakeEngines
from beluga.serving.cluster import Cluster, Record
from beluga.serving.scheduler import make_scheduler
from beluga.serving.trace import TraceRequest
from beluga.units import MiB

SYSTEMS = {"beluga": "locality-free", "mooncake": "locality-aware"}  # system: its scheduler
PAPER = {
    "ttft_fraction": 1.36 / 13.0,  # the paper's pass-2 mean TTFT, Beluga over Mooncake
    "qps_ratio": 7.35,
    "ttft_gap_s": 13.0 - 1.36,
}
# the paper's setting: Qwen-32B (64 layers, 8 KV heads of 128, bf16 KV), 15K-token prompts
PAPER_MODEL = {"name": "Qwen-32B", "layers": 64, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}
PAPER_TOKENS = 15_000
MEANINGFUL_SCALE = 16  # beyond this, per-block fixed costs scaled as bytes say little
MOONCAKE_HIGH_WATERMARK = 0.90  # mooncake_master's default --eviction_high_watermark_ratio
MOONCAKE_LEAST_SEGMENT = 16 * MiB  # a smaller segment fails to mount (INVALID_PARAMS), 0.3.13
MASTER_COUNTERS = {  # what a row reports: the master's Prometheus counter
    "evictions": "master_evicted_key_count",
    "puts_without_room": "master_put_start_alloc_failures_total",
}

Progress = Callable[[str, int, Record], None]

COLUMNS = [
    ("system", "system"),
    ("scheduler", "scheduler"),
    ("pass", "pass"),
    ("hit_ratio", "hit ratio"),
    ("ttft_mean_s", "TTFT mean s"),
    ("ttft_p99_s", "TTFT p99 s"),
    ("queue_mean_s", "queue s"),
    ("lookup_mean_ms", "lookup ms"),
    ("load_mean_ms", "load ms"),
    ("load_ms_per_block", "load ms/blk"),
    ("compute_mean_s", "compute s"),
    ("save_ms_per_block", "save ms/blk"),
    ("load_share_of_ttft", "load/TTFT"),
    ("imbalance", "imbalance"),
    ("qps", "QPS"),
    ("evictions", "evictions"),
    ("duplicate_blocks", "computed twice"),
]


def system_row(
    system: str,
    pass_no: int,
    records: Sequence[Record],
    trace: Sequence[TraceRequest],
    settings: e2e_settings.Settings,
    counters: dict[str, int | None],
) -> dict[str, Any]:
    """One row: :func:`e2e_figures.pass_row`, plus per-block costs and the share of TTFT loading KV.

    Per-block figures are None where no block moved (pass 2 saves nothing;
    pass 1 loads only what earlier requests of the same pass stored).
    """
    block_tokens, nbytes = settings.shape.block_tokens, settings.format.nbytes
    loaded_blocks = sum(r.served.cached_tokens // block_tokens for r in records)
    saved_blocks = sum(r.served.saved_blocks for r in records)
    lookup = sum(r.served.timings.lookup for r in records)
    load = sum(r.served.timings.load for r in records)
    save = sum(r.served.timings.save for r in records)
    service = sum(r.served.timings.ttft for r in records)
    ttft = sum(r.ttft for r in records)
    keys = sum(r.served.num_tokens // block_tokens for r in records)  # one per full block

    def per_block(seconds: float, blocks: int) -> float | None:
        return 1e3 * seconds / blocks if blocks else None

    return {
        "system": system,
        "scheduler": SYSTEMS[system],
        "pass": pass_no,
        **e2e_figures.pass_row(records, trace, settings, counters),
        "block_bytes": nbytes,
        "loaded_blocks": loaded_blocks,
        "lookup_ms_per_key": 1e3 * lookup / keys if keys else None,
        "load_ms_per_block": per_block(load, loaded_blocks),
        "save_ms_per_block": per_block(save, saved_blocks),
        "load_gbps": loaded_blocks * nbytes / load / 1e9 if loaded_blocks and load > 0 else None,
        "service_mean_s": service / len(records),
        "load_share_of_ttft": load / ttft if ttft > 0 else 0.0,
        "load_share_of_service": load / service if service > 0 else 0.0,
    }


def headline(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The paper's table from pass 2: Beluga's mean TTFT over Mooncake's, and the QPS ratio."""
    by = {(r["system"], r["pass"]): r for r in rows}
    b, m = by[("beluga", 2)], by[("mooncake", 2)]
    out = {
        "pass2_ttft_fraction": b["ttft_mean_s"] / m["ttft_mean_s"],
        "pass2_qps_ratio": b["qps"] / m["qps"],
        # without the queueing that routing adds: each request's own lookup + load + compute
        "pass2_service_fraction": b["service_mean_s"] / m["service_mean_s"],
        "pass2_load_per_block_ratio": ratio(m["load_ms_per_block"], b["load_ms_per_block"]),
        # what each system's engines could sustain, whatever the arrival rate
        "pass2_service_qps_ratio": ratio(b.get("service_qps"), m.get("service_qps")),
        "pass2_kv_share_of_ttft_beluga": b.get("load_share_of_ttft"),
        "pass2_kv_share_of_ttft_mooncake": m.get("load_share_of_ttft"),
        "paper": PAPER,
    }
    for system in SYSTEMS:  # each system's prefix cache: its pass-2 hits, and TTFT over pass 1's
        second, first = by[(system, 2)], by.get((system, 1), {})
        out[f"pass2_hit_ratio_{system}"] = second.get("hit_ratio")
        out[f"pass2_over_pass1_ttft_{system}"] = ratio(
            second["ttft_mean_s"], first.get("ttft_mean_s")
        )
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None where either is missing or b is 0."""
    return a / b if a is not None and b else None


def paper_scale(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The measured per-block costs carried to the paper's Qwen-32B / 15K-token requests.

    Loads and saves scale with bytes (both stores move a block as one run of
    bytes, so the time per byte measured here is used; fixed per-block costs
    make this an upper bound for the store with the larger per-block cost);
    lookups scale with keys.  Compute and queueing do not carry over from
    this CPU to the paper's GPUs, so the estimate is the KV time each request
    spends, and the gap it opens between the systems beside the paper's gap
    in mean TTFT.
    """
    model = PAPER_MODEL
    block_bytes = 2 * model["layers"] * model["kv_heads"] * model["head_dim"] * 16
    block_bytes *= model["dtype_bytes"]
    blocks = PAPER_TOKENS // 16
    out: dict[str, Any] = {
        "model": model,
        "tokens": PAPER_TOKENS,
        "block_bytes": block_bytes,
        "blocks_per_request": blocks,
        "bytes_scale": 0.0,  # paper block bytes over the measured block's
        "systems": {},
    }
    by = {(r["system"], r["pass"]): r for r in rows}
    for system in SYSTEMS:
        hit, fill = by[(system, 2)], by[(system, 1)]
        costs = (hit["load_ms_per_block"], hit["lookup_ms_per_key"], fill["save_ms_per_block"])
        if None in costs:
            continue
        scale = out["bytes_scale"] = block_bytes / hit["block_bytes"]
        load = blocks * hit["load_ms_per_block"] * scale / 1e3
        lookup = blocks * hit["lookup_ms_per_key"] / 1e3
        out["systems"][system] = {
            "load_ms_per_block": hit["load_ms_per_block"] * scale,
            "save_ms_per_block": fill["save_ms_per_block"] * scale,
            "lookup_s": lookup,
            "load_s": load,
            "save_s": blocks * fill["save_ms_per_block"] * scale / 1e3,
            "kv_s_per_hit": lookup + load,
        }
    systems = out["systems"]
    if len(systems) == len(SYSTEMS):
        b, m = systems["beluga"], systems["mooncake"]
        out["kv_gap_s_per_hit"] = m["kv_s_per_hit"] - b["kv_s_per_hit"]
        out["kv_ratio_per_hit"] = ratio(m["kv_s_per_hit"], b["kv_s_per_hit"])
        out["paper_ttft_gap_s"] = PAPER["ttft_gap_s"]
    return out


def capacity_budget(settings: e2e_settings.Settings) -> int:
    """One budget for both stores: :func:`e2e.capacity_budget` of one cache namespace (each
    system has a store of its own), never below what Mooncake's smallest segment holds."""
    least = int(MOONCAKE_LEAST_SEGMENT * MOONCAKE_HIGH_WATERMARK)
    budget = e2e.capacity_budget(settings, 1)
    if budget < least and settings.capacity is not None:
        raise ValueError(
            f"--capacity must be at least {least} bytes here: Mooncake's segment cannot be "
            f"smaller than {MOONCAKE_LEAST_SEGMENT >> 20} MiB"
        )
    return max(budget, least)


def segment_bytes(capacity: int) -> int:
    """A Mooncake segment (a whole number of MiB) that holds ``capacity`` bytes of KV below
    its master's high watermark."""
    return math.ceil(capacity / MOONCAKE_HIGH_WATERMARK / MiB) * MiB


def capacity_note(settings: e2e_settings.Settings, capacity: int) -> dict[str, Any]:
    """:func:`e2e.capacity_note` and Mooncake's side of the same budget."""
    return {
        **e2e.capacity_note(settings, capacity),
        "mooncake_segment_bytes": segment_bytes(capacity),
        "mooncake_evicts_above": MOONCAKE_HIGH_WATERMARK,
    }


def master_counters(url: str) -> dict[str, int | None]:
    """The master's evictions (and puts it found no room for) from its Prometheus page;
    None for each where the page or the counter is not there."""
    try:
        with urllib.request.urlopen(url, timeout=5) as page:
            text = page.read().decode()
    except OSError:
        return dict.fromkeys([*MASTER_COUNTERS, "duplicate_writes_skipped"])
    values = dict(
        line.split(" ", 1) for line in text.splitlines() if " " in line and line[0] != "#"
    )
    out: dict[str, int | None] = {
        key: int(float(values[name])) if name in values else None
        for key, name in MASTER_COUNTERS.items()
    }
    out["duplicate_writes_skipped"] = None  # the engines skip what exists; the master sees none
    return out


@contextlib.contextmanager
def mooncake_cluster(
    settings: e2e_settings.Settings, say: Callable[[str], None] = lambda _: None, capacity: int = 0
) -> Iterator[e2e.Started]:
    """Mooncake Store on loopback holding ``capacity`` bytes of KV (default:
    :func:`capacity_budget`), and engines in their roles that keep their KV there, warmed up.

    The engines always start with "spawn", whatever ``settings.start_method``
    says: this process holds a Mooncake client, and a forked child's own
    client never finishes connecting.  Everything stops when the block ends.
    """
    segment = segment_bytes(capacity or capacity_budget(settings))
    say(f"starting Mooncake (a {segment >> 20} MiB segment)")
    started = time.monotonic()
    with MooncakeBaseline(segment_size=segment, local_buffer_size=16 * MiB) as mooncake:
        build = MooncakeEngines(
            mooncake.metadata_url,
            mooncake.master_address,
            staging_blocks=settings.trace.max_prompt_tokens // settings.shape.block_tokens,
        )
        config = settings.engine_config()
        say(f"starting {settings.engines} engines on Mooncake")
        with Cluster(
            f"mooncake:{mooncake.master_address}",
            config,
            engines=settings.engines,
            roles=settings.roles,
            start_method="spawn",
            build=build,
        ) as cluster:
            startup = time.monotonic() - started
            e2e.warm_up(cluster, settings)
            counters = functools.partial(master_counters, mooncake.metrics_url)
            yield e2e.Started(cluster, startup, segment, counters)


def run(
    settings: e2e_settings.Settings,
    pool: str | None = None,
    on_record: Progress | None = None,
    on_phase: Callable[[str], None] | None = None,
    want_logits: bool = False,
) -> dict[str, Any]:
    """Both systems, ``settings.repeat`` times, pass by pass; ``on_record(system, pass,
    record)`` follows progress.

    In each repetition both stay up and take turns (Beluga's pass 1, Mooncake's
    pass 1, Beluga's pass 2, Mooncake's pass 2), so that a slow spell of a
    shared machine falls on both rather than on one.
    """
    say = on_phase or (lambda _: None)
    trace = settings.requests()
    prompts = [r.token_ids for r in trace]
    capacity = capacity_budget(settings)
    settings.check_gpu(len(SYSTEMS) * settings.engines)  # both systems' engines are up at once
    calibration = None
    runs = []
    for rep in range(settings.repeat):
        beluga_settings = dataclasses.replace(settings, schedulers=(SYSTEMS["beluga"],))
        records: dict[tuple[str, int], list[Record]] = {}
        counts: dict[tuple[str, int], dict[str, int | None]] = {}
        with contextlib.ExitStack() as stack:
            systems = {
                "beluga": stack.enter_context(
                    e2e.pool_cluster(beluga_settings, pool, say, capacity)
                ),
                "mooncake": stack.enter_context(mooncake_cluster(settings, say, capacity)),
            }
            if settings.rate is None:  # measured once, on Beluga's engines, for both systems
                say("measuring a rate below saturation")
                settings, calibration = e2e.with_rate(settings, systems["beluga"])
            # one scheduler per system for both passes: an affinity learnt in pass 1 holds
            schedulers = {
                system: make_scheduler(SYSTEMS[system], settings.engines) for system in systems
            }
            for pass_no in (1, 2):
                for system, started in systems.items():
                    say(f"run {rep + 1}/{settings.repeat}, {system}: pass {pass_no}")
                    before = started.counters()
                    records[(system, pass_no)] = started.cluster.run(
                        prompts,
                        schedulers[system],
                        salt=system,
                        arrivals=settings.arrivals(settings.seed + pass_no),
                        want_logits=want_logits,
                        on_record=on_record and functools.partial(on_record, system, pass_no),
                    )
                    counts[(system, pass_no)] = e2e.counted(started, before)
        rows = [
            system_row(system, p, records[(system, p)], trace, settings, counts[(system, p)])
            for system in SYSTEMS
            for p in (1, 2)
        ]
        startup = {system: started.startup_s for system, started in systems.items()}
        runs.append({"startup_s": startup, "rows": rows, "headline": headline(rows)})
    rows = e2e_figures.median_rows([r["rows"] for r in runs])
    fmt = settings.format
    return {
        "settings": {
            **dataclasses.asdict(settings),
            "schedulers": SYSTEMS,
            "kv_format": fmt.fingerprint,
            "kv_dtype": settings.kv_dtype,
            "block_bytes": fmt.nbytes,
            "engine_memory_bytes": settings.memory_bytes,
            "calibration": calibration,
            "pool_bytes": e2e.pool_for(settings, capacity)[0],
            "mooncake_segment_bytes": segment_bytes(capacity),
            "mooncake_transport": TRANSPORT,
            "mooncake_staging": staging_note(settings),
            "capacity": capacity_note(settings, capacity),
        },
        "model_params": settings.shape.num_params,
        "requests_per_pass": len(prompts),
        "startup_s": e2e_figures.median_fields([r["startup_s"] for r in runs]),
        "rows": rows,
        "headline": e2e_figures.median_fields([r["headline"] for r in runs]),
        "paper_scale": paper_scale(rows),
        "runs": runs,
    }


def staging_note(settings: e2e_settings.Settings) -> str:
    """Where Mooncake's engines stage blocks, in words."""
    if settings.on_gpu:
        return "pinned host memory registered with CUDA (one DMA per batch each way)"
    return "host memory (the engines are on the CPU)"


def transport_line(doc: dict[str, Any], scaled: bool = True) -> str:
    """How Mooncake moved bytes in this run (and, when ``scaled``, what the paper-scale
    figures that follow carry over)."""
    s = doc["settings"]
    line = (
        f"Mooncake's transport here: {s.get('mooncake_transport', TRANSPORT)} (its transfer "
        "engine's TCP on loopback; the paper's Mooncake ran over RDMA), staging in "
        f"{s.get('mooncake_staging', staging_note(e2e_settings.Settings()))}"
    )
    if scaled:
        line += "; the paper-scale figures below scale the per-byte costs measured here"
    return line


def capacity_line(doc: dict[str, Any]) -> str:
    """The capacity budget both stores had, in words."""
    c = doc["settings"]["capacity"]
    return (
        f"capacity: each store may hold {c['budget_bytes'] / MiB:.1f} MiB of KV before it "
        f"evicts (from {c['from']}): Beluga's data area {c['beluga_data_bytes'] / MiB:.1f} MiB "
        f"(its server evicts above {100 * c['beluga_evicts_above']:.0f}%), Mooncake's segment "
        f"{c['mooncake_segment_bytes'] / MiB:.0f} MiB (its master evicts above "
        f"{100 * c['mooncake_evicts_above']:.0f}%)"
    )


def store_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Evictions, blocks refused and computed twice per system and pass, and why a system's
    pass-2 hit ratio falls below the other's."""
    lines = []
    hits = {r["system"]: r["hit_ratio"] for r in rows if r["pass"] == 2}
    for row in rows:
        evictions = "n/a" if row["evictions"] is None else f"{row['evictions']:g}"
        lines.append(
            f"  {row['system']} pass {row['pass']}: {evictions} evictions, "
            f"{row['refused_blocks']:g} blocks refused, {e2e_report.duplicate_note(row)}"
        )
        others = [hit for system, hit in hits.items() if system != row["system"]]
        why = e2e_report.hit_shortfall(row, max(others)) if row["pass"] == 2 and others else None
        if why:
            lines.append(f"    {row['system']}'s pass 2: {why}")
    return lines


def summary(doc: dict[str, Any]) -> str:
    """The headline with its ranges, capacity and evictions, the KV share of pass-2 TTFT,
    and the paper-scale estimate, in words."""
    h, scale = doc["headline"], doc["paper_scale"]
    by = {(r["system"], r["pass"]): r for r in doc["rows"]}
    runs = len(doc.get("runs", [])) or 1
    lines = [
        f"{doc['requests_per_pass']} requests a pass ({e2e_report.arrivals_note(doc['settings'])})",
        f"pass 2 (median, range over {runs} runs): Beluga's mean TTFT is "
        f"{e2e_report.ranged(h, 'pass2_ttft_fraction', 100)}% of Mooncake's "
        f"(paper {100 * PAPER['ttft_fraction']:.1f}%); "
        f"QPS {e2e_report.ranged(h, 'pass2_qps_ratio')}x "
        f"(paper {PAPER['qps_ratio']:.2f}x); without queueing, per-request service "
        f"{e2e_report.ranged(h, 'pass2_service_fraction', 100)}%",
        "  pass-2 hit ratio: "
        + ", ".join(f"{s} {e2e_report.ranged(by[(s, 2)], 'hit_ratio')}" for s in SYSTEMS)
        + f" (best possible {by[('beluga', 2)]['best_hit_ratio']:.3f}); pass-2 TTFT over "
        "pass 1's: "
        + ", ".join(
            f"{s} {e2e_report.ranged(h, f'pass2_over_pass1_ttft_{s}', 100)}%"
            for s in SYSTEMS
            if h.get(f"pass2_over_pass1_ttft_{s}") is not None
        ),
        "  throughput the engines could sustain (requests per second of busy time), pass 2: "
        f"{times(h.get('pass2_service_qps_ratio'))} Beluga over Mooncake",
        capacity_line(doc),
        transport_line(doc),
        *store_lines(doc["rows"]),
    ]
    for system in SYSTEMS:
        row = by[(system, 2)]
        lines.append(
            f"  {system}: KV load is {100 * row['load_share_of_ttft']:.1f}% of pass-2 TTFT "
            f"({100 * row['load_share_of_service']:.1f}% of lookup+load+compute); "
            f"{_ms(row['load_ms_per_block'])} ms per {row['block_bytes'] >> 10} KiB block loaded, "
            f"{_ms(by[(system, 1)]['save_ms_per_block'])} ms per block saved"
        )
    model = scale["model"]
    lines.append(
        f"at the paper's {model['name']} / {scale['tokens']}-token hits "
        f"({scale['blocks_per_request']} blocks of {scale['block_bytes'] >> 20} MiB), "
        "by the per-byte costs measured here:"
    )
    if scale["bytes_scale"] > MEANINGFUL_SCALE:
        lines.append(
            f"  (blocks here are {scale['bytes_scale']:.0f}x smaller than the paper's: fixed "
            "per-block costs, scaled as bytes, inflate this; use --model wide-kv, or 7b on a GPU)"
        )
    for system, s in scale["systems"].items():
        lines.append(
            f"  {system}: lookup {s['lookup_s']:.2f} s + load {s['load_s']:.2f} s per hit "
            f"({s['load_ms_per_block']:.2f} ms/block); a fill saves in {s['save_s']:.2f} s"
        )
    if "kv_gap_s_per_hit" in scale:
        lines.append(
            f"  Mooncake spends {scale['kv_gap_s_per_hit']:.2f} s more on KV per hit "
            f"({scale['kv_ratio_per_hit']:.1f}x); the paper's mean TTFT gap is "
            f"{scale['paper_ttft_gap_s']:.2f} s"
        )
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def times(value: float | None) -> str:
    """A ratio as "1.23x", or "-" where it was not measured."""
    return "-" if value is None else f"{value:.2f}x"


def chart(doc: dict[str, Any], path: str) -> None:
    """TTFT per pass, pass-2 time split per step, and QPS per pass: both systems side by side."""
    from beluga.bench.report import pyplot

    plt = pyplot()
    by = {(r["system"], r["pass"]): r for r in doc["rows"]}
    systems = list(SYSTEMS)
    x = np.arange(len(systems))
    width = 0.35
    fig, (ttft, split, qps) = plt.subplots(1, 3, figsize=(13, 4.5), dpi=100)
    try:
        for k, pass_no in enumerate((1, 2)):
            at = x + (k - 0.5) * width
            rows = [by[(s, pass_no)] for s in systems]
            ttft.bar(
                at,
                [r["ttft_mean_s"] for r in rows],
                width,
                yerr=e2e_report.error_bars(rows, "ttft_mean_s"),
                capsize=3,
                label=f"pass {pass_no} mean",
            )
            ttft.scatter(at, [r["ttft_p99_s"] for r in rows], marker="_", s=400, color="black")
            qps.bar(
                at,
                [r["qps"] for r in rows],
                width,
                yerr=e2e_report.error_bars(rows, "qps"),
                capsize=3,
                label=f"pass {pass_no}",
            )
            sustained = [(a, r["service_qps"]) for a, r in zip(at, rows, strict=True)]
            sustained = [(a, v) for a, v in sustained if v is not None]
            if sustained:
                qps.scatter(*zip(*sustained, strict=True), marker="D", s=20, color="black")
        qps.scatter([], [], marker="D", s=20, color="black", label="sustainable (busy time)")
        ttft.scatter([], [], marker="_", s=100, color="black", label="p99")
        steps = [by[(s, p)] for p in (1, 2) for s in systems]
        e2e_report.step_bars(split, steps, [f"{r['system']}\npass {r['pass']}" for r in steps])
        labels = [f"{s}\n({SYSTEMS[s]})" for s in systems]
        h = doc["headline"]
        for ax, title, ylabel in (
            (ttft, "time to first token", "seconds"),
            (qps, f"throughput (pass 2: {h['pass2_qps_ratio']:.2f}x)", "requests / s"),
        ):
            ax.set_xticks(x, labels)
            ax.set(title=title, ylabel=ylabel)
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=8)
        s = doc["settings"]
        fig.suptitle(
            f"Beluga vs Mooncake Store: model {s['model']} ({s['block_bytes'] >> 10} KiB blocks), "
            f"{s['trace']['context_tokens']}-token contexts, {s['engines']} engines (Mooncake over "
            f"{s.get('mooncake_transport', TRANSPORT)});\npass-2 TTFT "
            f"{100 * h['pass2_ttft_fraction']:.1f}% of Mooncake's (median of "
            f"{s.get('repeat', 1)} runs; bars: range)"
        )
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
