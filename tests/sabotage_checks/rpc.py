"""RPC rings (rpc.c): round trips through reused slots, and sweeps inside a request
and a response."""

from __future__ import annotations

import random

from beluga import litmus
from beluga._native import _core
from beluga.coherence import Memory, ModelConfig
from beluga.litmus import Seen
from tests.sabotage_checks.base import SEEDS, Violation, _host, _window_seen

AREA, RING, DEPTH, GEN = 64 << 10, 64 << 10, 2, 1


def _ring_pair(client_mem: Memory, server_mem: Memory) -> tuple:
    """A client's ring (two slots) and a server that serves it, on two hosts."""
    client = _core.RingClient(client_mem, AREA, RING, DEPTH, GEN)
    server = _core.RingServer(server_mem, AREA, RING, 1)
    server.set_ring(0, GEN, DEPTH, 1)
    return client, server


def _payload(i: int) -> bytes:
    """Alternately out of line and inline, each different."""
    rng = random.Random(i)
    return rng.randbytes(rng.choice([300, 1999, 7, 40, 777]) if i % 3 else 41 + i)


def rpc_ring_round_trips(model: ModelConfig) -> None:
    """Requests and responses through reused slots, out of line and inline: exact both ways."""
    shared = bytearray(AREA + RING)
    client, server = _ring_pair(_host(shared, model, 1), _host(shared, model, 2))
    for i in range(12):
        request, reply = _payload(i), _payload(100 + i)
        seq = client.submit_many([(7, request)])
        got = server.poll(4, 0.0)
        if got != [(0, seq, 7, request)] or server.rejected:
            raise Violation(f"call {i}: the server saw {got!r:.80} ({server.rejected} rejected)")
        server.respond([(0, seq, 0, reply)])
        done = client.complete(1, 0.0)
        if done != [(0, reply)]:
            raise Violation(f"call {i}: the client got {done!r:.80}")


def rpc_payload_sweep(model: ModelConfig) -> None:
    """Every state inside a request and a response: a line never lands before its payload."""
    request, reply = _payload(1), _payload(2)

    def attempt(k: int | None, seed: int, side: str) -> tuple[Seen, int]:
        shared = bytearray(AREA + RING)
        cm, sm = _host(shared, model, seed), _host(shared, model, seed + 1)
        client, server = _ring_pair(cm, sm)
        writer = cm if side == "request" else sm
        if side == "response":
            client.submit_many([(7, request)])
            server.poll(4, 0.0)
        before = writer.model_stats()["landed"]
        if k is not None:
            writer.crash_after(k)
        if side == "request":
            client.submit_many([(7, request)])
        else:
            server.respond([(0, 1, 0, reply)])
        landed = writer.model_stats()["landed"] - before
        if side == "response":
            done = client.complete(1, 0.0)
            if done not in ([], [(0, reply)]):
                return Seen.WRONG, landed
            return (Seen.RIGHT if done else Seen.NOTHING), landed
        fresh = _core.RingServer(_host(shared, model, seed + 2), AREA, RING, 1)
        fresh.set_ring(0, GEN, DEPTH, 1)
        got = fresh.poll(4, 0.0)
        if fresh.rejected or got not in ([], [(0, 1, 7, request)]):
            return Seen.WRONG, landed
        return (Seen.RIGHT if got else Seen.NOTHING), landed

    for side in ("request", "response"):
        for seed in SEEDS:
            r = litmus.sweep_crashes(lambda k, s=seed, w=side: attempt(k, s, w), name=side)
            if r.caught:
                raise Violation(
                    f"a {side} line landed before its out-of-line payload (seed {seed})"
                )
            _window_seen(r)
