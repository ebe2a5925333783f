"""Which server serves, since when, and how many takeovers: kept in the pool's seat line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from beluga.cli import main
from beluga.pool import Pool
from beluga.server.server import MetadataServer

WAIT_S = 30.0


def _seat_pid(pool: Pool) -> int:
    seat = pool.hosts.seat()
    return seat.identity.pid if seat is not None and seat.epoch else 0


def test_a_killed_server_counts_a_takeover_a_clean_stop_does_not(
    pool: Pool, capsys: pytest.CaptureFixture[str]
) -> None:
    before = time.time()
    with MetadataServer(pool) as first:
        s = first.service.stats()
        assert (s["server_pid"], s["server_host"]) == (os.getpid(), socket.gethostname())
        assert before - 1 <= s["server_since_s"] <= time.time()
        assert (s["seats_taken"], s["takeovers"]) == (1, 0)
    victim = subprocess.Popen(
        [sys.executable, "-m", "beluga", "serve", "--pool", pool.spec], stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + WAIT_S
        while _seat_pid(pool) != victim.pid:
            assert victim.poll() is None and time.monotonic() < deadline, "no seat taken"
            time.sleep(0.02)
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait(WAIT_S)
    with MetadataServer(pool) as heir:  # the seat still names the dead server: a takeover
        s = heir.service.stats()
        assert (s["server_pid"], s["seats_taken"], s["takeovers"]) == (os.getpid(), 3, 1)
        assert main(["pool", "info", "--pool", pool.spec]) == 0
        out = capsys.readouterr().out
        assert f"pid {os.getpid()} on this machine, serving since" in out
        assert "takeovers: 1" in out
