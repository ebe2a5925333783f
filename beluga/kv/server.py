"""``beluga serve``: the metadata server process.

One RpcServer thread owns a MetadataService.  SIGTERM and SIGINT stop it
cleanly: clients see the server go away (and fail fast) instead of hanging,
and the next server rebuilds everything from the pool.  With a metrics port
it also serves Prometheus metrics (beluga.kv.metrics) until it stops.

It logs through ``logging`` (logger ``beluga.kv.server``); the ``beluga``
command prints those records as ``beluga serve: ...`` lines on stderr.
"""

from __future__ import annotations

import datetime
import logging
import signal
import socket
import time
from typing import TYPE_CHECKING, Any

from beluga.kv import protocol as p
from beluga.kv.service import MetadataService
from beluga.kv.tier import MooncakeTier, TierConfig, make_tier
from beluga.pool import Pool
from beluga.rpc import RpcServer

if TYPE_CHECKING:
    import threading

    from beluga.kv.metrics import ServerMetrics

log = logging.getLogger(__name__)


def op_name(op: int) -> str:
    """The metrics label of a service op: ``alloc``, ``commit``, ..."""
    try:
        return p.StoreOp(op).name.lower()
    except ValueError:
        return str(op)


class MetadataServer:
    """A metadata service behind the pool's RPC; ``start_thread`` for in-process use.

    ``metrics_port`` (0: any free port) serves Prometheus metrics on
    ``metrics_addr`` until ``close``; ``metrics_port`` then holds the port bound.
    """

    def __init__(
        self,
        pool: Pool,
        *,
        refresh_s: float = 0.1,
        metrics_port: int | None = None,
        metrics_addr: str = "0.0.0.0",
        tier: MooncakeTier | TierConfig | str | None = None,
        **service_options: Any,
    ) -> None:
        """``tier``: the cross-pod tier evicted values are demoted to (default ``BELUGA_TIER``)."""
        self.pool = pool
        started = time.perf_counter()
        self.service = MetadataService(pool, **service_options)
        self.tier = make_tier(tier)
        self._owns_tier = self.tier is not None and not isinstance(tier, MooncakeTier)
        if self.tier is not None:
            self.service.on_evict = self.tier.submit
        self.recovery_s = time.perf_counter() - started
        log.debug("recovery took %.3f s", self.recovery_s)
        self.metrics: ServerMetrics | None = None
        handlers, tick = self.service.handlers(), self.service.tick
        if metrics_port is not None:
            from beluga.kv.metrics import ServerMetrics  # prometheus_client only when asked

            metrics = self.metrics = ServerMetrics(self.service.stats, recovery_s=self.recovery_s)
            handlers = {op: metrics.timed(op_name(op), h) for op, h in handlers.items()}
            tick = self._tick_with_metrics
        self.rpc = RpcServer(
            pool,
            handlers,
            refresh_s=refresh_s,
            on_client_gone=self.service.client_gone,
            tick=tick,
        )
        self.service.writer_alive = self.rpc.holder_alive
        self.service.extra_stats = self._extra_stats
        self.metrics_port: int | None = None
        if self.metrics is not None and metrics_port is not None:
            try:
                self.metrics_port = self.metrics.serve_http(metrics_port, metrics_addr)
            except BaseException:
                self.rpc.close()
                raise
            log.info("metrics on http://%s:%d/metrics", metrics_addr, self.metrics_port)

    def _extra_stats(self) -> dict[str, object]:
        """Who serves (pid, host), since when, and the pool's seat history; the tier's counts."""
        seat = self.rpc.seat
        since = datetime.datetime.fromtimestamp(seat.since_ns / 1e9, datetime.timezone.utc)
        out: dict[str, object] = {
            "server_pid": seat.identity.pid,
            "server_host": socket.gethostname(),
            "server_since": since.isoformat(timespec="seconds"),
            "server_since_s": round(seat.since_ns / 1e9, 3),
            "seats_taken": seat.seats,
            "takeovers": seat.takeovers,
        }
        if self.tier is not None:
            out.update(self.tier.stats())
        return out

    def _tick_with_metrics(self) -> None:
        assert self.metrics is not None
        self.service.tick()
        self.metrics.tick()

    def serve_forever(self) -> None:
        self.rpc.serve_forever()

    def start_thread(self) -> threading.Thread:
        return self.rpc.start_thread()

    def stop(self) -> None:
        self.rpc.stop()

    def close(self) -> None:
        """Stop serving, tell clients, and stop the metrics endpoint."""
        try:
            self.rpc.close()
        finally:
            if self.metrics is not None:
                self.metrics.close()
            if self.tier is not None and self._owns_tier:
                self.tier.close()

    def __enter__(self) -> MetadataServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(spec: str, coherence: str | None = None, ready: Any = None, **options: Any) -> None:
    """Attach, serve until SIGTERM / SIGINT, then shut down cleanly."""
    with Pool.attach(spec, coherence=coherence) as pool:
        server = MetadataServer(pool, **options)
        stop = lambda *_: server.stop()  # noqa: E731 - a signal handler
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        s = server.service.stats()
        log.info(
            "%s: %s keys recovered, %s of %s blocks in use; epoch %08x",
            spec,
            s["keys"],
            s["blocks_used"],
            s["blocks_total"],
            server.rpc.epoch,
        )
        if ready is not None:
            ready.set()
        try:
            server.serve_forever()
        finally:
            server.close()
            log.info("stopped")
