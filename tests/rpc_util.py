"""Helpers for RPC tests that drive a server by hand, in one process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from beluga.coherence import Memory
from beluga.pool import Pool
from beluga.rpc import RpcClient, RpcServer


def connect(server: RpcServer, pool: Pool, **kwargs: Any) -> RpcClient:
    """Connect a client to a server that only refreshes (nothing serves its ring)."""
    box: list[RpcClient] = []
    errors: list[BaseException] = []
    worker = threading.Thread(target=capture(lambda: box.append(RpcClient(pool, **kwargs)), errors))
    worker.start()
    while worker.is_alive():
        server.refresh()
        time.sleep(0.001)
    if errors:
        raise errors[0]
    return box[0]


def capture(fn: Callable[[], object], errors: list[BaseException]) -> Callable[[], None]:
    """``fn`` for a thread: an exception lands in ``errors`` instead of the thread's traceback."""

    def run() -> None:
        try:
            fn()
        except BaseException as e:
            errors.append(e)

    return run


def start(fn: Callable[[], object], errors: list[BaseException]) -> threading.Thread:
    """Run ``fn`` in a daemon thread, collecting its exception."""
    thread = threading.Thread(target=capture(fn, errors), daemon=True)
    thread.start()
    return thread


def wait_until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``check`` until it holds; fail with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.001)


def wait_busy(mem: Memory, n: int = 1) -> None:
    """Wait until ``n`` GIL-free loops or copies run over ``mem`` (Memory.busy counts them)."""
    wait_until(lambda: mem.busy >= n, f"{n} loop(s) entering the pool's memory")
