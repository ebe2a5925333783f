"""The server's Prometheus endpoint, its logs, and ``beluga stats --watch``.

The end-to-end test runs ``beluga serve --metrics-port`` as a real process and
scrapes it over HTTP; the others run a MetadataServer in a thread of this
process (cheaper), with ``beluga stats`` in-process or as a child.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from prometheus_client.parser import text_string_to_metric_families

from beluga import KVStore
from beluga.cli import build_parser, main
from beluga.errors import BelugaError
from beluga.pool import Geometry, Pool
from beluga.server import MetadataServer, service
from beluga.server.metrics import INFO_FIELDS, STATS_METRICS

GEOMETRY = Geometry(max_hosts=4, rpc_bytes_per_host=64 << 10, block_size=16 << 10)
BELUGA = [sys.executable, "-m", "beluga"]
LOCAL = "127.0.0.1"


@pytest.fixture
def pool(shm_path: str) -> Iterator[Pool]:
    p = Pool.create(shm_path, 16 << 20, geometry=GEOMETRY)
    yield p
    p.close()
    Pool.destroy(shm_path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the endpoint: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample_name(field: str) -> str:
    kind, _ = STATS_METRICS[field]
    return f"beluga_{field}_total" if kind == "counter" else f"beluga_{field}"


@contextmanager
def serve_process(spec: str, port: int) -> Iterator[subprocess.Popen[str]]:
    """``beluga serve --metrics-port`` until SIGTERM; it must stop cleanly."""
    proc = subprocess.Popen(
        [*BELUGA, "serve", "--pool", spec, "--metrics-port", str(port), "--metrics-addr", LOCAL],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        lines = [proc.stderr.readline() for _ in range(2)]
        assert lines[0] == f"beluga serve: metrics on http://127.0.0.1:{port}/metrics\n", lines
        assert lines[1].startswith(f"beluga serve: {spec}: 0 keys recovered"), lines
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=30)
    assert proc.returncode == 0 and rest == "beluga serve: stopped\n", rest


@pytest.mark.leaves("keys")
def test_scrape_matches_stats_and_stops_with_the_server(pool: Pool) -> None:
    port = free_port()
    started = time.time()
    with serve_process(pool.spec, port) as proc, KVStore(pool.spec) as store:
        for i in range(20):
            store.put(f"k{i}", os.urandom(1000 + 100 * i))
        store.put_batch([f"b{i}" for i in range(8)], [b"v" * 5000] * 8)
        assert store.get("k3") is not None and store.get("missing") is None
        assert store.get_batch(["b1", "b2", "nope"])[2] is None
        assert store.remove("k0")
        stats = store.stats()
        samples = scrape(port)
        for field, value in stats.items():
            if field != "uptime_s" and not isinstance(value, str):
                assert samples[(sample_name(field), ())] == value, field
        assert stats["server_pid"] == proc.pid
        assert started - 1 <= stats["server_since_s"] <= time.time()
        info = {
            "server_host": socket.gethostname(),
            "server_pid": str(proc.pid),
            "server_since": stats["server_since"],
        }
        assert samples[("beluga_server_info", tuple(sorted(info.items())))] == 1
        assert stats["seats_taken"] == 1 and stats["takeovers"] == 0
        assert stats["puts"] == 28 and stats["hits"] >= 3 and stats["misses"] >= 2
        assert samples[("beluga_evictions_total", ())] == 0
        assert samples[("beluga_lease_expiries_total", ())] == 0
        assert 0 < samples[("beluga_recovery_seconds", ())] < 30
        assert 0 <= samples[("beluga_stats_age_seconds", ())] < 1
        assert samples[("process_resident_memory_bytes", ())] > 0
        for op in ("alloc", "commit", "remove", "stats"):
            labels = (("op", op),)
            n = samples[("beluga_rpc_requests_total", labels)]
            assert n >= 1 and samples[("beluga_rpc_errors_total", labels)] == 0, op
            assert samples[("beluga_rpc_handler_seconds_count", labels)] == n
            assert samples[("beluga_rpc_handler_seconds_bucket", (("le", "+Inf"), *labels))] == n
            assert samples[("beluga_rpc_handler_seconds_sum", labels)] > 0
        assert samples[("beluga_rpc_requests_total", (("op", "stats"),))] == 1
        assert scrape(port)[("beluga_rpc_requests_total", (("op", "stats"),))] == 1
    assert not port_open(port)


@contextmanager
def threaded_server(pool: Pool, **options: object) -> Iterator[MetadataServer]:
    server = MetadataServer(pool, refresh_s=0.01, **options)  # type: ignore[arg-type]
    server.start_thread()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.leaves("keys")
def test_only_the_server_thread_reads_the_service(pool: Pool) -> None:
    callers: list[str] = []
    server = MetadataServer(pool, refresh_s=0.01, metrics_port=0, metrics_addr="127.0.0.1")
    assert server.metrics is not None and server.metrics_port is not None

    def stats() -> dict[str, object]:
        callers.append(threading.current_thread().name)
        return server.service.stats()

    server.metrics._stats = stats
    port = server.metrics_port
    server.metrics.wait_s = 0.05
    stale = scrape(port)  # nobody ticks yet: the last snapshot, within wait_s
    assert stale[("beluga_keys", ())] == 0 and stale[("beluga_stats_age_seconds", ())] > 0
    server.start_thread()
    try:
        with KVStore(pool.spec) as store:
            store.put("a", b"x")
            assert scrape(port)[("beluga_keys", ())] == 1
    finally:
        server.close()
    assert callers and set(callers) == {"beluga-rpc"}, callers
    assert not port_open(port)
    server.close()  # twice is fine


def test_a_taken_port_fails_cleanly(pool: Pool) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BelugaError, match="--metrics-port"):
            MetadataServer(pool, metrics_port=port, metrics_addr="127.0.0.1")
    with threaded_server(pool):  # the failed one gave the server seat back
        pass


def test_every_stats_field_is_described(pool: Pool) -> None:
    with threaded_server(pool) as server:
        assert server.metrics is None  # no port, no endpoint (and no prometheus import needed)
        fields = set(server.service.stats())
    assert fields == set(STATS_METRICS) | set(INFO_FIELDS)
    assert not set(STATS_METRICS) & set(INFO_FIELDS)


def test_serve_defaults_come_from_the_service() -> None:
    args = build_parser().parse_args(["serve"])
    defaults = inspect.signature(service.MetadataService).parameters
    for option, param in [
        ("write_lease", "write_lease_s"),
        ("read_lease", "read_lease_s"),
        ("high_watermark", "high_watermark"),
        ("low_watermark", "low_watermark"),
    ]:
        assert getattr(args, option) == defaults[param].default, option
    assert args.metrics_port is None


def test_stats_watch_prints_each_period(pool: Pool, capsys: pytest.CaptureFixture[str]) -> None:
    with threaded_server(pool):
        assert main(["stats", "--pool", pool.spec, "--watch", "0.05", "--count", "2"]) == 0
        text = capsys.readouterr().out
        assert text.count("beluga stats: ") == 2 and text.count("    keys: 0") == 2
        assert "\x1b[" not in text  # not a terminal: tables one after another
        assert (
            main(["stats", "--pool", pool.spec, "--json", "--watch", "0.05", "--count", "3"]) == 0
        )
        docs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert len(docs) == 3 and all(d["keys"] == 0 for d in docs)


def _sigint_as_on_a_terminal() -> None:
    """In the child: SIGINT's default action, as a foreground command on a terminal has.  A
    shell without job control starts a background job (``cmd &``, as CI runners and nohup
    launches do) with SIGINT ignored, and a child would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_stats_watch_stops_on_ctrl_c(pool: Pool) -> None:
    with threaded_server(pool):
        proc = subprocess.Popen(
            [*BELUGA, "stats", "--pool", pool.spec, "--watch", "0.05"],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=_sigint_as_on_a_terminal,
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().startswith("beluga stats: ")
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--watch", "0"], "above 0"),
        (["--count", "2"], "--watch"),
    ],
)
def test_stats_watch_arguments(args: list[str], message: str) -> None:
    out = subprocess.run(
        [*BELUGA, "stats", "--pool", "/dev/shm/beluga-test-none", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and message in out.stderr


def test_serve_rejects_a_bad_port(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--pool", "/dev/shm/beluga-test-none", "--metrics-port", "70000"]) == 2
    assert "--metrics-port 70000" in capsys.readouterr().err
