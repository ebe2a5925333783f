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

Standby (``beluga serve --standby``, :func:`wait_for_seat`).  A standby
attaches, waits while the seat names a live server, then takes the seat,
recovers from the pool like any restarted server and serves; clients follow
the new epoch in their rings without reconnecting (beluga.rpc.client), and
writes the old server had granted are committed or refused by recovery, as
after any restart (requests it had not answered are answered RESTARTED,
unrun, and resent: rpc.c).  Any number may wait: the seat's advisory lock
(one kernel) and the seat line itself let exactly one of them in, and the
others go on waiting.

Fencing: the one rule
  *No server takes the seat while its previous holder can still store into
  the pool.*  Everything the new server owns (index buckets, header clears,
  commit words, grants, ring status and response lines) is then written by
  it alone, so readers and writers rely on nothing new: the rules of
  beluga.server.service hold as they do for one server.

  Why the rule is kept outside the pool.  The old server may be stopped, not
  dead (SIGSTOP, a paused VM), at any instruction, including between its
  last look at the seat and its next store.  CXL 2.0 memory shared between
  hosts offers loads, stores and flushes, and no cross-host atomic or
  conditional store, so no check it makes in the pool can be tied to the
  store that follows it: a server that checked "the seat is mine" and then
  paused stores after any takeover, whatever epoch it compares.  Making its
  stores harmless instead (every server record sealed with the seat's
  number, readers rejecting the others) would turn a lost race into misses
  but cannot undo a store over a line the new server wrote, or a response
  a client already took.  So the old server is cut off the pool before the
  seat changes hands, by the thing that can do it:

  - *one kernel*: the kernel.  A server whose pid and start time name no
    running process is gone; one whose heartbeat has stalled for
    ``takeover_after`` (stopped, or stuck) is SIGKILLed by the standby,
    which takes the seat only once the kernel says the process is gone.  A
    stopped process that is killed never runs again, so it never resumes.
  - *another host*: the operator's ``--fence COMMAND``, run once the seat's
    heartbeat has stalled for ``takeover_after`` of the standby's own
    clock.  Its exit status 0 must mean that host can no longer store into
    the pool: the switch's fabric manager unbinds its port (CXL 2.0 FM
    API), its BMC powers it off, its hypervisor destroys the VM.  Then the
    standby takes the seat, and only if the seat line is still the one it
    saw stall (``HostRegistry.take_seat(fenced=...)``).  Without
    ``--fence`` a standby never takes the seat from another host's server:
    it waits, and says so; a fence that fails is retried after another
    ``takeover_after``.

  A server's own seat heartbeat is written at every refresh and, while it
  recovers, by a thread (``RpcServer.beating_seat``), so a healthy server is
  never judged stalled; ``takeover_after`` must exceed its longest pause
  (default :data:`TAKEOVER_AFTER_S`).

  Defence in depth, not relied on: a server that finds at a refresh that the
  seat is no longer its own (a fence that lied) stops at once and exits
  non-zero, "another Beluga server ... took this pool over".
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from beluga.errors import PoolChangedError, PoolError
from beluga.kv import protocol as p
from beluga.kv.tier import MooncakeTier, TierConfig, make_tier
from beluga.pool import Pool
from beluga.pool.hosts import Seat, Staleness
from beluga.rpc import RpcServer
from beluga.server.collector import keep_collections_short
from beluga.server.recovery_state import RECOVERY_REGION
from beluga.server.service import MetadataService
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
        """``tier``: the cross-pod tier evicted values are demoted to (default ``BELUGA_TIER``).

        The seat comes first: recovery writes to the pool (it clears stale
        headers and commit words, repairs the index), so it runs only once
        this server holds the seat, never while another server serves.
        ``fenced``: the seat line of a server on another host that a standby
        cut off the pool (the module doc); its seat may be taken.
        ``stopping``: the flag that stops it (its process's signals set it).
        """
        self.pool = pool
        self.rpc = RpcServer(
            pool, {}, refresh_s=refresh_s, first_refresh=False, fenced=fenced, stopping=stopping
        )
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
        """Take the service over from the pool, wire it into the RPC server, refresh once.

        The service recovers in steps between polls (``RpcServer.background``): it
        answers writes at once, whatever the pool's size (beluga.server.recovery).
        A pool of one recovery region (``BELUGA_RECOVERY_REGION`` blocks, default
        :data:`~beluga.server.recovery.RECOVERY_REGION`) is recovered before the first answer:
        that takes one step's time.
        """
        started = time.perf_counter()
        region = int(os.environ.get("BELUGA_RECOVERY_REGION", RECOVERY_REGION))
        service_options.setdefault("recovery_region", region)
        service_options.setdefault(
            "recover_now", self.pool.superblock.nblocks <= service_options["recovery_region"]
        )
        with self.rpc.beating_seat():  # a recovering server is not a stalled one
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
#: how long a seat heartbeat may stand still before a standby fences its server
TAKEOVER_AFTER_S = 5.0
FENCE_TIMEOUT_S = 30.0  # the longest a fence may take (a command, or a killed process's exit)
FENCE_POLL_S = 0.01  # how often a standby looks whether its fence command is done
FENCE_TERM_GRACE_S = 1.0  # how long a fence command ended early has after SIGTERM


@dataclass(frozen=True)
class Takeover:
    """What a standby may take: a free seat, or (``fenced``) another host's cut-off server's."""

    fenced: Seat | None = None


def seat_free(pool: Pool) -> bool:
    """Whether the seat may be taken without fencing: it is empty, or its server is proven gone.

    Proven gone means: of this kernel, and its pid and start time name no
    running process (see the module doc for why nothing else counts).
    """
    return _gone(pool.hosts.seat())


def _gone(seat: Seat | None) -> bool:
    """:func:`seat_free` of a seat line already read."""
    if seat is None or not seat.epoch:
        return True
    return seat.identity.same_kernel() and not seat.identity.running()


def fence(
    seat: Seat,
    command: str | None,
    timeout_s: float = FENCE_TIMEOUT_S,
    stopping: StopFlag | None = None,
) -> bool:
    """Cut the seat's server off the pool; True once it can store nothing more into it.

    ``command`` (``/bin/sh -c``) gets the server in ``BELUGA_FENCE_PID``,
    ``BELUGA_FENCE_START_MS``, ``BELUGA_FENCE_BOOT_ID`` (hex) and
    ``BELUGA_FENCE_SAME_KERNEL`` (1 or 0); its exit status 0 is the word
    that the server's host is cut off.  On this kernel the kernel has the
    last word: the process is SIGKILLed if it still runs, and the fence
    holds once its pid and start time name no running process.

    ``stopping`` set meanwhile (this standby was told to stop) ends the
    fence unfinished (False): a command still running is ended (SIGTERM,
    then SIGKILL after :data:`FENCE_TERM_GRACE_S`), and nothing is taken.
    """
    who = seat.identity
    if command is not None:
        env = {
            **os.environ,
            "BELUGA_FENCE_PID": str(who.pid),
            "BELUGA_FENCE_START_MS": str(who.start_ms),
            "BELUGA_FENCE_BOOT_ID": who.boot_id.hex(),
            "BELUGA_FENCE_SAME_KERNEL": "1" if who.same_kernel() else "0",
        }
        code = _run_fence_command(command, env, timeout_s, stopping)
        if code is None:
            return False
        if code != 0:
            log.warning("the fence command exited %d: not fenced", code)
            return False
    if not who.same_kernel():
        return command is not None
    deadline = time.monotonic() + timeout_s
    while who.running():
        if stopping is not None and stopping.is_set():
            return False
        try:
            os.kill(who.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError:
            log.warning("no permission to kill the server (pid %d): not fenced", who.pid)
            return False
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _run_fence_command(
    command: str, env: dict[str, str], timeout_s: float, stopping: StopFlag | None
) -> int | None:
    """Run a fence command to its end; its exit status, or None if it ran out of time or was
    stopped (and ended: SIGTERM, then SIGKILL)."""
    proc = subprocess.Popen(["/bin/sh", "-c", command], env=env, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    try:
        while (code := proc.poll()) is None:
            if stopping is not None and stopping.is_set():
                log.warning("told to stop while the fence command ran: not fenced")
                return None
            if time.monotonic() > deadline:
                log.warning("the fence command ran past %g s: not fenced", timeout_s)
                return None
            time.sleep(FENCE_POLL_S)
        return code
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(FENCE_TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_for_seat(
    pool: Pool,
    stopping: StopFlag,
    takeover_after: float = TAKEOVER_AFTER_S,
    fence_command: str | None = None,
    poll_s: float = STANDBY_POLL_S,
) -> Takeover | None:
    """Wait until the seat may be taken (the module doc); None when ``stopping`` came first.

    The seat's server is fenced once its heartbeat has stood still for
    ``takeover_after`` of this process's clock.
    """
    if takeover_after <= 0:
        raise ValueError(f"takeover_after {takeover_after:g}: must be above 0 seconds")
    stalled = Staleness(takeover_after)
    warned = False
    while not stopping.is_set():
        pool.check_unchanged()
        seat = pool.hosts.seat()
        if _gone(seat):
            return Takeover()
        if seat is not None and not stalled.fresh("seat", (seat.epoch, seat.heartbeat_ns)):
            here = seat.identity.same_kernel()
            where = "" if here else " on another host"
            if not here and fence_command is None:
                if not warned:
                    log.warning(
                        "the server (pid %d%s) has not heartbeat for %g s, but without --fence "
                        "this standby cannot cut its host off the pool, so it waits",
                        seat.identity.pid,
                        where,
                        takeover_after,
                    )
                    warned = True
            else:
                log.warning(
                    "the server (pid %d%s) has not heartbeat for %g s: fencing it",
                    seat.identity.pid,
                    where,
                    takeover_after,
                )
                if fence(seat, fence_command, stopping=stopping):
                    log.info("fenced pid %d; taking the seat", seat.identity.pid)
                    return Takeover(None if here else seat)
                log.warning("not fenced; trying again after another %g s", takeover_after)
            stalled.forget("seat")
        stopping.wait(poll_s)
    return None


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
