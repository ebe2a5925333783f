"""``beluga serve``: the metadata server process.

One RpcServer thread owns a MetadataService.  SIGTERM and SIGINT stop it
cleanly: clients see the server go away (and fail fast) instead of hanging,
and the next server rebuilds everything from the pool.  The handlers only
raise a :class:`~beluga.signals.StopFlag` (the rule of beluga.signals); every
wait of :func:`serve` is bounded and looks at it: the standby's look at the
seat, a fence, taking the seat, the RPC poll.  A signal during recovery is
acted on once recovery is done, before anything is served.  With a metrics port
it also serves Prometheus metrics (beluga.server.metrics) until it stops.

It logs through ``logging`` (logger ``beluga.server.server``); the ``beluga``
command prints those records as ``beluga serve: ...`` lines on stderr.

Starting a server (:class:`MetadataServer`) is four steps, in this order:
attach to the pool (the caller: ``Pool.attach``), take the seat
(:class:`~beluga.pool.seat.ServerSeat`; a standby first waits for it and
fences its holder when it must: :mod:`beluga.server.standby`), take the
service over from the pool (:class:`~beluga.server.service.MetadataService`:
recovery starts, and goes on while serving) while a thread beats the seat,
then serve (the RPC transport, under that seat).  The seat comes before
recovery because recovery writes to the pool; the module doc of
:mod:`beluga.server.standby` has the one rule of fencing.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from beluga.errors import PoolChangedError, PoolError
from beluga.kv import protocol as p
from beluga.kv.tier import MooncakeTier, TierConfig, make_tier
from beluga.pool import Pool
from beluga.pool.host_records import Seat
from beluga.pool.seat import ServerSeat
from beluga.rpc import RpcServer
from beluga.server.collector import keep_collections_short
from beluga.server.recovery_state import RECOVERY_REGION
from beluga.server.service import MetadataService
from beluga.server.standby import STANDBY_POLL_S, TAKEOVER_AFTER_S, wait_for_seat
from beluga.signals import StopFlag, stop_on_signals

if TYPE_CHECKING:
    from beluga.server.metrics import ServerMetrics

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
        fenced: Seat | None = None,
        stopping: StopFlag | None = None,
        **service_options: Any,
    ) -> None:
        """Start a server on an attached pool (the module doc's steps).

        ``tier``: the cross-pod tier evicted values are demoted to (default
        ``BELUGA_TIER``).  ``fenced``: the seat line of a server on another
        host that a standby cut off the pool (beluga.server.standby); its seat
        may be taken.  ``stopping``: the flag that stops it (its process's
        signals set it).
        """
        self.pool = pool
        self.tier: MooncakeTier | None = None
        self._owns_tier = False
        self.metrics: ServerMetrics | None = None
        self.metrics_port: int | None = None
        self.rpc: RpcServer | None = None
        # the seat first: recovery writes to the pool (it clears stale headers and commit
        # words, repairs the index), so it runs only once this server holds the seat, never
        # while another server serves
        self.seat = ServerSeat.take(pool, fenced=fenced, stopping=stopping)
        try:
            # the transport, under the seat: it judges holders from the watches its
            # predecessor left from now on, but adopts no ring and grants no id before
            # its first refresh, once the service is there
            self.rpc = RpcServer(pool, self.seat, {}, refresh_s=refresh_s, stopping=stopping)
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
        """Take the service over from the pool, wire it into the RPC server, and serve:
        refresh once.

        The service recovers in steps between polls (``RpcServer.background``) and
        answers writes at once, whatever the pool's size (beluga.server.recovery); a
        pool of one recovery region (``BELUGA_RECOVERY_REGION`` blocks, default
        :data:`~beluga.server.recovery.RECOVERY_REGION`) is recovered first.
        ``BELUGA_RECOVER_WHILE_SERVING=0`` (or ``recover_now=True``) recovers the whole
        pool before the first answer, as before 2026-12-07 (minutes at the pod's size).
        The default changed once the chaos tier's loss in this mode was explained and
        fixed (docs/protocol.md, "Recovery").
        """
        started = time.perf_counter()
        region = int(os.environ.get("BELUGA_RECOVERY_REGION", RECOVERY_REGION))
        service_options.setdefault("recovery_region", region)
        while_serving = os.environ.get("BELUGA_RECOVER_WHILE_SERVING", "1") != "0"
        service_options.setdefault(
            "recover_now",
            not while_serving or self.pool.superblock.nblocks <= service_options["recovery_region"],
        )
        assert self.rpc is not None
        with self.seat.beating():  # a recovering server is not a stalled one
            self.service = MetadataService(self.pool, **service_options)
        self.tier = make_tier(tier)
        self._owns_tier = self.tier is not None and not isinstance(tier, MooncakeTier)
        if self.tier is not None:
            self.service.on_evict = self.tier.submit
        self.recovery_s = time.perf_counter() - started
        log.debug("recovery took %.3f s", self.recovery_s)
        handlers, tick = self.service.handlers(), self.service.tick
        if metrics_port is not None:
            from beluga.server.metrics import ServerMetrics  # prometheus_client only when asked

            metrics = self.metrics = ServerMetrics(self.service.stats, recovery_s=self.recovery_s)
            handlers = {op: metrics.timed(op_name(op), h) for op, h in handlers.items()}
            tick = self._tick_with_metrics
        self.rpc.handlers.update(handlers)
        self.rpc.on_client_gone = self.service.client_gone
        self.rpc.on_adopt = self.service.forget_unanswered
        self.rpc.tick = tick
        self.rpc.background = self.service.recover_some
        self.service.heartbeat = self.seat.keep  # in operations that recover (the service's)
        self.service.writer_alive = self.rpc.holder_alive
        self.service.extra_stats = self._extra_stats
        self.rpc.refresh()
        if self.metrics is not None and metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(metrics_port, metrics_addr)
            log.info("metrics on http://%s:%d/metrics", metrics_addr, self.metrics_port)

    def _extra_stats(self) -> dict[str, object]:
        """Who serves (pid, host), since when, and the pool's seat history; the tier's counts."""
        seat = self.seat.line
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
        assert self.rpc is not None
        self.rpc.serve_forever()

    def start_thread(self) -> threading.Thread:
        assert self.rpc is not None
        return self.rpc.start_thread()

    def stop(self) -> None:
        if self.rpc is not None:
            self.rpc.stop()

    def close(self) -> None:
        """Stop serving, tell clients, leave the seat, and stop the metrics endpoint."""
        try:
            if self.rpc is not None:
                self.rpc.close()  # it leaves the seat it served under
            else:
                self.seat.close()
        finally:
            if self.metrics is not None:
                self.metrics.close()
            if self.tier is not None and self._owns_tier:
                self.tier.close()

    def __enter__(self) -> MetadataServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def take_over(
    pool: Pool,
    stopping: StopFlag,
    options: dict[str, Any],
    takeover_after: float = TAKEOVER_AFTER_S,
    fence_command: str | None = None,
) -> MetadataServer | None:
    """Wait for the seat and take it (None: ``stopping`` came first).

    A rival standby that wins the seat sends this one back to waiting.
    """
    while True:
        got = wait_for_seat(pool, stopping, takeover_after, fence_command)
        if got is None:
            return None
        try:
            return MetadataServer(pool, fenced=got.fenced, stopping=stopping, **options)
        except PoolError as e:
            if isinstance(e, PoolChangedError):
                raise
            if not stopping.is_set():
                log.debug("lost the seat to another server (%s); waiting again", e)
            stopping.wait(STANDBY_POLL_S)


def serve(
    spec: str,
    coherence: str | None = None,
    ready: Any = None,
    standby: bool = False,
    takeover_after: float = TAKEOVER_AFTER_S,
    fence_command: str | None = None,
    **options: Any,
) -> None:
    """Attach, serve until SIGTERM / SIGINT, then shut down cleanly.

    ``standby``: first wait for the seat (the module doc says when it is
    taken), then serve; a signal while waiting ends it cleanly, unserved.
    ``takeover_after`` and ``fence_command``: when and how a standby fences
    a server that stopped heartbeating (the module doc).  Main thread only
    (it installs the signal handlers, which only raise a flag: beluga.signals).
    """
    with stop_on_signals() as stopping, Pool.attach(spec, coherence=coherence) as pool:
        if standby:
            log.info("%s: standing by", spec)
            if ready is not None:
                ready.set()
            server = take_over(pool, stopping, options, takeover_after, fence_command)
            if server is None:
                log.info("stopped while standing by")
                return
        else:
            try:
                server = MetadataServer(pool, stopping=stopping, **options)
            except PoolError as e:
                if not stopping.is_set() or isinstance(e, PoolChangedError):
                    raise
                log.info("stopped before it took the seat")
                return
        try:
            if stopping.is_set():  # told to stop while it recovered: serve nothing
                log.info("stopped while it recovered")
                return
            s = server.service.stats()
            log.info(
                "%s: %s keys recovered so far, %s of %s blocks scanned (the rest while it "
                "serves), %.3f s after taking the seat; epoch %08x",
                spec,
                s["keys"],
                s["blocks_total"] - s["recovery_blocks_left"],  # type: ignore[operator]
                s["blocks_total"],
                server.recovery_s,
                server.rpc.epoch,
            )
            keep_collections_short()  # after recovery: what it built is never scanned again
            if ready is not None and not standby:
                ready.set()
            server.serve_forever()
        finally:
            server.close()
            log.info("stopped")
