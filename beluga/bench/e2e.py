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
computed more than once across engines
(:func:`~beluga.bench.e2e_figures.duplicate_cost`).

Figures that mean something (:class:`~beluga.bench.e2e_settings.Settings`):

* ``repeat``: the experiment runs that many times from scratch (a fresh pool,
  server and engines each time); ``rows`` are the medians, ``runs`` each
  repetition, and every number comes with its range
  (:func:`~beluga.bench.e2e_figures.median_fields`);
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

This module starts and runs the experiment; its settings are
:mod:`beluga.bench.e2e_settings`, the figures of a pass and their medians
:mod:`beluga.bench.e2e_figures`, and what is printed and drawn
:mod:`beluga.bench.e2e_report`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from beluga.bench.e2e_figures import blocks_needed, median_rows, median_targets, pass_row, targets
from beluga.bench.e2e_settings import WARMUP_TOKENS, Settings
from beluga.kv.store import KVStore
from beluga.pool import Pool
from beluga.pool.layout import plan
from beluga.server.service import HIGH_WATERMARK
from beluga.serving.cluster import Cluster, Record
from beluga.serving.engine import create_kv_pool, kv_geometry, kv_pool_size
from beluga.serving.scheduler import make_scheduler

UTILISATION = 0.5  # an automatic rate offers this share of what the engines can serve
HEADROOM = 1.25  # the derived capacity budget over what the trace stores


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
