"""What one chaos round shares between its parts: the config, the seed's choices, the keys,
the history, the pool, the timers, and the account of errors and hangs.

The parts (:mod:`~beluga.chaos.supervisor`, :mod:`~beluga.chaos.fleet`,
:mod:`~beluga.chaos.injector`, :mod:`~beluga.chaos.audit`) each hold the
:class:`ChaosRun` and nothing of each other's but what they call; the
driver builds them around one.  Also here: the signal helpers every part
uses on its child processes.
"""

from __future__ import annotations

import contextlib
import heapq
import multiprocessing as mp
import os
import random
import re
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import psutil

from beluga.chaos.config import ChaosConfig
from beluga.chaos.verifier import History
from beluga.coherence import digest
from beluga.pool import Pool

#: every child of a round is forked
CTX = mp.get_context("fork")

#: what a connect refused for lack of host ids says (HostTable.claim)
IDS_REFUSED = "host ids of this pool are held by live processes"


def send_signal(pid: int, sig: int) -> None:
    """Signal one process (never a group); a process already gone is no error."""
    if pid <= 0:  # never a process group
        raise ValueError(f"refusing to signal pid {pid}")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def is_stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def wait_stopped(pid: int, timeout: float) -> bool:
    """Wait until ``pid`` is stopped (SIGSTOP took effect); False after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not is_stopped(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


class Timers:
    """Actions due at a time on the round's clock, run by the event loop in order.

    Not thread-safe (the driver's one thread owns it); not fork-safe.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def after(self, delay: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time.monotonic() + delay, self._seq, action))

    def run_due(self, now: float) -> None:
        """Run every action due at ``now``."""
        while self._heap and self._heap[0][0] <= now:
            heapq.heappop(self._heap)[2]()

    def next_due(self, default: float) -> float:
        """When the next action is due (``default`` when none is)."""
        return self._heap[0][0] if self._heap else default

    def run_pending_now(self) -> None:
        """Run as many actions as are pending now, earliest first, whenever they are due."""
        for _ in range(len(self._heap)):
            heapq.heappop(self._heap)[2]()


class ChaosRun:
    """The state of one round that its parts share.

    Not thread-safe: one thread drives a run.  Not fork-safe: a forked copy
    must not drive the same run.
    """

    def __init__(self, config: ChaosConfig, log: Callable[[str], None]) -> None:
        self.cfg = config
        self.seed = (
            config.seed if config.seed is not None else random.SystemRandom().getrandbits(32)
        )
        self.rng = random.Random(self.seed)
        self.log = log
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
        self.timers = Timers()
        self.pool: Pool | None = None
        self.nblocks = 0
        #: faults are being injected (False from the end's quiesce on: nothing is replaced)
        self.injecting = True
        self.hangs: list[dict[str, Any]] = []
        self.errors: Counter[str] = Counter()
        self.error_samples: dict[str, Counter[str]] = {}
        self.ids_refused = 0  # connects refused because every host id was held

    def after(self, delay: float, action: Callable[[], None]) -> None:
        self.timers.after(delay, action)

    def elapsed(self) -> float:
        """Seconds since the round began, as the report's times give them."""
        return round(time.monotonic() - self.start, 3)

    def error(self, kind: str, message: str) -> None:
        """Count an error a role or the driver met, keeping a few samples of each shape."""
        self.errors[kind] += 1
        self.ids_refused += IDS_REFUSED in message
        samples = self.error_samples.setdefault(kind, Counter())
        shape = re.sub(r"\d+", "N", message)  # one entry per kind of message, counted
        if shape in samples or len(samples) < 8:
            samples[shape] += 1

    def hang(self, who: str, what: str, pid: int) -> None:
        """Record a hang and have the process dump its stacks (SIGUSR1, faulthandler)."""
        self.hangs.append({"t": self.elapsed(), "role": who, "what": what})
        self.log(f"beluga chaos: HANG {who} (pid {pid}): {what}; its stacks follow on stderr")
        send_signal(pid, signal.SIGUSR1)
