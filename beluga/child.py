"""A server in a child process, for benchmarks, tests and tools.

The child gets a ``ready`` event as its last argument and sets it once it
serves.  Leaving the context stops it with SIGTERM (servers stop cleanly on
it; an Event a killed child waited on could wedge, a signal cannot), then
SIGKILL if it does not exit in time.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from beluga.errors import BelugaError

_CTX = mp.get_context("fork")


@contextmanager
def server_process(
    target: Callable[..., None], *args: Any, start_timeout: float = 30.0, stop_timeout: float = 15.0
) -> Iterator[mp.Process]:
    """Run ``target(*args, ready)`` in a forked child until the context ends."""
    ready = _CTX.Event()
    proc = _CTX.Process(target=target, args=(*args, ready), daemon=True)
    proc.start()
    try:
        if not ready.wait(start_timeout):
            raise BelugaError(
                f"{getattr(target, '__name__', 'server')} did not start within "
                f"{start_timeout} s (exit code {proc.exitcode})"
            )
        yield proc
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGTERM)
        proc.join(stop_timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
