"""``beluga serve --standby``: it waits, takes the seat of a server proven gone, and serves.

On one kernel a server is gone when its pid and start time name no running
process; a stopped (SIGSTOP) server is alive and never taken over, so it can
write nothing after a takeover (the module doc of beluga.kv.server).  Each
test runs real ``beluga serve`` processes; the client is this process, and it
is never restarted: its writes resume on the standby.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from beluga.kv.server import seat_free
from beluga.kv.store import KVStore
from beluga.pool import Pool

WAIT_S = 30.0  # bound of every wait; none is a timed assert


class Server:
    """A ``beluga serve`` child and its stderr lines, read by a thread."""

    def __init__(self, spec: str, mode: str, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "beluga", "serve", "--pool", spec, "--coherence", mode, *extra],
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)

    def wait_for(self, text: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not any(text in s for s in self.seen):
            try:
                self.seen.append(self.lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"no {text!r} on stderr; saw {self.seen}") from None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(WAIT_S)


@contextmanager
def servers(spec: str, mode: str, *kinds: tuple[str, ...]) -> Iterator[list[Server]]:
    """Start each in turn, each once it says it serves (or stands by); stop all at the end."""
    started: list[Server] = []
    try:
        for extra in kinds:
            started.append(Server(spec, mode, *extra))
            started[-1].wait_for("standing by" if "--standby" in extra else "keys recovered")
        yield started
    finally:
        for s in started:
            if s.proc.poll() is None:
                os.kill(s.pid, signal.SIGCONT)
                s.stop()


def _seat_pid(pool: Pool) -> int:
    seat = pool.hosts.seat()
    return seat.identity.pid if seat is not None and seat.epoch else 0


@pytest.mark.parametrize("mode", ["native", "model"])
def test_a_standby_takes_over_and_the_client_writes_on(pool: Pool, mode: str) -> None:
    with servers(pool.spec, mode, (), ("--standby",)) as (primary, standby):
        with KVStore(pool.spec, coherence=mode) as store:
            store.rpc.restart_grace_s = WAIT_S  # a call in the outage waits for the standby
            store.put("before", b"b" * 3000)
            os.kill(primary.pid, signal.SIGKILL)
            primary.proc.wait(WAIT_S)
            store.put("after", b"a" * 3000)  # the same client, not restarted
            standby.wait_for("keys recovered")
            assert store.get("before") == b"b" * 3000 and store.get("after") == b"a" * 3000
            stats = store.stats()
            assert stats["server_pid"] == standby.pid
            assert (stats["seats_taken"], stats["takeovers"]) == (2, 1)
            assert store.remove("before") and store.remove("after")
        assert standby.stop() == 0


def test_of_two_standbys_one_serves_and_the_other_follows_it(pool: Pool) -> None:
    with servers(pool.spec, "native", (), ("--standby",), ("--standby",)) as started:
        primary, *standbys = started
        os.kill(primary.pid, signal.SIGKILL)
        primary.proc.wait(WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while _seat_pid(pool) not in {s.pid for s in standbys}:
            assert time.monotonic() < deadline, "no standby took the seat"
            time.sleep(0.02)
        first = next(s for s in standbys if s.pid == _seat_pid(pool))
        second = next(s for s in standbys if s is not first)
        assert second.proc.poll() is None  # still waiting, not failed
        assert first.stop() == 0  # it leaves the seat: the other takes a free seat
        second.wait_for("keys recovered")
        assert _seat_pid(pool) == second.pid
        seat = pool.hosts.seat()
        assert seat is not None and (seat.seats, seat.takeovers) == (3, 1)  # primary, first, second


def test_a_stopped_server_is_alive_and_a_dead_one_is_not(pool: Pool) -> None:
    with servers(pool.spec, "native", ()) as (primary,):
        assert not seat_free(pool)
        os.kill(primary.pid, signal.SIGSTOP)
        try:
            assert not seat_free(pool)  # stopped, not gone: it could resume and write
        finally:
            os.kill(primary.pid, signal.SIGCONT)
        os.kill(primary.pid, signal.SIGKILL)
        primary.proc.wait(WAIT_S)
        assert seat_free(pool)


def test_a_standby_stopped_while_waiting_exits_cleanly(pool: Pool) -> None:
    with servers(pool.spec, "native", (), ("--standby",)) as (primary, standby):
        assert standby.stop() == 0
        standby.wait_for("stopped while standing by")
        assert _seat_pid(pool) == primary.pid
