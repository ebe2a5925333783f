"""Child processes and waits, for benchmarks, tests, tools and the serving cluster.

:func:`server_process` runs a server in a child: the child gets a ``ready``
event as its last argument and sets it once it serves.  Leaving the context
stops it with SIGTERM (servers stop cleanly on it; an Event a killed child
waited on could wedge, a signal cannot), then SIGKILL if it does not exit in
time.  Its pieces serve supervisors that start their children otherwise:
:func:`wait_ready` (the ready event, failing fast if the child dies first)
and :func:`stop_process` (stop and reap, escalating to SIGKILL).

:func:`wait_until` is the one poll-until-deadline loop.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from beluga.errors import BelugaError

_CTX = mp.get_context("fork")
#: how often a wait for a ready event looks whether the child is still alive
_READY_POLL_S = 0.1
#: how long a child that was sent SIGTERM gets before SIGKILL, after its own grace
_TERM_GRACE_S = 5.0

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    what: str | Callable[[], str],
    *,
    error: type[BelugaError] = BelugaError,
    pause: float = 0.0,
) -> T:
    """Poll ``predicate`` until it returns something true, and return that.

    Past ``timeout`` seconds raise ``error(what)``; ``what`` is the whole
    message (a callable makes it when needed, so it can tell the last state
    seen).  ``pause`` seconds pass between polls.
    """
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise error(what() if callable(what) else what)
        if pause:
            time.sleep(pause)
    return result


def wait_ready(
    proc: Any, ready: Any, timeout: float, what: str, *, error: type[BelugaError] = BelugaError
) -> None:
    """Wait until a started child sets ``ready``; raise ``error`` if it exits first or is late."""
    deadline = time.monotonic() + timeout
    while not ready.wait(_READY_POLL_S):
        if not proc.is_alive():
            raise error(
                f"{what} exited with code {proc.exitcode} before it was ready; "
                "its error is printed above"
            )
        if time.monotonic() > deadline:
            raise error(f"{what} was not ready within {timeout:g} s; is the machine overloaded?")


def stop_process(proc: Any, grace: float, *, terminate: bool = True) -> None:
    """Stop a started child and reap it, escalating to SIGKILL.

    ``terminate``: send SIGTERM at once and give it ``grace`` seconds (a
    server stops cleanly on it).  Otherwise the child was told to exit some
    other way (a pipe, an event) and gets ``grace`` seconds for that before
    SIGTERM.  Safe on a child that has already exited.
    """
    if not terminate:
        proc.join(grace)
    if proc.is_alive():
        proc.terminate()
        proc.join(grace if terminate else _TERM_GRACE_S)
    if proc.is_alive():
        proc.kill()
        proc.join()


@contextmanager
def server_process(
    target: Callable[..., None], *args: Any, start_timeout: float = 30.0, stop_timeout: float = 15.0
) -> Iterator[mp.Process]:
    """Run ``target(*args, ready)`` in a forked child until the context ends."""
    ready = _CTX.Event()
    proc = _CTX.Process(target=target, args=(*args, ready), daemon=True)
    proc.start()
    try:
        wait_ready(proc, ready, start_timeout, getattr(target, "__name__", "server"))
        yield proc
    finally:
        stop_process(proc, stop_timeout)
