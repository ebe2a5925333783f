"""``beluga bench rpc``: the slot RPC beside loopback TCP and Unix-socket RPC.

Every transport echoes a 64-byte message (the slot RPC: one cache line, 32
payload bytes inline) between this process and a server process:

slot-c       the pool's rings, answered by the C echo loop (transport alone)
slot-python  the pool's rings, answered by a Python handler through RpcServer
tcp          a loopback TCP socket (TCP_NODELAY), echo server in Python
unix         a Unix domain stream socket, echo server in Python

Round trips are timed per call from Python (p50/p99); throughput keeps
``depth`` requests in flight (pipelined writes for sockets, ``RingClient.pump``
for the rings).  Transports take turns in short rounds, so that the load of
a shared machine falls on all of them alike; figures from a busy machine are
still noisy, which is why every run carries its own TCP baseline.

``contended=N`` measures everything twice: quiet, then again while N CPU-hog
processes burn a core each (inference hosts run their cores hot), and reports
both in one document, with the targets: slot RPC no slower than loopback TCP
under the same hogs, and a quiet slot round trip of at most 1.9 µs p50.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from beluga.bench.stats import summarize, time_calls
from beluga.child import server_process
from beluga.pool import Pool
from beluga.rpc import Op, RpcClient, RpcServer
from beluga.signals import stop_on_signals

MESSAGE = 64
PAYLOAD = b"x" * 32
DEPTHS = [1, 8, 32, 128]
ROUNDS = 5  # transports take turns this many times per measurement
QUIET_P50_TARGET_US = 1.9
HOG_LIMIT_S = 3600.0  # a hog whose parent vanished without stopping it ends by itself
_CTX = mp.get_context("fork")


def ring_server(spec: str, mode: str, ready: Any) -> None:
    with Pool.attach(spec) as pool, stop_on_signals() as stopping:
        server = RpcServer.open(pool, stopping=stopping)  # SIGTERM only raises the flag
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


class _Echo(Protocol):
    """One transport's client end: a timed round trip, and ``depth`` in flight for a while."""

    def round_trip(self) -> None: ...

    def stream(self, depth: int, seconds: float) -> int: ...


class _SocketEcho:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.msg = bytes(MESSAGE)
        self.back = memoryview(bytearray(MESSAGE * max(DEPTHS)))

    def round_trip(self) -> None:
        self.sock.sendall(self.msg)
        _recv_exactly(self.sock, self.back[:MESSAGE])

    def stream(self, depth: int, seconds: float) -> int:
        batch, done = self.msg * depth, 0
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            self.sock.sendall(batch)
            _recv_exactly(self.sock, self.back[: MESSAGE * depth])
            done += depth
        return done


class _RingEcho:
    def __init__(self, client: RpcClient) -> None:
        self.client = client

    def round_trip(self) -> None:
        self.client.call(Op.ECHO, PAYLOAD)

    def stream(self, depth: int, seconds: float) -> int:
        return int(self.client.ring.pump(Op.ECHO, PAYLOAD, depth, seconds))


@contextmanager
def _socket_echo(family: int, address: Any) -> Iterator[_Echo]:
    with server_process(_socket_server, family, address), socket.socket(family) as sock:
        sock.settimeout(30)
        sock.connect(address)
        if family == socket.AF_INET:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        yield _SocketEcho(sock)


@contextmanager
def _ring_echo(pool: Pool, mode: str) -> Iterator[_Echo]:
    with server_process(ring_server, pool.spec, mode), RpcClient(pool, depth=max(DEPTHS)) as client:
        yield _RingEcho(client)


class _Tally:
    """Samples of one transport, gathered over interleaved rounds."""

    def __init__(self) -> None:
        self.rtt_ns: list[int] = []
        self.done = dict.fromkeys(DEPTHS, 0)
        self.seconds = dict.fromkeys(DEPTHS, 0.0)

    def measure(self, echo: _Echo, iterations: int, duration: float) -> None:
        self.rtt_ns += time_calls(echo.round_trip, iterations)
        for depth in DEPTHS:
            start = time.perf_counter()
            self.done[depth] += echo.stream(depth, duration)
            self.seconds[depth] += time.perf_counter() - start

    def figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rtt": summarize(self.rtt_ns)}
        for depth in DEPTHS:
            out[f"mops.depth{depth}"] = self.done[depth] / self.seconds[depth] / 1e6
        return out


def _burn(parent: int, limit_s: float) -> None:
    """Child process: keep one core busy until killed, orphaned, or limit_s passed."""
    end = time.monotonic() + limit_s
    while os.getppid() == parent and time.monotonic() < end:
        for _ in range(100_000):
            pass


@contextmanager
def cpu_hogs(n: int, limit_s: float = HOG_LIMIT_S) -> Iterator[list[int]]:
    """``n`` processes burning a core each while the context runs; all stopped after."""
    hogs = [_CTX.Process(target=_burn, args=(os.getpid(), limit_s), daemon=True) for _ in range(n)]
    try:
        for h in hogs:
            h.start()
        yield [h.pid for h in hogs if h.pid is not None]
    finally:
        for h in hogs:
            if h.pid is not None and h.is_alive():
                h.kill()
        for h in hogs:
            if h.pid is not None:
                h.join()


def _measure(pool: Pool, iterations: int, duration: float) -> dict[str, dict[str, Any]]:
    """Every transport, under whatever load the machine has now.

    Transports take turns in ``ROUNDS`` short rounds rather than one after
    the other, so that a change in the machine's load (other users, the
    hypervisor) falls on all of them alike.  The two slot servers cannot
    serve one pool at once: each has its phase, and the sockets (whose
    servers stay up throughout) take turns with both.
    """
    tallies = {name: _Tally() for name in ("slot-c", "slot-python", "tcp", "unix")}
    per_round = max(1, iterations // ROUNDS)
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="beluga-bench-"))
        sockets = {
            "tcp": stack.enter_context(_socket_echo(socket.AF_INET, ("127.0.0.1", _free_port()))),
            "unix": stack.enter_context(
                _socket_echo(socket.AF_UNIX, os.path.join(tmp, "echo.sock"))
            ),
        }
        for mode in ("c", "python"):
            with _ring_echo(pool, mode) as ring:
                turns = {f"slot-{mode}": (ring, 1.0), **{n: (e, 0.5) for n, e in sockets.items()}}
                for _ in range(ROUNDS):
                    for name, (echo, share) in turns.items():
                        tallies[name].measure(
                            echo, max(1, int(per_round * share)), duration * share / ROUNDS
                        )
    return {name: t.figures() for name, t in tallies.items()}


def _rows(transports: dict[str, dict[str, Any]], load: str) -> list[dict[str, Any]]:
    tcp_p50 = transports["tcp"]["rtt"]["p50_us"]
    rows = []
    for name, t in transports.items():
        row = {
            "load": load,
            "transport": name,
            "rtt_p50_us": t["rtt"]["p50_us"],
            "rtt_p99_us": t["rtt"]["p99_us"],
            "vs_tcp": tcp_p50 / t["rtt"]["p50_us"],
        }
        for depth in DEPTHS:
            row[f"mops_d{depth}"] = t[f"mops.depth{depth}"]
        rows.append(row)
    return rows


def _targets(quiet: list[dict[str, Any]], contended: list[dict[str, Any]]) -> dict[str, bool]:
    """The issue's targets, judged on this run's own figures."""
    out = {
        "quiet_slot_c_p50_ok": next(r for r in quiet if r["transport"] == "slot-c")["rtt_p50_us"]
        <= QUIET_P50_TARGET_US
    }
    if contended:
        by = {r["transport"]: r for r in contended}
        for slot in ("slot-c", "slot-python"):
            for p in ("p50", "p99"):
                key = f"rtt_{p}_us"
                out[f"contended_{slot}_{p}_vs_tcp_ok"] = by[slot][key] <= by["tcp"][key]
    return out


def run(
    pool: Pool, iterations: int = 20000, duration: float = 0.5, contended: int = 0
) -> dict[str, Any]:
    """Measure every transport (quiet, then under ``contended`` CPU hogs); rows and figures."""
    if contended < 0:
        raise ValueError(f"contended must be >= 0 CPU hogs, not {contended}")
    quiet = _rows(_measure(pool, iterations, duration), "quiet")
    loaded: list[dict[str, Any]] = []
    if contended:
        with cpu_hogs(contended):
            loaded = _rows(_measure(pool, iterations, duration), f"{contended} hogs")
    figures = {}
    for prefix, rows in (("rpc", quiet), ("rpc.contended", loaded)):
        for row in rows:
            for key, value in row.items():
                if key not in ("load", "transport"):
                    figures[f"{prefix}.{row['transport']}.{key}"] = value
    return {
        "rows": quiet + loaded,
        "figures": figures,
        "contended": contended,
        "targets": _targets(quiet, loaded),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COLUMNS = [
    ("load", "load"),
    ("transport", "transport"),
    ("rtt_p50_us", "RTT p50 µs"),
    ("rtt_p99_us", "RTT p99 µs"),
    ("vs_tcp", "faster than tcp"),
    *((f"mops_d{d}", f"Mops d={d}") for d in DEPTHS),
]
