"""The chaos driver: one pool, a real metadata server, clients, and faults.

The driver creates a scratch pool and builds a round from its parts, each in
a module of its own:

:mod:`~beluga.chaos.run`         what the parts share: config, seed, keys, history, timers,
                                  the account of errors and hangs
:mod:`~beluga.chaos.fleet`       ``beluga serve`` in a child process, its standbys, restarts
                                  and takeovers (fences of stalled servers)
:mod:`~beluga.chaos.supervisor`  writer, in-place writer, reader and auditor processes
                                  (:mod:`beluga.chaos.roles`), replaced when they die or hang
:mod:`~beluga.chaos.loop`        the event loop every wait goes through
:mod:`~beluga.chaos.injector`    the fault catalogue: one fault at a time at random intervals
:mod:`~beluga.chaos.audit`       the end: quiesce, audit, restart the server, audit again

Then :meth:`History.check <beluga.chaos.verifier.History.check>` judges every
read, and the driver gathers the :class:`~beluga.chaos.report.ChaosReport`;
for every server kill the report gives the write outage: from the kill to
the first put tried after it that was acknowledged (p50, p99, max).

The seed fixes the fault plan (kinds, targets, timings, hostile bytes) and
every role's choices; the operating system's scheduling is not replayable,
so a seed reproduces a run's faults, not its exact interleaving.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from beluga.chaos.audit import Audit
from beluga.chaos.config import ChaosConfig, ChaosError, replay_command
from beluga.chaos.fleet import ServerFleet
from beluga.chaos.injector import FaultInjector
from beluga.chaos.loop import EventLoop
from beluga.chaos.report import ChaosReport
from beluga.chaos.roles import CLIENTS
from beluga.chaos.run import ChaosRun
from beluga.chaos.supervisor import RoleSupervisor
from beluga.pool import Geometry, Pool


class ChaosDriver:
    """Runs one chaos round and returns its :class:`ChaosReport`.

    Not thread-safe: one thread drives a run (it owns its child processes and
    their pipes).  Not fork-safe: a forked copy must not drive the same run.
    """

    def __init__(self, config: ChaosConfig, log: Callable[[str], None] | None = None) -> None:
        self.cfg = config
        self.state = ChaosRun(
            config, log or (lambda line: print(line, file=sys.stderr, flush=True))
        )
        self.seed = self.state.seed
        self.roles = RoleSupervisor(self.state)
        self.fleet = ServerFleet(self.state)
        self.loop = EventLoop(self.state, self.roles, self.fleet)
        self.injector = FaultInjector(self.state, self.roles, self.fleet, self.loop)
        self.roles.on_mid_payload = self.injector.mid_payload
        self.audit = Audit(self.state, self.roles, self.fleet, self.injector, self.loop)

    def run(self) -> ChaosReport:
        cfg, state = self.cfg, self.state
        if os.path.exists(state.path):
            raise ChaosError(
                f"{state.path} already exists; a chaos run makes (and removes) a scratch pool "
                "of its own: name a new path, or remove that one if nothing uses it"
            )
        if cfg.writer_client is not None and cfg.writer_client not in CLIENTS:
            raise ChaosError(
                f"no writer client {cfg.writer_client!r} is registered (known: "
                f"{sorted(CLIENTS) or 'none'}); import the module that registers it first "
                "(beluga.compat.mooncake.chaos registers 'mooncake')"
            )
        state.log(
            f"beluga chaos: seed {self.seed}, {cfg.faults} faults, coherence {cfg.coherence}, "
            f"pool {state.path} (replay: {replay_command(self.seed, cfg)})"
        )
        # across (emulated) hosts a killed client's id comes back only once its heartbeat is
        # stale (hosts.DEFAULT_STALE_S), not at once: room for the kills meanwhile
        max_hosts = 128 if cfg.emulated_hosts else 32
        geometry = Geometry(
            max_hosts=max_hosts, rpc_bytes_per_host=128 << 10, block_size=cfg.block_size
        )
        state.pool = Pool.create(state.path, cfg.pool_bytes, geometry=geometry, coherence="native")
        state.nblocks = state.pool.superblock.nblocks
        try:
            self.fleet.start_server()
            self.loop.await_(
                lambda: self.fleet.server is not None and self.fleet.server.ready,
                cfg.server_start_timeout_s,
                "the first server to start",
            )
            for kind, count in (
                ("writer", cfg.writers),
                ("inplace", cfg.inplace_writers),
                ("reader", cfg.readers),
            ):
                for slot in range(count):
                    self.roles.spawn(kind, slot)
            self.loop.await_(
                lambda: all(r.hello for r in self.roles.live()),
                cfg.hang_bound_s,
                "every role to connect",
            )
            self.injector.inject_all()
            self.audit.finish()
        finally:
            self._teardown()
        return self._report()

    def _teardown(self) -> None:
        self.roles.kill_all()
        self.fleet.stop_all()
        state = self.state
        if state.pool is not None:
            state.pool.close()
            Pool.destroy(state.path)

    def _report(self) -> ChaosReport:
        state, history = self.state, self.state.history
        findings = history.check()
        return ChaosReport(
            seed=self.seed,
            config=self.cfg,
            wall_s=round(time.monotonic() - state.start, 2),
            faults=dict(self.injector.faults),
            fault_log=self.injector.fault_log,
            mid_payload_reused=self.injector.mid_reused,
            findings=findings,
            hangs=state.hangs,
            errors=dict(state.errors),
            error_samples=state.error_samples,
            corrupted_keys=sorted(state.keys[k] for k in history.corruptions),
            evictions_seen=history.evictions_seen,
            server_peaks={**history.peaks, "blocks_total": state.nblocks},
            server_restarts=len(history.server_kills),
            takeovers=self._outages(),
            seat_races_lost=self.fleet.lost_seat_races,
            ids_refused=state.ids_refused,
        )

    def _outages(self) -> list[dict[str, Any]]:
        """Each server kill: who took over, after how long, and the write outage it made."""
        takeovers, start = self.fleet.takeovers, self.state.start
        firsts = self.state.history.first_acks_after([k["t"] for k in takeovers])
        out = []
        for k, first in zip(takeovers, firsts, strict=True):
            item = {key: v for key, v in k.items() if key not in ("t", "sent")}
            item["at_s"] = round(k["t"] - start, 3)
            item["outage_s"] = None if first is None else round(first - k["t"], 4)
            out.append(item)
        return out


def run_chaos(config: ChaosConfig, log: Callable[[str], None] | None = None) -> ChaosReport:
    """Run one chaos round (see :class:`ChaosDriver`)."""
    return ChaosDriver(config, log).run()
