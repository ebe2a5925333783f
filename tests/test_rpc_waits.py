"""How RPC waits back off: spin, then sleep with a same-kernel wake-up, or timed naps.

Speed is the benchmark's business (``beluga bench rpc --contended N``).  These
tests check that each path is taken when it should be, through the counters
the C core keeps (``wait_stats``), and that every path completes or times out.
Sleeps are made long (``sleep_s``) where a test needs to know that a wake-up,
not a timeout, ended one.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from collections.abc import Iterator

import pytest

from beluga._native import _core
from beluga.coherence import LINE
from beluga.pool import Pool
from beluga.pool.layout import REGION_ALIGN, SUPERBLOCK_BYTES
from beluga.rpc import FIRST_SERVICE_OP, Op, Request, RpcClient, RpcServer, per_request
from beluga.rpc.protocol import CONTROL_LINE, DOORBELL, STATUS_LINE, request_line, response_line
from tests.rpc_util import connect, start, wait_until

OP_HELD = FIRST_SERVICE_OP  # answered only once the test lets it go


def test_wake_lines_have_their_own_place() -> None:
    assert (CONTROL_LINE, STATUS_LINE) == (0, LINE)
    head = {_core.RPC_CLIENT_WAKE, _core.RPC_SERVER_WAKE}
    assert head == {2 * LINE, 3 * LINE} and _core.RPC_HEAD == 4 * LINE
    assert request_line(8, 0) == _core.RPC_HEAD and response_line(8, 0) == _core.RPC_HEAD + 8 * LINE
    assert SUPERBLOCK_BYTES <= DOORBELL and _core.RPC_DOORBELL_COUNT == DOORBELL + LINE
    assert _core.RPC_DOORBELL_COUNT + LINE <= REGION_ALIGN  # inside region 0's reserved part


@pytest.fixture
def held() -> Iterator[threading.Event]:
    """An event that releases OP_HELD requests (set at the end, whatever happened)."""
    go = threading.Event()
    yield go
    go.set()


def _server(pool: Pool, go: threading.Event | None = None) -> RpcServer:
    def hold(r: Request) -> bytes:
        assert go is not None and go.wait(60)
        return r.payload

    return RpcServer.open(pool, {OP_HELD: per_request(hold)}, refresh_s=0.02)


def test_a_sleeping_client_is_woken_by_its_response(pool: Pool, held: threading.Event) -> None:
    server = _server(pool, held)
    server.start_thread()
    try:
        with Pool.attach(pool.spec) as other, RpcClient(other) as client:
            ring = client.ring
            assert ring.wake  # the server shares this kernel
            ring.sleep_s = 10.0  # so only a wake-up ends the sleep in time
            ring.submit_many([(OP_HELD, b"late")])
            got: list[list[tuple[int, bytes]]] = []
            errors: list[BaseException] = []
            waiter = start(lambda: got.append(ring.complete(1, 30.0)), errors)
            wait_until(lambda: ring.wait_stats["sleeps"] == 1, "the client falling asleep")
            held.set()
            waiter.join(30)
            assert not errors and got == [[(0, b"late")]]
            stats = ring.wait_stats
            assert stats["sleeps"] == 1 and stats["woken"] == 1 and stats["timeouts"] == 0
    finally:
        server.close()
    assert server.rings.wait_stats["wakes"] >= 1


def test_a_sleeping_server_is_woken_by_a_request_and_by_stop(pool: Pool) -> None:
    server = _server(pool)
    rings = server.rings
    rings.sleep_s = 10.0
    try:
        with Pool.attach(pool.spec) as other:
            client = connect(server, other)
            try:
                assert client.ring.wake
                batches: list[list] = []
                errors: list[BaseException] = []
                poller = start(lambda: batches.append(rings.poll(16, 30.0)), errors)
                wait_until(lambda: rings.wait_stats["sleeps"] == 1, "the server falling asleep")
                client.ring.submit_many([(Op.ECHO, b"ring")])
                poller.join(30)
                assert not errors and [(op, p) for _, _, op, p in batches[0]] == [(1, b"ring")]
                assert rings.wait_stats["woken"] == 1 and rings.wait_stats["timeouts"] == 0
                assert client.ring.wait_stats["wakes"] == 1
                rings.respond(server.dispatch(batches[0]))
                assert client.ring.complete(1, 30.0) == [(0, b"ring")]

                poller = start(lambda: batches.append(rings.poll(16, 30.0)), errors)
                wait_until(lambda: rings.wait_stats["sleeps"] == 2, "the server asleep again")
                server.stop()
                poller.join(30)
                assert not errors and batches[1] == []
                assert rings.wait_stats["woken"] == 2
            finally:
                client.close()
    finally:
        server.close()


def test_peers_on_other_kernels_complete_with_timed_naps(
    pool: Pool, held: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BELUGA_RPC_WAKE", "0")  # as if server and client had different boot ids
    server = _server(pool, held)
    server.start_thread()
    try:
        with Pool.attach(pool.spec) as other, RpcClient(other) as client:
            assert not client.ring.wake
            for i in range(20):
                assert client.call(Op.ECHO, bytes([i])) == bytes([i])
            errors: list[BaseException] = []
            caller = start(lambda: client.call(OP_HELD, b"slow"), errors)
            wait_until(lambda: client.ring.wait_stats["naps"] > 0, "the client napping")
            held.set()
            caller.join(30)
            assert not errors
            stats = client.ring.wait_stats
            assert stats["sleeps"] == 0 and stats["wakes"] == 0
    finally:
        server.close()
    stats = server.rings.wait_stats
    assert stats["naps"] > 0 and stats["sleeps"] == 0 and stats["wakes"] == 0


def _hog(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    while True:
        pass


@pytest.mark.skipif(
    not os.path.exists("/proc/thread-self/schedstat"), reason="the kernel has no schedstat"
)
def test_a_spinner_that_loses_its_core_sleeps_instead(pool: Pool) -> None:
    """Pinned to one core beside a CPU hog, a wait told to spin a whole second still sleeps."""
    server = _server(pool)  # nobody polls: the request goes unanswered
    cpu = min(os.sched_getaffinity(0))
    hog = mp.get_context("fork").Process(target=_hog, args=(cpu,), daemon=True)
    hog.start()
    mask = os.sched_getaffinity(0)
    try:
        with Pool.attach(pool.spec) as other:
            client = connect(server, other)
            try:
                client.ring.spin_s = 1.0
                client.ring.submit_many([(Op.ECHO, b"alone")])
                os.sched_setaffinity(0, {cpu})  # this thread only
                try:
                    assert client.ring.complete(1, 0.5) == []
                finally:
                    os.sched_setaffinity(0, mask)
                stats = client.ring.wait_stats
                assert stats["stalled"] >= 1 and stats["sleeps"] >= 1
            finally:
                client.close()
    finally:
        hog.kill()
        hog.join()
        server.close()


@pytest.mark.parametrize("wake", ["1", "0"])
def test_every_wait_ends_at_its_timeout(
    pool: Pool, wake: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BELUGA_RPC_WAKE", wake)
    server = _server(pool)  # nobody polls for it: requests go unanswered
    try:
        with Pool.attach(pool.spec) as other:
            client = connect(server, other)
            try:
                assert server.rings.poll(16, 0.05) == []
                client.ring.submit_many([(Op.ECHO, b"unanswered")])
                assert client.ring.complete(1, 0.05) == []
                assert client.ring.call(Op.ECHO, b"again", 0.05) is None
                slept = "sleeps" if wake == "1" else "naps"
                assert client.ring.wait_stats[slept] > 0
                assert server.rings.wait_stats[slept] > 0
            finally:
                client.close()
    finally:
        server.close()


def test_wait_settings_are_checked(pool: Pool) -> None:
    server = _server(pool)
    try:
        server.idle_after_s = 0.0
        assert server.rings.spin_s == 0.0
        with pytest.raises(ValueError, match="sleep_s"):
            server.rings.sleep_s = 0.0
        with pytest.raises(ValueError, match="spin_s"):
            server.rings.spin_s = -1.0
    finally:
        server.close()
