"""End to end: a long-context trace through engines that share one pool, twice.

``run`` creates a pool made for the model's KV blocks (a scratch file in
/dev/shm unless a spec is given), starts the metadata server and the engine
processes (:class:`beluga.serving.cluster.Cluster`), and for each scheduler
replays the trace (:func:`beluga.serving.trace.lv_eval_trace`) twice: pass 1
fills the cache, pass 2 should hit.  Each scheduler gets a cache of its own
through a cache salt (an extra key of every block, as vLLM's ``cache_salt``),
so the second scheduler starts as cold as the first.  Everything it started
or created is stopped and removed before it returns.

Per pass and scheduler it reports the token hit ratio (beside the best a
cache that kept every block could do), mean and p99 time to first token
(arrival to first token, so waiting for a busy engine counts), the mean of
each step (queue, lookup, load, compute, save), load imbalance (the busiest
engine's busy time over the mean), the server's evictions, and the blocks
computed more than once across engines (:func:`duplicate_cost`).

Figures that mean something (:class:`Settings`):

* ``repeat``: the experiment runs that many times from scratch (a fresh pool,
  server and engines each time); ``rows`` are the medians, ``runs`` each
  repetition, and every number comes with its range (:func:`median_fields`);
* ``rate``: Poisson arrivals, so that engines run below saturation and TTFT
  is service time rather than queueing (0: the whole trace at once, which
  measures throughput); ``burst``: each document's first questions arrive
  together (:func:`beluga.serving.trace.in_bursts`), the case where routing
  by load alone makes several engines compute one document;
* ``capacity``: the bytes of KV the store may hold before it evicts (by
  default derived once from the trace, :func:`capacity_budget`); the pool's
  data area is sized so that the server's high watermark falls there.

GPU engines (``device`` cuda) run in bfloat16 and share one GPU, each within
a memory budget (:func:`beluga.serving.model.engine_memory_bytes` of its
longest prompt); the budgets of every engine started at once (both systems'
beside a baseline) must fit on the GPU, or nothing starts.  ``rate`` None
("auto", the command line's default on a GPU) is set below saturation from
a measurement (:func:`calibrate`): each engine that prefills (with --pd,
each prefill engine) prefills one whole prompt, all at once, and the rate is
:data:`UTILISATION` of what they did together,
so that pass 1's TTFT is mostly service time rather than queueing.  The
throughput a pass could sustain, whatever the arrivals, is ``service_qps``:
requests per second of the engines' busy time.

Model sizes (:data:`MODELS`): ``7b`` is Qwen2-7B's shape
(:data:`beluga.serving.model.QWEN2_7B`, 7.6 B parameters), for GPUs only,
with the LV-Eval-like 15,000-token documents of the paper
(:data:`beluga.serving.trace.LV_EVAL_15K`) by default: a miss computes ~2.4e14
FLOP (its linear layers and attention over 15K tokens) and a hit moves 937
blocks of 896 KiB.  ``small`` is the CPU default because at 4K tokens its
compute dwarfs moving its KV: on the 2-core machine this was built on a
16-token block takes ~30 ms to compute at 4K context and ~0.05 ms to load
(128 KiB), so a hit saves what a real GPU hit saves, the compute.  ``tiny``
(the tests' model) keeps the same shape of result with ~7x less compute.
``wide-kv`` has no grouped-query sharing (8 KV heads of 8), so a 16-token
block is 768 KiB, near a 7B-class model's bf16 KV per token (Qwen2-7B: 0.9
MiB a block), for about 1.5x small's compute: moving KV is then a real part
of a hit's time to first token, as in the runs beside Mooncake Store.

Prefill/decode disaggregation over the same clusters is :mod:`beluga.bench.e2e_pd`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from beluga.bench.stats import percentile
from beluga.kv.store import KVStore
from beluga.pool import Pool
from beluga.pool.layout import plan
from beluga.server.service import HIGH_WATERMARK
from beluga.serving.cluster import Cluster, EngineConfig, Record, check_gpu_budget, gpu_bytes
from beluga.serving.engine import KV_ORDER, create_kv_pool, kv_geometry, kv_pool_size
from beluga.serving.model import DTYPES, QWEN2_7B, ModelShape, engine_memory_bytes
from beluga.serving.scheduler import SCHEDULERS, make_scheduler
from beluga.serving.trace import (
    LV_EVAL_15K,
    TraceRequest,
    TraceShape,
    in_bursts,
    lv_eval_trace,
    poisson_arrivals,
)
from beluga.transfer import BlockFormat

MODELS = {
    "tiny": ModelShape(max_positions=16384),
    "small": ModelShape(
        num_layers=8,
        hidden_size=512,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=1408,
        max_positions=16384,
    ),
    "wide-kv": ModelShape(
        num_layers=12,
        hidden_size=512,
        num_heads=8,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=1408,
        max_positions=16384,
    ),
    "7b": QWEN2_7B,
}
GPU_ONLY = {"7b"}  # a CPU would take minutes a prefill
#: the documents' tokens when the command line names none
CONTEXT_TOKENS = {"7b": LV_EVAL_15K.context_tokens}
DEFAULT_CONTEXT_TOKENS = 4096
UTILISATION = 0.5  # an automatic rate offers this share of what the engines can serve
TARGET_PASS2_RATIO = 0.2  # pass-2 mean TTFT at most 20% of pass 1's
HEADROOM = 1.25  # the derived capacity budget over what the trace stores
WARMUP_TOKENS = 64

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


@dataclass(frozen=True)
class Settings:
    """One end-to-end experiment."""

    model: str = "small"
    trace: TraceShape = field(default_factory=TraceShape)
    engines: int = 2
    schedulers: tuple[str, ...] = ("locality-free", "locality-aware")
    seed: int = 0
    rate: float | None = 0.0  # requests/s (Poisson); 0: all at once; None: below saturation
    threads: int = 1  # torch threads per engine
    start_method: str = "spawn"
    device: str = "cpu"  # "cuda": engines run the model, and move KV, on the GPU
    dtype: str | None = None  # of weights and KV; None: bfloat16 on a GPU, float32 on the CPU
    repeat: int = 1  # runs from scratch; rows are medians over them
    capacity: int | None = None  # bytes of KV a store may hold; None: derived from the trace
    burst: int = 1  # each document's first `burst` questions arrive at once
    pd: tuple[int, int] | None = None  # (prefill, decode) engines: disaggregated (e2e_pd)
    max_tokens: int = 16  # tokens a decode engine generates per request

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose from {sorted(MODELS)}")
        unknown = [s for s in self.schedulers if s not in SCHEDULERS]
        if unknown or not self.schedulers:
            raise ValueError(f"schedulers must be some of {sorted(SCHEDULERS)}, not {unknown}")
        if self.model in GPU_ONLY and not self.on_gpu:
            raise ValueError(
                f"model {self.model!r} runs on a GPU (--device cuda); on the CPU use one of "
                f"{sorted(set(MODELS) - GPU_ONLY)}"
            )
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        if self.rate is not None and self.rate < 0:
            raise ValueError(f"rate must be >= 0 requests/s (or None: automatic), not {self.rate}")
        if self.engines < 1 or self.threads < 1:
            raise ValueError("engines and threads must be >= 1")
        if self.repeat < 1 or self.burst < 1 or self.max_tokens < 1:
            raise ValueError("repeat, burst and max_tokens must be >= 1")
        if self.capacity is not None and self.capacity <= 0:
            raise ValueError(f"capacity must be a positive number of bytes, not {self.capacity}")
        if self.pd is not None and (min(self.pd) < 1 or sum(self.pd) != self.engines):
            raise ValueError(
                f"pd must be (prefill, decode) engines, each >= 1, {self.engines} in all; "
                f"not {self.pd}"
            )
        generated = self.max_tokens if self.pd is not None else 0
        if self.trace.max_prompt_tokens + generated > MODELS[self.model].max_positions:
            raise ValueError(
                f"prompts of up to {self.trace.max_prompt_tokens} tokens (and {generated} "
                f"generated) exceed model {self.model!r}'s {MODELS[self.model].max_positions} "
                "positions; use shorter contexts"
            )

    @property
    def shape(self) -> ModelShape:
        return MODELS[self.model]

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def kv_dtype(self) -> str:
        """The engines' dtype: ``dtype``, else bfloat16 on a GPU and float32 on the CPU."""
        return self.dtype or ("bfloat16" if self.on_gpu else "float32")

    @property
    def format(self) -> BlockFormat:
        return BlockFormat(self.shape.kv_spec(self.kv_dtype), KV_ORDER)

    @property
    def memory_bytes(self) -> int | None:
        """Each GPU engine's memory budget (None on the CPU): its longest prompt, and with
        prefill/decode disaggregation the tokens it generates."""
        if not self.on_gpu:
            return None
        generated = self.max_tokens if self.pd is not None else 0
        tokens = max(self.trace.max_prompt_tokens + generated, WARMUP_TOKENS)
        return engine_memory_bytes(self.shape, self.kv_dtype, tokens)

    def engine_config(self) -> EngineConfig:
        """What every engine process builds."""
        return EngineConfig(
            self.shape,
            seed=self.seed,
            threads=self.threads,
            device=self.device,
            dtype=self.kv_dtype,
            memory_bytes=self.memory_bytes,
        )

    def check_gpu(self, engines: int) -> None:
        """Refuse ``engines`` engines of these settings at once on the GPU when their memory
        budgets do not fit there (nothing to check on the CPU)."""
        if self.memory_bytes is not None:
            check_gpu_budget(self.memory_bytes, engines, gpu_bytes(self.device), self.device)

    @property
    def roles(self) -> list[str] | None:
        """Each engine's role when disaggregated: the prefill engines, then the decode ones."""
        if self.pd is None:
            return None
        return ["kv_producer"] * self.pd[0] + ["kv_consumer"] * self.pd[1]

    def requests(self) -> list[TraceRequest]:
        """The trace each pass replays, in arrival order."""
        return self._bursts()[0]

    def arrivals(self, seed: int) -> list[float]:
        """When each request arrives, in seconds from the start of a pass (an automatic rate
        must have been measured: :func:`with_rate`)."""
        if self.rate is None:
            raise ValueError("the rate is automatic: measure it first (beluga.bench.e2e.with_rate)")
        groups = self._bursts()[1]
        return poisson_arrivals(len(groups), self.rate, seed, groups)

    def _bursts(self) -> tuple[list[TraceRequest], list[int]]:
        return in_bursts(lv_eval_trace(self.trace, self.shape.vocab_size, self.seed), self.burst)


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


@dataclass
class Started:
    """A started cluster of engines, with what it took to start it and its store's counts.

    ``store_bytes``: the bytes the store keeps values in (a pool's data area,
    a Mooncake segment); ``counters()``: the store's own counts now
    (``evictions``, ``duplicate_writes_skipped``; None where it keeps none).
    Used by the thread that started it; not fork-safe (it holds the cluster's pipes).
    """

    cluster: Cluster
    startup_s: float
    store_bytes: int
    counters: Callable[[], dict[str, int | None]]


def counted(started: Started, before: dict[str, int | None]) -> dict[str, int | None]:
    """The store's counts since ``before`` (another reading of ``started.counters()``)."""
    out: dict[str, int | None] = {}
    for key, now in started.counters().items():
        then = before.get(key)
        out[key] = None if now is None or then is None else now - then
    return out


def capacity_budget(settings: Settings, namespaces: int) -> int:
    """The bytes of KV a store may hold before it evicts: ``settings.capacity``, else what
    the trace stores once per cache namespace (plus the warm-up's blocks), with HEADROOM."""
    if settings.capacity is not None:
        return settings.capacity
    fmt = settings.format
    bs = fmt.spec.block_tokens
    need = blocks_needed(settings.requests(), settings.trace, bs)
    need = need * namespaces + settings.engines * WARMUP_TOKENS // bs
    if settings.rate is None:  # the calibration's prompts, one per prefilling engine
        need += settings.engines * (settings.trace.max_prompt_tokens // bs)
    return int(need * fmt.nbytes * HEADROOM)


def pool_for(settings: Settings, capacity: int) -> tuple[int, int]:
    """The pool size whose data area holds ``capacity`` bytes of KV below the server's high
    watermark (it evicts above it), and the bytes of that data area."""
    fmt = settings.format
    geometry = kv_geometry(fmt, max_hosts=max(8, settings.engines + 2))
    size = kv_pool_size(math.ceil(capacity / (fmt.pool_block_bytes * HIGH_WATERMARK)), geometry)
    return size, plan(size, geometry).nblocks * geometry.block_size


def capacity_note(settings: Settings, capacity: int) -> dict[str, Any]:
    """What the output says about capacity: the budget, where it came from, Beluga's side."""
    size, data = pool_for(settings, capacity)
    return {
        "budget_bytes": capacity,
        "from": "--capacity" if settings.capacity is not None else "the trace",
        "beluga_pool_bytes": size,
        "beluga_data_bytes": data,
        "beluga_evicts_above": HIGH_WATERMARK,
    }


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


@contextlib.contextmanager
def pool_cluster(
    settings: Settings,
    pool: str | None = None,
    say: Callable[[str], None] = lambda _: None,
    capacity: int | None = None,
) -> Iterator[Started]:
    """A pool that holds ``capacity`` bytes of KV (default: :func:`capacity_budget` for the
    settings' schedulers), its server and engines (in their roles), warmed up.

    The pool (a scratch file in /dev/shm unless ``pool`` names one) is
    removed and every process stopped when the block ends, however it ends.
    """
    fmt = settings.format
    capacity = capacity or capacity_budget(settings, len(settings.schedulers))
    size, data = pool_for(settings, capacity)
    geometry = kv_geometry(fmt, max_hosts=max(8, settings.engines + 2))
    spec = pool or f"/dev/shm/beluga-e2e-{uuid.uuid4().hex[:8]}"
    say(f"creating a {size >> 20} MiB pool for {fmt.fingerprint}")
    create_kv_pool(spec, size, fmt, geometry=geometry).close()
    try:
        config = settings.engine_config()
        say(f"starting the metadata server and {settings.engines} engines")
        started = time.monotonic()
        with Cluster(
            spec,
            config,
            engines=settings.engines,
            roles=settings.roles,
            start_method=settings.start_method,
        ) as cluster:
            startup = time.monotonic() - started
            warm_up(cluster, settings)
            with KVStore(spec) as store:  # the driver's own view of the server's counters
                yield Started(cluster, startup, data, functools.partial(_server_counters, store))
    finally:
        with contextlib.suppress(FileNotFoundError):
            Pool.destroy(spec)


def _server_counters(store: KVStore) -> dict[str, int | None]:
    stats = store.stats()
    return {k: stats[k] for k in ("evictions", "duplicate_writes_skipped")}


class _InTurn:
    """Routes the requests of a run to the engines named, one each, in order."""

    name = "in-turn"

    def __init__(self, engines: Sequence[int]) -> None:
        self.engines = list(engines)

    def route(self, token_ids: Sequence[int], outstanding: Sequence[int]) -> int:
        return self.engines.pop(0)


def calibrate(cluster: Cluster, settings: Settings) -> dict[str, Any]:
    """The automatic rate: every engine that prefills whole prompts (each engine; with
    prefill/decode disaggregation the prefill engines) prefills one prompt of the trace's
    longest, all at once (fresh tokens, a cache namespace of their own), and the rate
    offers :data:`UTILISATION` of the requests per second they served together.

    Engines that share a GPU slow each other down while they compute together, so the
    measurement holds what sharing costs.
    """
    rng = np.random.default_rng(settings.seed + 2000)
    tokens = settings.trace.max_prompt_tokens
    prefilling = settings.pd[0] if settings.pd is not None else settings.engines
    prompts = [rng.integers(0, settings.shape.vocab_size, tokens).tolist() for _ in range(2)]
    records = cluster.run(
        [prompts[i % 2] for i in range(prefilling)],
        _InTurn(range(prefilling)),  # the prefill engines come first
        salt="calibrate",
    )
    service = float(np.median([r.served.timings.ttft for r in records]))
    return {
        "rate": UTILISATION * prefilling / service,
        "prompt_tokens": tokens,
        "service_s": service,
        "engines": prefilling,
        "utilisation": UTILISATION,
    }


def with_rate(settings: Settings, started: Started) -> tuple[Settings, dict[str, Any] | None]:
    """The settings with their rate set (measured with :func:`calibrate` when automatic) and
    what the measurement found (None when the rate was given)."""
    if settings.rate is not None:
        return settings, None
    found = calibrate(started.cluster, settings)
    return dataclasses.replace(settings, rate=found["rate"]), found


def run(
    settings: Settings,
    pool: str | None = None,
    on_record: Callable[[str, int, Record], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
    want_logits: bool = False,
) -> dict[str, Any]:
    """Run the experiment ``settings.repeat`` times; ``on_record(scheduler, pass, record)``
    follows progress.

    With ``want_logits`` every record carries the logits its engine computed.  An
    automatic rate is measured once, in the first repetition, and kept for the rest.
    """
    shape, fmt = settings.shape, settings.format
    trace = settings.requests()
    prompts = [r.token_ids for r in trace]
    say = on_phase or (lambda _: None)
    capacity = capacity_budget(settings, len(settings.schedulers))
    settings.check_gpu(settings.engines)
    calibration = None
    runs: list[dict[str, Any]] = []
    for rep in range(settings.repeat):
        rows: list[dict[str, Any]] = []
        with pool_cluster(settings, pool, say, capacity) as started:
            if settings.rate is None:
                say("measuring a rate below saturation")
                settings, calibration = with_rate(settings, started)
            for name in settings.schedulers:
                scheduler = make_scheduler(name, settings.engines)
                for pass_no in (1, 2):
                    say(f"run {rep + 1}/{settings.repeat}, {name}: pass {pass_no}")
                    before = started.counters()
                    records = started.cluster.run(
                        prompts,
                        scheduler,
                        salt=name,
                        arrivals=settings.arrivals(settings.seed + pass_no),
                        want_logits=want_logits,
                        on_record=on_record and functools.partial(on_record, name, pass_no),
                    )
                    row = pass_row(records, trace, settings, counted(started, before))
                    rows.append({"scheduler": name, "pass": pass_no, **row})
        runs.append({"startup_s": started.startup_s, "rows": rows, "targets": targets(rows)})
    return {
        "settings": {
            **asdict(settings),
            "kv_format": fmt.fingerprint,
            "kv_dtype": settings.kv_dtype,
            "engine_memory_bytes": settings.memory_bytes,
            "calibration": calibration,
            "pool_bytes": pool_for(settings, capacity)[0],
            "capacity": capacity_note(settings, capacity),
        },
        "model_params": shape.num_params,
        "requests_per_pass": len(trace),
        "startup_s": float(np.median([r["startup_s"] for r in runs])),
        "rows": median_rows([r["rows"] for r in runs]),
        "targets": median_targets([r["targets"] for r in runs]),
        "runs": runs,
    }


def warm_up(cluster: Cluster, settings: Settings) -> None:
    """One short request per engine, in a cache namespace of its own, before timing."""
    rng = np.random.default_rng(settings.seed + 1000)
    prompts = [
        rng.integers(0, settings.shape.vocab_size, WARMUP_TOKENS).tolist()
        for _ in range(settings.engines)
    ]
    cluster.run(prompts, make_scheduler("locality-free", settings.engines), salt="warm-up")


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
