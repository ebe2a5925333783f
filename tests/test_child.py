"""The child-process helpers: one poll loop, one ready wait, one stop."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time

import pytest

from beluga.child import server_process, stop_process, wait_ready, wait_until
from beluga.errors import BelugaError, CoherenceError

CTX = mp.get_context("fork")


def test_wait_until_returns_what_the_predicate_found() -> None:
    tries = iter([None, 0, "", "found"])
    assert wait_until(lambda: next(tries), 5.0, "never") == "found"


def test_wait_until_raises_the_given_error_with_the_last_state() -> None:
    seen = []

    def look() -> bool:
        seen.append(len(seen))
        return False

    with pytest.raises(CoherenceError, match=r"gave up after \d+ looks"):
        wait_until(look, 0.05, lambda: f"gave up after {len(seen)} looks", error=CoherenceError)
    with pytest.raises(BelugaError, match=r"^plain$"):
        wait_until(lambda: False, 0.0, "plain", pause=0.001)


def _exit_at_once(code: int, ready: object) -> None:
    raise SystemExit(code)


def _never_ready(ready: object) -> None:
    time.sleep(60)


def _deaf_to_sigterm(ready: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    time.sleep(60)


def test_wait_ready_fails_fast_when_the_child_dies_first() -> None:
    """Fast means on the death, not at the timeout: only the death says "exited"."""
    ready = CTX.Event()
    proc = CTX.Process(target=_exit_at_once, args=(3, ready))
    proc.start()
    with pytest.raises(BelugaError, match="the child exited with code 3 before it was ready"):
        wait_ready(proc, ready, 60.0, "the child")  # late would say "was not ready within"
    stop_process(proc, 1.0)


def test_wait_ready_says_when_the_child_is_late() -> None:
    ready = CTX.Event()
    proc = CTX.Process(target=_never_ready, args=(ready,))
    proc.start()
    try:
        with pytest.raises(CoherenceError, match=r"was not ready within 0\.2 s"):
            wait_ready(proc, ready, 0.2, "the child", error=CoherenceError)
    finally:
        stop_process(proc, 1.0)
    assert proc.exitcode == -signal.SIGTERM


def test_stop_process_kills_a_child_that_ignores_sigterm() -> None:
    with server_process(_deaf_to_sigterm, stop_timeout=0.2) as proc:
        assert proc.is_alive()
    assert proc.exitcode == -signal.SIGKILL


def test_stop_process_gives_a_told_child_its_grace_first() -> None:
    proc = CTX.Process(target=_exit_at_once, args=(0, None))
    proc.start()
    stop_process(proc, 5.0, terminate=False)
    assert proc.exitcode == 0
    stop_process(proc, 5.0)  # safe on a child that has already exited
