"""What the connector counts: per-interval stats for vLLM and Prometheus counters.

:data:`STATS` names every count and says what it means (its Prometheus help
too).  Each connector half keeps a :class:`Tally` of what it counted since
vLLM last asked (``get_kv_connector_stats``); vLLM adds the halves up, logs
them and exports them through :class:`BelugaPromMetrics` as ``vllm:beluga_*``
counters, also inside ``MultiConnector``.  :func:`counters` holds this
process's totals.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: what the connector counts, and what each count means (also its Prometheus help)
STATS = {
    "lookups": "Requests looked up in the pool.",
    "deferred_lookups": "Lookups put off because another request was loading the same blocks "
    "asynchronously (the blocks load once).",
    "hit_blocks": "Engine blocks found in the pool by lookups.",
    "miss_blocks": "Engine blocks looked up and not found in the pool.",
    "loaded_blocks": "Blocks loaded from the pool into the KV cache, validated.",
    "load_bytes": "Bytes loaded from the pool into the KV cache.",
    "load_seconds": "Seconds spent loading from the pool.",
    "saved_blocks": "Blocks saved from the KV cache into the pool.",
    "save_skipped": "Blocks not saved because the pool held them or another engine was "
    "saving them.",
    "save_bytes": "Bytes saved into the pool.",
    "save_seconds": "Seconds spent saving into the pool.",
    "load_errors": "Blocks that vanished, changed or failed their checksum while loading "
    "(recomputed).",
    "lease_losses": "Blocks not saved because their write lease ran out twice.",
    "save_full": "Blocks not saved because the pool had no room.",
    "pool_errors": "Calls that found the pool or its server unavailable.",
    "expected_blocks": "Blocks a kv_consumer was told (by its producer) to find in the pool.",
    "missing_blocks": "Blocks a kv_consumer was told to expect and did not find (recomputed).",
}
_COUNTERS: Counter[str] = Counter()
_COUNTERS_LOCK = threading.Lock()


def counters() -> dict[str, float]:
    """This process's totals since it started, by the names of :data:`STATS`."""
    with _COUNTERS_LOCK:
        return {name: _COUNTERS[name] for name in STATS}


@dataclass
class BelugaConnectorStats(KVConnectorStats):
    """What a connector counted over one interval (vLLM's ``KVConnectorStats``).

    ``data`` maps names of :data:`STATS` to numbers, so it crosses processes
    as it is; intervals add up.
    """

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {name: self.data[name] for name in STATS if self.data.get(name)}
        looked_up = self.data.get("hit_blocks", 0) + self.data.get("miss_blocks", 0)
        if looked_up:
            out["hit_rate"] = round(self.data.get("hit_blocks", 0) / looked_up, 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class Tally:
    """One connector half's counts since vLLM last asked, and the process's totals.

    Thread-safe: the worker's transfers may count from other threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._interval: Counter[str] = Counter()

    def add(self, **amounts: float) -> None:
        with self._lock, _COUNTERS_LOCK:
            for name, amount in amounts.items():
                if amount:
                    self._interval[name] += amount
                    _COUNTERS[name] += amount

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(**{name: time.perf_counter() - start})

    def take(self) -> BelugaConnectorStats | None:
        """The counts since the last call (None if nothing happened), and start again."""
        with self._lock:
            interval, self._interval = self._interval, Counter()
        return BelugaConnectorStats(data=dict(interval)) if interval else None


class BelugaPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per name of :data:`STATS` (``vllm:beluga_NAME``), per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[tuple[int, str], Any] = {}
        for name, documentation in STATS.items():
            counter = self._counter_cls(
                name=f"vllm:beluga_{name}", documentation=documentation, labelnames=labelnames
            )
            for engine, values in per_engine_labelvalues.items():
                self.counters[engine, name] = counter.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            counter = self.counters.get((engine_idx, name))
            if counter is not None and value:
                counter.inc(value)
