"""A client stopped between the stores of one request line (issue 23).

The server once answered a request line whose CRC still failed after 1 ms
as corrupt, so a client descheduled mid-line on a busy host had a healthy
put refused.  Here the test plays that client exactly: it writes the first
half of the next request line of a real client's ring (sequence and
generation included, so the server sees a torn line at the ring's head),
keeps the server busy with another client for far longer than 1 ms, then
writes the rest.  Under the model the halves are non-temporal stores made
visible by a fence each, as a descheduled writer's would be.
"""

from __future__ import annotations

import time

import pytest

from beluga.coherence import attach, read_line
from beluga.pool import Pool
from beluga.rpc import RpcClient, RpcServer
from beluga.rpc.protocol import Message, Op, Status, request_line, response_line, ring_offset
from tests.rpc_util import wait_until

HALF = 32  # seq, op, flags, length, generation and some payload: the CRC is in the rest
AWAY_S = 0.05  # the paused client is away at least this long: 50 times the old deadline


def _echo_line(seq: int, gen: int) -> bytes:
    return Message(seq, int(Op.ECHO), 0, 5, gen, b"hello", 0).pack()


@pytest.mark.parametrize("mode", ["native", "model"])
def test_a_client_paused_mid_line_is_served_when_it_resumes(pool: Pool, mode: str) -> None:
    with (
        Pool.attach(pool.spec, coherence=mode) as served,
        RpcServer.open(served, refresh_s=0.02) as server,
    ):
        server.start_thread()
        with (
            Pool.attach(pool.spec, coherence=mode) as host,
            RpcClient(host, depth=4) as paused,
            RpcClient(host, depth=4) as busy,
        ):
            assert paused.call(Op.ECHO, b"warm") == b"warm"
            seq, gen = paused.ring.next_seq, paused.entry.generation
            slot = (seq - 1) % 4
            base = ring_offset(pool.superblock, paused.host_id)
            req, resp = base + request_line(4, slot), base + response_line(4, slot)
            line = _echo_line(seq, gen)
            writer = attach(pool.mapping.buffer, mode)
            try:
                writer.nt_store(req, line[:HALF])
                writer.sfence()  # the first stores are out; then the client is descheduled
                away = time.monotonic()
                calls = 0
                while calls < 200 or time.monotonic() - away < AWAY_S:
                    assert busy.call(Op.ECHO, b"x") == b"x"  # the server scans every ring
                    calls += 1
                early = Message.unpack(read_line(pool.memory, resp))
                assert early is None or early.seq != seq, f"answered a torn line: {early}"
                writer.nt_store(req + HALF, line[HALF:])  # the client resumes
                writer.sfence()
            finally:
                writer.release()

            def answered() -> bool:
                m = Message.unpack(read_line(pool.memory, resp))
                return m is not None and m.seq == seq

            wait_until(answered, "the resumed request's answer")
            m = Message.unpack(read_line(pool.memory, resp))
            assert m is not None and m.code == Status.OK and m.inline[: m.length] == b"hello"
            assert server.rings.rejected == 0


def test_a_line_torn_past_the_patience_is_answered_corrupt(pool: Pool) -> None:
    with RpcServer.open(pool, refresh_s=0.02, torn_patience_s=0.2) as server:
        server.start_thread()
        assert server.rings.torn_patience_s == pytest.approx(0.2)
        with Pool.attach(pool.spec) as host, RpcClient(host, depth=4) as c:
            seq, gen = c.ring.next_seq, c.entry.generation
            base = ring_offset(pool.superblock, c.host_id)
            slot = (seq - 1) % 4
            writer = attach(pool.mapping.buffer, "native")
            try:
                writer.nt_store(base + request_line(4, slot), _echo_line(seq, gen)[:HALF])
                writer.sfence()  # and the client never comes back
            finally:
                writer.release()

            def answered() -> bool:
                m = Message.unpack(read_line(pool.memory, base + response_line(4, slot)))
                return m is not None and m.seq == seq

            wait_until(answered, "the corrupt answer")
            m = Message.unpack(read_line(pool.memory, base + response_line(4, slot)))
            assert m is not None and m.code == Status.CORRUPT
            assert server.rings.rejected == 1


def test_the_default_patience_is_the_documented_ten_seconds(pool: Pool) -> None:
    with RpcServer.open(pool) as server:
        assert server.rings.torn_patience_s == pytest.approx(10.0)
