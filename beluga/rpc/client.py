"""The RPC client: a ring of slots in the pool, a heartbeat, and calls with timeouts.

Thread-safe: one lock serialises the ring (a call is submit + complete of
consecutive sequence numbers, and the C wait releases the GIL), so threads
sharing a client take turns; an uncontended lock costs ~0.1 µs of a ~2 µs call.
Not fork-safe by design: the ring and the host id belong to the process that
connected.  A forked child that uses an inherited client gets an ``RpcError``
that says to connect again, and its ``close()`` leaves the parent's ring and
host id alone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

from beluga._native import _core
from beluga.coherence import LINE, read_line, write_line
from beluga.errors import RpcError
from beluga.pool import Pool
from beluga.pool.host_records import boot_id, process_start_ms
from beluga.pool.hosts import DEFAULT_STALE_S, Staleness
from beluga.rpc.protocol import (
    MAX_DEPTH,
    STATUS_LINE,
    Op,
    RingControl,
    ServerStatus,
    Status,
    error_for,
    ring_offset,
    wake_ups,
)

SLICE_S = 0.05  # how often a waiting call looks at the server's health
RESTART_GRACE_S = 3.0  # how long a call waits for a new server once its server is gone

# Bumped in every forked child: a client remembers the value it was made under,
# so a child notices an inherited client with one integer comparison per call.
_fork_generation = 0


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


class RpcClient:
    """One host's connection to the pool's server.  Use as a context manager."""

    def __init__(
        self,
        pool: Pool,
        *,
        depth: int = 32,
        host_id: int | None = None,
        connect_timeout: float = 10.0,
        timeout: float = 30.0,
        heartbeat_s: float = 1.0,
        stale_s: float = DEFAULT_STALE_S,
        restart_grace_s: float = RESTART_GRACE_S,
    ) -> None:
        if not 1 <= depth <= MAX_DEPTH:
            raise ValueError(f"depth must be 1..{MAX_DEPTH}, not {depth}")
        if restart_grace_s < 0:
            raise ValueError(f"restart_grace_s must be >= 0, not {restart_grace_s}")
        self.pool = pool
        self.timeout = timeout
        self.stale_s = stale_s
        self.restart_grace_s = restart_grace_s
        self._broken: str | None = None
        self._server_down = False  # broken because the server went away: a new one may adopt us
        self._pool_changed = False  # the pool was reformatted, unlinked or replaced under us
        self._submitted = self._completed = 0  # requests put in the ring, answers taken out
        self._lock = threading.Lock()
        self._fork_generation = _fork_generation
        self._pid = os.getpid()
        self._server_beat = Staleness(stale_s)
        sb = pool.superblock
        deadline = time.monotonic() + connect_timeout
        self.entry = pool.claim_host(host_id, timeout=connect_timeout)
        self._ring_off = ring_offset(sb, self.entry.host_id)
        try:
            ctl = RingControl(
                self.entry.host_id, self.entry.generation, depth, os.getpid(), 1, time.time_ns()
            )
            write_line(pool.memory, self._ring_off, ctl.pack())
            self.ring = _core.RingClient(
                pool.memory, self._ring_off, sb.rpc_bytes_per_host, depth, self.entry.generation
            )
            self._follow(self._wait_for_server(deadline, connect_timeout))
        except BaseException:
            self._retire()
            raise
        self._stop = threading.Event()
        self._beat = threading.Thread(
            target=self._heartbeat, args=(heartbeat_s,), name="beluga-heartbeat", daemon=True
        )
        self._beat.start()

    @property
    def host_id(self) -> int:
        return self.entry.host_id

    @property
    def max_payload(self) -> int:
        """Largest request or response payload one call carries."""
        return self.ring.buf_size

    # -- server health -------------------------------------------------------

    def _status(self) -> ServerStatus | None:
        return ServerStatus.unpack(read_line(self.pool.memory, self._ring_off + STATUS_LINE))

    def _follow(self, st: ServerStatus) -> None:
        """Talk to this server; waits sleep with a wake-up only if it shares our kernel."""
        self.server = st
        self.ring.wake = wake_ups(st.boot_id)

    def _alive(self, st: ServerStatus) -> bool:
        if st.boot_id == boot_id():
            return process_start_ms(st.pid) == st.start_ms
        return self._server_beat.fresh(st.epoch, st.heartbeat_ns)  # by our clock, not its

    def _wait_for_server(self, deadline: float, timeout: float) -> ServerStatus:
        while True:
            st = self._status()
            if st and st.epoch and st.acked_gen == self.entry.generation and self._alive(st):
                return st
            if time.monotonic() > deadline:
                raise RpcError(
                    f"no Beluga server answered on {self.pool.spec} within {timeout} s; "
                    f"start one with 'beluga serve --pool {self.pool.spec}'"
                )
            time.sleep(0.001)

    def _server_gone(self) -> str | None:
        """Why the server cannot answer (stopped, died), or None; follows a restarted one."""
        st = self._status()
        if st is None or st.epoch == 0 or not self._alive(st):
            changed = self.pool.changed()
            if changed is not None:
                self._pool_changed = True
                return (
                    f"the pool changed under this client: {changed}; close this client "
                    "(and its KVStore) and connect again"
                )
        if st is None or st.epoch == 0:
            return (
                f"the Beluga server of {self.pool.spec} stopped; start it again "
                "with 'beluga serve' and reconnect"
            )
        if st.epoch != self.server.epoch and st.acked_gen == self.entry.generation:
            self._follow(st)  # a new server adopted our ring and serves what is in flight
        if not self._alive(st):
            return (
                f"the Beluga server (pid {st.pid}) of {self.pool.spec} died; "
                "restart it with 'beluga serve'"
            )
        return None

    # -- calls ---------------------------------------------------------------

    def _forked(self) -> bool:
        return self._fork_generation != _fork_generation

    def _usable(self) -> None:
        if self._forked():
            raise RpcError(
                f"this RPC client (and the KVStore over it) was opened by pid {self._pid}; "
                "a forked child cannot share its ring: open a new KVStore in the child"
            )
        if self._broken and self._server_down:
            self._resume()
        if self._broken:
            if self._server_down:
                raise RpcError(self._broken)
            raise RpcError(
                f"this RPC client is unusable ({self._broken}); close it and connect again"
            )

    def _resume(self) -> None:
        """Follow a new server that adopted this ring once the old one went away.

        Requests that were in flight when calls gave up are answered by the new
        server (``RESTARTED``, unrun: it runs nothing sent to the server that is
        gone); those answers are taken out and dropped here, so the next call
        gets its own answer, never theirs.
        """
        st = self._status()
        if not (
            st
            and st.epoch
            and st.epoch != self.server.epoch
            and st.acked_gen == self.entry.generation
            and self._alive(st)
        ):
            return
        self._follow(st)
        self._broken = None
        self._server_down = False
        pending = self._submitted - self._completed
        if pending:
            self._complete(pending, None)

    def _complete(self, n: int, timeout: float | None) -> list[tuple[int, bytes]]:
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        out: list[tuple[int, bytes]] = []
        gone_since: float | None = None
        while len(out) < n:
            got = self.ring.complete(n - len(out), SLICE_S)
            self._completed += len(got)
            out += got
            if len(out) == n:
                break
            # A server that is gone may be restarting: a new one adopts the ring and
            # serves what is in flight.  Wait for that a bounded grace, then give up.
            gone = self._server_gone()
            now = time.monotonic()
            if gone is None:
                gone_since = None
            elif gone_since is None:
                gone_since = now
            waited = now - gone_since if gone_since is not None else 0.0
            if gone is not None and (
                self._pool_changed or waited >= self.restart_grace_s or now > deadline
            ):
                self._broken = gone
                self._server_down = not self._pool_changed  # no new server adopts a lost pool
                raise RpcError(gone)
            if now > deadline:
                self._broken = f"no answer within {limit} s"
                raise RpcError(
                    f"the server did not answer within {limit} s; "
                    "is it overloaded or wedged? ('beluga stats' shows its state)"
                )
        return out

    def _resend_by(self, deadline: float, op: int) -> None:
        """A request came back RESTARTED (a new server adopted the ring): send it again?"""
        if time.monotonic() > deadline:
            raise RpcError(
                f"op {op}: the server was replaced while this call waited and the call's "
                "time ran out before its new server could answer; try again"
            )

    def call(self, op: int, payload: bytes = b"", timeout: float | None = None) -> bytes:
        """One request, one response; raises the server's error for a non-OK status.

        A request the server that took over never ran (``RESTARTED``: sent to
        the server that is gone) is sent again, within the call's timeout.
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            self._usable()
            while True:
                r = self.ring.call(op, payload, SLICE_S)
                self._submitted += 1
                if r is not None:
                    self._completed += 1
                status, data = r if r is not None else self._complete(1, timeout)[0]
                if status != Status.RESTARTED:
                    break
                self._resend_by(deadline, op)
        if status != Status.OK:
            raise error_for(status, data, op)
        return data

    def call_many(
        self, requests: Sequence[tuple[int, bytes]], timeout: float | None = None
    ) -> list[bytes]:
        """Pipeline many requests (up to the ring depth in flight); raises the first error."""
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            self._usable()
            depth = self.ring.depth
            for start in range(0, len(requests), depth):
                chunk = list(requests[start : start + depth])
                self.ring.submit_many(chunk)
                self._submitted += len(chunk)
                got = self._complete(len(chunk), timeout)
                while again := [i for i, (st, _) in enumerate(got) if st == Status.RESTARTED]:
                    self._resend_by(deadline, chunk[again[0]][0])  # as call() does
                    self.ring.submit_many([chunk[i] for i in again])
                    self._submitted += len(again)
                    for i, answer in zip(again, self._complete(len(again), timeout), strict=True):
                        got[i] = answer
                out += got
        for (op, _), (status, data) in zip(requests, out, strict=True):
            if status != Status.OK:
                raise error_for(status, data, op)
        return [data for _, data in out]

    def ping(self) -> int:
        """Round trip to the server; returns its epoch."""
        return int.from_bytes(self.call(Op.PING), "little")

    # -- life cycle ----------------------------------------------------------

    def _heartbeat(self, every: float) -> None:
        hosts = self.pool.hosts
        while not self._stop.wait(every):
            try:
                if not hosts.holds(self.entry):
                    # only a host taken for dead (heartbeat stalled past stale_s, across
                    # hosts) loses its id: it must not write the line of the next holder
                    self._broken = (
                        f"host id {self.host_id} was granted to another process after this "
                        f"one's heartbeat stalled for over {self.stale_s} s"
                    )
                    return
                self.entry = hosts.heartbeat(self.entry)
            except BaseException:  # the pool went away under us: stop beating
                return

    def _retire(self) -> None:
        if not self.pool.memory.released:
            write_line(self.pool.memory, self._ring_off, bytes(LINE))
            self.pool.hosts.release(self.entry)

    def close(self) -> None:
        """Leave: stop the heartbeat, retire the ring, give the host id back.

        In a forked child this only lets go of the child's copy: the ring and
        the host id are the parent's.
        """
        if getattr(self, "_stop", None) is None or self._stop.is_set():
            return
        self._stop.set()
        if self._forked():
            return
        self._beat.join(5)
        with self._lock:
            self._retire()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
