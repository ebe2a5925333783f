"""The fault catalogue of a chaos round, and its injection one fault at a time.

One method per kind (``_fault_<kind>``), each injecting one fault or saying
that none fits right now:

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

Writers are frozen (SIGSTOP, for a few milliseconds) while the injector picks
and corrupts a block, so the block it hit is the one it looked at; the key
whose committed block it corrupted is recorded, and misses of that key are
then excused from lost-write accounting (never wrong bytes: a corrupted block
must read as a miss).  The hostile bytes themselves come from :mod:`beluga.chaos.faults`.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from beluga._native import _core
from beluga.chaos.config import KINDS, ChaosError
from beluga.chaos.faults import (
    Hit,
    corrupt_header,
    corrupt_index,
    corrupt_payload,
    corrupt_rpc,
)
from beluga.chaos.fleet import ServerFleet
from beluga.chaos.loop import EventLoop
from beluga.chaos.run import ChaosRun, send_signal, wait_stopped
from beluga.chaos.supervisor import MidPayload, RoleProcess, RoleSupervisor
from beluga.coherence import BlockState, parse_header, read_line

#: a drawn fault kind that does not fit yet is tried again every FAULT_RETRY_S, at most
#: MAX_FAULT_WAITS times (5 s: past a stall's hold and the takeover), before another is drawn
FAULT_RETRY_S = 0.05
MAX_FAULT_WAITS = 100


class FaultInjector:
    """Draws faults by their weights and injects them; keeps the log of what it did.

    Not thread-safe (the driver's one thread owns it); not fork-safe.
    """

    def __init__(
        self, run: ChaosRun, roles: RoleSupervisor, fleet: ServerFleet, loop: EventLoop
    ) -> None:
        self.run, self.roles, self.fleet, self.loop = run, roles, fleet, loop
        self.faults: Counter[str] = Counter()
        self.fault_log: list[dict[str, Any]] = []
        self.mid_reused = 0

    def inject_all(self) -> None:
        """Inject the round's faults at random intervals (or until max_inject_s)."""
        run, cfg = self.run, self.run.cfg
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
            if time.monotonic() - run.start > cfg.max_inject_s:
                run.log(f"beluga chaos: stopped injecting after {cfg.max_inject_s} s")
                break
            self.loop.pump(
                FAULT_RETRY_S if pending else run.rng.expovariate(1 / cfg.fault_interval_s)
            )
            if pending is None or waited >= MAX_FAULT_WAITS:
                pending, waited = self._draw(kinds, weights), 0
            if self.inject(pending):
                pending = None
            else:
                waited += 1
            if time.monotonic() - last_log > 10:
                last_log = time.monotonic()
                run.log(
                    f"beluga chaos: {time.monotonic() - run.start:.0f} s, "
                    f"{sum(self.faults.values())} faults, {len(run.history.reads)} reads, "
                    f"{run.history.live_wrong} wrong, {len(run.hangs)} hangs"
                )

    def _draw(self, kinds: list[str], weights: list[int]) -> str:
        """The next kind to inject: by weight, except that once the faults left are no more
        than the kinds not injected yet, one of those, so a round of at least as many faults
        as kinds injects every kind (a rare kind is not left to the seed's luck)."""
        cfg, rng = self.run.cfg, self.run.rng
        missing = [k for k in kinds if not self.faults[k]]
        if missing and cfg.faults - sum(self.faults.values()) <= len(missing):
            return rng.choice(missing)
        return rng.choices(kinds, weights)[0]

    def record(self, kind: str, target: str, **extra: Any) -> None:
        """Count a fault injected and log it."""
        self.faults[kind] += 1
        self.fault_log.append({"t": self.run.elapsed(), "kind": kind, "target": target, **extra})

    def inject(self, kind: str) -> bool:
        """Inject one fault of ``kind``; False when nothing fits it right now."""
        return bool(getattr(self, f"_fault_{kind}")())

    # -- the server ----------------------------------------------------------

    def _fault_kill_server(self) -> bool:
        s = self.fleet.server_up()
        if s is None or s.stalled:  # a stalled server is left to the standbys' fence
            return False
        self.fleet.kill_server()
        self.record("kill_server", f"server pid {s.pid}", held=s.held)
        self.run.after(self.run.rng.uniform(0, 0.3), self.fleet.start_server)
        return True

    def _fault_stop_server(self) -> bool:
        run, cfg = self.run, self.run.cfg
        s = self.fleet.server_up()
        if s is None or s.held:
            return False
        hold = run.rng.uniform(0.3, 2 * cfg.write_lease_s)
        sent = time.monotonic()
        send_signal(s.pid, signal.SIGSTOP)
        s.held = True
        self.record("stop_server", f"server pid {s.pid}", hold_s=round(hold, 3))
        # past the standbys' takeover_after a stop is a stall (across hosts any stop is: the
        # standby cannot see the process): a standby fences it and takes the seat
        if self.fleet.standbys and (cfg.emulated_hosts or hold > cfg.takeover_after_s):
            wait_stopped(s.pid, 1.0)
            self.fleet.stall_began(s, sent)

        def resume() -> None:
            if not s.gone:
                send_signal(s.pid, signal.SIGCONT)
                s.held, s.stalled, s.beat_seen = False, False, time.monotonic()

        run.after(hold, resume)
        return True

    def _fault_stall_server(self) -> bool:
        """Stop the server past the standbys' takeover_after: one must fence it and serve."""
        run = self.run
        s = self.fleet.server_up()
        if s is None or s.held or not self.fleet.standbys:
            return False
        hold = run.cfg.takeover_after_s + run.rng.uniform(1.0, 2.0)
        sent = time.monotonic()
        send_signal(s.pid, signal.SIGSTOP)
        s.held = True
        self.record("stall_server", f"server pid {s.pid}", hold_s=round(hold, 3))
        wait_stopped(s.pid, 1.0)
        self.fleet.stall_began(s, sent)

        def resume() -> None:
            if not s.gone:  # no standby fenced it in time: it serves on
                send_signal(s.pid, signal.SIGCONT)
                s.held, s.stalled, s.beat_seen = False, False, time.monotonic()

        run.after(hold, resume)
        return True

    # -- the clients ---------------------------------------------------------

    def _kill_role(self, kinds: tuple[str, ...], fault: str) -> bool:
        victims = self.roles.alive(kinds, free=False)
        if not victims:
            return False
        r = self.run.rng.choice(victims)
        state = "mid-payload" if r.mid else "stopped" if r.held else "running"
        self.roles.kill(r)
        self.record(fault, r.name, state=state)
        self.roles.spawn(r.kind, r.slot)
        return True

    def _fault_kill_writer(self) -> bool:
        return self._kill_role(("writer", "inplace"), "kill_writer")

    def _fault_kill_reader(self) -> bool:
        return self._kill_role(("reader",), "kill_reader")

    def _stop_role(self, kinds: tuple[str, ...], fault: str, hold: float) -> bool:
        victims = self.roles.alive(kinds)
        if not victims:
            return False
        r = self.run.rng.choice(victims)
        send_signal(r.pid, signal.SIGSTOP)
        r.held = True
        self.record(fault, r.name, hold_s=round(hold, 3))
        self.run.after(hold, lambda: self.roles.resume(r))
        return True

    def _fault_stop_writer(self) -> bool:
        hold = self.run.cfg.write_lease_s + self.run.rng.uniform(0.1, 1.0)
        return self._stop_role(("writer", "inplace"), "stop_writer", hold)

    def _fault_stop_reader(self) -> bool:
        hold = self.run.cfg.read_lease_s + self.run.rng.uniform(0.1, 1.5)
        return self._stop_role(("reader",), "stop_reader", hold)

    # -- a writer stopped mid-payload ----------------------------------------

    def _fault_stop_mid_payload(self) -> bool:
        now = time.monotonic()
        asked = [
            r
            for r in self.roles.alive(("inplace",), free=False)
            if r.mid or (r.pause_asked and now - r.pause_asked < self.run.cfg.hang_bound_s)
        ]
        if asked:
            return False  # one at a time: the pattern needs the other writers running
        candidates = self.roles.alive(("inplace",))
        if not candidates:
            return False
        r = self.run.rng.choice(candidates)
        r.pause_asked = now
        self.roles.command(r, "pause-mid")
        return True  # counted when the writer is actually stopped (see mid_payload)

    def mid_payload(
        self,
        r: RoleProcess,
        t: float,
        key: int,
        serial: int,
        block: int,
        nblocks: int,
        version: int,
    ) -> None:
        """An in-place writer announced its stop mid-payload: count it, watch its extent."""
        r.pause_asked = None
        if not wait_stopped(r.pid, 2.0):
            self.run.error(
                "ChaosMidPause", f"{r.name} announced a mid-payload stop but did not stop"
            )
            return
        r.mid = MidPayload(block, nblocks, version, time.monotonic())
        self.record(
            "stop_mid_payload",
            r.name,
            key=self.run.keys[key],
            serial=f"{serial:#x}",
            block=block,
            nblocks=nblocks,
        )
        self.run.after(0.05, lambda: self.watch_mid(r))

    def _extent_reused(self, m: MidPayload) -> bool:
        """Whether another write (newer version) now covers a block of the stalled extent."""
        pool = self.run.pool
        assert pool is not None
        mem, sb = pool.memory, pool.superblock
        first = max(0, m.block - self.run.cfg.max_value_blocks + 1)
        for b in range(first, min(sb.nblocks, m.block + m.nblocks)):
            h = parse_header(read_line(mem, sb.block_header_offset(b)))
            if h is None or h.version <= m.version or h.state == BlockState.FREE:
                continue
            if b + max(1, -(-h.length // sb.block_size)) > m.block:
                return True
        return False

    def watch_mid(self, r: RoleProcess) -> None:
        """Keep a writer stopped mid-payload past its lease until its extent is reused (or a
        bound passes; at once when no more faults are injected), then SIGCONT it."""
        run, cfg = self.run, self.run.cfg
        m = r.mid
        if r.gone or m is None:
            return
        waited = time.monotonic() - m.since
        past_lease = waited > cfg.write_lease_s + 0.1
        m.reused = m.reused or (past_lease and self._extent_reused(m))
        if run.injecting and not m.reused and waited < cfg.write_lease_s + cfg.max_reuse_wait_s:
            run.after(0.05, lambda: self.watch_mid(r))
            return
        if run.injecting and not past_lease:
            run.after(0.05, lambda: self.watch_mid(r))
            return
        self.fault_log.append(
            {
                "t": run.elapsed(),
                "kind": "resume_mid_payload",
                "target": r.name,
                "stopped_s": round(waited, 3),
                "extent_reused": m.reused,
            }
        )
        self.mid_reused += m.reused
        r.mid = None
        r.last_progress = time.monotonic()
        send_signal(r.pid, signal.SIGCONT)

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
            for r in self.roles.roles
            if r.kind in ("writer", "inplace") and not r.gone and not r.held and not r.mid
        ]
        for r in frozen:
            send_signal(r.pid, signal.SIGSTOP)
        for r in frozen:
            if not wait_stopped(r.pid, 1.0) and r.proc.is_alive():
                self.run.error("ChaosFreeze", f"{r.name} did not stop within 1 s")
        self.roles.drain(frozen)
        try:
            yield
        finally:
            for r in frozen:
                if not r.gone and not r.mid:
                    send_signal(r.pid, signal.SIGCONT)

    def _fault_corrupt_rpc_line(self) -> bool:
        return self._corrupt_rpc("corrupt_rpc_line", ("request-line", "response-line"))

    def _fault_corrupt_rpc_buffer(self) -> bool:
        return self._corrupt_rpc("corrupt_rpc_buffer", ("request-buffer", "response-buffer"))

    def _corrupt_rpc(self, fault: str, parts: tuple[str, ...]) -> bool:
        pool, rng = self.run.pool, self.run.rng
        assert pool is not None
        hit = corrupt_rpc(pool.memory, pool.superblock, pool.hosts, rng, rng.choice(parts))
        if hit is None:
            return False
        self.record(fault, hit.target, bytes=hit.length)
        return True

    def _corrupt_block(self, fault: str, injector: Callable[..., Hit | None]) -> bool:
        run = self.run
        assert run.pool is not None
        with self._writers_frozen():
            # the earliest moment a reader can see the hostile bytes: before the store,
            # not after it (a read that raced it is excused, not a lost write)
            before = time.monotonic()
            hit = injector(run.pool.memory, run.pool.superblock, run.rng)
            if hit is None:
                return False
            key = None
            if hit.header is not None:
                key = run.by_digest.get(hit.header.digest)
                if key is not None:
                    run.history.corrupted(key, before)
            self.record(
                fault,
                hit.target,
                bytes=hit.length,
                key=None if key is None else run.keys[key],
                version=None if hit.header is None else hit.header.version,
            )
            return True

    def _fault_corrupt_header(self) -> bool:
        return self._corrupt_block("corrupt_header", corrupt_header)

    def _fault_corrupt_payload(self) -> bool:
        return self._corrupt_block("corrupt_payload", corrupt_payload)

    def _fault_corrupt_index(self) -> bool:
        """Hostile bytes in an index bucket: its keys may miss until the server's scrub
        rewrites it (excused as corrupted), but a read may never return other bytes."""
        run = self.run
        assert run.pool is not None
        sb = run.pool.superblock
        # Writers are frozen while we aim, as for blocks: a put tried before the store may
        # have its commit land either side of it (its misses are excused); one tried after
        # rewrites the bucket from the server's mirror. Unfrozen, a put tried between the
        # timestamp and the store, and committed before it, was called a lost write.
        with self._writers_frozen():
            before = time.monotonic()
            hit, bucket = corrupt_index(run.pool.memory, sb, run.rng)
            for d, key in run.by_digest.items():
                if bucket in _core.ix_hash(d, sb.nbuckets)[1:]:
                    run.history.corrupted(key, before)
            self.record("corrupt_index", hit.target, bytes=hit.length)
        return True
