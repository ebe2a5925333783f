"""Prometheus metrics of the metadata server (``beluga serve --metrics-port N``).

What is exported, all prefixed ``beluga_``:

- every field of ``MetadataService.stats()`` (``beluga stats``): the
  running totals as counters (``beluga_puts_total``, ``beluga_evictions_total``,
  ``beluga_lease_expiries_total``, ...), the rest as gauges (``beluga_keys``,
  ``beluga_used_bytes``, ...); a field added to ``stats()`` later and not yet
  described in :data:`STATS_METRICS` is still exported, as a gauge;
- per RPC op: ``beluga_rpc_requests_total``, ``beluga_rpc_errors_total`` and
  ``beluga_rpc_handler_seconds`` (a histogram);
- ``beluga_server_info``: 1, labelled with the text fields of ``stats()``
  (``server_host``, ``server_since``) and ``server_pid``: which server
  serves, where, since when (with ``beluga_takeovers_total`` beside it);
- ``beluga_recovery_seconds``: how long the service took from the seat to its
  first answer (the rest of recovery runs while it serves: ``beluga_recovering``);
- ``beluga_stats_age_seconds``: how old the statistics of this scrape are;
- the standard ``process_*`` metrics of the server process.

Threads.  The metadata service is single-threaded, so the HTTP thread never
calls into it.  A scrape asks for fresh statistics and waits (at most
``wait_s``) until the server thread, on its next tick (every ``refresh_s``,
between batches), has copied ``stats()`` into a snapshot; the collector
reads that snapshot.  Nothing is computed on an idle server between scrapes,
and a server too busy to tick in time is scraped with its last snapshot, whose
age says so.  RPC timings are plain counters the server thread bumps once per
batch, without a lock; a scrape copies them.

``ServerMetrics`` is thread-safe in that way (server thread: ``timed`` handlers
and ``tick``; any thread: ``collect``); it is not fork-safe: a forked child
must not serve the parent's endpoint.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from time import perf_counter
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from beluga.errors import BelugaError
from beluga.rpc.server import BatchHandler, Request, Result

PREFIX = "beluga_"

#: stats() field -> (counter or gauge, help text)
STATS_METRICS: dict[str, tuple[str, str]] = {
    "capacity_bytes": ("gauge", "Bytes of the pool's data area"),
    "used_bytes": ("gauge", "Bytes of the data area in allocated blocks"),
    "block_size": ("gauge", "Bytes per pool block of the data area"),
    "blocks_total": ("gauge", "Blocks in the data area"),
    "blocks_used": ("gauge", "Blocks allocated (committed, being written, or retiring)"),
    "keys": ("gauge", "Keys in the index"),
    "value_bytes": ("gauge", "Bytes of the values of all keys"),
    "writes_in_flight": ("gauge", "Writes reserved and not yet committed or aborted"),
    "quarantined_extents": (
        "gauge",
        "Writes whose lease ran out, held until their writer is done",
    ),
    "retiring_extents": ("gauge", "Extents waiting for a read lease to end before reuse"),
    "hits": ("counter", "Lookups that found their key (RPC and one-sided reads)"),
    "misses": ("counter", "Lookups that did not find their key (RPC and one-sided reads)"),
    "puts": ("counter", "Values committed"),
    "removes": ("counter", "Keys removed"),
    "corrupt_dropped": ("counter", "Values removed because a reader found them corrupt"),
    "duplicate_writes_skipped": (
        "counter",
        "Saves granted no extent: the key was committed or being written already",
    ),
    "evictions": ("counter", "Keys evicted (LRU) to make room"),
    "lease_expiries": ("counter", "Write leases that ran out before their commit"),
    "late_commits_refused": ("counter", "Commits refused because their lease had run out"),
    "dead_writer_reclaims": ("counter", "Writes reclaimed because their writer was gone"),
    "unanswered_grants_freed": (
        "counter",
        "Grants a gone server made and never answered, freed as their writer's ring was adopted",
    ),
    "unreadable_extents": (
        "gauge",
        "Extents held under a header nobody can read until every writer of before is gone",
    ),
    "unreadable_headers_held": (
        "counter",
        "Headers nobody could read (hostile bytes) whose blocks were held, writer unknown",
    ),
    "recovered_keys": ("gauge", "Keys rebuilt from the pool since this server started"),
    "puts_while_recovering": (
        "counter",
        "Commits acknowledged while this server's recovery had keys left to scan",
    ),
    "recovering": ("gauge", "1 while the server still scans the pool it took over, else 0"),
    "recovery_blocks_left": ("gauge", "Blocks whose keys the recovering server has not scanned"),
    "recovery_graves": (
        "gauge",
        "Keys decided during recovery whose older copies the scan must still drop",
    ),
    "index_buckets": ("gauge", "Buckets of the pool-resident index"),
    "index_moves": ("counter", "Entries moved between buckets of the pool index"),
    "index_scrub_repairs": ("counter", "Pool index buckets rewritten by the scrub"),
    "index_evictions": ("counter", "Keys dropped because the pool index had no room"),
    "index_repaired": ("gauge", "Pool index slots dropped or inserted at recovery"),
    "tier_hits": ("counter", "Pool misses the cross-pod tier served (clients' counts)"),
    "promotions": ("counter", "Values clients copied from the cross-pod tier into the pool"),
    "uptime_s": ("gauge", "Seconds since this server's service started"),
    "server_pid": ("gauge", "Process id of the server that serves the pool"),
    "server_since_s": ("gauge", "When the serving server took the pool's seat (Unix seconds)"),
    "seats_taken": ("counter", "Servers that ever took this pool's seat (this one included)"),
    "takeovers": (
        "counter",
        "Servers that took the seat from one that had not left it (it died or stalled)",
    ),
}

#: stats() fields that are text: labels of ``beluga_server_info``, not samples
INFO_FIELDS: dict[str, str] = {
    "server_host": "Host name of the server that serves the pool",
    "server_since": "When it took the pool's seat (ISO 8601, UTC)",
}

#: upper bounds (seconds) of the handler-time histogram: a batch takes microseconds
LATENCY_BUCKETS: tuple[float, ...] = (
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4,
    1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0,
)  # fmt: skip


def _errors(results: list[Result]) -> int:
    """How many results are errors; cheap when none is (a list of bytes)."""
    if list(map(type, results)).count(bytes) == len(results):
        return 0
    return sum(isinstance(r, BaseException) for r in results)


class _OpTimings:
    """Requests, errors and handler time of one op (bucket counts not cumulative).

    Only the server thread adds; a scrape reads without a lock, so it may see
    a batch in one count and not yet in another (never a histogram whose
    ``+Inf`` bucket disagrees with its count: both come from ``buckets``).
    """

    __slots__ = ("buckets", "errors", "requests", "seconds")

    def __init__(self, nbuckets: int) -> None:
        self.requests = 0
        self.errors = 0
        self.buckets = [0] * (nbuckets + 1)  # the last one is +Inf
        self.seconds = 0.0

    def add(self, n: int, failed: int, elapsed: float, bounds: tuple[float, ...]) -> None:
        """A batch of ``n`` requests, ``failed`` of them errors, answered in ``elapsed`` s."""
        self.requests += n
        self.errors += failed
        self.buckets[bisect.bisect_left(bounds, elapsed)] += n
        self.seconds += elapsed * n


class ServerMetrics:
    """The metrics of one metadata server, and the HTTP endpoint that serves them."""

    def __init__(
        self,
        stats: Callable[[], Mapping[str, object]],
        *,
        recovery_s: float,
        wait_s: float = 1.0,
        buckets: tuple[float, ...] = LATENCY_BUCKETS,
    ) -> None:
        self._stats = stats
        self.recovery_s = recovery_s
        self.wait_s = wait_s
        self._bounds = buckets
        self._ops: dict[str, _OpTimings] = {}
        self._wanted = threading.Event()  # a scrape waits for a fresh snapshot
        self._fresh = threading.Condition()
        self._snapshot: dict[str, object] = {}
        self._taken = 0.0
        self._scrapes = threading.Lock()  # one scrape at a time asks the server thread
        self._httpd: Any = None
        self._http_thread: threading.Thread | None = None
        self.take_snapshot()

    # -- server thread -------------------------------------------------------

    def take_snapshot(self) -> None:
        """Copy the service's statistics for the collector (server thread only)."""
        taken = time.monotonic()
        snapshot = dict(self._stats())
        with self._fresh:
            self._snapshot, self._taken = snapshot, taken
            self._fresh.notify_all()

    def tick(self) -> None:
        """On the server's tick: take a snapshot if a scrape is waiting for one."""
        if self._wanted.is_set():
            self._wanted.clear()
            self.take_snapshot()

    def timed(self, op: str, handler: BatchHandler) -> BatchHandler:
        """``handler``, counting its requests and errors and timing each batch.

        Every request of a batch is answered when the batch is done, so the
        batch's time is observed once per request.
        """
        timings = self._ops.setdefault(op, _OpTimings(len(self._bounds)))
        bounds = self._bounds

        def run(requests: list[Request]) -> list[Result]:
            start = perf_counter()
            try:
                results = handler(requests)
            except Exception:  # the server fails the whole batch
                timings.add(len(requests), len(requests), perf_counter() - start, bounds)
                raise
            timings.add(len(requests), _errors(results), perf_counter() - start, bounds)
            return results

        return run

    # -- any thread ----------------------------------------------------------

    def snapshot(self) -> tuple[dict[str, object], float]:
        """A fresh snapshot of the statistics (or the last one after ``wait_s``) and its age."""
        with self._scrapes, self._fresh:
            asked = time.monotonic()
            self._wanted.set()
            self._fresh.wait_for(lambda: self._taken >= asked, self.wait_s)
            return self._snapshot, time.monotonic() - self._taken

    def collect(self) -> Iterator[Metric]:
        """The metrics of one scrape (prometheus_client's Collector interface)."""
        stats, age = self.snapshot()
        info = {f: str(v) for f, v in stats.items() if f in INFO_FIELDS}
        if info:
            info["server_pid"] = str(stats.get("server_pid", ""))
            family = GaugeMetricFamily(
                PREFIX + "server_info",
                "The server that serves the pool: host, pid, since when",
                labels=sorted(info),
            )
            family.add_metric([info[k] for k in sorted(info)], 1)
            yield family
        for field, value in stats.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            kind, doc = STATS_METRICS.get(field, ("gauge", f"beluga stats field {field}"))
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(PREFIX + field, doc, value=value)
        yield GaugeMetricFamily(
            PREFIX + "stats_age_seconds", "Age of the statistics in this scrape", value=age
        )
        yield GaugeMetricFamily(
            PREFIX + "recovery_seconds",
            "Seconds from taking the seat to serving (recovery goes on while it serves)",
            value=self.recovery_s,
        )
        yield from self._rpc_families()

    def _rpc_families(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            PREFIX + "rpc_requests", "RPC requests answered, per op", labels=["op"]
        )
        errors = CounterMetricFamily(
            PREFIX + "rpc_errors", "RPC requests answered with an error, per op", labels=["op"]
        )
        latency = HistogramMetricFamily(
            PREFIX + "rpc_handler_seconds",
            "Seconds the server spent on the batch that answered a request, per op",
            labels=["op"],
        )
        rows = [
            (op, t.requests, t.errors, list(t.buckets), t.seconds)
            for op, t in list(self._ops.items())
        ]
        for op, n, failed, counts, seconds in rows:
            requests.add_metric([op], n)
            errors.add_metric([op], failed)
            cumulative, total = [], 0
            for bound, count in zip((*self._bounds, float("inf")), counts, strict=True):
                total += count
                cumulative.append(("+Inf" if bound == float("inf") else repr(bound), total))
            latency.add_metric([op], cumulative, sum_value=seconds)
        yield from (requests, errors, latency)

    # -- the endpoint --------------------------------------------------------

    def serve_http(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``addr:port`` in a daemon thread; returns the port bound."""
        if self._httpd is not None:
            raise BelugaError("the metrics endpoint is already running")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        ProcessCollector(registry=registry)
        try:
            self._httpd, self._http_thread = start_http_server(port, addr, registry=registry)
        except OSError as e:
            raise BelugaError(
                f"cannot serve metrics on {addr}:{port}: {e.strerror or e}; "
                "pick another --metrics-port (0 picks a free one)"
            ) from e
        return int(self._httpd.server_port)

    def close(self) -> None:
        """Stop the endpoint and release its port (safe to call twice)."""
        httpd, thread = self._httpd, self._http_thread
        self._httpd = self._http_thread = None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if thread is not None:
            thread.join()
