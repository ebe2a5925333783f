"""A signal handler only records the signal, and every wait of a server notices it.

The rule (beluga.signals): CPython runs a Python signal handler in the main
thread between two bytecodes, wherever that thread is, holding whatever it
holds.  A handler that takes a lock the interrupted code holds waits for
itself forever: ``beluga serve --standby`` hung on SIGTERM that way, its
handler's ``Event.set`` waiting for the lock its own ``Event.wait`` held.

That window is a few bytecodes wide, so repeating signals at random rarely
hits it.  These tests put the signal exactly there instead: a child process
runs ``serve`` under a profile hook (``sys.setprofile``, the main thread
only) that sends the child SIGTERM at a chosen point, so the handler runs at
the next bytecode, inside that point:

- a standby, at the first lock its main thread takes (or the first sleep,
  whichever comes first) after it stands by: where the old handler
  deadlocked;
- a server, as its recovery starts: the old handler raised a flag that no
  wait looked at, so it recovered and served on;
- a server that is stopping, at every C call its main thread returns from
  while it closes (every lock taken on the way), so a second SIGTERM can
  land inside anything the shutdown holds.

Each child must exit 0 within :data:`HANG_S` (a hang is forever: the bound
only ends the test) and must report that the hook fired, so a test whose
point was never reached fails instead of passing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from beluga.pool import Pool
from beluga.rpc import RpcServer
from beluga.signals import StopFlag, interrupt_on_signals, raise_if_interrupted, stop_on_signals

HANG_S = 20.0  # a child not gone by then is hung (the old code never ended)

# The child: serve(spec) under a profile hook that SIGTERMs the process at one point.
CHILD = r"""
import logging, os, signal, sys
from beluga.server.server import serve
from beluga.server.service import MetadataService
from beluga.rpc.server import RpcServer

where, spec = sys.argv[1], sys.argv[2]
LOCKS = {"lock.acquire", "lock.__enter__", "RLock.acquire", "RLock.__enter__"}
SLEEPS = {"sleep", "select", "poll", "epoll.poll"}
fired = []
logging.basicConfig(level=logging.INFO, format="%(message)s")  # serve's lines, on stderr


def term(point):
    if not fired:
        print(f"hook: SIGTERM at {point}", file=sys.stderr, flush=True)
    fired.append(point)
    os.kill(os.getpid(), signal.SIGTERM)  # its handler runs at this hook's next bytecode


def first_lock_or_sleep(frame, event, arg):
    name = getattr(arg, "__qualname__", "")
    if (event == "c_return" and name in LOCKS) or (event == "c_call" and name in SLEEPS):
        sys.setprofile(None)
        term(f"{event} {name}")


def recovery_starts(frame, event, arg):
    if event == "call" and frame.f_code is MetadataService.__init__.__code__:
        sys.setprofile(None)
        term("recovery")


def every_call_while_closing(frame, event, arg):
    if event == "call" and frame.f_code is RpcServer.close.__code__:
        sys.setprofile(storm)


def storm(frame, event, arg):
    # while a Python handler is installed: after it, SIGTERM would end the process
    if event == "c_return" and callable(signal.getsignal(signal.SIGTERM)):
        term(f"c_return {getattr(arg, '__qualname__', arg)}")


class Ready:
    def set(self):
        print("ready", file=sys.stderr, flush=True)
        if where == "standby":
            sys.setprofile(first_lock_or_sleep)
        elif where == "closing":
            sys.setprofile(every_call_while_closing)
            os.kill(os.getpid(), signal.SIGTERM)  # the first stop; the storm comes in close


if where == "recovery":
    sys.setprofile(recovery_starts)
serve(spec, coherence="native", ready=Ready(), standby=where == "standby")
sys.setprofile(None)
print(f"hook: fired {len(fired)} times; exited cleanly", file=sys.stderr, flush=True)
"""


def _run_child(where: str, spec: str) -> str:
    """Run CHILD to its end; its stderr.  Fails (after killing it) if it hangs."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, where, spec], stderr=subprocess.PIPE, text=True
    )
    try:
        _, err = proc.communicate(timeout=HANG_S)
        hung = False
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        hung = True
    assert not hung, f"the {where} child hung after its SIGTERM; its stderr:\n{err}"
    assert proc.returncode == 0, f"the {where} child exited {proc.returncode}:\n{err}"
    assert "hook: SIGTERM at" in err, f"the hook never fired, so nothing was tested:\n{err}"
    assert "exited cleanly" in err, err
    return err


def test_a_standby_signalled_while_its_wait_holds_a_lock_exits(pool: Pool) -> None:
    """The old handler's Event.set waited for the lock of the Event.wait it interrupted."""
    with RpcServer.open(pool):  # holds the seat (this process is alive): the standby waits
        err = _run_child("standby", pool.spec)
    assert "stopped while standing by" in err


def test_a_server_signalled_as_its_recovery_starts_stops_once_recovered(pool: Pool) -> None:
    """The old handler's flag was never looked at: it recovered, then served on, forever."""
    err = _run_child("recovery", pool.spec)
    assert "stopped while it recovered" in err
    assert pool.hosts.seat() is not None and not pool.hosts.seat().epoch  # it left the seat


def test_a_server_signalled_at_every_call_while_it_closes_exits(pool: Pool) -> None:
    """A second SIGTERM inside the shutdown: the old handler's stop took the stop Event's
    lock that close() held; now every one of them is only recorded."""
    err = _run_child("closing", pool.spec)
    fired = int(err.split("hook: fired ")[1].split()[0])
    assert fired > 1, f"the storm reached no call inside close():\n{err}"
    assert not pool.hosts.seat().epoch  # close() finished: it left the seat


# A foreground command under interrupt_on_signals: the emulation runner's supervise loop,
# SIGTERMed right after Popen.poll took its wait lock (the hook, as above).  A handler that
# raised KeyboardInterrupt itself raised it before poll's try began, so the lock stayed taken
# and the clean-up's Popen.wait waited for it forever; now the loop raises at its next look.
SUPERVISED = r"""
import os, signal, sys
from beluga.signals import interrupt_on_signals
from emulation.runner import supervise


def after_poll_takes_its_lock(frame, event, arg):
    if (
        event == "c_return"
        and getattr(arg, "__qualname__", "") == "lock.acquire"
        and frame.f_code.co_name == "_internal_poll"
    ):
        sys.setprofile(None)
        print("hook: SIGTERM at Popen.poll's lock", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)


try:
    with interrupt_on_signals():
        sys.setprofile(after_poll_takes_its_lock)
        supervise([["sleep", "30"]], [sys.argv[1]], timeout=60)
except KeyboardInterrupt:
    print("interrupted; exited cleanly", file=sys.stderr, flush=True)
"""


def test_a_supervisor_signalled_inside_popen_poll_ends_its_processes(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SUPERVISED, str(tmp_path / "log")],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=HANG_S)
        hung = False
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        hung = True
    assert not hung, f"the supervisor hung after its SIGTERM:\n{err}"
    assert "hook: SIGTERM at" in err, f"the hook never fired, so nothing was tested:\n{err}"
    assert proc.returncode == 0 and "interrupted; exited cleanly" in err, err


def test_an_interrupted_block_raises_at_the_next_look_or_at_its_end() -> None:
    with pytest.raises(KeyboardInterrupt), interrupt_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)  # recorded only: nothing raises here
        try:
            raise_if_interrupted()
        finally:
            raise_if_interrupted()  # the clean-up that looks again is not interrupted again
    with pytest.raises(KeyboardInterrupt), interrupt_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)  # no loop looked: the block's end raises
    with interrupt_on_signals():
        raise_if_interrupted()  # a new block starts clear
    raise_if_interrupted()  # and outside any block it never raises


# -- the flag itself ----------------------------------------------------------------------


def test_a_signal_only_sets_the_flag_and_the_previous_handler_comes_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_signals() as stop:
        assert not stop.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(HANG_S) and stop.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_child_forked_inside_a_block_gets_the_previous_handlers() -> None:
    """An engine forked by `beluga bench` (under interrupt_on_signals) must still die on
    SIGTERM: its parent's flag is nothing it looks at."""
    ctx = mp.get_context("fork")
    started = ctx.Event()
    with interrupt_on_signals():
        child = ctx.Process(target=_sleep_once_started, args=(started,))
        child.start()
        assert started.wait(HANG_S)  # past the fork's own set-up, where a signal is lost
        os.kill(child.pid, signal.SIGTERM)
        child.join(HANG_S)
    assert child.exitcode == -signal.SIGTERM


def _sleep_once_started(started: Any) -> None:
    started.set()
    time.sleep(HANG_S)


def test_a_waiter_notices_a_flag_set_by_another_thread() -> None:
    stop = StopFlag()
    assert not stop.wait(0.02)  # nobody set it: the wait runs out
    setter = threading.Timer(0.05, stop.set)
    setter.start()
    try:
        assert stop.wait(HANG_S)
    finally:
        setter.join(HANG_S)
    assert stop.signum == 0  # set by a call, not a signal


def test_handlers_are_installed_only_from_the_main_thread() -> None:
    errors: list[BaseException] = []

    def install() -> None:
        try:
            with stop_on_signals():
                pass
        except ValueError as e:
            errors.append(e)

    t = threading.Thread(target=install)
    t.start()
    t.join(HANG_S)
    assert errors and "main thread" in str(errors[0])


def test_an_rpc_server_stopped_by_its_flag_ends_serve_forever(pool: Pool) -> None:
    stop = StopFlag()
    with RpcServer.open(pool, stopping=stop) as server:
        thread = server.start_thread()
        stop.set()  # what a signal handler does: no call into the server
        thread.join(HANG_S)
        assert not thread.is_alive()
    assert not pool.hosts.seat().epoch  # and close() left the seat


def test_closing_an_rpc_server_leaves_its_process_stop_flag_alone(pool: Pool) -> None:
    """The flag is the process's (a standby's): a server that closes itself because it lost
    the seat during recovery must send the standby back to waiting, not stop it."""
    stop = StopFlag()
    with RpcServer.open(pool, stopping=stop) as server:
        server.stop()
    assert not stop.is_set()
