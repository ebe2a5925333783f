"""The chaos driver: one pool, a real metadata server, clients, and faults.

The driver creates a scratch pool, runs ``beluga serve`` (``beluga.server.server.serve``)
in a child process, forks writer, in-place writer and reader processes
(:mod:`beluga.chaos.roles`), and then, one fault at a time at random
intervals, injects:

``kill_server``         SIGKILL the server, start a new one (it rebuilds its index from the pool)
``stop_server``         SIGSTOP the server, sometimes past the write lease, then SIGCONT
``stall_server``        (with standbys) SIGSTOP the server 1-2 s past the standbys'
                        ``--takeover-after``: a standby must fence it (SIGKILL, as on
                        one kernel) before it takes the seat; SIGCONT after the hold
                        reaches a server no standby fenced
``kill_writer``         SIGKILL a writer or in-place writer; a new process takes its slot over
``kill_reader``         SIGKILL a reader; a new one takes over
``stop_writer``         SIGSTOP a writer past its write lease, then SIGCONT
``stop_reader``         SIGSTOP a reader past its read lease, then SIGCONT
``stop_mid_payload``    an in-place writer stops itself halfway through a payload
                        (reserve, half the payload, SIGSTOP); the driver keeps it
                        stopped past its write lease until another writer has reused
                        the extent (or a bound passes), then SIGCONT: it writes the
                        rest and seals
``corrupt_rpc_line``    random bytes into a request or response line of a client's ring
``corrupt_rpc_buffer``  random bytes into a request or response payload buffer
``corrupt_header``      random bytes into a block header (usually a published one)
``corrupt_payload``     random bytes into a published block's payload
``corrupt_index``       random bytes into a bucket of the pool index (its keys may miss
                        until the server's scrub rewrites it, never read other bytes)

Writers are frozen (SIGSTOP, for a few milliseconds) while the driver picks
and corrupts a block, so the block it hit is the one it looked at; the key
whose committed block it corrupted is recorded, and misses of that key are
then excused from lost-write accounting (never wrong bytes: a corrupted block
must read as a miss).

With ``standbys=N`` (``beluga chaos --standby N``) N ``beluga serve --standby``
processes wait beside the server.  A killed server is then not restarted by
the driver: a standby takes the seat, recovers and serves, and the driver
starts a new standby to keep N waiting.  A server stopped (SIGSTOP) for less
than the standbys' ``takeover_after_s`` keeps its seat (its heartbeat has not
stood still long enough; beluga.server.server says why that is the rule), and the
verifier catches a standby that takes it.  A server stopped for longer
(``stall_server``, or a ``stop_server`` hold past it; with ``emulated_hosts``,
where a standby cannot see a process, any stop) is a stall: a standby fences
it (SIGKILL, or its ``--fence`` command across hosts) and takes the seat, and
a stall no standby fenced counts in the report.
For every server kill the report gives the write outage: from the kill to the
first put tried after it that was acknowledged (p50, p99, max).

After the last fault every process is resumed, the writers are stopped, an
auditor reads every key through every read path, the server is killed and
restarted once more, and the auditor reads everything again (what the
rebuilt index serves).  Then :meth:`History.check` judges every read.

A role that is neither stopped nor killed and reports nothing for
``hang_bound_s`` is a hang: its stacks are dumped (SIGUSR1, faulthandler) to
stderr and it is replaced.  The server hangs when its heartbeat in the pool's
server seat stops while it is not stopped.

The seed fixes the fault plan (kinds, targets, timings, hostile bytes) and
every role's choices; the operating system's scheduling is not replayable,
so a seed reproduces a run's faults, not its exact interleaving.
"""

from __future__ import annotations

import contextlib
import heapq
import multiprocessing as mp
import os
import random
import re
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import psutil

from beluga._native import _core
from beluga.chaos import faults
from beluga.chaos.report import ChaosReport, replay_command
from beluga.chaos.roles import CLIENTS, RoleSpec, role_main
from beluga.chaos.verifier import History
from beluga.coherence import BlockState, digest, parse_header, read_line
from beluga.errors import BelugaError
from beluga.pool import Geometry, Pool
from beluga.pool.host_records import emulate_host
from beluga.pool.seat import SEAT_SETTLE_S
from beluga.server.server import serve
from beluga.signals import raise_if_interrupted

_CTX = mp.get_context("fork")

KINDS = (
    "kill_server",
    "stop_server",
    "stall_server",
    "kill_writer",
    "kill_reader",
    "stop_writer",
    "stop_reader",
    "stop_mid_payload",
    "corrupt_rpc_line",
    "corrupt_rpc_buffer",
    "corrupt_header",
    "corrupt_payload",
    "corrupt_index",
)
WEIGHTS = {
    "kill_server": 4,
    "stop_server": 5,
    "stall_server": 3,  # only with standbys
    "kill_writer": 7,
    "kill_reader": 5,
    "stop_writer": 7,
    "stop_reader": 5,
    "stop_mid_payload": 9,
    "corrupt_rpc_line": 10,
    "corrupt_rpc_buffer": 9,
    "corrupt_header": 8,
    "corrupt_payload": 8,
    "corrupt_index": 8,
}
COHERENCE = ("native", "mixed", "model")
#: a drawn fault kind that does not fit yet is tried again every FAULT_RETRY_S, at most
#: MAX_FAULT_WAITS times (5 s: past a stall's hold and the takeover), before another is drawn
FAULT_RETRY_S = 0.05
MAX_FAULT_WAITS = 100


class ChaosError(BelugaError):
    """The chaos run itself could not proceed (not a finding about Beluga).

    Its message says what it waited for and how to rerun (seed, bounds).
    """


@dataclass(frozen=True)
class ChaosConfig:
    """One chaos run.  ``seed=None`` draws one (it is printed and reported).

    Frozen (treat ``weights`` as read-only too): thread-safe and fork-safe.
    """

    faults: int = 200
    seed: int | None = None
    writers: int = 3
    inplace_writers: int = 2
    readers: int = 3
    keys_per_writer: int = 12
    coherence: str = "native"  # native | mixed (odd role slots model) | model (all)
    write_lease_s: float = 0.75
    read_lease_s: float = 0.5
    fault_interval_s: float = 0.3  # mean gap between faults
    hang_bound_s: float = 30.0
    rpc_timeout_s: float = 4.0
    connect_timeout_s: float = 6.0
    server_start_timeout_s: float = 30.0
    max_reuse_wait_s: float = 2.0  # past the lease, waiting for the extent to be reused
    pool_path: str | None = None  # default: a unique /dev/shm/beluga-chaos-* file
    pool_bytes: int = 64 << 20  # freed extents are reused within seconds; nothing is evicted
    block_size: int = 16 << 10  # pool block, bytes (Geometry.block_size)
    max_value_blocks: int = 3
    role_pause_s: float = 0.002
    settle_s: float = 1.5
    max_inject_s: float = 1200.0  # stop injecting after this long, whatever the count
    standbys: int = 0  # `beluga serve --standby` processes waiting beside the server
    takeover_after_s: float = 1.0  # the standbys' --takeover-after (the product default is 5)
    #: each server and standby a host of its own (BELUGA_EMULATED_HOST): a standby then sees
    #: a server only by its heartbeat and fences it with a --fence command, as across machines
    emulated_hosts: bool = False
    #: a writer client of a layer above chaos for writer slots 2, 5, ... (roles.CLIENTS):
    #: "mooncake", the Mooncake drop-in (import beluga.compat.mooncake.chaos first); None: none
    writer_client: str | None = None
    weights: dict[str, float] = field(default_factory=lambda: dict(WEIGHTS))

    def __post_init__(self) -> None:
        if self.coherence not in COHERENCE:
            raise ValueError(f"coherence must be one of {COHERENCE}, not {self.coherence!r}")
        if self.writers < 1 or self.inplace_writers < 0 or self.readers < 1:
            raise ValueError("a chaos run needs at least one writer and one reader")
        unknown = set(self.weights) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; the kinds are {KINDS}")
        if self.faults < 0 or self.write_lease_s <= 0 or self.hang_bound_s <= 0:
            raise ValueError("faults, write_lease_s and hang_bound_s must be positive")
        if not 0 <= self.standbys <= 8:
            raise ValueError(f"standbys must be 0..8, not {self.standbys}")
        if self.emulated_hosts and not self.standbys:
            raise ValueError("emulated_hosts is for standbys: give standbys >= 1")
        if self.takeover_after_s <= 0:
            raise ValueError(f"takeover_after_s must be above 0, not {self.takeover_after_s}")


@dataclass
class _Mid:
    block: int
    nblocks: int
    version: int
    since: float
    reused: bool = False


@dataclass
class _Role:
    name: str
    kind: str
    slot: int
    incarnation: int
    proc: BaseProcess
    out: Connection
    ctl: Connection
    coherence: str
    last_progress: float
    hello: bool = False
    held: bool = False  # stopped by the driver (a stop fault or a freeze)
    mid: _Mid | None = None  # stopped itself mid-payload, resumed by the driver
    pause_asked: float | None = None
    gone: bool = False
    exitcode: int | None = None
    audited: bool = False
    pid: int = 0  # kept: the process object is closed once reaped

    def __post_init__(self) -> None:
        assert self.proc.pid is not None
        self.pid = self.proc.pid


@dataclass
class _Server:
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


#: what a connect refused for lack of host ids says (HostTable.claim)
IDS_REFUSED = "host ids of this pool are held by live processes"

#: the standbys' --fence with emulated hosts: every "host" is this kernel, so SIGKILL the
#: server and wait until its pid names no process (the driver reaps it within a pump)
CHAOS_FENCE = (
    'kill -KILL "$BELUGA_FENCE_PID" 2>/dev/null; for _ in $(seq 1000); do '
    'kill -0 "$BELUGA_FENCE_PID" 2>/dev/null || exit 0; sleep 0.01; done; exit 1'
)


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


def _is_stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def _wait_stopped(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not _is_stopped(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


def _signal(pid: int, sig: int) -> None:
    if pid <= 0:  # never a process group
        raise ValueError(f"refusing to signal pid {pid}")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


class ChaosDriver:
    """Runs one chaos round and returns its :class:`ChaosReport`.

    Not thread-safe: one thread drives a run (it owns its child processes and
    their pipes).  Not fork-safe: a forked copy must not drive the same run.
    """

    def __init__(self, config: ChaosConfig, log: Callable[[str], None] | None = None) -> None:
        self.cfg = config
        self.seed = (
            config.seed if config.seed is not None else random.SystemRandom().getrandbits(32)
        )
        self.rng = random.Random(self.seed)
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.path = (
            config.pool_path or f"/dev/shm/beluga-chaos-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        nwriters = config.writers + config.inplace_writers
        self.keys = [
            f"chaos/w{w}/k{i}" for w in range(nwriters) for i in range(config.keys_per_writer)
        ]
        self.owner = [w for w in range(nwriters) for _ in range(config.keys_per_writer)]
        self.by_digest = {digest(k.encode()): i for i, k in enumerate(self.keys)}
        self.start = time.monotonic()
        self.history = History(self.keys, self.owner, origin=self.start)
        self.roles: list[_Role] = []
        self.stragglers: list[BaseProcess] = []  # ended by us, not yet reaped
        self.incarnations: Counter[tuple[str, int]] = Counter()
        self.server: _Server | None = None
        self.standbys: list[_Server] = []  # waiting for the seat
        self.takeovers: list[dict[str, Any]] = []  # per server kill: who took over, when
        self.hosts_made = 0  # emulated hosts named so far (one per server process)
        self.lost_seat_races = 0  # standbys that stored the seat at once and lost it again
        self.ids_refused = 0  # connects refused because every host id was held
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        self.timer_seq = 0
        self.faults: Counter[str] = Counter()
        self.fault_log: list[dict[str, Any]] = []
        self.hangs: list[dict[str, Any]] = []
        self.errors: Counter[str] = Counter()
        self.error_samples: dict[str, Counter[str]] = {}
        self.mid_reused = 0
        self.injecting = True
        self.pool: Pool | None = None
        self.nblocks = 0

    # -- set-up and tear-down ------------------------------------------------

    def run(self) -> ChaosReport:
        cfg = self.cfg
        if os.path.exists(self.path):
            raise ChaosError(
                f"{self.path} already exists; a chaos run makes (and removes) a scratch pool "
                "of its own: name a new path, or remove that one if nothing uses it"
            )
        if cfg.writer_client is not None and cfg.writer_client not in CLIENTS:
            raise ChaosError(
                f"no writer client {cfg.writer_client!r} is registered (known: "
                f"{sorted(CLIENTS) or 'none'}); import the module that registers it first "
                "(beluga.compat.mooncake.chaos registers 'mooncake')"
            )
        self.log(
            f"beluga chaos: seed {self.seed}, {cfg.faults} faults, coherence {cfg.coherence}, "
            f"pool {self.path} (replay: {replay_command(self.seed, cfg)})"
        )
        # across (emulated) hosts a killed client's id comes back only once its heartbeat is
        # stale (hosts.DEFAULT_STALE_S), not at once: room for the kills meanwhile
        max_hosts = 128 if cfg.emulated_hosts else 32
        geometry = Geometry(
            max_hosts=max_hosts, rpc_bytes_per_host=128 << 10, block_size=cfg.block_size
        )
        self.pool = Pool.create(self.path, cfg.pool_bytes, geometry=geometry, coherence="native")
        self.nblocks = self.pool.superblock.nblocks
        try:
            self._start_server()
            self._await(
                lambda: self.server is not None and self.server.ready,
                cfg.server_start_timeout_s,
                "the first server to start",
            )
            for kind, count in (
                ("writer", cfg.writers),
                ("inplace", cfg.inplace_writers),
                ("reader", cfg.readers),
            ):
                for slot in range(count):
                    self._spawn(kind, slot)
            self._await(
                lambda: all(r.hello for r in self.roles if not r.gone),
                cfg.hang_bound_s,
                "every role to connect",
            )
            self._inject_all()
            self._finish()
        finally:
            self._teardown()
        return self._report()

    def _teardown(self) -> None:
        live = [r for r in self.roles if not r.gone]
        for r in live:
            _signal(r.pid, signal.SIGKILL)
        for r in live:
            r.proc.join(10)
            r.out.close()
            r.ctl.close()
        for proc in self.stragglers:
            assert proc.pid is not None
            _signal(proc.pid, signal.SIGKILL)
            proc.join(10)
        if self.server is not None and not self.server.gone:
            self._stop_server()
        for sb in self.standbys:
            self._end_server(sb)
        self.standbys.clear()
        if self.pool is not None:
            self.pool.close()
            Pool.destroy(self.path)

    # -- the event loop ------------------------------------------------------

    def _after(self, delay: float, action: Callable[[], None]) -> None:
        self.timer_seq += 1
        heapq.heappush(self.timers, (time.monotonic() + delay, self.timer_seq, action))

    def _pump(self, seconds: float) -> None:
        """Serve messages, timers, deaths and hang checks for ``seconds``."""
        end = time.monotonic() + seconds
        while True:
            now = time.monotonic()
            while self.timers and self.timers[0][0] <= now:
                heapq.heappop(self.timers)[2]()
            if now >= end:
                return
            nxt = min(end, self.timers[0][0] if self.timers else end)
            live = [r for r in self.roles if not r.gone]
            waitables: list[Any] = [r.out for r in live] + [r.proc.sentinel for r in live]
            if self.server is not None and not self.server.gone:
                waitables.append(self.server.proc.sentinel)
                if not self.server.ready:
                    waitables.append(self.server.ready_conn)
            waitables += [sb.proc.sentinel for sb in self.standbys]
            ready = wait(waitables, timeout=max(0.0, min(0.05, nxt - now)))
            raise_if_interrupted()  # a signal to `beluga chaos`: unwind through _teardown
            self._drain([r for r in live if r.out in ready])
            self._server_events(ready)
            self._standby_events(ready)
            for r in live:
                if r.proc.sentinel in ready:
                    self._role_exited(r)
            self._check_hangs()

    def _await(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                seen = "; ".join(f"{k}: {dict(v)}" for k, v in self.error_samples.items())
                raise ChaosError(
                    f"waited {timeout} s for {what} in vain (errors so far: {seen or 'none'}); "
                    f"rerun with --seed {self.seed}; a loaded machine needs a larger --hang-bound"
                )
            self._pump(0.02)

    def _drain(self, roles: list[_Role]) -> None:
        for r in roles:
            try:
                while r.out.poll():
                    self._message(r, r.out.recv())
            except (EOFError, OSError):
                continue

    def _message(self, r: _Role, msg: tuple[Any, ...]) -> None:
        r.last_progress = time.monotonic()
        kind = msg[0]
        h = self.history
        if kind == "hello":
            r.hello = True
        elif kind == "try":
            h.tried(r.name, msg[1], msg[2])
        elif kind == "done":
            h.done(r.name, msg[1], msg[2], msg[3])
        elif kind == "read":
            h.read(r.name, msg[1], msg[2], msg[3], msg[4])
        elif kind == "retired":
            h.retired(r.name, msg[1], msg[2], msg[3], msg[4])
        elif kind == "error":
            self._error(f"{msg[2]}", msg[3])
        elif kind == "stats":
            h.stats(msg[2], msg[3])
        elif kind == "mid":
            self._mid_payload(r, *msg[1:])
        elif kind == "audited":
            r.audited = True

    def _error(self, kind: str, message: str) -> None:
        self.errors[kind] += 1
        self.ids_refused += IDS_REFUSED in message
        samples = self.error_samples.setdefault(kind, Counter())
        shape = re.sub(r"\d+", "N", message)  # one entry per kind of message, counted
        if shape in samples or len(samples) < 8:
            samples[shape] += 1

    # -- processes -----------------------------------------------------------

    def _coherence(self, kind: str, slot: int) -> str:
        mode = self.cfg.coherence
        if mode == "mixed":
            return "model" if slot % 2 else "native"
        return mode

    def _spawn(self, kind: str, slot: int) -> _Role:
        cfg = self.cfg
        self.incarnations[kind, slot] += 1
        inc = self.incarnations[kind, slot]
        writer_id = slot + (cfg.writers if kind == "inplace" else 0)
        own = tuple(
            i for i, w in enumerate(self.owner) if kind in ("writer", "inplace") and w == writer_id
        )
        name = f"{kind}-{slot}" if kind != "auditor" else "auditor"
        spec = RoleSpec(
            name=f"{name}#{inc}",
            kind=kind,
            slot=writer_id if kind in ("writer", "inplace") else slot,
            incarnation=inc,
            seed=self.rng.getrandbits(63),
            pool=self.path,
            coherence=self._coherence(kind, slot) if kind != "auditor" else "native",
            keys=tuple(self.keys),
            own=own,
            block_bytes=cfg.block_size,
            max_value=cfg.block_size * cfg.max_value_blocks,
            rpc_timeout_s=cfg.rpc_timeout_s,
            connect_timeout_s=cfg.connect_timeout_s,
            pause_s=cfg.role_pause_s,
            client=cfg.writer_client,
        )
        out_r, out_w = _CTX.Pipe(duplex=False)
        ctl_r, ctl_w = _CTX.Pipe(duplex=False)
        proc = _CTX.Process(
            target=role_main, args=(spec, out_w, ctl_r), name=spec.name, daemon=True
        )
        proc.start()
        out_w.close()
        ctl_r.close()
        role = _Role(
            spec.name, kind, slot, inc, proc, out_r, ctl_w, spec.coherence, time.monotonic()
        )
        self.roles.append(role)
        return role

    def _command(self, r: _Role, cmd: str) -> None:
        with contextlib.suppress(OSError):
            r.ctl.send(cmd)

    def _reap(self, r: _Role) -> None:
        """A role process ended: collect its last messages; its unfinished writes are unknown."""
        r.proc.join(5)
        self._drain([r])
        r.gone = True
        r.exitcode = r.proc.exitcode
        self.history.role_died(r.name, time.monotonic())
        r.out.close()
        r.ctl.close()
        if r.exitcode is not None:
            r.proc.close()  # its sentinel fd: a long run starts hundreds of processes
        else:
            self.stragglers.append(r.proc)

    def _role_exited(self, r: _Role) -> None:
        if r.gone:
            return
        self._reap(r)
        code = r.exitcode
        if code != 0:
            self._error("RoleExited", f"{r.name} exited with code {code}")
        if self.injecting and code != 0:
            self._spawn(r.kind, r.slot)

    def _kill(self, r: _Role) -> None:
        _signal(r.pid, signal.SIGKILL)
        self._reap(r)

    def _alive(self, kinds: tuple[str, ...], *, free: bool = True) -> list[_Role]:
        """Live roles of these kinds (``free``: connected and not stopped by us)."""
        return [
            r
            for r in self.roles
            if r.kind in kinds
            and not r.gone
            and (not free or (r.hello and not r.held and not r.mid))
        ]

    # -- the server ----------------------------------------------------------

    def _start_server(self) -> None:
        """A server for a seat that is empty: a standby takes it when there is one."""
        if self.server is not None and not self.server.gone:
            return  # one server at a time (a restart was already made)
        if self.cfg.standbys:
            self._replenish()
            if self.standbys:
                return  # one of them takes the seat (_standby_events)
        self.server = self._spawn_server(standby=False)

    def _spawn_server(self, standby: bool) -> _Server:
        cfg = self.cfg
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
        ready_r, ready_w = _CTX.Pipe(duplex=False)
        proc = _CTX.Process(
            target=_server_main,
            args=(self.path, mode, options, ready_w, standby, host),
            name="standby" if standby else "server",
            daemon=True,
        )
        proc.start()
        ready_w.close()
        return _Server(proc, ready_r, time.monotonic(), standby=standby)

    def _replenish(self) -> None:
        """Keep ``standbys`` processes waiting for the seat."""
        while len(self.standbys) < self.cfg.standbys:
            self.standbys.append(self._spawn_server(standby=True))

    def _standby_events(self, ready: list[Any]) -> None:
        """Standbys that died, and the one that took the seat once the server was gone."""
        for sb in list(self.standbys):
            if sb.proc.sentinel in ready:
                sb.proc.join(5)
                self.standbys.remove(sb)
                self._server_gone(sb)
                self._error("StandbyExited", f"a standby exited with code {sb.proc.exitcode}")
                if self.injecting:
                    self._replenish()
        if not self.standbys or self.pool is None:
            return
        seat = self.pool.hosts.seat()
        if seat is None or not seat.epoch:
            return
        for sb in self.standbys:
            if seat.identity.pid == sb.pid:
                s = self.server
                if s is not None and not s.gone and not s.proc.is_alive():
                    self._server_died(s)  # fenced (or dead) a moment ago: not seen yet
                s = self.server
                if s is not None and not s.gone and s.seat_beat is not None and not s.ready:
                    # a standby that stored the seat line while this one did, from another
                    # host, and lost (beluga.pool.seat.take_seat's settle): it waits again
                    s.standby, s.seat_beat = True, None
                    self.standbys.append(s)
                    self.server = None
                    self.lost_seat_races += 1
                if self.server is not None and not self.server.gone:
                    self._error(
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
                if self.injecting:
                    self._after(self.rng.uniform(0, 0.3), self._replenish)
                return

    def _server_events(self, ready: list[Any]) -> None:
        s = self.server
        if s is None or s.gone:
            return
        if not s.ready and s.seat_beat is not None and self.pool is not None:
            seat = self.pool.hosts.seat()  # a standby serves once it beats the seat
            # (across hosts, once it has held it past the settle: it may lose it till then)
            settle = SEAT_SETTLE_S if self.cfg.emulated_hosts else 0.0
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
            self._server_died(s)

    def _server_died(self, s: _Server) -> None:
        """The serving server's process ended without the driver ending it: a standby's fence
        of a stalled server (SIGKILL), or else an error."""
        s.proc.join(5)
        code = s.proc.exitcode
        fenced = s.stalled and code == -signal.SIGKILL
        self._server_gone(s)
        if fenced:
            self.history.server_killed(time.monotonic())
            stall = next(k for k in reversed(self.takeovers) if k.get("stalled") == s.pid)
            stall["fenced_s"] = round(time.monotonic() - stall["t"], 4)
        else:
            self._error("ServerExited", f"the server exited with code {code}")
        self._start_server()

    def _kill_server(self) -> None:
        s = self.server
        assert s is not None
        t = time.monotonic()
        _signal(s.pid, signal.SIGKILL)
        s.proc.join(10)
        self._server_gone(s)
        self.history.server_killed(time.monotonic())
        self.takeovers.append(
            {
                "t": t,
                "kind": "kill",
                "killed": s.pid,
                "during": "run" if self.injecting else "audit",
            }
        )

    def _stop_server(self) -> None:
        s = self.server
        assert s is not None
        self._end_server(s)

    def _end_server(self, s: _Server) -> None:
        """SIGTERM a server or standby (resumed first) and reap it."""
        pid = s.pid
        _signal(pid, signal.SIGCONT)
        _signal(pid, signal.SIGTERM)
        s.proc.join(15)
        if s.proc.is_alive():
            self._hang("server", "did not stop within 15 s of SIGTERM", pid)
            _signal(pid, signal.SIGKILL)
            s.proc.join(10)
        self._server_gone(s)

    def _server_gone(self, s: _Server) -> None:
        s.gone = True
        s.ready_conn.close()
        if s.proc.exitcode is not None:
            s.proc.close()

    def _server_beat(self, s: _Server) -> None:
        """Follow the server's heartbeat in the pool's server seat (its progress)."""
        assert self.pool is not None
        seat = self.pool.hosts.seat()
        if seat is None or not seat.epoch or seat.identity.pid != s.pid:
            return  # not (yet) this server's seat
        if seat.heartbeat_ns != s.beat_ns:
            s.beat_ns, s.beat_seen = seat.heartbeat_ns, time.monotonic()

    # -- hangs ---------------------------------------------------------------

    def _hang(self, who: str, what: str, pid: int) -> None:
        self.hangs.append({"t": round(time.monotonic() - self.start, 3), "role": who, "what": what})
        self.log(f"beluga chaos: HANG {who} (pid {pid}): {what}; its stacks follow on stderr")
        _signal(pid, signal.SIGUSR1)

    def _check_hangs(self) -> None:
        now = time.monotonic()
        bound = self.cfg.hang_bound_s
        for r in list(self.roles):
            if r.gone or r.held or r.mid or now - r.last_progress <= bound:
                continue
            self._hang(r.name, f"no progress for {now - r.last_progress:.1f} s", r.pid)
            time.sleep(0.2)  # let faulthandler write
            self._kill(r)
            if self.injecting:
                self._spawn(r.kind, r.slot)
        s = self.server
        if s is None or s.gone or s.held:
            return
        if not s.ready:
            if now - s.started > self.cfg.server_start_timeout_s:
                self._hang("server", "did not start in time", s.pid)
                self._kill_server()
                self._start_server()
            return
        self._server_beat(s)
        if now - s.beat_seen > bound:
            self._hang("server", f"no heartbeat for {now - s.beat_seen:.1f} s", s.pid)
            self._kill_server()
            self._start_server()

    # -- faults --------------------------------------------------------------

    def _inject_all(self) -> None:
        cfg = self.cfg
        kinds = [
            k for k in KINDS
            if cfg.weights.get(k, 0) > 0 and (k != "stall_server" or cfg.standbys)
        ]  # fmt: skip
        if not kinds:
            raise ChaosError("no fault kind to inject: stall_server needs --standby N")
        weights = [cfg.weights[k] for k in kinds]
        last_log = time.monotonic()
        # A drawn kind that does not fit right now (the server is stalled, every reader is
        # stopped) is tried again shortly rather than yielding to one that fits: redrawing
        # would starve the kinds that need a running server whenever stalls are frequent,
        # so a round's mix would follow its weights only on average over lucky seeds.
        pending: str | None = None
        waited = 0
        while sum(self.faults.values()) < cfg.faults:
            if time.monotonic() - self.start > cfg.max_inject_s:
                self.log(f"beluga chaos: stopped injecting after {cfg.max_inject_s} s")
                break
            self._pump(FAULT_RETRY_S if pending else self.rng.expovariate(1 / cfg.fault_interval_s))
            if pending is None or waited >= MAX_FAULT_WAITS:
                pending, waited = self.rng.choices(kinds, weights)[0], 0
            if self._inject(pending):
                pending = None
            else:
                waited += 1
            if time.monotonic() - last_log > 10:
                last_log = time.monotonic()
                self.log(
                    f"beluga chaos: {time.monotonic() - self.start:.0f} s, "
                    f"{sum(self.faults.values())} faults, {len(self.history.reads)} reads, "
                    f"{self.history.live_wrong} wrong, {len(self.hangs)} hangs"
                )

    def _record(self, kind: str, target: str, **extra: Any) -> None:
        self.faults[kind] += 1
        self.fault_log.append(
            {"t": round(time.monotonic() - self.start, 3), "kind": kind, "target": target, **extra}
        )

    def _inject(self, kind: str) -> bool:
        """Inject one fault of ``kind``; False when nothing fits it right now."""
        return bool(getattr(self, f"_fault_{kind}")())

    def _server_up(self) -> _Server | None:
        s = self.server
        return s if s is not None and not s.gone and s.ready else None

    def _fault_kill_server(self) -> bool:
        s = self._server_up()
        if s is None or s.stalled:  # a stalled server is left to the standbys' fence
            return False
        self._kill_server()
        self._record("kill_server", f"server pid {s.pid}", held=s.held)
        self._after(self.rng.uniform(0, 0.3), self._start_server)
        return True

    def _fault_stop_server(self) -> bool:
        s = self._server_up()
        if s is None or s.held:
            return False
        hold = self.rng.uniform(0.3, 2 * self.cfg.write_lease_s)
        _signal(s.pid, signal.SIGSTOP)
        s.held = True
        self._record("stop_server", f"server pid {s.pid}", hold_s=round(hold, 3))
        # past the standbys' takeover_after a stop is a stall (across hosts any stop is: the
        # standby cannot see the process): a standby fences it and takes the seat
        if self.standbys and (self.cfg.emulated_hosts or hold > self.cfg.takeover_after_s):
            s.stalled = True
            self.takeovers.append(
                {"t": time.monotonic(), "kind": "stall", "stalled": s.pid, "during": "run"}
            )

        def resume() -> None:
            if not s.gone:
                _signal(s.pid, signal.SIGCONT)
                s.held, s.stalled, s.beat_seen = False, False, time.monotonic()

        self._after(hold, resume)
        return True

    def _fault_stall_server(self) -> bool:
        """Stop the server past the standbys' takeover_after: one must fence it and serve."""
        s = self._server_up()
        if s is None or s.held or not self.standbys:
            return False
        hold = self.cfg.takeover_after_s + self.rng.uniform(1.0, 2.0)
        _signal(s.pid, signal.SIGSTOP)
        s.held = s.stalled = True
        self._record("stall_server", f"server pid {s.pid}", hold_s=round(hold, 3))
        self.takeovers.append({"t": time.monotonic(), "kind": "stall", "stalled": s.pid,
                               "during": "run"})  # fmt: skip

        def resume() -> None:
            if not s.gone:  # no standby fenced it in time: it serves on
                _signal(s.pid, signal.SIGCONT)
                s.held, s.stalled, s.beat_seen = False, False, time.monotonic()

        self._after(hold, resume)
        return True

    def _kill_role(self, kinds: tuple[str, ...], fault: str) -> bool:
        victims = self._alive(kinds, free=False)
        if not victims:
            return False
        r = self.rng.choice(victims)
        state = "mid-payload" if r.mid else "stopped" if r.held else "running"
        self._kill(r)
        self._record(fault, r.name, state=state)
        self._spawn(r.kind, r.slot)
        return True

    def _fault_kill_writer(self) -> bool:
        return self._kill_role(("writer", "inplace"), "kill_writer")

    def _fault_kill_reader(self) -> bool:
        return self._kill_role(("reader",), "kill_reader")

    def _stop_role(self, kinds: tuple[str, ...], fault: str, hold: float) -> bool:
        victims = self._alive(kinds)
        if not victims:
            return False
        r = self.rng.choice(victims)
        _signal(r.pid, signal.SIGSTOP)
        r.held = True
        self._record(fault, r.name, hold_s=round(hold, 3))
        self._after(hold, lambda: self._resume(r))
        return True

    def _resume(self, r: _Role) -> None:
        if not r.gone and r.held:
            _signal(r.pid, signal.SIGCONT)
            r.held = False
            r.last_progress = time.monotonic()

    def _fault_stop_writer(self) -> bool:
        hold = self.cfg.write_lease_s + self.rng.uniform(0.1, 1.0)
        return self._stop_role(("writer", "inplace"), "stop_writer", hold)

    def _fault_stop_reader(self) -> bool:
        hold = self.cfg.read_lease_s + self.rng.uniform(0.1, 1.5)
        return self._stop_role(("reader",), "stop_reader", hold)

    # -- a writer stopped mid-payload ----------------------------------------

    def _fault_stop_mid_payload(self) -> bool:
        now = time.monotonic()
        asked = [
            r
            for r in self._alive(("inplace",), free=False)
            if r.mid or (r.pause_asked and now - r.pause_asked < self.cfg.hang_bound_s)
        ]
        if asked:
            return False  # one at a time: the pattern needs the other writers running
        candidates = self._alive(("inplace",))
        if not candidates:
            return False
        r = self.rng.choice(candidates)
        r.pause_asked = now
        self._command(r, "pause-mid")
        return True  # counted when the writer is actually stopped (see _mid_payload)

    def _mid_payload(
        self, r: _Role, t: float, key: int, serial: int, block: int, nblocks: int, version: int
    ) -> None:
        r.pause_asked = None
        if not _wait_stopped(r.pid, 2.0):
            self._error("ChaosMidPause", f"{r.name} announced a mid-payload stop but did not stop")
            return
        r.mid = _Mid(block, nblocks, version, time.monotonic())
        self._record(
            "stop_mid_payload",
            r.name,
            key=self.keys[key],
            serial=f"{serial:#x}",
            block=block,
            nblocks=nblocks,
        )
        self._after(0.05, lambda: self._watch_mid(r))

    def _extent_reused(self, m: _Mid) -> bool:
        """Whether another write (newer version) now covers a block of the stalled extent."""
        assert self.pool is not None
        mem, sb = self.pool.memory, self.pool.superblock
        first = max(0, m.block - self.cfg.max_value_blocks + 1)
        for b in range(first, min(sb.nblocks, m.block + m.nblocks)):
            h = parse_header(read_line(mem, sb.block_header_offset(b)))
            if h is None or h.version <= m.version or h.state == BlockState.FREE:
                continue
            if b + max(1, -(-h.length // sb.block_size)) > m.block:
                return True
        return False

    def _watch_mid(self, r: _Role) -> None:
        m = r.mid
        if r.gone or m is None:
            return
        waited = time.monotonic() - m.since
        past_lease = waited > self.cfg.write_lease_s + 0.1
        m.reused = m.reused or (past_lease and self._extent_reused(m))
        if (
            self.injecting
            and not m.reused
            and waited < self.cfg.write_lease_s + self.cfg.max_reuse_wait_s
        ):
            self._after(0.05, lambda: self._watch_mid(r))
            return
        if self.injecting and not past_lease:
            self._after(0.05, lambda: self._watch_mid(r))
            return
        self.fault_log.append(
            {
                "t": round(time.monotonic() - self.start, 3),
                "kind": "resume_mid_payload",
                "target": r.name,
                "stopped_s": round(waited, 3),
                "extent_reused": m.reused,
            }
        )
        self.mid_reused += m.reused
        r.mid = None
        r.last_progress = time.monotonic()
        _signal(r.pid, signal.SIGCONT)

    # -- hostile bytes -------------------------------------------------------

    @contextlib.contextmanager
    def _writers_frozen(self) -> Iterator[None]:
        """Every running writer SIGSTOPped for the block, so nothing changes hands while we
        aim; SIGCONT after.

        A writer that stopped itself mid-payload sent "mid" first: draining
        the frozen writers' pipes finds it, and it stays stopped at the thaw.
        """
        frozen = [
            r
            for r in self.roles
            if r.kind in ("writer", "inplace") and not r.gone and not r.held and not r.mid
        ]
        for r in frozen:
            _signal(r.pid, signal.SIGSTOP)
        for r in frozen:
            if not _wait_stopped(r.pid, 1.0) and r.proc.is_alive():
                self._error("ChaosFreeze", f"{r.name} did not stop within 1 s")
        self._drain(frozen)
        try:
            yield
        finally:
            for r in frozen:
                if not r.gone and not r.mid:
                    _signal(r.pid, signal.SIGCONT)

    def _fault_corrupt_rpc_line(self) -> bool:
        return self._corrupt_rpc("corrupt_rpc_line", ("request-line", "response-line"))

    def _fault_corrupt_rpc_buffer(self) -> bool:
        return self._corrupt_rpc("corrupt_rpc_buffer", ("request-buffer", "response-buffer"))

    def _corrupt_rpc(self, fault: str, parts: tuple[str, ...]) -> bool:
        assert self.pool is not None
        hit = faults.corrupt_rpc(
            self.pool.memory,
            self.pool.superblock,
            self.pool.hosts,
            self.rng,
            self.rng.choice(parts),
        )
        if hit is None:
            return False
        self._record(fault, hit.target, bytes=hit.length)
        return True

    def _corrupt_block(self, fault: str, injector: Callable[..., faults.Hit | None]) -> bool:
        assert self.pool is not None
        with self._writers_frozen():
            # the earliest moment a reader can see the hostile bytes: before the store,
            # not after it (a read that raced it is excused, not a lost write)
            before = time.monotonic()
            hit = injector(self.pool.memory, self.pool.superblock, self.rng)
            if hit is None:
                return False
            key = None
            if hit.header is not None:
                key = self.by_digest.get(hit.header.digest)
                if key is not None:
                    self.history.corrupted(key, before)
            self._record(
                fault,
                hit.target,
                bytes=hit.length,
                key=None if key is None else self.keys[key],
                version=None if hit.header is None else hit.header.version,
            )
            return True

    def _fault_corrupt_header(self) -> bool:
        return self._corrupt_block("corrupt_header", faults.corrupt_header)

    def _fault_corrupt_payload(self) -> bool:
        return self._corrupt_block("corrupt_payload", faults.corrupt_payload)

    def _fault_corrupt_index(self) -> bool:
        """Hostile bytes in an index bucket: its keys may miss until the server's scrub
        rewrites it (excused as corrupted), but a read may never return other bytes."""
        assert self.pool is not None
        sb = self.pool.superblock
        # Writers are frozen while we aim, as for blocks: a put tried before the store may
        # have its commit land either side of it (its misses are excused); one tried after
        # rewrites the bucket from the server's mirror. Unfrozen, a put tried between the
        # timestamp and the store, and committed before it, was called a lost write.
        with self._writers_frozen():
            before = time.monotonic()
            hit, bucket = faults.corrupt_index(self.pool.memory, sb, self.rng)
            for d, key in self.by_digest.items():
                if bucket in _core.ix_hash(d, sb.nbuckets)[1:]:
                    self.history.corrupted(key, before)
            self._record("corrupt_index", hit.target, bytes=hit.length)
        return True

    # -- the end: quiesce, audit, restart, audit -----------------------------

    def _finish(self) -> None:
        cfg = self.cfg
        self.injecting = False
        for r in self.roles:
            if r.kind == "inplace" and not r.gone:
                self._command(r, "no-pause")
        for _ in range(len(self.timers)):  # every pending SIGCONT and restart, now
            heapq.heappop(self.timers)[2]()
        for r in self.roles:
            self._resume(r)
            if r.mid is not None:
                self._watch_mid(r)
        self._await(
            lambda: self._server_up() is not None and not self.server.held,  # type: ignore[union-attr]
            cfg.server_start_timeout_s + cfg.hang_bound_s,
            "the server to come back",
        )
        self._pump(cfg.settle_s)
        self._stop_roles(("writer", "inplace"))
        self._audit("audit")
        self._kill_server()
        self._start_server()
        self._await(
            lambda: self._server_up() is not None,
            cfg.server_start_timeout_s,
            "the server to restart for the final audit",
        )
        self._audit("audit after restart")
        self._stop_roles(("reader",))

    def _stop_roles(self, kinds: tuple[str, ...]) -> None:
        targets = [r for r in self.roles if r.kind in kinds and not r.gone]
        for r in targets:
            self._command(r, "stop")
        deadline = time.monotonic() + self.cfg.hang_bound_s
        while any(not r.gone for r in targets) and time.monotonic() < deadline:
            self._pump(0.05)
        for r in targets:
            if not r.gone:
                self._hang(r.name, f"did not stop within {self.cfg.hang_bound_s} s", r.pid)
                time.sleep(0.2)
                self._kill(r)

    def _audit(self, label: str) -> None:
        started = time.monotonic()
        r = self._spawn("auditor", 0)
        self.history.phases[r.name] = label
        deadline = started + 2 * self.cfg.hang_bound_s
        while not r.audited and not r.gone and time.monotonic() < deadline:
            self._pump(0.05)
        if not r.audited:
            if not r.gone:
                self._hang(r.name, f"{label}: not done within {2 * self.cfg.hang_bound_s} s", r.pid)
                time.sleep(0.2)
            self._error("AuditIncomplete", f"{label} did not read every key")
        self._stop_roles(("auditor",))
        self.log(f"beluga chaos: {label} done in {time.monotonic() - started:.1f} s")

    # -- the report ----------------------------------------------------------

    def _report(self) -> ChaosReport:
        findings = self.history.check()
        return ChaosReport(
            seed=self.seed,
            config=self.cfg,
            wall_s=round(time.monotonic() - self.start, 2),
            faults=dict(self.faults),
            fault_log=self.fault_log,
            mid_payload_reused=self.mid_reused,
            findings=findings,
            hangs=self.hangs,
            errors=dict(self.errors),
            error_samples=self.error_samples,
            corrupted_keys=sorted(self.keys[k] for k in self.history.corruptions),
            evictions_seen=self.history.evictions_seen,
            server_peaks={**self.history.peaks, "blocks_total": self.nblocks},
            server_restarts=len(self.history.server_kills),
            takeovers=self._outages(),
            seat_races_lost=self.lost_seat_races,
            ids_refused=self.ids_refused,
        )

    def _outages(self) -> list[dict[str, Any]]:
        """Each server kill: who took over, after how long, and the write outage it made."""
        firsts = self.history.first_acks_after([k["t"] for k in self.takeovers])
        out = []
        for k, first in zip(self.takeovers, firsts, strict=True):
            item = {key: v for key, v in k.items() if key != "t"}
            item["at_s"] = round(k["t"] - self.start, 3)
            item["outage_s"] = None if first is None else round(first - k["t"], 4)
            out.append(item)
        return out


def run_chaos(config: ChaosConfig, log: Callable[[str], None] | None = None) -> ChaosReport:
    """Run one chaos round (see :class:`ChaosDriver`)."""
    return ChaosDriver(config, log).run()
