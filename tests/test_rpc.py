"""Shared-memory RPC across processes, in native and model coherence modes.

The server runs in its own process (its own emulated host) unless a test
needs to poke at it; every client is another process or this one.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from beluga._native import _core
from beluga.child import server_process
from beluga.coherence import LINE, Memory, attach, read_line, write_line
from beluga.errors import CapacityError, RpcError
from beluga.pool import Pool
from beluga.rpc import RemoteValueError, Request, RpcClient, RpcServer, Status, per_request
from beluga.rpc.protocol import (
    RING_MAGIC,
    Message,
    Op,
    RingControl,
    buf_size,
    request_buffer,
    request_line,
    response_buffer,
    response_line,
    ring_offset,
)
from beluga.signals import stop_on_signals
from tests.rpc_util import connect, start, wait_until
from tests.test_native import crc32c_reference

OP_ADD, OP_FAIL, OP_FULL, OP_BIG, OP_SLOW, OP_CRASH = range(16, 22)
CTX = mp.get_context("fork")


def _add(r: Request) -> bytes:
    a, b = struct.unpack("<qq", r.payload)
    return struct.pack("<q", a + b)


def _fail(r: Request) -> bytes:
    raise ValueError("negative sizes are not allowed")


def _full(r: Request) -> bytes:
    raise CapacityError("pool is full")


def _slow(r: Request) -> bytes:
    time.sleep(float(r.payload.decode()))
    return b"late"


def handlers() -> dict:
    return {
        OP_ADD: per_request(_add),
        OP_FAIL: per_request(_fail),
        OP_FULL: per_request(_full),
        OP_BIG: per_request(lambda r: bytes(int(r.payload.decode()))),
        OP_SLOW: per_request(_slow),
        OP_CRASH: lambda reqs: [b"wrong count"],  # a broken batch handler
    }


def _server_main(spec: str, mode: str, gone: mp.Queue, ready: mp.Event) -> None:
    with Pool.attach(spec, coherence=mode) as pool, stop_on_signals() as stopping:
        server = RpcServer.open(
            pool, handlers(), refresh_s=0.02, on_client_gone=gone.put, stopping=stopping
        )
        ready.set()
        server.serve_forever()
        server.close()


@contextmanager
def rpc_server(spec: str, mode: str = "native") -> Iterator[tuple[mp.Process, mp.Queue]]:
    """A server in its own process, and the queue of the host ids it saw die."""
    gone = CTX.Queue()
    try:
        with server_process(_server_main, spec, mode, gone) as proc:
            yield proc, gone
    finally:
        gone.close()
        gone.join_thread()


def add(client: RpcClient, a: int, b: int) -> int:
    return struct.unpack("<q", client.call(OP_ADD, struct.pack("<qq", a, b)))[0]


def test_calls_errors_and_payload_sizes(pool: Pool) -> None:
    with rpc_server(pool.spec), RpcClient(pool, depth=8) as c:
        assert add(c, 2, 40) == 42
        assert c.call(1, b"") == b""
        big = os.urandom(c.max_payload)  # the largest request travels out of line
        assert c.call(1, big) == big
        with pytest.raises(RpcError, match="slot buffer"):
            c.call(1, big + b"x")
        with pytest.raises(RemoteValueError, match="negative sizes"):
            c.call(OP_FAIL)
        with pytest.raises(CapacityError, match="pool is full"):
            c.call(OP_FULL)
        with pytest.raises(RpcError, match="unknown op 99"):
            c.call(99)
        with pytest.raises(RpcError, match="returned 1 results for 3"):
            c.call_many([(OP_CRASH, b"")] * 3)
        with pytest.raises(RpcError, match="exceeds the ring"):
            c.call(OP_BIG, str(c.max_payload + 1).encode())
        assert len(c.call(OP_BIG, str(c.max_payload).encode())) == c.max_payload
        assert add(c, -1, 1) == 0  # still serving after all of that


def test_pipelined_calls_keep_order(pool: Pool) -> None:
    with rpc_server(pool.spec), RpcClient(pool, depth=16) as c:
        reqs = [(OP_ADD, struct.pack("<qq", i, i)) for i in range(100)]
        assert [struct.unpack("<q", r)[0] for r in c.call_many(reqs)] == [2 * i for i in range(100)]


def _client_main(spec: str, mode: str, seed: int, n: int, out: mp.Queue) -> None:
    try:
        with Pool.attach(spec, coherence=mode) as pool, RpcClient(pool, depth=8) as c:
            rng = __import__("random").Random(seed)
            for _ in range(n):
                size = rng.choice([0, 7, 40, 41, 300, min(2000, c.max_payload)])
                data = rng.randbytes(size)
                if c.call(1, data) != data:
                    out.put("wrong echo")
                    return
                a, b = rng.randrange(-(2**40), 2**40), rng.randrange(-(2**40), 2**40)
                if add(c, a, b) != a + b:
                    out.put("wrong sum")
                    return
            out.put("ok")
    except BaseException as e:
        out.put(repr(e))


@pytest.mark.parametrize("mode", ["model", "native"])
@pytest.mark.usefixtures("model_eviction")
def test_three_processes_server_and_two_clients(pool: Pool, mode: str) -> None:
    with rpc_server(pool.spec, mode):
        out = CTX.Queue()
        clients = [
            CTX.Process(target=_client_main, args=(pool.spec, mode, s, 300, out)) for s in range(2)
        ]
        for p in clients:
            p.start()
        results = [out.get(timeout=60) for _ in clients]
        for p in clients:
            p.join(30)
        out.close()
        out.join_thread()
    assert results == ["ok", "ok"]


@pytest.mark.usefixtures("model_eviction")
def test_a_model_server_reusing_slots_reads_every_out_of_line_payload_fresh(pool: Pool) -> None:
    """Two slots, so every slot carries a new out-of-line payload every other call, both ways.

    A server (or client) that loaded a slot's buffer without invalidating it,
    or without the MFENCE after, would read the payload the slot held before:
    a CORRUPT status (its CRC fails) or a wrong echo.
    """
    rng = random.Random(11)
    with (
        rpc_server(pool.spec, "model"),
        Pool.attach(pool.spec, coherence="model") as host,
        RpcClient(host, depth=2) as c,
    ):
        sizes = [41, 300, 1999, c.max_payload]
        for i in range(200):
            data = rng.randbytes(sizes[i % len(sizes)])
            assert c.call(Op.ECHO, data) == data, f"call {i}: a stale payload came back"


def test_no_server_is_a_clear_error(pool: Pool) -> None:
    with pytest.raises(RpcError, match="beluga serve"):
        RpcClient(pool, connect_timeout=0.2)
    assert not [e for e in pool.hosts.entries() if pool.hosts.is_alive(e)]  # host id returned


def test_server_stop_and_death_are_detected(pool: Pool) -> None:
    """A call fails once its server has been gone for the restart grace, not at its timeout;
    later calls fail at once until a new server adopts the ring, then they resume."""
    with rpc_server(pool.spec) as (proc, _):
        c = RpcClient(pool, restart_grace_s=0.3)
        assert add(c, 1, 1) == 2
    with pytest.raises(RpcError, match="stopped"):
        c.call(1, b"x", timeout=60)
    c.close()
    with rpc_server(pool.spec) as (proc, _):
        c = RpcClient(pool, restart_grace_s=0.3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        with pytest.raises(RpcError, match="died"):
            c.call(1, b"x", timeout=60)
        with pytest.raises(RpcError, match="died"):  # again, without waiting out the grace
            c.call(1, b"x", timeout=60)
    with rpc_server(pool.spec):  # a new server adopts the ring: calls resume, each its own answer
        assert add(c, 2, 3) == 5
        assert add(c, 4, 5) == 9
    c.close()


def test_restarted_server_serves_the_request_in_flight(pool: Pool) -> None:
    """A call waiting while its server is dead is served by the next server, however
    long that takes to start within the client's restart grace."""
    with rpc_server(pool.spec) as (proc, _):
        c = RpcClient(pool, restart_grace_s=60)
        assert add(c, 1, 2) == 3
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    result: list[object] = []
    submitted = c.ring.next_seq
    caller = threading.Thread(target=lambda: result.append(add(c, 20, 22)))
    caller.start()
    deadline = time.monotonic() + 10
    while c.ring.next_seq == submitted:  # the request is in the ring, and no server runs
        assert time.monotonic() < deadline, "the call never submitted its request"
        time.sleep(0.001)
    with rpc_server(pool.spec):
        caller.join(20)
        assert result == [42]
        assert add(c, 5, 5) == 10
    c.close()


def _counting_server(pool: Pool, runs: list[bytes]) -> RpcServer:
    """An in-process server whose OP_ADD records each request it runs."""

    def add(r: Request) -> bytes:
        runs.append(r.payload)
        return _add(r)

    return RpcServer.open(pool, {OP_ADD: per_request(add)}, refresh_s=0.02)


def test_a_request_its_caller_gave_up_on_is_never_run_by_the_next_server(pool: Pool) -> None:
    """A request left in the ring when its server went away (its caller gave up) is answered
    RESTARTED by the next server, unrun; the client drops that answer, and its next call
    runs once and gets its own answer."""
    first_runs: list[bytes] = []
    first = _counting_server(pool, first_runs)
    c = connect(first, pool, restart_grace_s=0.0)
    try:
        first.close()  # the server stops; the client has not noticed yet
        with pytest.raises(RpcError, match="stopped"):  # it sends, then gives up at once
            c.call(OP_ADD, struct.pack("<qq", 1, 2), timeout=30)
        runs: list[bytes] = []
        second = _counting_server(pool, runs)
        try:
            assert second.refused_pending == 1  # found at adoption, answered unrun
            second.start_thread()
            assert add(c, 2, 2) == 4  # its own answer, not the abandoned request's
        finally:
            second.close()
        assert runs == [struct.pack("<qq", 2, 2)] and first_runs == []
    finally:
        c.close()


def test_a_call_waiting_through_a_replaced_server_runs_once_on_the_new_one(pool: Pool) -> None:
    """The call in flight is sent again when its new server refuses it RESTARTED: it gets its
    answer, and the request ran exactly once, on the server that answered."""
    first_runs: list[bytes] = []
    first = _counting_server(pool, first_runs)
    c = connect(first, pool, restart_grace_s=60)
    result: list[object] = []
    errors: list[BaseException] = []
    submitted = c.ring.next_seq
    caller = start(lambda: result.append(add(c, 20, 22)), errors)
    try:
        wait_until(lambda: c.ring.next_seq != submitted, "the call submitting its request")
        first.close()
        runs: list[bytes] = []
        second = _counting_server(pool, runs)
        try:
            assert second.refused_pending == 1
            second.start_thread()
            caller.join(30)
            assert not errors and result == [42]
            assert runs == [struct.pack("<qq", 20, 22)] and first_runs == []
            many = c.call_many([(OP_ADD, struct.pack("<qq", i, i)) for i in range(40)])
            assert [struct.unpack("<q", m)[0] for m in many] == [2 * i for i in range(40)]
        finally:
            second.close()
    finally:
        caller.join(30)
        c.close()


def test_recover_head_resumes_at_the_oldest_unanswered_request() -> None:
    """A restarted server reads the slot lines of its generation: what is unanswered is next."""
    depth, gen = 4, 7
    ring_bytes = _core.RPC_HEAD + 2 * depth * LINE + 2 * depth * LINE
    mem = Memory(bytearray(ring_bytes))
    server = _core.RingServer(mem, 0, ring_bytes, 1)

    def put(line_of: Callable[[int, int], int], seq: int, ring_gen: int = gen) -> None:
        mem.store(line_of(depth, (seq - 1) % depth), Message(seq, 0, 0, 0, ring_gen, b"", 0).pack())

    try:
        assert server.recover_head(0, gen, depth, 5) == 5  # nothing sent yet: the first seq
        put(request_line, 1)
        put(response_line, 1)
        assert server.recover_head(0, gen, depth, 1) == 2  # all answered: after the newest
        put(request_line, 2)
        put(request_line, 3)
        put(response_line, 3)
        put(response_line, 2, gen + 1)  # an answer of another generation answers nothing
        assert server.recover_head(0, gen, depth, 1) == 2
        mem.store(request_line(depth, 1) + 8, b"\xff")  # request 2 torn: not a request
        assert server.recover_head(0, gen, depth, 1) == 4
        assert server.recover_head(0, gen + 1, depth, 9) == 9  # no request of that generation
    finally:
        mem.release()


def test_timeout_makes_the_client_unusable_not_hung(pool: Pool) -> None:
    with rpc_server(pool.spec), RpcClient(pool) as c:
        with pytest.raises(RpcError, match=r"did not answer within 0\.2"):
            c.call(OP_SLOW, b"1.0", timeout=0.2)
        with pytest.raises(RpcError, match="unusable"):
            c.call(1, b"")


def _doomed_client(spec: str, started: mp.Event) -> None:
    with Pool.attach(spec) as pool:
        c = RpcClient(pool, depth=4)
        c.ring.submit_many([(OP_SLOW, b"0.001")] * 3)  # requests in flight, never collected
        started.set()
        time.sleep(60)  # killed here: mid-request


def test_a_killed_client_is_reclaimed_and_others_keep_going(pool: Pool) -> None:
    with rpc_server(pool.spec) as (_, gone), RpcClient(pool) as survivor:
        started = CTX.Event()
        doomed = CTX.Process(target=_doomed_client, args=(pool.spec, started))
        doomed.start()
        assert started.wait(30)
        dead_host = next(e.host_id for e in pool.hosts.entries() if e.pid == doomed.pid)
        os.kill(doomed.pid, signal.SIGKILL)  # with three requests in flight
        doomed.join(10)
        assert gone.get(timeout=10) == dead_host
        assert add(survivor, 3, 4) == 7
        with RpcClient(pool, host_id=dead_host) as heir:  # the id is free again
            assert heir.entry.generation > 1 and add(heir, 1, 1) == 2


def test_in_process_server_and_hostile_lines(pool: Pool) -> None:
    """A rogue host writes lines into a live ring; the server answers errors and carries on."""
    server = RpcServer.open(pool, handlers(), refresh_s=0.02)
    server.start_thread()
    try:
        with Pool.attach(pool.spec) as other, RpcClient(other, depth=4) as c:
            assert add(c, 1, 1) == 2
            base = ring_offset(pool.superblock, c.host_id)
            rogue = attach(pool.mapping.buffer, "native")
            seq, gen, depth, ool = c.ring.next_seq, c.entry.generation, 4, _core.RPC_OOL
            cases = [
                ({"code": 777}, Status.UNKNOWN_OP),
                ({"length": _core.RPC_INLINE + 1}, Status.BAD_LENGTH),
                ({"flags": ool, "length": buf_size(pool.superblock, depth) + 1}, Status.BAD_LENGTH),
                ({"flags": ool, "length": 100, "payload_crc": 1}, Status.CORRUPT),
            ]
            try:
                for fields, status in cases:
                    bad = Message(
                        **{
                            "seq": seq,
                            "code": 1,
                            "flags": 0,
                            "length": 3,
                            "gen": gen,
                            "inline": b"abc",
                            "payload_crc": 0,
                            **fields,
                        }
                    )
                    slot = (seq - 1) % depth
                    write_line(rogue, base + request_line(depth, slot), bad.pack())
                    deadline = time.monotonic() + 5
                    while True:
                        resp = Message.unpack(
                            read_line(pool.memory, base + response_line(depth, slot))
                        )
                        if resp and resp.seq == seq:
                            break
                        assert time.monotonic() < deadline, f"no error response to {bad}"
                    assert resp.code == status
                    seq += 1
            finally:
                rogue.release()
    finally:
        server.close()
    assert server.rings.rejected >= 3


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.integers(0, 7), st.binary(min_size=LINE, max_size=LINE)),
        min_size=1,
        max_size=8,
    )
)
def test_random_bytes_in_slots_never_stop_the_server(pool: Pool, junk: list) -> None:
    server = RpcServer.open(pool, handlers(), refresh_s=0.02)
    server.start_thread()
    try:
        with Pool.attach(pool.spec) as other, RpcClient(other, depth=8) as c:
            base = ring_offset(pool.superblock, c.host_id)
            rogue = attach(pool.mapping.buffer, "native")
            try:
                for slot, line in junk:
                    write_line(rogue, base + request_line(8, slot), line)
            finally:
                rogue.release()
            for i in range(10):
                assert add(c, i, i) == 2 * i
    finally:
        server.close()


def test_a_ring_control_line_is_its_fields_padded_then_their_crc32c() -> None:
    """The byte format of a ring control line, built here by hand: it must never change."""
    ctl = RingControl(host_id=2, gen=5, depth=16, pid=4321, first_seq=9, created_ns=10**18)
    body = struct.pack("<IIIIIIQ", RING_MAGIC, 2, 5, 16, 4321, 9, 10**18).ljust(60, b"\0")
    line = body + struct.pack("<I", crc32c_reference(body))
    assert ctl.pack() == line and RingControl.unpack(line) == ctl
    assert RingControl.unpack(bytes(60) + line[60:]) is None


def test_out_of_line_payloads_lie_in_the_slot_buffers_the_protocol_names(pool: Pool) -> None:
    """request_buffer / response_buffer (what chaos aims its hostile bytes at) are where the
    C core really puts a slot's out-of-line payloads."""
    server = RpcServer.open(pool, handlers(), refresh_s=0.02)
    server.start_thread()
    try:
        with RpcClient(pool, depth=4) as c:
            sb, base = pool.superblock, ring_offset(pool.superblock, c.host_id)
            for _ in range(5):  # every slot, and one reused
                slot, payload = (c.ring.next_seq - 1) % 4, os.urandom(c.max_payload)
                assert c.call(Op.ECHO, payload) == payload
                sent = pool.memory.load(base + request_buffer(sb, 4, slot), len(payload))
                answer = pool.memory.load(base + response_buffer(sb, 4, slot), len(payload))
                assert sent == payload and answer == payload
            assert response_buffer(sb, 4, 3) + buf_size(sb, 4) <= sb.rpc_bytes_per_host
            assert request_buffer(sb, 4, 0) == response_line(4, 3) + LINE
    finally:
        server.close()
    with pytest.raises(ValueError, match="slot < depth"):
        request_buffer(pool.superblock, 4, 4)
