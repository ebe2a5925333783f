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
    its blocks into a registered staging buffer and moving them with
    ``batch_put_from`` / ``batch_get_into`` through Mooncake's transfer
    engine, routed by the locality-aware scheduler Mooncake deployments use.

Each replays the trace twice (pass 1 fills its store, pass 2 hits it).  Per
system and pass the report gives what :func:`beluga.bench.e2e.summarize`
does plus the cost per block of each step and the share of TTFT spent loading
KV; the headline is the paper's table: pass-2 mean TTFT of Beluga as a
fraction of Mooncake's, and the pass-2 QPS ratio.  :func:`paper_scale` then
carries the measured per-block costs to the paper's Qwen-32B / 15K-token
setting.  Everything started is stopped, and everything created removed,
however the run ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from beluga.bench import e2e
from beluga.bench.mooncake import MooncakeBaseline
from beluga.bench.mooncake_engine import MooncakeEngines
from beluga.serving.cluster import Cluster, EngineConfig, Record
from beluga.serving.scheduler import make_scheduler
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
SEGMENT_HEADROOM = 1.5  # Mooncake evicts above a high watermark: room over what the trace stores
SEGMENT_SLACK = 64 * MiB

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
]


def system_row(
    system: str,
    pass_no: int,
    records: Sequence[Record],
    engines: int,
    block_tokens: int,
    nbytes: int,
) -> dict[str, Any]:
    """One row: :func:`e2e.summarize`, plus per-block costs and the share of TTFT loading KV.

    Per-block figures are None where no block moved (pass 2 saves nothing;
    pass 1 loads only what earlier requests of the same pass stored).
    """
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
        **e2e.summarize(records, engines),
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
    return {
        "pass2_ttft_fraction": b["ttft_mean_s"] / m["ttft_mean_s"],
        "pass2_qps_ratio": b["qps"] / m["qps"],
        # without the queueing that routing adds: each request's own lookup + load + compute
        "pass2_service_fraction": b["service_mean_s"] / m["service_mean_s"],
        "pass2_load_per_block_ratio": _ratio(m["load_ms_per_block"], b["load_ms_per_block"]),
        "paper": PAPER,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
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
        out["kv_ratio_per_hit"] = _ratio(m["kv_s_per_hit"], b["kv_s_per_hit"])
        out["paper_ttft_gap_s"] = PAPER["ttft_gap_s"]
    return out


def segment_bytes(settings: e2e.Settings) -> int:
    """A Mooncake segment that holds every block the trace stores, with headroom."""
    need = e2e.blocks_needed(settings.requests(), settings.trace, settings.shape.block_tokens)
    need += settings.engines * e2e.WARMUP_TOKENS // settings.shape.block_tokens
    return int(need * settings.format.nbytes * SEGMENT_HEADROOM) + SEGMENT_SLACK


@contextlib.contextmanager
def mooncake_cluster(
    settings: e2e.Settings, say: Callable[[str], None] = lambda _: None
) -> Iterator[e2e.Started]:
    """Mooncake Store on loopback and engines that keep their KV there, warmed up.

    The engines always start with "spawn", whatever ``settings.start_method``
    says: this process holds a Mooncake client, and a forked child's own
    client never finishes connecting.  Everything stops when the block ends.
    """
    segment = segment_bytes(settings)
    say(f"starting Mooncake (a {segment >> 20} MiB segment)")
    started = time.monotonic()
    with MooncakeBaseline(segment_size=segment, local_buffer_size=16 * MiB) as mooncake:
        build = MooncakeEngines(
            mooncake.metadata_url,
            mooncake.master_address,
            staging_blocks=settings.trace.max_prompt_tokens // settings.shape.block_tokens,
        )
        config = EngineConfig(
            settings.shape, seed=settings.seed, threads=settings.threads, device=settings.device
        )
        say(f"starting {settings.engines} engines on Mooncake")
        with Cluster(
            f"mooncake:{mooncake.master_address}",
            config,
            engines=settings.engines,
            start_method="spawn",
            build=build,
        ) as cluster:
            startup = time.monotonic() - started
            e2e.warm_up(cluster, settings)
            yield e2e.Started(cluster, startup, segment)


def run(
    settings: e2e.Settings,
    pool: str | None = None,
    on_record: Progress | None = None,
    on_phase: Callable[[str], None] | None = None,
    want_logits: bool = False,
) -> dict[str, Any]:
    """Both systems, pass by pass; ``on_record(system, pass, record)`` follows progress.

    Both stay up for the whole run and take turns (Beluga's pass 1, Mooncake's
    pass 1, Beluga's pass 2, Mooncake's pass 2), so that a slow spell of a
    shared machine falls on both rather than on one.
    """
    say = on_phase or (lambda _: None)
    prompts = [r.token_ids for r in settings.requests()]
    beluga_settings = dataclasses.replace(settings, schedulers=(SYSTEMS["beluga"],))
    records: dict[tuple[str, int], list[Record]] = {}
    with contextlib.ExitStack() as stack:
        systems = {
            "beluga": stack.enter_context(e2e.pool_cluster(beluga_settings, pool, say)),
            "mooncake": stack.enter_context(mooncake_cluster(settings, say)),
        }
        # one scheduler per system for both passes: an affinity learnt in pass 1 holds in pass 2
        schedulers = {
            system: make_scheduler(SYSTEMS[system], settings.engines) for system in systems
        }
        for pass_no in (1, 2):
            for system, started in systems.items():
                say(f"{system}: pass {pass_no}")
                records[(system, pass_no)] = started.cluster.run(
                    prompts,
                    schedulers[system],
                    salt=system,
                    rate=settings.rate,
                    seed=settings.seed + pass_no,
                    want_logits=want_logits,
                    on_record=on_record and functools.partial(on_record, system, pass_no),
                )
    fmt = settings.format
    rows = [
        system_row(
            system, p, records[(system, p)], settings.engines, fmt.spec.block_tokens, fmt.nbytes
        )
        for system in SYSTEMS
        for p in (1, 2)
    ]
    return {
        "settings": {
            **dataclasses.asdict(settings),
            "schedulers": SYSTEMS,
            "kv_format": fmt.fingerprint,
            "block_bytes": fmt.nbytes,
            "pool_bytes": systems["beluga"].store_bytes,
            "mooncake_segment_bytes": systems["mooncake"].store_bytes,
        },
        "model_params": e2e.model_params(settings.shape),
        "requests_per_pass": len(prompts),
        "startup_s": {system: started.startup_s for system, started in systems.items()},
        "rows": rows,
        "headline": headline(rows),
        "paper_scale": paper_scale(rows),
    }


def summary(doc: dict[str, Any]) -> str:
    """The headline, the KV share of pass-2 TTFT, and the paper-scale estimate, in words."""
    h, scale = doc["headline"], doc["paper_scale"]
    by = {(r["system"], r["pass"]): r for r in doc["rows"]}
    lines = [
        f"pass 2: Beluga's mean TTFT is {100 * h['pass2_ttft_fraction']:.1f}% of Mooncake's "
        f"(paper {100 * PAPER['ttft_fraction']:.1f}%); QPS {h['pass2_qps_ratio']:.2f}x "
        f"(paper {PAPER['qps_ratio']:.2f}x); without queueing, per-request service "
        f"{100 * h['pass2_service_fraction']:.1f}%",
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
            "per-block costs, scaled as bytes, inflate this; use --model wide-kv)"
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


def chart(doc: dict[str, Any], path: str) -> None:
    """TTFT per pass, pass-2 time split per step, and QPS per pass: both systems side by side."""
    from beluga.bench.report import _pyplot

    plt = _pyplot()
    by = {(r["system"], r["pass"]): r for r in doc["rows"]}
    systems = list(SYSTEMS)
    x = np.arange(len(systems))
    width = 0.35
    fig, (ttft, split, qps) = plt.subplots(1, 3, figsize=(13, 4.5), dpi=100)
    try:
        for k, pass_no in enumerate((1, 2)):
            at = x + (k - 0.5) * width
            rows = [by[(s, pass_no)] for s in systems]
            ttft.bar(at, [r["ttft_mean_s"] for r in rows], width, label=f"pass {pass_no} mean")
            ttft.scatter(at, [r["ttft_p99_s"] for r in rows], marker="_", s=400, color="black")
            qps.bar(at, [r["qps"] for r in rows], width, label=f"pass {pass_no}")
        ttft.scatter([], [], marker="_", s=100, color="black", label="p99")
        bottom = np.zeros(len(systems))
        second = [by[(s, 2)] for s in systems]
        for key, name, scale in (
            ("queue_mean_s", "queue", 1.0),
            ("lookup_mean_ms", "lookup", 1e-3),
            ("load_mean_ms", "KV load", 1e-3),
            ("compute_mean_s", "compute", 1.0),
        ):
            part = np.array([r[key] * scale for r in second])
            split.bar(x, part, 0.5, bottom=bottom, label=name)
            bottom += part
        labels = [f"{s}\n({SYSTEMS[s]})" for s in systems]
        h = doc["headline"]
        for ax, title, ylabel in (
            (ttft, "time to first token", "seconds"),
            (split, "pass 2: mean TTFT by step", "seconds"),
            (qps, f"throughput (pass 2: {h['pass2_qps_ratio']:.2f}x)", "requests / s"),
        ):
            ax.set_xticks(x, labels)
            ax.set(title=title, ylabel=ylabel)
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=8)
        s = doc["settings"]
        fig.suptitle(
            f"Beluga vs Mooncake Store: model {s['model']} ({s['block_bytes'] >> 10} KiB blocks), "
            f"{s['trace']['context_tokens']}-token contexts, {s['engines']} engines; pass-2 TTFT "
            f"{100 * h['pass2_ttft_fraction']:.1f}% of Mooncake's"
        )
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
