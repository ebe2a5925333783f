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

A foreground command that should end on SIGTERM as on Ctrl-C (``beluga
bench e2e``, ``python -m emulation``) uses :func:`interrupt_on_signals`: the
handler records the signal as above, and the command's waiting loops call
:func:`raise_if_interrupted`, which raises ``KeyboardInterrupt`` there, so
the command unwinds through its ``finally`` blocks from a known place.  A
handler that raised it itself would raise at any bytecode, for instance
between ``subprocess.Popen.poll``'s ``acquire`` of its wait lock and the
``try`` that releases it: the clean-up's ``Popen.wait`` then waits for that
lock forever.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

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
    abrupt end.  A child forked inside the block starts with the previous
    handlers, not these (its parent's flag is not its own to set): an engine
    process forked by ``beluga bench`` still dies on SIGTERM.
    """
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("signal handlers can only be installed from the main thread")
    stop = StopFlag() if flag is None else flag

    def record(signum: int, frame: FrameType | None) -> None:
        stop.set(signum)  # the whole handler: THE RULE above

    previous = {s: signal.signal(s, record) for s in signals}
    _replaced.append(previous)
    try:
        yield stop
    finally:
        _replaced.remove(previous)
        for s, handler in previous.items():
            signal.signal(s, handler)


#: the handlers each open block replaced, outermost first (a forked child gets them back)
_replaced: list[dict[int, Any]] = []


def _after_fork_in_child() -> None:
    """Put back, in a forked child, the handlers its parent's open blocks replaced."""
    global _interrupt
    for previous in reversed(_replaced):
        for s, handler in previous.items():
            signal.signal(s, handler)
    _replaced.clear()
    _interrupt = None


os.register_at_fork(after_in_child=_after_fork_in_child)


#: the flag of the innermost :func:`interrupt_on_signals` block (None: outside any)
_interrupt: StopFlag | None = None


@contextmanager
def interrupt_on_signals(signals: tuple[int, ...] = (signal.SIGTERM,)) -> Iterator[StopFlag]:
    """For a foreground command: ``signals`` end it as Ctrl-C would, from its waiting loops.

    The handlers only record the signal; :func:`raise_if_interrupted`,
    called by the loops that wait, raises ``KeyboardInterrupt`` once one
    came, and so does the end of the block if no loop looked since.  It
    raises once: the clean-up that follows may wait in the same loops.
    Main thread only.
    """
    global _interrupt
    outer, _interrupt = _interrupt, StopFlag()
    try:
        with stop_on_signals(_interrupt, signals) as flag:
            yield flag
            raise_if_interrupted()
    finally:
        _interrupt = outer


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` in the main thread if a signal interrupted the command.

    For loops that wait, between two bounded waits; a no-op outside an
    :func:`interrupt_on_signals` block and in other threads.
    """
    global _interrupt
    flag = _interrupt
    if flag is not None and flag.is_set() and threading.current_thread() is threading.main_thread():
        _interrupt = StopFlag()  # raised once; the handlers record into the old one from now on
        raise KeyboardInterrupt(f"signal {flag.signum}")
