"""The RPC server: one thread polls every client's ring and answers in batches.

Handlers are batch-first: ``handler(requests) -> results``, one result per
request, each ``bytes`` (OK) or an exception (an error status whose message
the client raises).  :func:`per_request` adapts a one-at-a-time function.

The server's life cycle, in shared memory:

- it serves under the pool's server seat, taken before it starts
  (beluga.pool.seat: refused while another live server holds it), whose
  random *epoch* names it in every status line; it holds no host id of its
  own.  A server of its own (tests, benchmarks) takes both at once with
  :meth:`RpcServer.open`; the metadata server takes the seat as a step of its
  start (beluga.server.server);
- every ``refresh_s`` it reads each ring's control line and the host table:
  a ring whose generation is that of the id's grant and whose holder is alive
  (pid + start time on this kernel, a moving heartbeat across hosts) is
  served; a dead or departed client's ring is dropped and
  ``on_client_gone(host_id)`` runs, so upper layers reclaim what that client
  held; then it answers claim requests in the host table's lobby (it is the
  one writer of grants: see beluga.pool.hosts), then ``tick()`` runs, for the
  service's own timers;
- it writes each ring's status line (epoch, acknowledged generation,
  heartbeat); a clean stop writes epoch 0 so that clients fail fast.

Waiting for requests happens in C (``RingServer.poll``): it spins for
``idle_after_s`` after the last request, yields, then sleeps until a client
on this kernel rings the doorbell (a futex wake-up) or a short bounded sleep
ends; rings of clients on other kernels are re-polled after timed naps.  An
idle server therefore costs little CPU and still answers within microseconds
of a wake-up.

A request line caught half written (its CRC fails) is waited for: a client
descheduled or stopped between the stores of one line gets its request served
when it comes back within ``torn_patience_s`` (10 s by default), and only a
line torn longer than that is answered ``CORRUPT`` (rpc.c, TORN LINES).

A restarted server recovers each ring's position from the lines themselves
(``RingServer.recover_head`` in C, which owns the slot format) and answers the
requests it finds pending there ``RESTARTED``, unrun (``refuse_pending``):
they were sent to the server that is gone, and a caller still waiting sends
them again (rpc.c, TORN LINES, has the argument).  Just before, ``on_adopt``
lets the service free what a gone server granted for such a request and
never answered (rpc.c, GRANTS NOBODY LEARNED): no request outlives its
server, whether or not a server ran it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NamedTuple

from beluga._native import _core
from beluga.coherence import read_line, write_line
from beluga.errors import BelugaError, CapacityError, RpcError
from beluga.pool import Pool
from beluga.pool.host_records import Grant, boot_id, process_start_ms
from beluga.pool.hosts import DEFAULT_STALE_S, HostRegistry
from beluga.pool.seat import ServerSeat
from beluga.rpc.protocol import (
    STATUS_LINE,
    Op,
    RingControl,
    ServerStatus,
    Status,
    buf_size,
    ring_offset,
    wake_ups,
)
from beluga.signals import StopFlag


class Request(NamedTuple):
    """One request of a polled batch, as handlers see it."""

    host_id: int
    op: int
    payload: bytes
    generation: int = 0  # of the sender's host id: with host_id, who exactly sent it
    seq: int = 0  # its sequence number in the sender's ring (on_adopt asks about it later)


Result = bytes | BaseException
Batch = list[tuple[int, int, int, bytes]]  # (ring, seq, op or status, payload)
BatchHandler = Callable[[list[Request]], list[Result]]


def per_request(fn: Callable[[Request], bytes]) -> BatchHandler:
    """Adapt a handler of one request into a batch handler (errors stay per request)."""

    def batch(requests: list[Request]) -> list[Result]:
        out: list[Result] = []
        for r in requests:
            try:
                out.append(fn(r))
            except Exception as e:  # each request gets its own error status
                out.append(e)
        return out

    return batch


def _status_of(result: BaseException) -> int:
    if isinstance(result, CapacityError):
        return Status.CAPACITY
    if isinstance(result, ValueError | BelugaError):
        return Status.BAD_REQUEST
    return Status.FAILED


NO_HOST = 0xFFFFFFFF  # the server's "host id" in status lines: it holds none


class RpcServer:
    """Serve every ring of a pool under a seat.  ``serve_forever`` until ``stop``; or
    ``start_thread``.

    One thread serves (``serve_forever``); ``stop`` may be called from any
    thread.  Not fork-safe: a forked child must not serve the parent's rings.
    """

    @classmethod
    def open(
        cls,
        pool: Pool,
        handlers: Mapping[int, BatchHandler] | None = None,
        *,
        stale_s: float = DEFAULT_STALE_S,
        stopping: StopFlag | None = None,
        **options: Any,
    ) -> RpcServer:
        """Take the pool's seat (:meth:`ServerSeat.take <beluga.pool.seat.ServerSeat.take>`),
        serve under it, and refresh once: a transport serving on its own (tests,
        benchmarks).  ``options``: the constructor's."""
        seat = ServerSeat.take(pool, wait_s=stale_s, stopping=stopping)
        try:
            server = cls(pool, seat, handlers, stale_s=stale_s, stopping=stopping, **options)
        except BaseException:
            seat.close()
            raise
        try:
            server.refresh()
        except BaseException:
            server.close()
            raise
        return server

    def __init__(
        self,
        pool: Pool,
        seat: ServerSeat,
        handlers: Mapping[int, BatchHandler] | None = None,
        *,
        max_batch: int = 256,
        refresh_s: float = 0.1,
        idle_after_s: float = 50e-6,
        stale_s: float = DEFAULT_STALE_S,
        on_client_gone: Callable[[int], None] | None = None,
        tick: Callable[[], None] | None = None,
        torn_patience_s: float | None = None,
        stopping: StopFlag | None = None,
    ) -> None:
        """Serve under ``seat`` (taken: :class:`~beluga.pool.seat.ServerSeat`), which this
        server keeps at every refresh and leaves when it closes.  It adopts no ring and
        grants no id until the first :meth:`refresh`.

        ``torn_patience_s``: how long a torn request line is waited for (rpc.c TORN LINES).
        ``stopping``: a flag that stops this server too, besides :meth:`stop`
        (which leaves it alone: it is not this server's to raise); a process
        passes the one its signal handlers set (beluga.signals), so a signal
        stops :meth:`serve_forever` and :meth:`serve_echo`
        within a poll, and nothing waits on a lock.
        """
        self.pool = pool
        self.sb = pool.superblock
        self.mem = pool.memory
        self.handlers: dict[int, BatchHandler] = {
            Op.PING: per_request(lambda r: self.epoch.to_bytes(4, "little")),
            Op.ECHO: per_request(lambda r: r.payload),
            **(handlers or {}),
        }
        self.max_batch = max_batch
        self.refresh_s = refresh_s
        self.stale_s = stale_s
        self.on_client_gone = on_client_gone
        #: on_adopt(host_id, generation, unanswered) runs as a ring is adopted, before the
        #: requests gone servers left in it are refused; ``unanswered(seq)`` says whether a
        #: request is there with no answer (or only RESTARTED): what a gone server granted
        #: for it reached nobody (rpc.c, GRANTS NOBODY LEARNED)
        self.on_adopt: Callable[[int, int, Callable[[int], bool]], None] | None = None
        self.tick = tick
        #: work of the serving thread between polls (a recovering service's steps): called
        #: with how many requests the last poll served, it says whether more remains (then
        #: the next poll does not wait)
        self.background: Callable[[int], bool] | None = None
        self.seat = seat
        self.epoch = seat.epoch
        self.start_ms = process_start_ms(os.getpid()) or 0
        self.active: dict[int, RingControl] = {}
        self.refused_pending = 0  # requests left by a gone server, answered RESTARTED unrun
        self.limits: dict[int, int] = {}  # largest response per ring
        self.rings = _core.RingServer(
            self.mem, self.sb.rpc.offset, self.sb.rpc_bytes_per_host, self.sb.max_hosts
        )
        self.idle_after_s = idle_after_s
        if torn_patience_s is not None:
            self.rings.torn_patience_s = torn_patience_s
        self._stop = StopFlag()  # raised by stop()
        self._stopping = stopping  # raised by whoever owns it (a signal)
        self._thread: threading.Thread | None = None
        self.registry = HostRegistry(pool.hosts, stale_s, before_grant=self._regrant)
        self._inherit_watches()

    def _inherit_watches(self) -> None:
        """Start judging each id's holder from what the servers before this one watched."""
        for h in range(self.sb.max_hosts):
            st = ServerStatus.unpack(read_line(self.mem, ring_offset(self.sb, h) + STATUS_LINE))
            if st is not None and st.watch is not None:
                self.registry.inherit(h, st.watch)

    @property
    def idle_after_s(self) -> float:
        """How long polling spins after the last request before it backs off and sleeps."""
        return float(self.rings.spin_s)

    @idle_after_s.setter
    def idle_after_s(self, seconds: float) -> None:
        self.rings.spin_s = seconds

    # -- rings ---------------------------------------------------------------

    def _write_status(self, host_id: int, epoch: int, acked_gen: int) -> None:
        status = ServerStatus(
            epoch,
            acked_gen,
            NO_HOST,
            os.getpid(),
            self.start_ms,
            boot_id(),
            time.time_ns(),
            self.registry.watch(host_id),
        )
        write_line(self.mem, ring_offset(self.sb, host_id) + STATUS_LINE, status.pack())

    def refresh(self) -> None:
        """Adopt new clients, drop dead ones, grant host ids, heartbeat every status line.

        First of all it checks that the pool is still the one attached
        (:meth:`Pool.check_unchanged`): a pool reformatted, unlinked or
        replaced under the server raises ``PoolChangedError`` here, within a
        refresh, before anything more is written.
        """
        self.pool.check_unchanged()
        self.seat.keep()
        for h in range(self.sb.max_hosts):
            ctl = RingControl.unpack(read_line(self.mem, ring_offset(self.sb, h)))
            grant = self.registry.alive(h) if ctl else None
            live = (
                ctl is not None
                and grant is not None
                and grant.generation == ctl.gen
                and ctl.host_id == h
            )
            current = self.active.get(h)
            if live and current != ctl:
                assert ctl is not None and grant is not None
                head = self.rings.recover_head(h, ctl.gen, ctl.depth, ctl.first_seq)
                self.rings.set_ring(h, ctl.gen, ctl.depth, head, wake_ups(grant.identity.boot_id))
                if self.on_adopt:  # before the refusals: what gone servers granted for them
                    self.on_adopt(h, ctl.gen, partial(self.rings.unanswered, h))
                self.refused_pending += self.rings.refuse_pending(h)
                self.active[h] = ctl
                self.limits[h] = buf_size(self.sb, ctl.depth)
            elif not live and current is not None:
                self._drop(h)
            self._write_status(h, self.epoch, ctl.gen if live and ctl else 0)
        self.registry.serve_lobby()
        if self.tick:
            self.tick()

    def _drop(self, host_id: int) -> None:
        """Stop serving a ring whose client is gone, and let upper layers reclaim."""
        self.rings.clear_ring(host_id)
        del self.active[host_id]
        if self.on_client_gone:
            self.on_client_gone(host_id)

    def _regrant(self, host_id: int, old: Grant) -> None:
        """An id is about to be granted again: whatever its old holder had goes first."""
        if host_id in self.active:
            self._drop(host_id)
        elif self.on_client_gone:
            self.on_client_gone(host_id)  # e.g. writes recovered from the pool after a restart

    def holder_alive(self, host_id: int, generation: int) -> bool:
        """Whether host id ``host_id`` is still held, alive, in ``generation``."""
        grant = self.registry.alive(host_id)
        return grant is not None and grant.generation == generation

    # -- serving -------------------------------------------------------------

    def dispatch(
        self, batch: list[tuple[int, int, int, bytes]]
    ) -> list[tuple[int, int, int, bytes]]:
        """Run handlers over one polled batch; returns the responses to write."""
        by_op: dict[int, list[int]] = {}
        for i, (_, _, op, _) in enumerate(batch):
            by_op.setdefault(op, []).append(i)
        results: list[Result] = [b""] * len(batch)
        for op, idx in by_op.items():
            handler = self.handlers.get(op)
            if handler is None:
                for i in idx:
                    results[i] = RpcError(
                        f"unknown op {op}; this server knows {sorted(self.handlers)}"
                    )
                continue
            reqs = [
                Request(batch[i][0], op, batch[i][3], self.active[batch[i][0]].gen, batch[i][1])
                for i in idx
            ]
            try:
                out = handler(reqs)
                if len(out) != len(reqs):
                    raise RpcError(
                        f"handler for op {op} returned {len(out)} results for {len(reqs)} requests"
                    )
            except Exception as e:  # a broken handler fails its requests, not the server
                out = [e] * len(reqs)
            for i, r in zip(idx, out, strict=True):
                results[i] = r
        responses = []
        for (ring, seq, op, _), r in zip(batch, results, strict=True):
            if isinstance(r, BaseException):
                status = Status.UNKNOWN_OP if op not in self.handlers else _status_of(r)
                payload = str(r).encode()[: self.limits[ring]]
            else:
                status, payload = Status.OK, bytes(r)
                limit = self.limits[ring]
                if len(payload) > limit:
                    status = Status.FAILED
                    payload = (
                        f"response of {len(payload)} bytes exceeds the ring's {limit}-byte "
                        "slot buffer; connect with a smaller depth"
                    ).encode()
            responses.append((ring, seq, int(status), payload))
        return responses

    def serve_once(self, timeout: float) -> int:
        """Poll once (up to ``timeout`` s), answer what arrived; returns how many."""
        batch = self.rings.poll(self.max_batch, timeout)
        if batch:
            self.rings.respond(self.dispatch(batch))
        return len(batch)

    def serve_forever(self) -> None:
        """Serve until :meth:`stop`; between refreshes the C poll spins, then sleeps.

        Raises ``RpcError`` if the pool is closed under it (close the server first).
        """
        next_refresh = time.monotonic()
        served = 0
        while not self._stopped():
            now = time.monotonic()
            if now >= next_refresh:
                self.refresh()
                next_refresh = now + self.refresh_s
            busy = self.background is not None and self.background(served)
            served = self.serve_once(0.0 if busy else max(0.0, next_refresh - time.monotonic()))

    def serve_echo(self, duration_s: float) -> int:
        """Answer every request by echoing it, entirely in C (measures the transport)."""
        end, answered = time.monotonic() + duration_s, 0
        while not self._stopped() and (left := end - time.monotonic()) > 0:
            self.refresh()
            answered += self.rings.serve_echo(min(self.refresh_s, left))
        return answered

    def _stopped(self) -> bool:
        return self._stop.is_set() or (self._stopping is not None and self._stopping.is_set())

    def start_thread(self) -> threading.Thread:
        """Run serve_forever in a daemon thread (tests, in-process use)."""
        if self._thread is not None:
            raise RpcError("this server is already running")
        self._thread = threading.Thread(target=self.serve_forever, name="beluga-rpc", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """Make serve_forever / serve_echo return promptly (thread-safe; takes no lock)."""
        self._stop.set()
        self.rings.stop()

    def close(self, timeout: float = 10.0) -> None:
        """Stop, tell every client the server is gone, and give the host id back."""
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RpcError(f"server thread did not stop within {timeout} s")
            self._thread = None
        try:
            if self.mem.released or self.pool.superblock_rewritten():
                return  # another pool's lines now: write none of them
            for h in range(self.sb.max_hosts):
                self._write_status(h, 0, 0)
            self.seat.leave()
        finally:
            self.seat.unlock()

    def __enter__(self) -> RpcServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
