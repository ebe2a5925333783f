"""The event loop of a chaos round: messages, timers, deaths and hang checks, in one thread.

Every wait of the driver goes through :meth:`EventLoop.pump` (for a time) or
:meth:`EventLoop.await_` (until a condition holds, with a bound), so roles'
reports are taken in, timers fire and hangs are caught while it waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from beluga.chaos.config import ChaosError
from beluga.chaos.fleet import ServerFleet
from beluga.chaos.run import ChaosRun
from beluga.chaos.supervisor import RoleSupervisor
from beluga.signals import raise_if_interrupted


class EventLoop:
    """Waits of one round, serving its roles and servers meanwhile.

    Not thread-safe (the driver's one thread runs it); not fork-safe.
    """

    def __init__(self, run: ChaosRun, roles: RoleSupervisor, fleet: ServerFleet) -> None:
        self.run, self.roles, self.fleet = run, roles, fleet

    def pump(self, seconds: float) -> None:
        """Serve messages, timers, deaths and hang checks for ``seconds``."""
        roles, fleet, timers = self.roles, self.fleet, self.run.timers
        end = time.monotonic() + seconds
        while True:
            now = time.monotonic()
            timers.run_due(now)
            if now >= end:
                return
            nxt = min(end, timers.next_due(end))
            live = roles.live()
            waitables: list[Any] = [r.out for r in live] + [r.proc.sentinel for r in live]
            waitables += fleet.waitables()
            ready = wait(waitables, timeout=max(0.0, min(0.05, nxt - now)))
            raise_if_interrupted()  # a signal to `beluga chaos`: unwind through the teardown
            roles.drain([r for r in live if r.out in ready])
            fleet.server_events(ready)
            fleet.standby_events(ready)
            for r in live:
                if r.proc.sentinel in ready:
                    roles.exited(r)
            now = time.monotonic()
            roles.check_hangs(now)
            fleet.check_hang(now)

    def await_(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        """Pump until ``done()``; ChaosError after ``timeout`` (saying what it waited for)."""
        run = self.run
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                seen = "; ".join(f"{k}: {dict(v)}" for k, v in run.error_samples.items())
                raise ChaosError(
                    f"waited {timeout} s for {what} in vain (errors so far: {seen or 'none'}); "
                    f"rerun with --seed {run.seed}; a loaded machine needs a larger --hang-bound"
                )
            self.pump(0.02)
