"""The end of a chaos round: quiesce, audit, restart the server, audit again.

After the last fault every process is resumed, the writers are stopped, an
auditor reads every key through every read path, the server is killed and
restarted once more, and the auditor reads everything again (what the
rebuilt index serves).  Then the history judges every read.
"""

from __future__ import annotations

import time

from beluga.chaos.fleet import ServerFleet
from beluga.chaos.injector import FaultInjector
from beluga.chaos.loop import EventLoop
from beluga.chaos.run import ChaosRun
from beluga.chaos.supervisor import RoleSupervisor


class Audit:
    """The round's last phase.

    Not thread-safe (the driver's one thread runs it); not fork-safe.
    """

    def __init__(
        self,
        run: ChaosRun,
        roles: RoleSupervisor,
        fleet: ServerFleet,
        injector: FaultInjector,
        loop: EventLoop,
    ) -> None:
        self.run, self.roles, self.fleet, self.injector, self.loop = (
            run,
            roles,
            fleet,
            injector,
            loop,
        )

    def finish(self) -> None:
        """Stop injecting, resume everything, audit, restart the server, audit again."""
        run, roles, fleet, cfg = self.run, self.roles, self.fleet, self.run.cfg
        run.injecting = False
        for r in roles.roles:
            if r.kind == "inplace" and not r.gone:
                roles.command(r, "no-pause")
        run.timers.run_pending_now()  # every pending SIGCONT and restart, now
        for r in roles.roles:
            roles.resume(r)
            if r.mid is not None:
                self.injector.watch_mid(r)
        self.loop.await_(
            lambda: fleet.server_up() is not None and not fleet.server.held,  # type: ignore[union-attr]
            cfg.server_start_timeout_s + cfg.hang_bound_s,
            "the server to come back",
        )
        self.loop.pump(cfg.settle_s)
        self.stop_roles(("writer", "inplace"))
        self.audit("audit")
        fleet.kill_server()
        fleet.start_server()
        self.loop.await_(
            lambda: fleet.server_up() is not None,
            cfg.server_start_timeout_s,
            "the server to restart for the final audit",
        )
        self.audit("audit after restart")
        self.stop_roles(("reader",))

    def stop_roles(self, kinds: tuple[str, ...]) -> None:
        """Ask the roles of these kinds to stop; a role still running after hang_bound_s hangs."""
        run, roles = self.run, self.roles
        targets = [r for r in roles.roles if r.kind in kinds and not r.gone]
        for r in targets:
            roles.command(r, "stop")
        deadline = time.monotonic() + run.cfg.hang_bound_s
        while any(not r.gone for r in targets) and time.monotonic() < deadline:
            self.loop.pump(0.05)
        for r in targets:
            if not r.gone:
                run.hang(r.name, f"did not stop within {run.cfg.hang_bound_s} s", r.pid)
                time.sleep(0.2)
                roles.kill(r)

    def audit(self, label: str) -> None:
        """An auditor reads every key through every read path (its phase named ``label``)."""
        run = self.run
        started = time.monotonic()
        r = self.roles.spawn("auditor", 0)
        run.history.phases[r.name] = label
        bound = 2 * run.cfg.hang_bound_s
        deadline = started + bound
        while not r.audited and not r.gone and time.monotonic() < deadline:
            self.loop.pump(0.05)
        if not r.audited:
            if not r.gone:
                run.hang(r.name, f"{label}: not done within {bound} s", r.pid)
                time.sleep(0.2)
            run.error("AuditIncomplete", f"{label} did not read every key")
        self.stop_roles(("auditor",))
        run.log(f"beluga chaos: {label} done in {time.monotonic() - started:.1f} s")
