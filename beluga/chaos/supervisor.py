"""The role processes of a chaos round: start, message, reap, replace, check for hangs.

Each writer, in-place writer, reader and auditor (:mod:`beluga.chaos.roles`)
runs in a forked process of its own with two pipes: its reports come in on
``out`` (every try, ack, read and error goes to the round's history), its
commands go out on ``ctl``.  A role that dies while faults are injected is
replaced by a new incarnation in its slot.

A role that is neither stopped nor killed and reports nothing for
``hang_bound_s`` is a hang: its stacks are dumped (SIGUSR1, faulthandler) to
stderr and it is replaced.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from beluga.chaos.roles import RoleSpec, role_main
from beluga.chaos.run import CTX, ChaosRun, send_signal


@dataclass
class MidPayload:
    """An in-place writer that stopped itself halfway through a payload: the extent it holds."""

    block: int
    nblocks: int
    version: int
    since: float
    reused: bool = False


@dataclass
class RoleProcess:
    """One incarnation of a role in its slot, and what the driver knows of it."""

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
    mid: MidPayload | None = None  # stopped itself mid-payload, resumed by the driver
    pause_asked: float | None = None
    gone: bool = False
    exitcode: int | None = None
    audited: bool = False
    pid: int = 0  # kept: the process object is closed once reaped

    def __post_init__(self) -> None:
        assert self.proc.pid is not None
        self.pid = self.proc.pid


#: what the supervisor calls when an in-place writer announces its mid-payload stop:
#: (role, t, key, serial, block, nblocks, version)
MidPayloadHandler = Callable[..., None]


class RoleSupervisor:
    """Every role process of a round.

    ``on_mid_payload`` handles a writer's "mid" message (the fault injector,
    which asked for the stop).  Not thread-safe (the driver's one thread owns
    it); not fork-safe (it holds its children's pipes).
    """

    def __init__(self, run: ChaosRun) -> None:
        self.run = run
        self.roles: list[RoleProcess] = []
        self.stragglers: list[BaseProcess] = []  # ended by us, not yet reaped
        self.incarnations: Counter[tuple[str, int]] = Counter()
        self.on_mid_payload: MidPayloadHandler = self._unexpected_mid_payload

    def _unexpected_mid_payload(self, r: RoleProcess, *_: Any) -> None:
        self.run.error("ChaosMidPause", f"{r.name} stopped mid-payload with nobody to resume it")

    def _coherence(self, kind: str, slot: int) -> str:
        mode = self.run.cfg.coherence
        if mode == "mixed":
            return "model" if slot % 2 else "native"
        return mode

    def spawn(self, kind: str, slot: int) -> RoleProcess:
        """Start the next incarnation of a role in its slot."""
        run, cfg = self.run, self.run.cfg
        self.incarnations[kind, slot] += 1
        inc = self.incarnations[kind, slot]
        writer_id = slot + (cfg.writers if kind == "inplace" else 0)
        own = tuple(
            i for i, w in enumerate(run.owner) if kind in ("writer", "inplace") and w == writer_id
        )
        name = f"{kind}-{slot}" if kind != "auditor" else "auditor"
        spec = RoleSpec(
            name=f"{name}#{inc}",
            kind=kind,
            slot=writer_id if kind in ("writer", "inplace") else slot,
            incarnation=inc,
            seed=run.rng.getrandbits(63),
            pool=run.path,
            coherence=self._coherence(kind, slot) if kind != "auditor" else "native",
            keys=tuple(run.keys),
            own=own,
            block_bytes=cfg.block_size,
            max_value=cfg.block_size * cfg.max_value_blocks,
            rpc_timeout_s=cfg.rpc_timeout_s,
            connect_timeout_s=cfg.connect_timeout_s,
            pause_s=cfg.role_pause_s,
            client=cfg.writer_client,
        )
        out_r, out_w = CTX.Pipe(duplex=False)
        ctl_r, ctl_w = CTX.Pipe(duplex=False)
        proc = CTX.Process(target=role_main, args=(spec, out_w, ctl_r), name=spec.name, daemon=True)
        proc.start()
        out_w.close()
        ctl_r.close()
        role = RoleProcess(
            spec.name, kind, slot, inc, proc, out_r, ctl_w, spec.coherence, time.monotonic()
        )
        self.roles.append(role)
        return role

    def command(self, r: RoleProcess, cmd: str) -> None:
        with contextlib.suppress(OSError):
            r.ctl.send(cmd)

    def drain(self, roles: list[RoleProcess]) -> None:
        """Take in every message the roles have sent."""
        for r in roles:
            try:
                while r.out.poll():
                    self._message(r, r.out.recv())
            except (EOFError, OSError):
                continue

    def _message(self, r: RoleProcess, msg: tuple[Any, ...]) -> None:
        r.last_progress = time.monotonic()
        kind = msg[0]
        h = self.run.history
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
            self.run.error(f"{msg[2]}", msg[3])
        elif kind == "stats":
            h.stats(msg[2], msg[3])
        elif kind == "mid":
            self.on_mid_payload(r, *msg[1:])
        elif kind == "audited":
            r.audited = True

    def reap(self, r: RoleProcess) -> None:
        """A role process ended: collect its last messages; its unfinished writes are unknown."""
        r.proc.join(5)
        self.drain([r])
        r.gone = True
        r.exitcode = r.proc.exitcode
        self.run.history.role_died(r.name, time.monotonic())
        r.out.close()
        r.ctl.close()
        if r.exitcode is not None:
            r.proc.close()  # its sentinel fd: a long run starts hundreds of processes
        else:
            self.stragglers.append(r.proc)

    def exited(self, r: RoleProcess) -> None:
        """A role's process ended by itself: an error unless it exited 0; replaced while
        faults are injected."""
        if r.gone:
            return
        self.reap(r)
        code = r.exitcode
        if code != 0:
            self.run.error("RoleExited", f"{r.name} exited with code {code}")
        if self.run.injecting and code != 0:
            self.spawn(r.kind, r.slot)

    def kill(self, r: RoleProcess) -> None:
        send_signal(r.pid, signal.SIGKILL)
        self.reap(r)

    def resume(self, r: RoleProcess) -> None:
        """SIGCONT a role the driver stopped (not one stopped mid-payload)."""
        if not r.gone and r.held:
            send_signal(r.pid, signal.SIGCONT)
            r.held = False
            r.last_progress = time.monotonic()

    def alive(self, kinds: tuple[str, ...], *, free: bool = True) -> list[RoleProcess]:
        """Live roles of these kinds (``free``: connected and not stopped by us)."""
        return [
            r
            for r in self.roles
            if r.kind in kinds
            and not r.gone
            and (not free or (r.hello and not r.held and not r.mid))
        ]

    def live(self) -> list[RoleProcess]:
        return [r for r in self.roles if not r.gone]

    def check_hangs(self, now: float) -> None:
        """Replace every role that made no progress for hang_bound_s and was not stopped."""
        run = self.run
        bound = run.cfg.hang_bound_s
        for r in list(self.roles):
            if r.gone or r.held or r.mid or now - r.last_progress <= bound:
                continue
            run.hang(r.name, f"no progress for {now - r.last_progress:.1f} s", r.pid)
            time.sleep(0.2)  # let faulthandler write
            self.kill(r)
            if run.injecting:
                self.spawn(r.kind, r.slot)

    def kill_all(self) -> None:
        """SIGKILL and reap every role still running, and every straggler."""
        live = self.live()
        for r in live:
            send_signal(r.pid, signal.SIGKILL)
        for r in live:
            r.proc.join(10)
            r.out.close()
            r.ctl.close()
        for proc in self.stragglers:
            assert proc.pid is not None
            send_signal(proc.pid, signal.SIGKILL)
            proc.join(10)
