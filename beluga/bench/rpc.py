"""``beluga bench rpc``: the slot RPC beside loopback TCP and Unix-socket RPC.

Every transport echoes a 64-byte message (the slot RPC: one cache line, 32
payload bytes inline) between this process and a server process:

slot-c       the pool's rings, answered by the C echo loop (transport alone)
slot-python  the pool's rings, answered by a Python handler through RpcServer
tcp          a loopback TCP socket (TCP_NODELAY), echo server in Python
unix         a Unix domain stream socket, echo server in Python

Round trips are timed per call from Python (p50/p99); throughput keeps
``depth`` requests in flight (pipelined writes for sockets, ``RingClient.pump``
for the rings).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import tempfile
import time
from typing import Any

from beluga.bench.stats import summarize, time_calls
from beluga.child import server_process
from beluga.pool import Pool
from beluga.rpc import Op, RpcClient, RpcServer

MESSAGE = 64
PAYLOAD = b"x" * 32
DEPTHS = [1, 8, 32, 128]
_CTX = mp.get_context("fork")


def ring_server(spec: str, mode: str, ready: Any) -> None:
    with Pool.attach(spec) as pool:
        server = RpcServer(pool, idle_after_s=3600)
        signal.signal(signal.SIGTERM, lambda *_: server.stop())
        ready.set()
        if mode == "c":
            server.serve_echo(3600)
        else:
            server.serve_forever()
        server.close()


def _socket_server(family: int, address: Any, ready: Any) -> None:
    with socket.socket(family, socket.SOCK_STREAM) as listener:
        listener.bind(address)
        listener.listen(1)
        ready.set()
        conn, _ = listener.accept()
        with conn:
            if family == socket.AF_INET:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buf = bytearray(MESSAGE * 256)
            while n := conn.recv_into(buf):
                conn.sendall(memoryview(buf)[:n])


def _recv_exactly(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if not n:
            raise ConnectionError("echo server closed the connection")
        got += n


def _socket_figures(family: int, address: Any, iterations: int, duration: float) -> dict[str, Any]:
    with server_process(_socket_server, family, address), socket.socket(family) as sock:
        sock.settimeout(30)
        sock.connect(address)
        if family == socket.AF_INET:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg = bytes(MESSAGE)
        back = memoryview(bytearray(MESSAGE * max(DEPTHS)))

        def round_trip() -> None:
            sock.sendall(msg)
            _recv_exactly(sock, back[:MESSAGE])

        out: dict[str, Any] = {"rtt": summarize(time_calls(round_trip, iterations))}
        for depth in DEPTHS:
            batch = msg * depth
            done, end = 0, time.perf_counter() + duration
            start = time.perf_counter()
            while time.perf_counter() < end:
                sock.sendall(batch)
                _recv_exactly(sock, back[: MESSAGE * depth])
                done += depth
            out[f"mops.depth{depth}"] = done / (time.perf_counter() - start) / 1e6
        return out


def _ring_figures(pool: Pool, mode: str, iterations: int, duration: float) -> dict[str, Any]:
    with server_process(ring_server, pool.spec, mode), RpcClient(pool, depth=max(DEPTHS)) as client:
        out: dict[str, Any] = {
            "rtt": summarize(time_calls(lambda: client.call(Op.ECHO, PAYLOAD), iterations))
        }
        for depth in DEPTHS:
            out[f"mops.depth{depth}"] = client.ring.pump(Op.ECHO, PAYLOAD, depth, duration) / (
                duration * 1e6
            )
        return out


def run(pool: Pool, iterations: int = 20000, duration: float = 0.5) -> dict[str, Any]:
    """Measure every transport; returns rows and named figures."""
    transports: dict[str, dict[str, Any]] = {
        "slot-c": _ring_figures(pool, "c", iterations, duration),
        "slot-python": _ring_figures(pool, "python", iterations, duration),
        "tcp": _socket_figures(socket.AF_INET, ("127.0.0.1", _free_port()), iterations, duration),
    }
    with tempfile.TemporaryDirectory(prefix="beluga-bench-") as tmp:
        transports["unix"] = _socket_figures(
            socket.AF_UNIX, os.path.join(tmp, "echo.sock"), iterations, duration
        )
    rows, figures = [], {}
    tcp_p50 = transports["tcp"]["rtt"]["p50_us"]
    for name, t in transports.items():
        row = {
            "transport": name,
            "rtt_p50_us": t["rtt"]["p50_us"],
            "rtt_p99_us": t["rtt"]["p99_us"],
            "vs_tcp": tcp_p50 / t["rtt"]["p50_us"],
        }
        for depth in DEPTHS:
            row[f"mops_d{depth}"] = t[f"mops.depth{depth}"]
        rows.append(row)
        for key, value in row.items():
            if key != "transport":
                figures[f"rpc.{name}.{key}"] = value
    return {"rows": rows, "figures": figures}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COLUMNS = [
    ("transport", "transport"),
    ("rtt_p50_us", "RTT p50 µs"),
    ("rtt_p99_us", "RTT p99 µs"),
    ("vs_tcp", "faster than tcp"),
    *((f"mops_d{d}", f"Mops d={d}") for d in DEPTHS),
]
