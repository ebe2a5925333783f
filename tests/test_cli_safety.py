"""Operator safety (issue 23): no command destroys what is not a Beluga pool or is in use.

Each of the issue's reproductions is a test here, on temporary files only:
destroy of a text file and of a random file, destroy and ``create --force``
of a served pool (with an acknowledged value), destroy of a missing pool,
``serve`` of a file that is not a pool; and a server whose pool is
unlinked, replaced or reformatted under it exits non-zero while its client
is told the pool changed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from beluga.errors import RpcError
from beluga.kv.store import KVStore
from beluga.pool import Pool
from beluga.units import MiB
from tests.conftest import SMALL

BELUGA = [sys.executable, "-m", "beluga"]
WAIT_S = 30.0  # bound of every wait below; none is a timed assert


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*BELUGA, *args], capture_output=True, text=True, timeout=120)


def _seat_pid(spec: str) -> int:
    with Pool.attach(spec) as p:
        seat = p.hosts.seat()
    return seat.identity.pid if seat is not None and seat.epoch else 0


@contextmanager
def served(spec: str) -> Iterator[subprocess.Popen[str]]:
    """``beluga serve`` in a child until it sits in the seat; killed afterwards if still up."""
    proc = subprocess.Popen([*BELUGA, "serve", "--pool", spec], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while _seat_pid(spec) != proc.pid:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the server took no seat"
            time.sleep(0.02)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=WAIT_S)


def _bytes_of(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture
def text_file(shm_path: str) -> str:
    with open(shm_path, "w") as f:
        f.write("root:x:0:0:root:/root:/bin/bash\n" * 40)  # a passwd-like file of our own
    return shm_path


@pytest.mark.parametrize("kind", ["text", "random"])
@pytest.mark.parametrize("command", [["pool", "destroy"], ["pool", "create", "--force"]])
def test_a_file_that_is_not_a_pool_is_left_alone(
    shm_path: str, kind: str, command: list[str]
) -> None:
    with open(shm_path, "wb") as f:
        f.write(b"just some notes\n" * 100 if kind == "text" else os.urandom(8 * MiB))
    before = _bytes_of(shm_path)
    argv = [*command, "--pool", shm_path] + (["--size", "32M"] if "create" in command else [])
    r = run(*argv)
    assert r.returncode == 1, r
    assert "not a Beluga pool" in r.stderr and "left untouched" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr  # one line
    assert _bytes_of(shm_path) == before


def test_destroying_a_missing_pool_is_an_error(shm_path: str) -> None:
    r = run("pool", "destroy", "--pool", shm_path)
    assert r.returncode == 1 and "no pool at" in r.stderr and "destroyed" not in r.stdout
    assert not os.path.exists(shm_path)


def test_serving_a_file_that_is_not_a_pool_says_so(text_file: str) -> None:
    r = run("serve", "--pool", f"shm:{text_file}")
    assert r.returncode == 1 and "not a Beluga pool" in r.stderr, r.stderr
    assert "outside" not in r.stderr


@pytest.mark.parametrize("share", ["0", "1", "-0.5", "nan"])
def test_a_recovery_share_outside_0_1_is_refused_before_the_pool_is_touched(
    shm_path: str, share: str
) -> None:
    Pool.create(shm_path, 32 * MiB, geometry=SMALL).close()
    before = _bytes_of(shm_path)
    r = run("serve", "--pool", shm_path, "--recovery-share", share)
    assert r.returncode != 0 and "--recovery-share" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr  # one line
    assert _bytes_of(shm_path) == before  # no seat taken, nothing recovered


@pytest.mark.leaves("keys")
def test_a_served_pool_is_neither_destroyed_nor_reformatted(shm_path: str) -> None:
    Pool.create(shm_path, 32 * MiB, geometry=SMALL).close()
    with served(shm_path) as server:
        with KVStore(shm_path) as store:
            store.put("acknowledged", b"value" * 100)
        where = ["--pool", shm_path]
        for argv in (
            ["pool", "destroy", "--pool", shm_path],
            ["pool", "destroy", "--pool", shm_path, "--ignore-live-hosts"],
            ["pool", "create", "--force", "--size", "32M", "--pool", shm_path],
            ["pool", "create", "--force", "--ignore-live-hosts", "--size", "32M", *where],
        ):
            r = run(*argv)
            assert r.returncode == 1, (argv, r)
            assert f"pid {server.pid}" in r.stderr and "this machine" in r.stderr, r.stderr
        assert os.path.exists(shm_path) and server.poll() is None
        with KVStore(shm_path) as store:
            assert store.get("acknowledged") == b"value" * 100
            assert store.remove("acknowledged")
    assert run("pool", "destroy", "--pool", shm_path).returncode == 0


def test_live_hosts_refuse_unless_overridden(pool: Pool) -> None:
    from tests.conftest import serving

    with serving(pool) as server:
        store = KVStore(pool.spec)
    try:  # the server is gone; the client host still lives (this process)
        server.close()
        r = run("pool", "destroy", "--pool", pool.spec)
        assert r.returncode == 1, r
        assert f"host {store.rpc.host_id} (pid {os.getpid()} on this machine)" in r.stderr
        assert "--ignore-live-hosts" in r.stderr and os.path.exists(pool.spec.split(":", 1)[1])
        r = run("pool", "destroy", "--pool", pool.spec, "--ignore-live-hosts")
        assert r.returncode == 0 and "destroyed" in r.stdout, r
    finally:
        store.close()


@pytest.mark.parametrize("change", ["unlinked", "replaced", "reformatted"])
def test_a_server_whose_pool_changes_exits_and_its_clients_are_told(
    shm_path: str, tmp_path: object, change: str
) -> None:
    if change == "reformatted":  # a device is formatted in place: a dax stand-in file
        dev = os.path.join(str(tmp_path), "dax")
        with open(dev, "wb") as f:
            f.truncate(32 * MiB)
        spec = f"dax:{dev}"
    else:
        spec = shm_path
    Pool.create(spec, 32 * MiB, geometry=SMALL).close()
    with served(spec) as server, KVStore(spec, timeout=WAIT_S) as store:
        store.put("before", b"x" * 64)
        assert store.remove("before")
        if change == "unlinked":
            os.unlink(shm_path)
        elif change == "replaced":
            Pool.create(shm_path + ".new", 32 * MiB, geometry=SMALL).close()
            os.replace(shm_path + ".new", shm_path)
        else:
            Pool.create(spec, 32 * MiB, geometry=SMALL, force=True).close()  # unguarded API
        _, err = server.communicate(timeout=WAIT_S)
        assert server.returncode == 1, err
        assert "the pool changed under this process" in err and change[:5] in err, err
        with pytest.raises(RpcError, match="the pool changed under this client"):
            store.put("after", b"y" * 64)
    if change == "reformatted":
        Pool.destroy(spec)


def test_dax_destroy_clears_only_a_pool_and_refuses_other_bytes(tmp_path: object) -> None:
    dev = os.path.join(str(tmp_path), "dax")
    junk = os.urandom(4 * MiB)
    with open(dev, "wb") as f:
        f.write(junk)
    r = run("pool", "destroy", "--pool", f"dax:{dev}")
    assert r.returncode == 1 and "not a Beluga pool" in r.stderr, r
    assert _bytes_of(dev) == junk
    r = run("pool", "create", "--force", "--size", "4M", "--pool", f"dax:{dev}")
    assert r.returncode == 1 and "not a Beluga pool" in r.stderr, r
    assert _bytes_of(dev) == junk
    with open(dev, "wb") as f:
        f.truncate(32 * MiB)
    Pool.create(f"dax:{dev}", 32 * MiB, geometry=SMALL).close()
    with served(f"dax:{dev}") as server:
        r = run("pool", "destroy", "--pool", f"dax:{dev}", "--ignore-live-hosts")
        assert r.returncode == 1 and f"pid {server.pid}" in r.stderr, r
    assert run("pool", "destroy", "--pool", f"dax:{dev}").returncode == 0
    assert run("pool", "destroy", "--pool", f"dax:{dev}").returncode == 1  # no pool any more
