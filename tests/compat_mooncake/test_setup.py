"""The Mooncake drop-in's set-up and life cycle: which pool, setup's forms, close, leases,
threads sharing a store, a forked child, the dummy client and Mooncake's teardown."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import threading
import time
from typing import Any

import pytest

from beluga.compat import mooncake as compat
from beluga.compat.mooncake import INVALID_PARAMS, MooncakeDistributedStore, core, pool_spec_for
from beluga.kv import KVStore
from beluga.pool import Pool
from tests.compat_mooncake.conftest import connect

CTX = mp.get_context("fork")


def test_the_pool_is_named_by_an_argument_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("BELUGA_POOL", raising=False)
    assert (
        pool_spec_for("http://127.0.0.1:8080/metadata", "127.0.0.1:50051") == "shm:/dev/shm/beluga"
    )
    monkeypatch.setenv("BELUGA_POOL", "shm:/dev/shm/from-env")
    assert pool_spec_for("P2PHANDSHAKE", "127.0.0.1:50051") == "shm:/dev/shm/from-env"
    assert pool_spec_for("beluga:shm:/dev/shm/meta", "127.0.0.1:50051") == "shm:/dev/shm/meta"
    assert pool_spec_for("beluga:shm:/dev/shm/meta", "beluga:dax:/dev/dax0.0") == "dax:/dev/dax0.0"
    assert pool_spec_for("beluga:", "") == "shm:/dev/shm/from-env"


def test_setup_forms_and_life_cycle(pool: Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    s = MooncakeDistributedStore()
    # before setup: Mooncake's "client is not initialized"
    assert s.put("k", b"v") == INVALID_PARAMS and s.get("k") == b""
    assert s.is_exist("k") == INVALID_PARAMS and s.get_tensor("k") is None
    assert s.register_buffer(4096, 10) == INVALID_PARAMS and s.remove_all() == INVALID_PARAMS
    assert s.health_check() == 1 and s.close() == 0
    monkeypatch.setenv("BELUGA_POOL", pool.spec)
    config = {"local_hostname": "node-a", "metadata_server": "P2PHANDSHAKE", "protocol": "rdma"}
    assert s.setup(config) == 0
    assert s.get_hostname().startswith("node-a:") and s.health_check() == 0  # Mooncake adds a port
    assert s.put("k", b"v") == 0 and s.get("k") == b"v"
    # setting up again reconnects; the pool keeps its values
    assert s.setup("node-b", "P2PHANDSHAKE", 0, 0, "tcp", "", "127.0.0.1:50051") == 0
    assert s.get("k") == b"v" and s.remove("k") == 0
    assert s.close() == 0 and s.close() == 0
    assert s.get("k") == b"" and s.put("k", b"v") == INVALID_PARAMS and s.health_check() == 1
    assert s.setup({"local_hostname": "x"}) == INVALID_PARAMS  # metadata_server is required
    assert s.setup("x", "P2PHANDSHAKE", 0, 0, "tcp", "", "m", tenant_id="other") == INVALID_PARAMS


def test_setup_on_a_missing_pool_fails_cleanly(shm_path: str) -> None:
    s = MooncakeDistributedStore()
    assert s.setup("localhost", f"beluga:{shm_path}", 0, 0, "tcp", "", "127.0.0.1:50051") < 0
    assert s.health_check() == 1 and s.close() == 0


# -- threads and processes ----------------------------------------------------------


def test_threads_share_one_store(store: MooncakeDistributedStore) -> None:
    errors: list[str] = []
    barrier = threading.Barrier(4)

    def worker(t: int) -> None:
        buf = (ctypes.c_ubyte * 4096)()
        ptr = ctypes.addressof(buf)
        if store.register_buffer(ptr, 4096) != 0:
            errors.append(f"thread {t}: register_buffer")
        barrier.wait()
        for i in range(40):
            key, value = f"t{t}/{i}", f"value {t} {i} ".encode() * 20
            checks = [
                store.put(key, value) == 0,
                store.get(key) == value,
                store.get_into(key, ptr, 4096) == len(value) and bytes(buf[: len(value)]) == value,
                store.is_exist(key) == 1,
                store.remove(key) == 0,
                store.get(key) == b"",
            ]
            if not all(checks):
                errors.append(f"thread {t} item {i}: {checks}")
        if store.unregister_buffer(ptr) != 0:
            errors.append(f"thread {t}: unregister_buffer")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []


def test_close_waits_for_calls_in_flight(pool: Pool) -> None:
    s = connect(pool)
    value = bytes(range(256)) * 400
    assert s.put("big", value) == 0
    stop, reading, errors = threading.Event(), threading.Event(), []

    def reader() -> None:
        while not stop.is_set():
            got = s.get("big")
            if got == value:
                reading.set()
            elif got != b"":
                errors.append(len(got))

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for th in threads:
        th.start()
    assert reading.wait(30)
    assert s.close() == 0  # while readers run: they see misses afterwards, never a crash
    stop.set()
    for th in threads:
        th.join()
    assert errors == []
    with KVStore(pool) as native:
        assert native.remove("big")


def test_close_stops_waiting_for_a_call_that_outlives_close_wait(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call stuck in flight (here: a get held inside the store's get_batch) does not hold close
    forever: after CLOSE_WAIT_S it closes under the call, which then fails cleanly."""
    s = connect(pool)
    assert s.put("held", b"v") == 0
    assert s._store is not None
    inside, release = threading.Event(), threading.Event()
    real_get = s._store.get_batch

    def held_get(*args: Any, **kwargs: Any) -> Any:
        inside.set()
        release.wait(60)
        return real_get(*args, **kwargs)

    monkeypatch.setattr(s._store, "get_batch", held_get)
    monkeypatch.setattr(core, "CLOSE_WAIT_S", 0.2)
    got: list[bytes] = []
    caller = threading.Thread(target=lambda: got.append(s.get("held")))
    caller.start()
    assert inside.wait(30)
    closer = threading.Thread(target=s.close)
    closer.start()
    closer.join(30)
    held = not release.is_set()
    release.set()
    caller.join(30)
    assert not closer.is_alive() and held  # close returned while the call was still held
    assert got == [b""]  # the held call ended with a miss on the closed store, not a crash
    with KVStore(pool) as native:
        assert native.remove("held")


def test_the_lease_is_the_environments_as_a_masters_flag_would_set_it(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BELUGA_MOONCAKE_LEASE_TTL_MS plays mooncake_master's --default_kv_lease_ttl: a key is
    cleared once that lease is past, and kept while the default 5 s lease runs."""
    monkeypatch.setenv(compat.LEASE_ENV, "100")
    short = connect(pool)
    monkeypatch.delenv(compat.LEASE_ENV)
    default = connect(pool)
    for s in (short, default):
        assert s.put(f"lease-{id(s)}", b"v") == 0
    time.sleep(0.3)  # past the short lease; far inside the default one
    assert short.batch_replica_clear([f"lease-{id(short)}"]) == [f"lease-{id(short)}"]
    assert default.batch_replica_clear([f"lease-{id(default)}"]) == []
    assert default.remove(f"lease-{id(default)}") == 0
    for bad in ("0", "-5", "soon"):
        monkeypatch.setenv(compat.LEASE_ENV, bad)
        refused = MooncakeDistributedStore()
        assert refused.setup("localhost", f"beluga:{pool.spec}", 0, 0, "tcp", "", "") == -600
    for s in (short, default):
        assert s.close() == 0


def _child_uses(store: MooncakeDistributedStore, spec: str, out: Any) -> None:
    inherited = (store.put("child", b"c"), store.get("parent"), store.close())
    own = MooncakeDistributedStore()
    assert own.setup("child", f"beluga:{spec}", 0, 0, "tcp", "", "") == 0
    mine = (own.get("parent"), own.put("child", b"c"), own.remove("child"))
    own.close()
    out.send((inherited, mine))


def test_a_forked_child_sets_up_its_own(store: MooncakeDistributedStore, pool: Pool) -> None:
    assert store.put("parent", b"p") == 0
    here, there = CTX.Pipe()
    child = CTX.Process(target=_child_uses, args=(store, pool.spec, there))
    child.start()
    inherited, mine = here.recv()
    child.join(30)
    assert child.exitcode == 0
    assert inherited == (INVALID_PARAMS, b"", 0)
    assert mine == (b"p", 0, 0)
    assert store.get("parent") == b"p" and store.is_exist("child") == 0  # parent still connected


def test_config_dict_sizes_parse_as_mooncakes(pool: Pool) -> None:
    from beluga.compat.mooncake import parse_size

    assert parse_size("16MB") == parse_size("16 MB") == 16 << 20
    assert parse_size("1 GiB") == 1 << 30
    assert parse_size(4096) == 4096
    assert parse_size("50%") is None
    config = {
        "local_hostname": "localhost",
        "metadata_server": f"beluga:{pool.spec}",
        "global_segment_size": "50%",
        "local_buffer_size": "16MB",
    }
    s = MooncakeDistributedStore()
    assert s.setup(config) == compat.INVALID_PARAMS
    config["global_segment_size"] = "16 MB"
    assert s.setup(config) == 0
    host, port = s.get_hostname().split(":")
    assert host == "localhost" and 12300 <= int(port) <= 14300
    assert s.close() == 0


def test_setup_dummy_attaches_the_same_pool(store: MooncakeDistributedStore, pool: Pool) -> None:
    assert store.put("shared", b"by the real client") == 0
    dummy = MooncakeDistributedStore()
    assert dummy.setup_dummy(64 << 20, 16 << 20, f"beluga:{pool.spec}") == 0
    assert dummy.get("shared") == b"by the real client"
    assert dummy.close() == 0


def test_teardown_drop_is_mooncakes_behaviour(pool: Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    s = connect(pool)
    assert s.put("kept", b"v") == 0
    s.close()
    s = connect(pool)
    assert s.get("kept") == b"v"  # Beluga's default: values outlive their writer
    assert s.remove("kept") == 0
    monkeypatch.setenv(compat.TEARDOWN_ENV, "drop")
    assert s.put("dropped", b"v") == 0
    s.close()
    s = connect(pool)
    assert s.get("dropped") == b""  # Mooncake's: they go with the client that wrote them
    s.close()
