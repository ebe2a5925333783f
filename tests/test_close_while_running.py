"""Closing a pool while a loop runs over it without the GIL: a clear error or a wait, never a crash.

Each scenario runs in a forked child, so that a segfault (what unmapping
under a running loop used to cause) fails the test through the child's exit
status instead of killing pytest.  Inside the child, the scenario waits until
the loop is really inside the pool's memory (``Memory.busy``), closes the
pool, checks the loop ended with an error that says what happened, and then
checks the pool still serves.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
from collections.abc import Callable

import numpy as np
import pytest

import beluga.rpc.client as rpc_client
from beluga.errors import CoherenceError, RpcError
from beluga.pool import Pool
from beluga.rpc import Op, RpcClient, RpcServer
from tests.rpc_util import connect, start, wait_busy, wait_until

CTX = mp.get_context("fork")


def run_in_child(scenario: Callable[[str], None], spec: str) -> None:
    proc = CTX.Process(target=scenario, args=(spec,))
    proc.start()
    proc.join(120)
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail(f"{scenario.__name__} hung")
    code = proc.exitcode
    assert code is not None
    died = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    assert code == 0, f"{scenario.__name__}: the child process ended with {died}"


def ended_closed(thread: threading.Thread, errors: list[BaseException]) -> None:
    """The loop's thread ended, with an RpcError saying the pool was closed under it."""
    thread.join(30)
    assert not thread.is_alive(), "the loop did not end after its pool was closed"
    assert len(errors) == 1 and isinstance(errors[0], RpcError), errors
    assert "was closed" in str(errors[0]), errors[0]


def still_serves(spec: str) -> None:
    """The pool attaches again and a new server answers a new client."""
    with Pool.attach(spec) as pool, RpcServer.open(pool, refresh_s=0.01) as server:
        server.start_thread()
        with Pool.attach(spec) as other, RpcClient(other) as client:
            assert client.call(Op.ECHO, b"still here") == b"still here"


def close_under_serve_forever(spec: str) -> None:
    spool, cpool = Pool.attach(spec), Pool.attach(spec)
    server = RpcServer.open(spool, refresh_s=3600)  # one poll call: the close lands inside it
    client = connect(server, cpool)  # an active ring, so the poll reads pool memory
    errors: list[BaseException] = []
    loop = start(server.serve_forever, errors)
    wait_busy(spool.memory)
    spool.close()
    ended_closed(loop, errors)
    assert spool.memory.released
    server.close()
    client.close()
    cpool.close()
    still_serves(spec)


def close_under_client_wait(spec: str) -> None:
    rpc_client.SLICE_S = 3600.0  # one C wait per call: the close lands inside it
    spool, cpool = Pool.attach(spec), Pool.attach(spec)
    server = RpcServer.open(spool)  # never polls: the call is never answered
    client = connect(server, cpool)
    errors: list[BaseException] = []
    caller = start(lambda: client.call(Op.ECHO, b"x", timeout=3600), errors)
    wait_busy(cpool.memory)
    wait_until(lambda: client.ring.wait_stats["sleeps"] > 0, "the client sleeping in its wait")
    cpool.close()
    ended_closed(caller, errors)
    client.close()
    server.close()
    spool.close()
    still_serves(spec)


def close_under_pump_and_echo(spec: str) -> None:
    spool, cpool = Pool.attach(spec), Pool.attach(spec)
    server = RpcServer.open(spool, refresh_s=3600)
    client = connect(server, cpool, depth=8)
    echo_errors: list[BaseException] = []
    pump_errors: list[BaseException] = []
    echo = start(lambda: server.serve_echo(3600), echo_errors)
    wait_busy(spool.memory)
    pump = start(lambda: client.ring.pump(Op.ECHO, b"x", 8, 3600), pump_errors)
    wait_busy(cpool.memory)
    cpool.close()
    ended_closed(pump, pump_errors)
    spool.close()
    ended_closed(echo, echo_errors)
    client.close()
    server.close()
    still_serves(spec)


def release_refused_during_a_long_copy(spec: str) -> None:
    pool = Pool.attach(spec)
    chunk = 64 << 10
    out = np.zeros(chunk, dtype=np.uint8)
    rows = np.tile(np.array([[0, 0, pool.superblock.headers.offset, chunk]], np.uint64), (40000, 1))
    errors: list[BaseException] = []
    copy = start(lambda: pool.memory.scatter_read([out], rows), errors)  # ~2.6 GB of loads
    wait_busy(pool.memory)
    with pytest.raises(CoherenceError, match="still run over it") as refused:
        pool.memory.release(timeout_s=0.001)
    assert "close the pool again" in str(refused.value)
    assert not pool.memory.released and pool.mapping.buffer is not None
    assert len(pool.memory.load(0, 8)) == 8  # still attached and mapped
    copy.join(120)
    assert not copy.is_alive() and not errors, errors
    pool.close()  # now nothing runs: the close goes through
    assert pool.memory.released
    still_serves(spec)


@pytest.mark.parametrize(
    "scenario",
    [
        close_under_serve_forever,
        close_under_client_wait,
        close_under_pump_and_echo,
        release_refused_during_a_long_copy,
    ],
)
def test_closing_the_pool_under_a_running_loop_never_crashes(
    pool: Pool, scenario: Callable[[str], None]
) -> None:
    run_in_child(scenario, pool.spec)
    assert not [e for e in pool.hosts.entries() if pool.hosts.is_alive(e)]  # no host id leaked


def test_a_loop_refuses_to_start_on_a_closing_or_released_pool(pool: Pool) -> None:
    memory = pool.memory
    server = RpcServer.open(pool)
    try:
        with Pool.attach(pool.spec) as other:
            client = connect(server, other)
            client.close()
        pool.close()
        with pytest.raises(RpcError, match="closed"):
            server.rings.poll(8, 0.01)
        with pytest.raises(CoherenceError, match="released"):
            memory.load(0, 8)
        assert memory.busy == 0
    finally:
        server.close()
