"""Stopping a process on a signal, with no way for the handler to deadlock it.

THE RULE, for every long-running Beluga process (server, standby, bench and
chaos children, the emulation runner): *a signal handler only records the
signal.*  It stores a flag (:class:`StopFlag`), and the loop that waits
notices it, because every wait in that loop is bounded.  A handler takes no
lock, logs nothing, and makes no call that can block.

Why.  CPython runs a Python signal handler in the main thread, between two
bytecodes, whatever that thread is doing at that moment, including holding
a lock.  ``threading.Event.set`` takes the Event's lock; so does
``Event.wait`` on its way in and out.  A handler that calls ``set`` while
the same thread is inside ``wait`` waits for a lock its own thread holds:
the process hangs forever in a futex wait (a ``beluga serve --standby``
did, on SIGTERM; issue 36).  The same holds for ``logging`` (its handlers'
locks), ``queue``, and anything else built on locks.

So a handler here stores one attribute (atomic for the interpreter: no
lock) and nothing else; :meth:`StopFlag.wait` is a bounded sleep in short
steps, never a lock; a loop that waits in C (the RPC server's poll) is
bounded by its own timeout and looks at the flag between two polls.  asyncio
programs use ``loop.add_signal_handler`` instead (``beluga proxy``): asyncio
records the signal with ``signal.set_wakeup_fd`` and runs the callback in
the loop, which is the same rule.

:func:`stop_on_signals` installs such handlers for a block and puts the
previous ones back after it.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

#: the longest step of :meth:`StopFlag.wait`: how late a waiter may notice the flag
POLL_S = 0.01
#: what stops a server: systemd's stop, ``kill``, and Ctrl-C
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopFlag:
    """A one-way flag set by a signal handler or any thread and polled by the loop that waits.

    Unlike ``threading.Event`` it takes no lock anywhere, so a signal
    handler may set it at any instruction of the thread that waits on it.
    Thread-safe (one attribute store; reads see it at the next poll).
    Fork-safe: a forked child gets a copy, set or not, that is its own.
    """

    __slots__ = ("_set", "signum")

    def __init__(self) -> None:
        self._set = False
        #: the first signal that set the flag (0: none, or set by a call to :meth:`set`)
        self.signum = 0

    def set(self, signum: int = 0) -> None:
        """Raise the flag (and note ``signum`` if it is the first signal); never blocks."""
        if signum and not self.signum:
            self.signum = signum
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` s, or less once the flag is raised; returns :meth:`is_set`.

        The flag is looked at every :data:`POLL_S` at most.  A signal that
        lands in the sleep runs its handler and the sleep resumes (PEP 475),
        so it is noticed within one step.
        """
        deadline = time.monotonic() + timeout
        while not self._set:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, POLL_S))
        return self._set

    def __repr__(self) -> str:
        state = f"set by signal {self.signum}" if self.signum else "set" if self._set else "clear"
        return f"StopFlag({state})"


@contextmanager
def stop_on_signals(
    flag: StopFlag | None = None, signals: tuple[int, ...] = STOP_SIGNALS
) -> Iterator[StopFlag]:
    """While the block runs, each of ``signals`` only sets ``flag`` (a new one if None).

    Main thread only (Python's rule for signal handlers); ValueError
    elsewhere.  The previous handlers come back when the block ends, so
    keep it open until the process has finished stopping: a second signal
    during the clean-up is then recorded too, not the default action's
    abrupt end.
    """
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("signal handlers can only be installed from the main thread")
    stop = StopFlag() if flag is None else flag

    def record(signum: int, frame: FrameType | None) -> None:
        stop.set(signum)  # the whole handler: THE RULE above

    previous = {s: signal.signal(s, record) for s in signals}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
