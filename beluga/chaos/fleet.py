"""The metadata servers of a chaos round: the serving one, its standbys, restarts and
takeovers.

The fleet runs ``beluga serve`` (``beluga.server.server.serve``) in a child
process.  With ``standbys=N`` (``beluga chaos --standby N``) N ``beluga serve
--standby`` processes wait beside it.  A killed server is then not restarted:
a standby takes the seat, recovers and serves, and a new standby is started to
keep N waiting.  A server stopped (SIGSTOP) for less than the standbys'
``takeover_after_s`` keeps its seat (its heartbeat has not stood still long
enough; beluga.server.server says why that is the rule), and the verifier
catches a standby that takes it.  A server stopped for longer (a stall; with
``emulated_hosts``, where a standby cannot see a process, any stop) is fenced
by a standby (SIGKILL, or its ``--fence`` command across hosts) before it
takes the seat, and a stall no standby fenced counts in the report.

Every server kill and stall is a takeover record (who took the seat, when,
and the fence of a stall) from which the report derives the write outage.
The server hangs when its heartbeat in the pool's server seat stops while it
is not stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from beluga.chaos.run import CTX, ChaosRun, send_signal
from beluga.pool.host_records import emulate_host
from beluga.pool.seat import SEAT_SETTLE_S
from beluga.server.server import serve

#: the standbys' --fence with emulated hosts: every "host" is this kernel, so SIGKILL the
#: server and wait until its pid names no process (the driver reaps it within a pump)
CHAOS_FENCE = (
    'kill -KILL "$BELUGA_FENCE_PID" 2>/dev/null; for _ in $(seq 1000); do '
    'kill -0 "$BELUGA_FENCE_PID" 2>/dev/null || exit 0; sleep 0.01; done; exit 1'
)


@dataclass
class ServerProcess:
    """One ``beluga serve`` process (serving, or a standby), and what the driver knows of it."""

    proc: BaseProcess
    ready_conn: Connection
    started: float
    ready: bool = False
    held: bool = False
    gone: bool = False
    beat_ns: int = 0
    beat_seen: float = 0.0
    pid: int = 0  # kept: the process object is closed once reaped
    standby: bool = False  # waiting for the seat (not serving yet)
    seat_beat: int | None = None  # the seat's heartbeat when this standby took it
    stalled: bool = False  # stopped past the standbys' takeover_after (stall_server)

    def __post_init__(self) -> None:
        assert self.proc.pid is not None
        self.pid = self.proc.pid


class _Ready:
    """``serve(ready=...)`` sets this; a pipe, because a killed child may not hold a lock."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def set(self) -> None:
        self.conn.send_bytes(b"ready")


def _server_main(
    spec: str,
    coherence: str,
    options: dict[str, Any],
    conn: Connection,
    standby: bool,
    host: str | None = None,
) -> None:
    with open(os.devnull, "w") as quiet:  # one "beluga serve" line per restart is noise here
        os.dup2(quiet.fileno(), 1)
    if host is not None:
        emulate_host(host)
    if coherence == "model":
        os.environ["BELUGA_MODEL_SEED"] = str(os.getpid())
    serve(spec, coherence=coherence, ready=_Ready(conn), standby=standby, **options)


class ServerFleet:
    """The serving server and the standbys of one round.

    Not thread-safe (the driver's one thread owns it); not fork-safe (it holds
    its children's pipes).
    """

    def __init__(self, run: ChaosRun) -> None:
        self.run = run
        self.server: ServerProcess | None = None
        self.standbys: list[ServerProcess] = []  # waiting for the seat
        self.takeovers: list[dict[str, Any]] = []  # per server kill or stall: who took over, when
        self.hosts_made = 0  # emulated hosts named so far (one per server process)
        self.lost_seat_races = 0  # standbys that stored the seat at once and lost it again

    def server_up(self) -> ServerProcess | None:
        """The serving server, when it is ready."""
        s = self.server
        return s if s is not None and not s.gone and s.ready else None

    def waitables(self) -> list[Any]:
        """What the event loop waits on: the servers' ends, and a starting server's word."""
        out: list[Any] = []
        if self.server is not None and not self.server.gone:
            out.append(self.server.proc.sentinel)
            if not self.server.ready:
                out.append(self.server.ready_conn)
        return out + [sb.proc.sentinel for sb in self.standbys]

    def start_server(self) -> None:
        """A server for a seat that is empty: a standby takes it when there is one."""
        if self.server is not None and not self.server.gone:
            return  # one server at a time (a restart was already made)
        if self.run.cfg.standbys:
            self.replenish()
            if self.standbys:
                return  # one of them takes the seat (standby_events)
        self.server = self._spawn(standby=False)

    def _spawn(self, standby: bool) -> ServerProcess:
        run, cfg = self.run, self.run.cfg
        options: dict[str, Any] = {
            "write_lease_s": cfg.write_lease_s,
            "read_lease_s": cfg.read_lease_s,
            "refresh_s": 0.05,
        }
        if standby:
            options["takeover_after"] = cfg.takeover_after_s
        host = None
        if cfg.emulated_hosts:
            self.hosts_made += 1
            host = f"chaos-host-{self.hosts_made}"
            if standby:
                options["fence_command"] = CHAOS_FENCE
        mode = "model" if cfg.coherence == "model" else "native"
        ready_r, ready_w = CTX.Pipe(duplex=False)
        proc = CTX.Process(
            target=_server_main,
            args=(run.path, mode, options, ready_w, standby, host),
            name="standby" if standby else "server",
            daemon=True,
        )
        proc.start()
        ready_w.close()
        return ServerProcess(proc, ready_r, time.monotonic(), standby=standby)

    def replenish(self) -> None:
        """Keep ``standbys`` processes waiting for the seat."""
        while len(self.standbys) < self.run.cfg.standbys:
            self.standbys.append(self._spawn(standby=True))

    def standby_events(self, ready: list[Any]) -> None:
        """Standbys that died, and the one that took the seat once the server was gone."""
        run = self.run
        for sb in list(self.standbys):
            if sb.proc.sentinel in ready:
                sb.proc.join(5)
                self.standbys.remove(sb)
                self._gone(sb)
                run.error("StandbyExited", f"a standby exited with code {sb.proc.exitcode}")
                if run.injecting:
                    self.replenish()
        if not self.standbys or run.pool is None:
            return
        seat = run.pool.hosts.seat()
        if seat is None or not seat.epoch:
            return
        for sb in self.standbys:
            if seat.identity.pid == sb.pid:
                s = self.server
                if s is not None and not s.gone and not s.proc.is_alive():
                    self._died(s)  # fenced (or dead) a moment ago: not seen yet
                s = self.server
                if s is not None and not s.gone and s.seat_beat is not None and not s.ready:
                    # a standby that stored the seat line while this one did, from another
                    # host, and lost (beluga.pool.seat.take_seat's settle): it waits again
                    s.standby, s.seat_beat = True, None
                    self.standbys.append(s)
                    self.server = None
                    self.lost_seat_races += 1
                if self.server is not None and not self.server.gone:
                    run.error(
                        "StandbyTookALiveSeat",
                        f"standby pid {sb.pid} took the seat of live server pid {self.server.pid}",
                    )
                    return
                self.standbys.remove(sb)
                sb.standby, sb.started = False, time.monotonic()
                sb.seat_beat = seat.heartbeat_ns
                with contextlib.suppress(EOFError, OSError):  # its "standing by" message
                    while sb.ready_conn.poll():
                        sb.ready_conn.recv_bytes()
                self.server = sb
                if self.takeovers and "seat_s" not in self.takeovers[-1]:
                    self.takeovers[-1].update(
                        by=sb.pid, seat_s=round(sb.started - self.takeovers[-1]["t"], 4)
                    )
                if run.injecting:
                    run.after(run.rng.uniform(0, 0.3), self.replenish)
                return

    def server_events(self, ready: list[Any]) -> None:
        """The serving server became ready, or its process ended."""
        s = self.server
        run = self.run
        if s is None or s.gone:
            return
        if not s.ready and s.seat_beat is not None and run.pool is not None:
            seat = run.pool.hosts.seat()  # a standby serves once it beats the seat
            # (across hosts, once it has held it past the settle: it may lose it till then)
            settle = SEAT_SETTLE_S if run.cfg.emulated_hosts else 0.0
            if (
                seat is not None
                and seat.identity.pid == s.pid
                and seat.heartbeat_ns != s.seat_beat
                and time.monotonic() - s.started > settle
            ):
                s.ready, s.beat_seen = True, time.monotonic()
        if not s.ready and s.ready_conn in ready:
            with contextlib.suppress(EOFError, OSError):
                s.ready = s.ready_conn.recv_bytes() == b"ready"
            if s.ready:
                s.beat_seen = time.monotonic()
        if s.proc.sentinel in ready:
            self._died(s)

    def _died(self, s: ServerProcess) -> None:
        """The serving server's process ended without the driver ending it: a standby's fence
        of a stalled server (SIGKILL), or else an error."""
        s.proc.join(5)
        code = s.proc.exitcode
        fenced = s.stalled and code == -signal.SIGKILL
        self._gone(s)
        if fenced:
            stall = next(k for k in reversed(self.takeovers) if k.get("stalled") == s.pid)
            # the server answered nothing from its stall on, and a standby may have served
            # before its death was seen here: the history's restart is the stall's start
            self.run.history.server_killed(stall["sent"], stall["t"])
            stall["fenced_s"] = round(time.monotonic() - stall["t"], 4)
        else:
            self.run.error("ServerExited", f"the server exited with code {code}")
        self.start_server()

    def kill_server(self) -> None:
        """SIGKILL the serving server (a takeover record follows it)."""
        s = self.server
        assert s is not None
        t = time.monotonic()
        send_signal(s.pid, signal.SIGKILL)
        s.proc.join(10)
        self._gone(s)
        # it may have answered until the signal landed, after t; nothing once it was reaped
        self.run.history.server_killed(t, time.monotonic())
        self.takeovers.append(
            {
                "t": t,
                "kind": "kill",
                "killed": s.pid,
                "during": "run" if self.run.injecting else "audit",
            }
        )

    def stall_began(self, s: ServerProcess, sent: float) -> None:
        """The serving server is stopped past the standbys' takeover_after: one must fence it.
        ``sent``: when its SIGSTOP was sent (it may have answered until it landed)."""
        s.stalled = True
        self.takeovers.append(
            {
                "t": time.monotonic(),
                "sent": sent,
                "kind": "stall",
                "stalled": s.pid,
                "during": "run",
            }
        )

    def _end(self, s: ServerProcess) -> None:
        """SIGTERM a server or standby (resumed first) and reap it."""
        pid = s.pid
        send_signal(pid, signal.SIGCONT)
        send_signal(pid, signal.SIGTERM)
        s.proc.join(15)
        if s.proc.is_alive():
            self.run.hang("server", "did not stop within 15 s of SIGTERM", pid)
            send_signal(pid, signal.SIGKILL)
            s.proc.join(10)
        self._gone(s)

    def _gone(self, s: ServerProcess) -> None:
        s.gone = True
        s.ready_conn.close()
        if s.proc.exitcode is not None:
            s.proc.close()

    def _follow_beat(self, s: ServerProcess) -> None:
        """Follow the server's heartbeat in the pool's server seat (its progress)."""
        assert self.run.pool is not None
        seat = self.run.pool.hosts.seat()
        if seat is None or not seat.epoch or seat.identity.pid != s.pid:
            return  # not (yet) this server's seat
        if seat.heartbeat_ns != s.beat_ns:
            s.beat_ns, s.beat_seen = seat.heartbeat_ns, time.monotonic()

    def check_hang(self, now: float) -> None:
        """Replace a server that did not start in time, or whose heartbeat stood still."""
        s = self.server
        if s is None or s.gone or s.held:
            return
        run = self.run
        if not s.ready:
            if now - s.started > run.cfg.server_start_timeout_s:
                run.hang("server", "did not start in time", s.pid)
                self.kill_server()
                self.start_server()
            return
        self._follow_beat(s)
        if now - s.beat_seen > run.cfg.hang_bound_s:
            run.hang("server", f"no heartbeat for {now - s.beat_seen:.1f} s", s.pid)
            self.kill_server()
            self.start_server()

    def stop_all(self) -> None:
        """SIGTERM (then SIGKILL) the server and every standby, and reap them."""
        if self.server is not None and not self.server.gone:
            self._end(self.server)
        for sb in self.standbys:
            self._end(sb)
        self.standbys.clear()
