"""The seat: the one server of a pool, and how a server takes, keeps and leaves it.

Taking the seat is a step of starting a server of its own
(:mod:`beluga.server.server`: attach, take the seat, recover, serve); the RPC
transport serves under a seat taken (:class:`~beluga.rpc.RpcServer`), it takes
none.  The seat is two things:

- an exclusive lock (``flock``) on the pool's backing file: one kernel lets
  one process hold it, so two servers of one machine never both serve;
- the seat line of the host region (:class:`~beluga.pool.host_records.Seat`,
  read by :meth:`HostTable.seat <beluga.pool.hosts.HostTable.seat>`): the
  serving server's identity, epoch and heartbeat, which clients and standbys
  on every host watch, and the pool's history of seats and takeovers.

Who may take a seat that is held, and why only a fenced server's
(:mod:`beluga.server.standby`), is said by :func:`take_seat`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from beluga.coherence import write_line
from beluga.errors import PoolError
from beluga.pool.host_records import Identity, Seat
from beluga.pool.hosts import DEFAULT_STALE_S, HostTable
from beluga.pool.pool import Pool
from beluga.signals import StopFlag

#: how long a server that took the seat from another host keeps checking that it is still
#: its own before it writes anything else (take_seat): two standbys on two hosts
#: that fenced one server at once both store the seat line; the last store wins
SEAT_SETTLE_S = 0.5
SEAT_POLL_S = 0.05  # how often a server taking the seat looks at it again
#: how often a server beats its seat while it works without serving (ServerSeat.beating)
BEAT_S = 0.25


class ServerSeat:
    """The seat one server holds: the lock and the seat line (the module doc).

    :meth:`take` it, :meth:`keep` it at every refresh (or let :meth:`beating`
    keep it while the server works without refreshing: recovery), and
    :meth:`close` it (leave the line, drop the lock).  Not thread-safe: one
    thread keeps it at a time (:meth:`beating`'s thread while the caller does
    not); not fork-safe: the lock is this process's.
    """

    def __init__(self, table: HostTable, line: Seat, lock_fd: int) -> None:
        self.table = table
        #: the seat line as this server last wrote it
        self.line = line
        self._lock_fd = lock_fd

    @classmethod
    def take(
        cls,
        pool: Pool,
        *,
        epoch: int | None = None,
        wait_s: float = DEFAULT_STALE_S,
        fenced: Seat | None = None,
        stopping: StopFlag | None = None,
    ) -> ServerSeat:
        """Lock the pool's seat, then write this server into the seat line
        (:func:`take_seat`: ``wait_s``, ``fenced`` and ``stopping`` are its).

        ``epoch``: the number that names this server's life in the seat and the
        RPC status lines (default: a random one).  Raises ``PoolError`` when
        another server holds the seat.
        """
        if epoch is None:
            epoch = int.from_bytes(os.urandom(4), "little") or 1
        lock_fd = pool.mapping.exclusive_lock(f"the server seat of {pool.spec}")
        try:
            line = take_seat(pool.hosts, epoch, wait_s, fenced=fenced, stopping=stopping)
        except BaseException:
            os.close(lock_fd)
            raise
        return cls(pool.hosts, line, lock_fd)

    @property
    def epoch(self) -> int:
        return self.line.epoch

    def keep(self) -> None:
        """Heartbeat the seat; raises ``PoolError`` if another server took it over."""
        self.line = keep_seat(self.table, self.line)

    @contextmanager
    def beating(self, period_s: float = BEAT_S) -> Iterator[None]:
        """Heartbeat the seat from a thread while the caller works without keeping it.

        For a server's start (recovery reads the pool before the first
        refresh): standbys judge a server by its seat heartbeat, and must not
        take a recovering server for a stalled one.  A seat taken over
        meanwhile raises here, at the end, as :meth:`keep` would.
        """
        done = threading.Event()
        lost: list[BaseException] = []

        def beat() -> None:
            while not done.wait(period_s):
                try:
                    self.keep()
                except BaseException as e:  # the seat is gone: report it to the caller
                    lost.append(e)
                    return

        t = threading.Thread(target=beat, name="beluga-seat-beat", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join()
        if lost:
            raise lost[0]

    def leave(self) -> None:
        """Clear the seat line if it is still this server's (the lock stays held)."""
        leave_seat(self.table, self.line)

    def unlock(self) -> None:
        """Drop the lock (once; the line is left as it is)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def close(self) -> None:
        """Leave the seat and drop the lock."""
        try:
            self.leave()
        finally:
            self.unlock()


def _stopped(seconds: float, stopping: StopFlag | None) -> bool:
    """Sleep ``seconds``, or less once ``stopping`` is set; whether it is."""
    if stopping is None:
        time.sleep(seconds)
        return False
    return stopping.wait(seconds)


def take_seat(
    table: HostTable,
    epoch: int,
    wait_s: float,
    fenced: Seat | None = None,
    stopping: StopFlag | None = None,
) -> Seat:
    """Write this server into the seat, unless a server that may still write holds it.

    A server of this kernel is judged exactly (pid and start time): a
    running one, stopped or not, keeps the seat.  One of another host
    whose heartbeat moves within ``wait_s`` of our clock keeps it; one
    whose heartbeat has stalled may only be paused, so the seat is taken
    from it only when the caller has fenced it (``fenced``: the seat line
    as it was when its host was cut off the pool, beluga.server.standby) and
    the line has not changed since.

    A standby on another host may store the seat line at the same moment
    (both fenced the same stalled server; both saw an empty seat last
    held elsewhere), and CXL memory has no atomic to stop it.  So a seat
    taken from another host is held, heartbeaten, for ``SEAT_SETTLE_S``
    and re-read every beat: the last store wins, the other server raises
    ``PoolError`` here and its standby waits again.  A standby paused
    between its look and its store can still break this (the operator's
    fence must cover standbys too: docs/operations.md).

    Both waits end early, with ``PoolError``, once ``stopping`` is set
    (the process was told to stop: beluga.signals).
    """
    t = table
    seat = t.seat()
    if seat is not None and seat.epoch:
        where = "" if seat.identity.same_kernel() else ", on another host"
        if seat.identity.same_kernel():
            busy = seat.identity.running() and seat.identity != Identity.mine()
        elif fenced is not None:
            busy = seat != fenced
        elif _seat_moves(t, seat, wait_s, stopping):
            busy = True
        else:
            raise PoolError(
                f"the Beluga server of this pool (pid {seat.identity.pid}{where}) has not "
                f"heartbeat for {wait_s:g} s, but it may be paused, not dead, and write "
                "again: take over with `beluga serve --standby --fence COMMAND` (a command "
                "that cuts its host off the pool; docs/operations.md), or stop that server"
            )
        if busy:
            raise PoolError(
                f"another Beluga server (pid {seat.identity.pid}{where}) serves this "
                "pool; stop it first (one server per pool)"
            )
    now = t.wall()
    seats = seat.seats if seat is not None else 0
    took_over = seat is not None and seat.epoch != 0 and seat.identity != Identity.mine()
    takeovers = (seat.takeovers if seat is not None else 0) + took_over
    mine = Seat(epoch, Identity.mine(), now, now, seats + 1, takeovers)
    write_line(t.mem, t._seat_off, mine.pack())
    empty_elsewhere = seat is not None and not seat.epoch and not seat.identity.same_kernel()
    if fenced is not None or empty_elsewhere:
        mine = _settle(t, mine, stopping)
    return mine


def _settle(table: HostTable, mine: Seat, stopping: StopFlag | None) -> Seat:
    """Hold a seat just taken for SEAT_SETTLE_S, beating it, until no rival overwrote it."""
    deadline = time.monotonic() + SEAT_SETTLE_S
    while True:
        if _stopped(SEAT_POLL_S, stopping):
            leave_seat(table, mine)
            raise PoolError("told to stop while settling into the seat; it was left")
        try:
            mine = keep_seat(table, mine)
        except PoolError as e:
            raise PoolError(f"a standby on another host took the seat at once: {e}") from e
        if time.monotonic() >= deadline:
            return mine


def _seat_moves(table: HostTable, seat: Seat, wait_s: float, stopping: StopFlag | None) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        now = table.seat()
        if now != seat:
            return now is not None and now.epoch != 0
        if _stopped(SEAT_POLL_S, stopping):
            raise PoolError("told to stop while watching the seat's heartbeat")
    return False


def keep_seat(table: HostTable, seat: Seat) -> Seat:
    """Heartbeat the seat; raises if another server took it over meanwhile."""
    t = table
    now = t.seat()
    if now is None or now.epoch != seat.epoch or now.identity != seat.identity:
        who = f"pid {now.identity.pid}" if now else "someone"
        raise PoolError(f"another Beluga server ({who}) took this pool over; stopping")
    beat = replace(seat, heartbeat_ns=max(t.wall(), seat.heartbeat_ns + 1))
    write_line(t.mem, t._seat_off, beat.pack())
    return beat


def leave_seat(table: HostTable, seat: Seat) -> None:
    """Clear the seat if it is still ours."""
    t = table
    now = t.seat()
    if now is not None and now.epoch == seat.epoch and now.identity == seat.identity:
        write_line(t.mem, t._seat_off, replace(seat, epoch=0, heartbeat_ns=t.wall()).pack())
