"""The standby: a server that waits for the seat, fences its holder when it must, and
takes it (then it starts as any server: beluga.server.server).

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
    saw stall (``beluga.pool.seat.take_seat(fenced=...)``).  Without
    ``--fence`` a standby never takes the seat from another host's server:
    it waits, and says so; a fence that fails is retried after another
    ``takeover_after``.

  A server's own seat heartbeat is written at every refresh and, while it
  recovers, by a thread (``ServerSeat.beating``), so a healthy server is
  never judged stalled; ``takeover_after`` must exceed its longest pause
  (default :data:`TAKEOVER_AFTER_S`).

  Defence in depth, not relied on: a server that finds at a refresh that the
  seat is no longer its own (a fence that lied) stops at once and exits
  non-zero, "another Beluga server ... took this pool over".
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass

from beluga.pool import Pool
from beluga.pool.host_records import Seat
from beluga.pool.hosts import Staleness
from beluga.signals import StopFlag

log = logging.getLogger(__name__)

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
