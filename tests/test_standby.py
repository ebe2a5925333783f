"""``beluga serve --standby``: it waits, takes the seat of a server gone or fenced, and serves.

On one kernel a server is gone when its pid and start time name no running
process; a stopped (SIGSTOP) server is alive, and is taken over only once
its heartbeat has stood still for ``--takeover-after`` and the standby has
SIGKILLed it, so it never resumes.  A server on another host (emulated here
by ``BELUGA_EMULATED_HOST``: its pid means nothing to the others) is taken
over only after ``--fence COMMAND`` succeeded; the commands here SIGKILL it,
which is what cutting its host off the pool does to it (the module doc of
beluga.server.server).  Each test runs real ``beluga serve`` processes; the
client is this process, and it is never restarted: its writes resume on the
standby.
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

from beluga.kv.store import KVStore
from beluga.pool import Pool
from beluga.server.standby import seat_free

WAIT_S = 30.0  # bound of every wait; none is a timed assert


class Server:
    """A ``beluga serve`` child and its stderr lines, read by a thread."""

    def __init__(self, spec: str, mode: str, *extra: str) -> None:
        args = list(extra)
        env = dict(os.environ)
        for a in extra:
            if a.startswith("host="):  # this server runs as a host of its own
                env["BELUGA_EMULATED_HOST"] = a.removeprefix("host=")
                args.remove(a)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "beluga", "serve", "--pool", spec, "--coherence", mode, *args],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
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


def _wait_seat(pool: Pool, pid: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while _seat_pid(pool) != pid:
        assert time.monotonic() < deadline, f"pid {pid} never took the seat"
        time.sleep(0.02)


@pytest.mark.parametrize("mode", ["native", "model"])
def test_a_stopped_server_is_killed_and_taken_over_and_the_client_writes_on(
    pool: Pool, mode: str
) -> None:
    standby_args = ("--standby", "--takeover-after", "0.5")
    with servers(pool.spec, mode, (), standby_args) as (primary, standby):
        with KVStore(pool.spec, coherence=mode) as store:
            store.rpc.restart_grace_s = WAIT_S
            store.put("before", b"b" * 3000)
            os.kill(primary.pid, signal.SIGSTOP)
            store.put("after", b"a" * 3000)  # sent to the stopped server, served by the standby
            assert primary.proc.wait(WAIT_S) == -signal.SIGKILL  # fenced: it never resumes
            standby.wait_for("fencing it")
            assert store.get("before") == b"b" * 3000 and store.get("after") == b"a" * 3000
            stats = store.stats()
            assert stats["server_pid"] == standby.pid and stats["takeovers"] == 1
            assert store.remove("before") and store.remove("after")
        assert standby.stop() == 0


FENCE_BY_KILL = (
    'echo "$BELUGA_FENCE_PID $BELUGA_FENCE_SAME_KERNEL" > {marker}; kill -KILL "$BELUGA_FENCE_PID"'
)


@pytest.mark.parametrize("mode", ["native", "model"])
def test_a_stalled_server_on_another_host_is_taken_over_once_fenced(
    pool: Pool, mode: str, tmp_path: os.PathLike[str]
) -> None:
    marker = os.path.join(tmp_path, "fenced")
    fence = FENCE_BY_KILL.format(marker=marker)
    standby_args = ("host=b", "--standby", "--takeover-after", "0.5", "--fence", fence)
    with servers(pool.spec, mode, ("host=a",), standby_args) as (primary, standby):
        with KVStore(pool.spec, coherence=mode) as store:
            store.rpc.restart_grace_s = WAIT_S
            store.put("before", b"b" * 3000)
            os.kill(primary.pid, signal.SIGSTOP)
            store.put("after", b"a" * 3000)
            standby.wait_for("keys recovered")
            with open(marker) as f:
                assert f.read().split() == [str(primary.pid), "0"]  # its pid; another host's
            assert primary.proc.wait(WAIT_S) == -signal.SIGKILL
            assert store.get("before") == b"b" * 3000 and store.get("after") == b"a" * 3000
            assert store.stats()["server_pid"] == standby.pid
            assert store.remove("before") and store.remove("after")
        assert standby.stop() == 0


@pytest.mark.parametrize("fence", [None, "false"])
def test_a_server_on_another_host_is_never_taken_over_unfenced(
    pool: Pool, fence: str | None
) -> None:
    standby_args = ("host=b", "--standby", "--takeover-after", "0.3")
    standby_args += ("--fence", fence) if fence else ()
    with (
        servers(pool.spec, "native", ("host=a",), standby_args) as (primary, standby),
        KVStore(pool.spec) as store,
    ):
        store.put("before", b"b" * 3000)
        os.kill(primary.pid, signal.SIGSTOP)
        try:
            standby.wait_for("not fenced" if fence else "without --fence")
            assert _seat_pid(pool) == primary.pid and standby.proc.poll() is None
        finally:
            os.kill(primary.pid, signal.SIGCONT)
        store.put("after", b"a" * 3000)  # the old server serves on: nothing changed hands
        assert store.get("before") == b"b" * 3000 and store.get("after") == b"a" * 3000
        assert store.stats()["server_pid"] == primary.pid
        assert store.remove("before") and store.remove("after")


def test_a_resumed_server_whose_seat_was_taken_stops_and_exits_nonzero(pool: Pool) -> None:
    # a fence that lies (`true` cuts nothing off): the old server resumes after the takeover
    standby_args = ("host=b", "--standby", "--takeover-after", "0.3", "--fence", "true")
    with servers(pool.spec, "native", ("host=a",), standby_args) as (primary, standby):
        with KVStore(pool.spec) as store:
            store.rpc.restart_grace_s = WAIT_S
            store.put("before", b"b" * 3000)
            os.kill(primary.pid, signal.SIGSTOP)
            standby.wait_for("keys recovered")
            _wait_seat(pool, standby.pid)
            os.kill(primary.pid, signal.SIGCONT)
            assert primary.proc.wait(WAIT_S) == 1
            primary.wait_for("took this pool over")
            store.put("after", b"a" * 3000)
            assert store.get("before") == b"b" * 3000 and store.get("after") == b"a" * 3000
            assert _seat_pid(pool) == standby.pid
            assert store.remove("before") and store.remove("after")
        assert standby.stop() == 0


def test_the_takeover_options_are_for_a_standby(pool: Pool) -> None:
    for extra in (
        ["--takeover-after", "1"],
        ["--fence", "true"],
        ["--standby", "--takeover-after", "0"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "beluga", "serve", "--pool", pool.spec, *extra],
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )
        assert done.returncode != 0 and "beluga: error:" in done.stderr, (extra, done.stderr)
