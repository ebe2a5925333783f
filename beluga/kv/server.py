"""``beluga serve``: the metadata server process.

One RpcServer thread owns a MetadataService.  SIGTERM and SIGINT stop it
cleanly: clients see the server go away (and fail fast) instead of hanging,
and the next server rebuilds everything from the pool.  With a metrics port
it also serves Prometheus metrics (beluga.kv.metrics) until it stops.

It logs through ``logging`` (logger ``beluga.kv.server``); the ``beluga``
command prints those records as ``beluga serve: ...`` lines on stderr.

Standby (``beluga serve --standby``, :func:`wait_for_seat`).  A standby
attaches, waits while the seat names a live server, then takes the seat,
recovers from the pool like any restarted server and serves; clients follow
the new epoch in their rings without reconnecting (beluga.rpc.client), and
writes the old server had granted are committed or refused by recovery, as
after any restart.  Any number may wait: on one kernel the seat's advisory
lock lets exactly one of them in, and the others go on waiting.

A standby takes over only from a server it can *prove* gone: one of its own
kernel whose pid and start time no longer name a running process.  A dead
process cannot resume, and a stopped one (SIGSTOP) still counts as alive,
so no old server can write after the takeover: no fencing is needed for
this case, and none is claimed for any other.  A server on another host is
never taken over by a standby: judged by a stalled heartbeat, it might only
be paused and resume mid-batch after the takeover, writing index buckets,
commit words and responses the new server owns.  That needs a fencing rule
(issue 23) that is not built yet; until then a standby on another host than
its server waits, and says so.
"""

from __future__ import annotations

import datetime
import logging
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from beluga.errors import PoolChangedError, PoolError
from beluga.kv import protocol as p
from beluga.kv.service import MetadataService
from beluga.kv.tier import MooncakeTier, TierConfig, make_tier
from beluga.pool import Pool
from beluga.rpc import RpcServer

if TYPE_CHECKING:
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
        """``tier``: the cross-pod tier evicted values are demoted to (default ``BELUGA_TIER``).

        The seat comes first: recovery writes to the pool (it clears stale
        headers and commit words, repairs the index), so it runs only once
        this server holds the seat, never while another server serves.
        """
        self.pool = pool
        self.rpc = RpcServer(pool, {}, refresh_s=refresh_s, first_refresh=False)
        self.tier: MooncakeTier | None = None
        self._owns_tier = False
        self.metrics: ServerMetrics | None = None
        self.metrics_port: int | None = None
        try:
            self._start(tier, metrics_port, metrics_addr, service_options)
        except BaseException:
            self.close()
            raise

    def _start(
        self,
        tier: MooncakeTier | TierConfig | str | None,
        metrics_port: int | None,
        metrics_addr: str,
        service_options: dict[str, Any],
    ) -> None:
        """Recover the service from the pool, wire it into the RPC server, refresh once."""
        started = time.perf_counter()
        self.service = MetadataService(self.pool, **service_options)
        self.tier = make_tier(tier)
        self._owns_tier = self.tier is not None and not isinstance(tier, MooncakeTier)
        if self.tier is not None:
            self.service.on_evict = self.tier.submit
        self.recovery_s = time.perf_counter() - started
        log.debug("recovery took %.3f s", self.recovery_s)
        handlers, tick = self.service.handlers(), self.service.tick
        if metrics_port is not None:
            from beluga.kv.metrics import ServerMetrics  # prometheus_client only when asked

            metrics = self.metrics = ServerMetrics(self.service.stats, recovery_s=self.recovery_s)
            handlers = {op: metrics.timed(op_name(op), h) for op, h in handlers.items()}
            tick = self._tick_with_metrics
        self.rpc.handlers.update(handlers)
        self.rpc.on_client_gone = self.service.client_gone
        self.rpc.tick = tick
        self.service.writer_alive = self.rpc.holder_alive
        self.service.extra_stats = self._extra_stats
        self.rpc.refresh()
        if self.metrics is not None and metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(metrics_port, metrics_addr)
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


STANDBY_POLL_S = 0.05  # how often a standby looks at the seat


def seat_free(pool: Pool) -> bool:
    """Whether a standby may take the seat now: it is empty, or its server is proven gone.

    Proven gone means: of this kernel, and its pid and start time name no
    running process (see the module doc for why nothing else counts).
    """
    seat = pool.hosts.seat()
    if seat is None or not seat.epoch:
        return True
    return seat.identity.same_kernel() and not seat.identity.running()


def wait_for_seat(pool: Pool, stopping: threading.Event, poll_s: float = STANDBY_POLL_S) -> bool:
    """Wait until :func:`seat_free`; False when ``stopping`` was set first."""
    warned = False
    while not stopping.is_set():
        pool.check_unchanged()
        if seat_free(pool):
            return True
        seat = pool.hosts.seat()
        if not warned and seat is not None and not seat.identity.same_kernel():
            log.warning(
                "the seat's server (pid %d) is on another host: this standby takes over only "
                "from a server of its own kernel, so it waits until that seat is left",
                seat.identity.pid,
            )
            warned = True
        stopping.wait(poll_s)
    return False


def take_over(
    pool: Pool, stopping: threading.Event, options: dict[str, Any]
) -> MetadataServer | None:
    """Wait for the seat and take it (None: ``stopping`` came first).

    A rival standby that wins the seat sends this one back to waiting.
    """
    while True:
        if not wait_for_seat(pool, stopping):
            return None
        try:
            return MetadataServer(pool, **options)
        except PoolError as e:
            if isinstance(e, PoolChangedError):
                raise
            log.debug("lost the seat to another server (%s); waiting again", e)
            stopping.wait(STANDBY_POLL_S)


def serve(
    spec: str,
    coherence: str | None = None,
    ready: Any = None,
    standby: bool = False,
    **options: Any,
) -> None:
    """Attach, serve until SIGTERM / SIGINT, then shut down cleanly.

    ``standby``: first wait for the seat (the module doc says when it is
    taken), then serve; a signal while waiting ends it cleanly, unserved.
    """
    with Pool.attach(spec, coherence=coherence) as pool:
        stopping = threading.Event()
        server: MetadataServer | None = None

        def stop(*_: object) -> None:
            stopping.set()
            if server is not None:
                server.stop()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        if standby:
            log.info("%s: standing by", spec)
            if ready is not None:
                ready.set()
            server = take_over(pool, stopping, options)
            if server is None:
                log.info("stopped while standing by")
                return
            if stopping.is_set():
                server.stop()
        else:
            server = MetadataServer(pool, **options)
        s = server.service.stats()
        log.info(
            "%s: %s keys recovered, %s of %s blocks in use; epoch %08x",
            spec,
            s["keys"],
            s["blocks_used"],
            s["blocks_total"],
            server.rpc.epoch,
        )
        if ready is not None and not standby:
            ready.set()
        try:
            server.serve_forever()
        finally:
            server.close()
            log.info("stopped")
