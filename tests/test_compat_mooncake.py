"""The Mooncake drop-in: Mooncake Store's Python API and return codes over a Beluga pool.

The behaviours are those Mooncake's own Python store tests assert
(mooncake-wheel/tests in its repository), plus the codes Mooncake 0.3.13
returned for each edge case when run here side by side; the last test runs
one scenario on both and compares every answer (it needs Mooncake installed
and skips otherwise).  Every test ends with the pool as it found it: no keys
left, no write in flight.
"""

from __future__ import annotations

import ctypes
import hashlib
import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from beluga.chaos.roles import Midway
from beluga.child import server_process
from beluga.coherence import digest
from beluga.compat import mooncake as compat
from beluga.compat.mooncake import (
    INVALID_PARAMS,
    OBJECT_NOT_FOUND,
    BufferHandle,
    ErrorCode,
    MooncakeDistributedStore,
    ReplicateConfig,
    beluga_key,
    pool_spec_for,
)
from beluga.errors import CapacityError, RpcError
from beluga.kv import KVStore
from beluga.kv import store as store_module
from beluga.pool import Geometry, Pool
from beluga.server.server import serve

GEOMETRY = Geometry(max_hosts=8, rpc_bytes_per_host=256 << 10, block_size=16 << 10)
CTX = mp.get_context("fork")


def _serve(spec: str, ready: Any) -> None:
    # short read leases, so that removed values' extents come back within the test
    serve(spec, coherence="native", ready=ready, refresh_s=0.02, read_lease_s=0.2)


def _pool_is_empty(pool: Pool) -> None:
    """No key, no write in flight, and (once read leases ran out) no block in use."""
    with KVStore(pool) as check:
        stats = check.stats()
        assert stats["keys"] == 0, "the test left keys in the pool"
        assert stats["writes_in_flight"] == 0
        deadline = time.monotonic() + 10
        while stats["blocks_used"] and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = check.stats()
        assert stats["blocks_used"] == 0, "the test leaked blocks"


@pytest.fixture
def pool(shm_path: str) -> Iterator[Pool]:
    """A pool with its metadata server; afterwards it must be as empty as it began."""
    p = Pool.create(shm_path, 48 << 20, geometry=GEOMETRY)
    try:
        with server_process(_serve, p.spec):
            yield p
            _pool_is_empty(p)
    finally:
        p.close()
        Pool.destroy(shm_path)


def connect(pool: Pool) -> MooncakeDistributedStore:
    """A store set up the way Mooncake code does, the pool named by the master address."""
    store = MooncakeDistributedStore()
    rc = store.setup(
        "localhost",
        "http://127.0.0.1:8080/metadata",
        512 << 20,
        128 << 20,
        "tcp",
        "",
        f"beluga:{pool.spec}",
    )
    assert rc == 0
    return store


@pytest.fixture
def store(pool: Pool) -> Iterator[MooncakeDistributedStore]:
    s = connect(pool)
    yield s
    s.remove_all()
    assert s.close() == 0


def buffer_of(data: bytes, size: int | None = None) -> tuple[Any, int]:
    """A ctypes buffer holding ``data`` (of ``size`` bytes), and its address."""
    buf = (ctypes.c_ubyte * (size or len(data)))()
    ctypes.memmove(buf, data, len(data))
    return buf, ctypes.addressof(buf)


# -- set-up ------------------------------------------------------------------------


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


# -- what Mooncake's store tests assert -----------------------------------------------


def test_put_get_exist_size_remove(store: MooncakeDistributedStore) -> None:
    data = b"Hello, World!"
    assert store.put("test_basic_key", data) == 0
    assert store.get_size("test_basic_key") == len(data)
    assert store.get("test_basic_key") == data
    assert store.is_exist("test_basic_key") == 1
    # put of an existing key succeeds and keeps the first value, as Mooncake's
    assert store.put("test_basic_key", b"another") == 0
    assert store.get("test_basic_key") == data
    # upsert replaces
    assert store.upsert("test_basic_key", b"replaced", ReplicateConfig()) == 0
    assert store.get("test_basic_key") == b"replaced" and store.get_size("test_basic_key") == 8
    assert store.remove("test_basic_key", force=True) == 0
    assert store.get("test_basic_key") == b"" and store.is_exist("test_basic_key") == 0
    assert store.remove("test_basic_key") == OBJECT_NOT_FOUND
    assert store.get_size("test_basic_key") == OBJECT_NOT_FOUND == -704
    # values of any buffer type; config accepted
    assert store.put("ba", bytearray(b"xyz"), ReplicateConfig(replica_num=2)) == 0
    assert store.put("np", np.arange(4, dtype=np.int32)) == 0
    assert store.get("np") == np.arange(4, dtype=np.int32).tobytes()
    assert store.batch_remove(["ba", "np", "ba"]) == [0, 0, OBJECT_NOT_FOUND]


def test_empty_keys_and_values(store: MooncakeDistributedStore) -> None:
    assert store.put("", b"x") == INVALID_PARAMS
    assert store.put("empty", b"") == INVALID_PARAMS
    assert store.upsert("empty", b"") == INVALID_PARAMS
    assert store.get("") == b"" and store.is_exist("") == 0 and store.get_size("") == -704
    assert store.is_exist("empty") == 0


def test_batch_is_exist(store: MooncakeDistributedStore) -> None:
    keys = [f"test_batch_exist_key_{i}" for i in range(20)]
    for key in keys[:10]:
        assert store.put(key, b"Hello, Batch World!") == 0
    results = store.batch_is_exist(keys)
    assert results == [1] * 10 + [0] * 10
    assert store.batch_is_exist([]) == []
    assert store.batch_is_exist([keys[0]]) == [1]
    assert store.batch_is_exist(["non_existent_key", ""]) == [0, 0]


def test_zero_copy_put_from_get_into(store: MooncakeDistributedStore) -> None:
    data = b"Hello, Zero-Copy World! " * 1000
    size = len(data) + 1024
    buf, ptr = buffer_of(data, size)
    assert store.register_buffer(ptr, size) == 0
    assert store.register_buffer(ptr, size) == INVALID_PARAMS  # twice
    assert store.put_from("test_zero_copy_key", ptr, len(data)) == 0
    assert store.get("test_zero_copy_key") == data
    ctypes.memset(buf, 0, size)
    assert store.get_into("test_zero_copy_key", ptr, size) == len(data)
    assert bytes(buf[: len(data)]) == data
    small, small_ptr = buffer_of(b"", len(data) // 2)
    assert store.register_buffer(small_ptr, len(small)) == 0
    assert store.get_into("test_zero_copy_key", small_ptr, len(small)) == INVALID_PARAMS
    assert store.get_into("missing", ptr, size) == OBJECT_NOT_FOUND
    assert store.put_from("zero", ptr, 0) == INVALID_PARAMS
    assert store.put_from("null", 0, 10) == INVALID_PARAMS
    assert store.get_into("test_zero_copy_key", 0, 10) == INVALID_PARAMS
    assert store.upsert_from("test_zero_copy_key", ptr, 5) == 0
    assert store.get("test_zero_copy_key") == data[:5]
    assert store.unregister_buffer(ptr) == 0 and store.unregister_buffer(small_ptr) == 0
    assert store.unregister_buffer(ptr) == INVALID_PARAMS  # not registered any more
    assert store.remove("test_zero_copy_key") == 0


def test_batch_put_from_and_batch_get_into(store: MooncakeDistributedStore) -> None:
    spacing, n = 1024, 8
    big, base = buffer_of(b"", spacing * (n + 4))
    assert store.register_buffer(base, len(big)) == 0
    keys = [f"test_batch_key_{i}" for i in range(n)]
    values = [f"Batch Data {i} ".encode() * (i + 1) for i in range(n)]
    for i, v in enumerate(values):
        ctypes.memmove(base + i * spacing, v, len(v))
    ptrs = [base + i * spacing for i in range(n)]
    assert store.batch_put_from(keys, ptrs, [len(v) for v in values]) == [0] * n
    assert store.get_batch(keys) == values
    assert store.batch_put_from(keys[:2], ptrs[:3], [1, 1, 1]) == [INVALID_PARAMS] * 2
    assert store.batch_put_from([], [], []) == []
    # per-item codes: a miss, a buffer too small, an empty key and a null pointer
    ctypes.memset(base, 0, len(big))
    got = store.batch_get_into(
        [keys[0], "missing", keys[7], "", keys[1]],
        [base, base + spacing, base + 2 * spacing, base + 3 * spacing, 0],
        [spacing, spacing, 8, spacing, spacing],
    )
    assert got == [len(values[0]), OBJECT_NOT_FOUND, INVALID_PARAMS, OBJECT_NOT_FOUND, -600]
    assert bytes(big[: len(values[0])]) == values[0]
    out = store.batch_get_into(keys, ptrs, [spacing] * n)
    assert out == [len(v) for v in values]
    assert [
        bytes(big[p - base : p - base + len(v)]) for p, v in zip(ptrs, values, strict=True)
    ] == values
    assert store.batch_get_into(keys[:2], ptrs[:3], [spacing] * 3) == [INVALID_PARAMS] * 2
    assert store.batch_get_into([], [], []) == []
    # upserting from buffers replaces, putting keeps
    ctypes.memmove(base, b"NEW", 3)
    assert store.batch_put_from([keys[0]], [base], [3]) == [0]
    assert store.get(keys[0]) == values[0]
    assert store.batch_upsert_from([keys[0]], [base], [3]) == [0]
    assert store.get(keys[0]) == b"NEW"
    assert store.unregister_buffer(base) == 0
    assert store.batch_remove(keys) == [0] * n


def test_put_batch_get_batch_and_parts(store: MooncakeDistributedStore) -> None:
    assert store.put_batch(["p1", "p2"], [b"one", b"two"]) == 0
    assert store.put_batch(["p1", "p5"], [b"ONE", b"five"]) == 0
    assert store.get_batch(["p1", "missing", "p5"]) == [b"one", b"", b"five"]
    assert store.put_batch(["p3", "p4"], [b"one"]) == INVALID_PARAMS
    assert store.put_batch(["p3", "p4"], [b"one", b""]) == INVALID_PARAMS
    assert store.is_exist("p3") == 0
    assert store.put_batch([], []) == 0 and store.get_batch([]) == []
    assert store.put_batch(["d", "d"], [b"first", b"second"]) == 0
    assert store.get("d") == b"first"
    assert store.upsert_batch(["p1", "p6"], [b"uno", b"six"]) == 0
    assert store.get_batch(["p1", "p6"]) == [b"uno", b"six"]
    assert store.put_parts("pp", b"ab", bytearray(b"cd")) == 0
    assert store.get("pp") == b"abcd"
    assert store.upsert_parts("pp", b"x", b"yz") == 0
    assert store.get("pp") == b"xyz"


def test_get_buffer(store: MooncakeDistributedStore) -> None:
    data = [b"Buffer Data 0" * 10, b"Buffer Data 1" * 20]
    assert store.put_batch(["gb0", "gb1"], data) == 0
    handles = store.batch_get_buffer(["gb0", "gb1", "missing"])
    assert [None if h is None else bytes(h) for h in handles] == [*data, None]
    first = handles[0]
    assert isinstance(first, BufferHandle) and first.size() == len(data[0]) == len(first)
    assert ctypes.string_at(first.ptr(), first.size()) == data[0]
    assert bytes(memoryview(first)) == data[0]
    assert store.get_buffer("missing") is None and store.batch_get_buffer([]) == []
    one = store.get_buffer("gb1")
    assert one is not None and bytes(one) == data[1]


def test_tensors_round_trip(store: MooncakeDistributedStore) -> None:
    tensors = {
        "f32": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "bf16": torch.randn(2, 3, 5).to(torch.bfloat16),
        "bool": torch.tensor([True, False, True]),
        "i64-6d": torch.arange(8, dtype=torch.int64).reshape(1, 2, 1, 2, 1, 2),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "strided": torch.arange(10.0)[::2],
    }
    for key, t in tensors.items():
        assert store.put_tensor(key, t) == 0, key
    for key, t in tensors.items():
        back = store.get_tensor(key)
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t), key
    assert store.get_size("f32") == 8 + 2 * 8 + 48  # header, two dims, the floats
    assert store.put_tensor("f32", tensors["f32"] + 1) == 0  # kept
    assert torch.equal(store.get_tensor("f32"), tensors["f32"])
    assert store.upsert_tensor("f32", tensors["f32"] + 1) == 0  # replaced
    assert torch.equal(store.get_tensor("f32"), tensors["f32"] + 1)
    assert store.get_tensor("missing") is None
    assert store.put("raw", b"not a tensor at all") == 0 and store.get_tensor("raw") is None
    assert store.put_tensor("t2", b"abc") == INVALID_PARAMS
    assert store.batch_put_tensor(["b1", "b2"], [tensors["f32"], tensors["bool"]]) == [0, 0]
    got = store.batch_get_tensor(["b1", "missing", "b2"])
    assert torch.equal(got[0], tensors["f32"]) and got[1] is None
    assert torch.equal(got[2], tensors["bool"])
    assert store.batch_upsert_tensor(["b1"], [tensors["scalar"]]) == [0]
    assert torch.equal(store.get_tensor("b1"), tensors["scalar"])
    assert store.batch_put_tensor(["x"], []) == [INVALID_PARAMS]


def test_wrong_types_raise_type_error_and_store_nothing(store: MooncakeDistributedStore) -> None:
    bad_calls = [
        lambda: store.put("k", 123),
        lambda: store.put("k", "a str is not a buffer"),
        lambda: store.put(123, b"x"),
        lambda: store.get(None),
        lambda: store.is_exist(1.5),
        lambda: store.batch_is_exist("not-a-list"),
        lambda: store.put_from("k", -1, 10),
        lambda: store.put_from("k", 4096, "10"),
        lambda: store.get_into("k", 4096.0, 10),
        lambda: store.batch_put_from(["k"], [True], [1]),
        lambda: store.put_batch(["k"], [torch.ones(2)]),
        lambda: store.put("k", np.arange(10)[::2]),
        lambda: store.register_buffer(-5, 10),
        lambda: store.remove_by_regex(5),
    ]
    for call in bad_calls:
        with pytest.raises(TypeError):
            call()
    assert store.is_exist("k") == 0
    assert store.remove_by_regex("(unclosed") == INVALID_PARAMS


def test_keys(store: MooncakeDistributedStore, pool: Pool) -> None:
    long_key = "L" * 1000
    assert store.put(long_key, b"long") == 0 and store.get(long_key) == b"long"
    assert beluga_key(long_key) == b"\xff" + hashlib.sha256(long_key.encode()).digest()
    assert store.put("ключ/块", b"unicode") == 0
    assert store.get("ключ/块".encode()) == b"unicode"  # bytes keys are their UTF-8
    assert store.put(b"raw-bytes-key", b"b") == 0 and store.get("raw-bytes-key") == b"b"
    # one key, one mapping: Beluga's own store sees the same values
    with KVStore(pool) as native:
        assert native.get("ключ/块") == b"unicode"
        assert native.get(beluga_key(long_key)) == b"long"
        native.put("written-natively", b"n")
    assert store.get("written-natively") == b"n" and store.remove("written-natively") == 0


def test_remove_all_and_by_regex(store: MooncakeDistributedStore, pool: Pool) -> None:
    with KVStore(pool) as native:
        native.put("shared", b"written natively")
    assert store.put("shared", b"kept") == 0 and store.get("shared") == b"written natively"
    assert store.remove_all() == 1  # a key this handle put, though it kept the older value
    for i in range(5):
        assert store.put(f"layer/{i}", b"x") == 0
        assert store.put(f"other/{i}", b"y") == 0
    assert store.remove("other/0") == 0
    assert store.remove_by_regex("^layer/[0-2]$") == 3
    assert store.batch_is_exist(["layer/0", "layer/3"]) == [0, 1]
    assert store.remove_all() == 6 and store.remove_all() == 0
    assert store.batch_is_exist(["layer/3", "other/4"]) == [0, 0]


def test_error_codes_are_mooncakes() -> None:
    assert ErrorCode.INVALID_PARAMS == -600 and ErrorCode.OBJECT_NOT_FOUND == -704
    assert ErrorCode.NO_AVAILABLE_HANDLE == -200 and ErrorCode.RPC_FAIL == -900
    assert ErrorCode.INTERNAL_ERROR == -1 and compat.OK == 0


def test_failures_become_mooncake_codes(
    store: MooncakeDistributedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    native = store._store
    assert native is not None

    def fail(exc: Exception) -> Any:
        def raiser(*args: Any, **kwargs: Any) -> Any:
            raise exc

        return raiser

    monkeypatch.setattr(native, "batch_put_from", fail(CapacityError("pool full")))
    assert store.upsert("k", b"v") == ErrorCode.NO_AVAILABLE_HANDLE
    buf, ptr = buffer_of(b"bytes")
    assert store.batch_upsert_from(["a", "b"], [ptr, ptr], [0, len(buf)]) == [-600, -200]
    monkeypatch.setattr(native, "batch_is_exist", fail(RpcError("server gone")))
    assert store.put("k", b"v") == ErrorCode.RPC_FAIL
    assert store.is_exist("k") == -900 and store.batch_is_exist(["k", ""]) == [-900, -900]
    monkeypatch.setattr(native, "get_batch", fail(RpcError("server gone")))
    assert store.get("k") == b"" and store.get_buffer("k") is None
    assert store.get_tensor("k") is None
    monkeypatch.setattr(native, "stats", fail(RpcError("server gone")))
    assert store.health_check() == 2


def _losing_the_lease_of(store: MooncakeDistributedStore, name: str) -> Any:
    """A stand-in for the Buffers a KVStore saves through: the write lease of ``name``'s
    value is lost between its reservation and its commit (its grant taken back)."""
    native = store._store
    assert native is not None
    lost = digest(beluga_key(name))

    def take_back(mem: Any, places: Any) -> None:
        native._abort([r for r in places if r.digest == lost])

    return lambda values: Midway(values, take_back)


@pytest.mark.leaves("writes")  # a value whose lease was lost is sealed by its writer anyway
def test_a_batch_put_that_loses_one_lease_fails_that_value_and_no_other(
    store: MooncakeDistributedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Puts of several values (the first key present already, so the put skips it) and
    upserts, each batch losing the write lease of one value: that value's code is
    RPC_FAIL and it is not stored; every other value is stored, its code 0."""
    assert store.put("there", b"kept") == 0
    keys = ["there", "a", "b", "c"]
    values = [b"new there", b"value a", b"value b", b"value c"]
    bufs = [buffer_of(v) for v in values]
    ptrs, sizes = [a for _, a in bufs], [len(v) for v in values]
    monkeypatch.setattr(store_module, "Buffers", _losing_the_lease_of(store, "b"))
    assert store.batch_put_from(keys, ptrs, sizes) == [0, 0, ErrorCode.RPC_FAIL, 0]
    assert store.get_batch(keys) == [b"kept", b"value a", b"", b"value c"]
    monkeypatch.setattr(store_module, "Buffers", _losing_the_lease_of(store, "e"))
    assert store.put_batch(["a", "d", "e", "f"], [b"A", b"d", b"e", b"f"]) == ErrorCode.RPC_FAIL
    assert store.get_batch(["a", "d", "e", "f"]) == [b"value a", b"d", b"", b"f"]
    monkeypatch.setattr(store_module, "Buffers", _losing_the_lease_of(store, "there"))
    assert store.batch_upsert_from(keys[::-1], ptrs[::-1], sizes[::-1]) == [
        0,
        0,
        0,
        ErrorCode.RPC_FAIL,
    ]
    assert store.get_batch(keys) == [b"kept", *values[1:]]


def test_a_value_larger_than_the_pool_is_invalid(
    store: MooncakeDistributedStore, pool: Pool
) -> None:
    # Mooncake answers -600 for a value larger than its client's staging buffer
    huge = bytes(pool.superblock.payloads.length + 1)
    assert store.put("too-big", huge) == INVALID_PARAMS
    assert store.is_exist("too-big") == 0


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
    monkeypatch.setattr(compat, "CLOSE_WAIT_S", 0.2)
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


# -- code written for Mooncake, unchanged but for the import ----------------------------

MOONCAKE_SNIPPET = """
import ctypes
from mooncake.store import MooncakeDistributedStore

store = MooncakeDistributedStore()
rc = store.setup("localhost", "http://127.0.0.1:8080/metadata", 512 * 1024 * 1024,
                 128 * 1024 * 1024, "tcp", "", "127.0.0.1:50051")
if rc:
    raise RuntimeError(f"setup failed: {rc}")
store.put("hello_key", b"Hello, Mooncake Store!")
data = store.get("hello_key")
print(data.decode())

buffer = (ctypes.c_ubyte * 4096)()
ptr = ctypes.addressof(buffer)
assert store.register_buffer(ptr, 4096) == 0
ctypes.memmove(buffer, b"zero-copy bytes", 15)
assert store.put_from("zc", ptr, 15) == 0
ctypes.memset(buffer, 0, 4096)
n = store.get_into("zc", ptr, 4096)
print(bytes(buffer[:n]).decode())
assert store.batch_is_exist(["hello_key", "zc", "nope"]) == [1, 1, 0]
store.unregister_buffer(ptr)
store.remove("hello_key")
store.remove("zc")
store.close()
"""


def test_mooncake_code_runs_with_one_import_changed(
    pool: Pool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BELUGA_POOL", pool.spec)
    source = MOONCAKE_SNIPPET.replace(
        "from mooncake.store import", "from beluga.compat.mooncake import"
    )
    assert source.count("beluga") == 1
    exec(compile(source, "mooncake_snippet.py", "exec"), {})
    assert capsys.readouterr().out == "Hello, Mooncake Store!\nzero-copy bytes\n"


def test_install_makes_mooncake_store_this_module(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = {name: sys.modules.get(name) for name in ("mooncake", "mooncake.store")}
    package = saved["mooncake"]
    if package is not None:  # undone afterwards: the attribute as it was, or none
        monkeypatch.setattr(package, "store", getattr(package, "store", None), raising=False)
    monkeypatch.setenv("BELUGA_POOL", pool.spec)
    try:
        compat.install()
        from mooncake.store import MooncakeDistributedStore as Imported  # type: ignore

        assert Imported is MooncakeDistributedStore
        s = Imported()
        assert s.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", "127.0.0.1:50051") == 0
        assert s.put("via-install", b"i") == 0 and s.remove("via-install") == 0
        assert s.close() == 0
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


# -- side by side with the real Mooncake --------------------------------------------------


def scenario(s: Any) -> list[Any]:
    """One sequence of calls and edge cases; returns every answer, for comparison."""
    buf, ptr = buffer_of(b"hello zero copy", 4096)
    small, small_ptr = buffer_of(b"", 8)
    answers: list[Any] = [
        s.put("a", b"first"),
        s.put("a", b"second"),
        s.get("a"),
        s.upsert("a", b"third!"),
        s.get("a"),
        s.get_size("a"),
        s.get("nope"),
        s.get_size("nope"),
        s.is_exist("a"),
        s.is_exist("nope"),
        s.batch_is_exist(["a", "nope", ""]),
        s.put("empty", b""),
        s.put("", b"x"),
        s.get(""),
        s.register_buffer(ptr, 4096),
        s.register_buffer(ptr, 4096),
        s.register_buffer(small_ptr, 8),
        s.put_from("z", ptr, 15),
        s.get_into("z", ptr + 100, 200),
        bytes(buf[100:115]),
        s.get_into("z", small_ptr, 8),
        s.get_into("nope", ptr, 100),
        s.batch_put_from(["b1", "b2", "z"], [ptr, ptr + 16, ptr], [10, 10, 15]),
        s.batch_put_from(["m1", "m2"], [ptr, ptr, ptr], [1, 1, 1]),
        s.batch_get_into(
            ["b1", "nope", "z", "b2"],
            [ptr + 1000, ptr + 2000, small_ptr, ptr + 3000],
            [100] * 2 + [8, 100],
        ),
        s.batch_get_into(["b1", "b2"], [ptr, ptr, ptr], [100, 100, 100]),
        s.unregister_buffer(ptr),
        s.unregister_buffer(ptr),
        s.unregister_buffer(small_ptr),
        s.put_batch(["p1", "p2"], [b"one", b"two"]),
        s.put_batch(["p3", "p4"], [b"one"]),
        s.put_batch(["p1", "p5"], [b"ONE", b"five"]),
        s.get_batch(["p1", "nope", "p5"]),
        s.upsert_batch(["p1", "p6"], [b"uno", b"six"]),
        s.get_batch(["p1", "p6"]),
        s.put_parts("pp", b"ab", b"cd"),
        s.upsert_parts("pp", b"x", b"yz"),
        s.get("pp"),
        [None if h is None else bytes(h) for h in s.batch_get_buffer(["p1", "nope"])],
        s.put_tensor("t", torch.arange(6.0).reshape(2, 3)),
        s.get_tensor("t").tolist(),
        s.upsert_tensor("t", torch.ones(2, dtype=torch.bfloat16)),
        s.get_tensor("t").tolist(),
        s.get_tensor("nope"),
        s.get_tensor("p1"),
        s.put_tensor("t2", b"abc"),
        s.remove("nope"),
        s.health_check(),
    ]
    del small
    return answers


def scenario_more(s: Any, module: Any) -> list[Any]:
    """Soft pins, ranged reads, tensor-parallel forms and replica clearing; every answer.

    ``module`` is the one ``s`` comes from (its ``ReplicateConfig``, ``SoftPinAction``).
    """
    ReplicateConfig, SoftPinAction = module.ReplicateConfig, module.SoftPinAction

    data1, data2 = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", b"abcdefghijklmnopqrstuvwxyz0123"
    buf, ptr = buffer_of(b"", 64)
    enable, preserve, disable = ReplicateConfig(), ReplicateConfig(), ReplicateConfig()
    enable.soft_pin_action, enable.soft_pin_ttl_ms = SoftPinAction.ENABLE, 1000
    preserve.soft_pin_ttl_ms = 1000
    disable.soft_pin_action = SoftPinAction.DISABLE
    tensor = torch.arange(24.0).reshape(2, 4, 3)
    answers: list[Any] = [
        preserve.soft_pin_ttl_ms,
        ReplicateConfig().soft_pin_ttl_ms,
        int(ReplicateConfig().soft_pin_action),
        s.put("sp", b"pinned", enable),
        s.upsert("sp", b"pinned", preserve),
        s.upsert("sp", b"again", disable),
        s.get("sp"),
        s.put("r1", data1),
        s.put("r2", data2),
        s.register_buffer(ptr, 64),
        s.get_into_ranges(
            [ptr],
            [["r1", "r2", "nope"]],
            [[[0, 20], [8], [40]]],
            [[[1, 30], [2], [0]]],
            [[[4, 3], [5], [4]]],
        ),
        bytes(buf[0:4]) + bytes(buf[8:13]) + bytes(buf[20:23]),
        s.get_into_ranges([ptr], [["r1"]], [[[0]]], [[[len(data1) - 1]]], [[[4]]])[0][0][0] < 0,
        s.get_into_ranges([ptr], [["r1"]], [[[63]]], [[[0]]], [[[4]]])[0][0][0] < 0,
        s.unregister_buffer(ptr),
        s.put_tensor_with_tp("tp", tensor, tp_size=2, split_dim=1),
        [s.get_tensor_with_tp("tp", tp_rank=r, tp_size=2).tolist() for r in range(2)],
        s.batch_put_tensor_with_tp(["btp"], [tensor], tp_size=2, split_dim=2),
        [
            getattr(t, "shape", None)
            for t in s.batch_get_tensor_with_tp(["btp"], tp_rank=1, tp_size=2)
        ],
        s.put_tensor_with_tp("one", tensor),
        getattr(s.get_tensor_with_tp("one"), "shape", None),
        getattr(s.get_tensor("one"), "shape", None),
        s.batch_replica_clear([]),
        s.batch_replica_clear(["nope1", "nope2"]),
        s.batch_replica_clear(["r1", "r2"]),  # leased: just written and read
        s.get("r1") == data1,
        ":" in s.get_hostname(),
        s.batch_put_tensor_with_tp(["even"], [tensor], tp_size=2, split_dim=0),
    ]
    return answers


def scenario_tensors(s: Any, module: Any) -> list[Any]:
    """The pub, *_from, tensor-parallel *_from / *_into, whole-tensor *_with_parallelism and
    multi-buffer forms; every answer (tensors as lists, so both systems' answers compare)."""

    def listed(t: Any) -> Any:
        return None if t is None else t.tolist()

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    _buf, ptr = buffer_of(b"", 4096)
    _out, out_ptr = buffer_of(b"", 4096)
    parts = [buffer_of(b"head-"), buffer_of(b"middle--"), buffer_of(b"tail")]
    into = [buffer_of(b"", n) for n in (5, 8, 4)]
    bufs = [(ptr, 4096), (out_ptr, 4096)] + [(a, len(b)) for b, a in parts + into]
    registered = [s.register_buffer(a, n) for a, n in bufs]
    answers: list[Any] = [registered, s.pub_tensor("pt", t + 1), listed(s.get_tensor("pt"))]
    answers += [s.pub_tensor("pt", t), s.upsert_pub_tensor("pt", t), listed(s.get_tensor("pt"))]
    answers += [
        s.batch_pub_tensor(["bp0", "bp1"], [t, t + 1]),
        [listed(x) for x in s.batch_get_tensor(["bp0", "bp1"])],
        s.batch_upsert_pub_tensor(["bp0"], [t + 5]),
        listed(s.get_tensor("bp0")),
        s.pub_tensor_with_tp("ptp", t, module.ReplicateConfig(), tp_size=2, split_dim=1),
        [listed(s.get_tensor_with_tp("ptp", tp_rank=r, tp_size=2)) for r in range(2)],
        s.batch_pub_tensor_with_tp(["bptp"], [t], tp_size=3, split_dim=0),
        listed(s.get_tensor_with_tp("bptp", tp_rank=2, tp_size=3)),
    ]
    n = s.get_size("pt")
    answers += [listed(s.get_tensor_into("pt", ptr, 4096))]
    answers += [
        s.put_tensor_from("ptf", ptr, n),
        s.batch_put_tensor_from(["bf0", "bf1"], [ptr, ptr], [n, n]),
        [listed(x) for x in s.batch_get_tensor(["ptf", "bf0", "bf1"])],
        s.upsert_tensor_from("bf0", ptr, n),
        s.batch_upsert_tensor_from(["bf1", "bf2"], [ptr, ptr], [n, n]),
        listed(s.get_tensor("bf2")),
        s.put_tensor_with_tp_from("tpf", ptr, n, tp_size=2, split_dim=1),
        [listed(s.get_tensor_with_tp("tpf", tp_rank=r, tp_size=2)) for r in range(2)],
        s.batch_put_tensor_with_tp_from(["btpf"], [ptr], [n], tp_size=2, split_dim=0),
        listed(s.get_tensor_with_tp_into("btpf", out_ptr, 4096, tp_rank=1, tp_size=2)),
        [listed(x) for x in s.batch_get_tensor_with_tp_into(["tpf"], [out_ptr], [4096], 0, 2)],
        s.put_tensor_with_parallelism("par", t),
        listed(s.get_tensor_with_parallelism("par")),
        s.put_tensor_with_parallelism("par", t + 1),
        s.upsert_tensor_with_parallelism("par", t + 1),
        listed(s.get_tensor("par")),
        s.batch_put_tensor_with_parallelism(["pb0", "pb1"], [t, t + 1]),
        s.batch_upsert_tensor_with_parallelism(["pb1"], [t + 2]),
        [listed(x) for x in s.batch_get_tensor_with_parallelism(["pb0", "pb1", "nope"])],
        s.put_tensor_with_parallelism_from("pf", ptr, n),
        s.upsert_tensor_with_parallelism_from("pf", ptr, n),
        s.batch_put_tensor_with_parallelism_from(["pf1"], [ptr], [n]),
        s.batch_upsert_tensor_with_parallelism_from(["pf2"], [ptr], [n]),
        listed(s.get_tensor_with_parallelism_into("pf2", out_ptr, 4096)),
        [listed(x) for x in s.batch_get_tensor_with_parallelism_into(["pf1"], [out_ptr], [4096])],
        s.batch_put_from_multi_buffers(["mb"], [[a for _, a in parts]], [[5, 8, 4]]),
        s.get("mb"),
        s.batch_put_from_multi_buffers(["mb"], [[a for _, a in parts]], [[5, 8, 4]]),
        s.batch_get_into_multi_buffers(["mb"], [[a for _, a in into]], [[5, 8, 4]]),
        b"".join(bytes(b) for b, _ in into),
        s.batch_get_into_multi_buffers(["nope"], [[a for _, a in into]], [[5, 8, 4]])[0] < 0,
        s.batch_put_from_multi_buffers(["mb2", "mb3"], [[parts[0][1]]], [[5]]),
    ]
    answers += [[s.unregister_buffer(a) for a, _ in bufs]]
    return answers


def scenario_meta(s: Any, module: Any, folder: str) -> list[Any]:
    """Metadata-prefixed puts, safetensors files, and the segment, replica and task forms
    (no meaning on a pool: their codes and shapes must be Mooncake's); every answer."""
    _data, data_ptr = buffer_of(bytes(range(64)))
    _meta, meta_ptr = buffer_of(b"METADATA")
    t = torch.arange(6.0).reshape(2, 3)
    os.makedirs(folder, exist_ok=True)
    path = f"{folder}/t.safetensors"
    answers: list[Any] = [
        s.put_from_with_metadata("m", data_ptr, meta_ptr, 64, 8),
        s.get("m"),
        s.put_tensor("st", t),
        s.save_tensor_to_safetensor("st", path),
        s.save_tensor_to_safetensor("nope", f"{folder}/nope.safetensors"),
        s.load_tensor_from_safetensor("st2", path).tolist(),
        s.get_tensor("st2").tolist(),
        s.load_tensor_from_safetensor("st3", f"{folder}/missing.safetensors"),
        s.get_replica_desc("nope"),
        s.batch_get_replica_desc(["nope"]),
        [
            (r.is_memory_replica(), r.is_disk_replica(), int(r.status))
            for r in s.get_replica_desc("m")
        ],
        s.get_replica_desc("m")[0].get_memory_descriptor().buffer_descriptor.size,
        list(s.batch_get_replica_desc(["m", "nope"])),
        s.create_copy_task("nope", ["x"])[1],
        s.create_copy_task("m", ["x"])[1],
        s.create_move_task("m", "a", "b")[1],
        s.query_task((1, 2)),
        s.unmount_segment(["bogus"]),
        s.mount_segment(f"{folder}/no-such-file", 16 << 20),
        sorted(s.allocate_and_mount_segment(16 << 20).items())[0],
        s.allocate_and_mount_segment(16 << 20)["allocated_size"],
        s.unmount_local_disk_segment(),
        s.get_offload_rpc_read_count(),
    ]
    with pytest.raises(RuntimeError, match="Expected DiskDescriptor"):
        s.get_replica_desc("m")[0].get_disk_descriptor()
    return answers


def scenario_sessions(s: Any) -> list[Any]:
    """Put sessions assembling objects from ranges, get sessions reading ranges; every
    answer."""
    pieces = [buffer_of(b"0123456789"), buffer_of(b"abcdef"), buffer_of(b"XYZ")]
    ptr = [a for _, a in pieces]
    out = [buffer_of(b"", 4), buffer_of(b"", 6)]
    out_ptr = [a for _, a in out]
    bufs = [(a, len(b)) for b, a in pieces + out]
    answers: list[Any] = [[s.register_buffer(a, n) for a, n in bufs]]
    answers += [
        s.batch_put_session_start(["ps1", "ps2"], [16, 3]),
        s.batch_put_session_start(["ps1"], [16]),  # open already
        s.get("ps1"),  # not readable before the end
        s.batch_put_from_multi_buffer_ranges(["ps1"], [[ptr[1], ptr[0]]], [[6, 10]], [[10, 0]]),
        s.batch_put_from_multi_buffer_ranges(["ps2"], [[ptr[2]]], [[3]], [[1]]),  # past the end
        s.batch_put_from_multi_buffer_ranges(["nope"], [[ptr[2]]], [[3]], [[0]]),
        s.batch_put_from_multi_buffer_ranges(["ps2"], [[ptr[2]]], [[3]], [[0]]),
        s.batch_put_session_end(["ps1", "ps2", "nope"]),
        s.get("ps1"),
        s.get("ps2"),
        s.batch_put_session_start(["ps3"], [4]),
        s.batch_put_session_revoke(["ps3", "nope"]),
        s.get("ps3"),
        s.batch_get_session_start([]),
        s.batch_get_session_start(["ps1", "nope"]),
        s.batch_get_into_multi_buffer_ranges(
            ["ps1", "ps2"], [out_ptr, [out_ptr[0]]], [[4, 6], [3]], [[2, 10], [0]]
        ),
        bytes(out[0][0]) + bytes(out[1][0]),
        s.batch_get_into_multi_buffer_ranges(["ps1"], [[out_ptr[0]]], [[4]], [[14]]),
        s.batch_get_session_end(["ps1"]),
        s.batch_get_into_multi_buffer_ranges(["ps1"], [[out_ptr[0]]], [[4]], [[0]]),
    ]
    answers += [[s.unregister_buffer(a) for a, _ in bufs]]
    return answers


def test_sessions_assemble_objects_from_ranges_and_read_ranges(
    store: MooncakeDistributedStore,
) -> None:
    """Beluga's own answers to scenario_sessions (compared with Mooncake's side by side)."""
    a = scenario_sessions(store)
    assert a[1] == [0, 0] and a[2] == [-600] and a[3] == b""  # unreadable until the end
    assert a[4] == [16] and a[5] == [-600] and a[6] == [-600] and a[7] == [3]
    assert a[8] == [0, 0, -600] and a[9] == b"0123456789abcdef" and a[10] == b"XYZ"
    assert a[12] == [0, -600] and a[13] == b""  # revoked: nothing stored
    assert a[15] == [0, -704] and a[16] == [10, -600]  # ps2 has no get session
    assert a[17] == b"2345abcdef" and a[18] == [-600] and a[19] == 0 and a[20] == [-600]


def test_metadata_files_segments_replicas_and_tasks(
    store: MooncakeDistributedStore, tmp_path: Path
) -> None:
    """Beluga's own answers to scenario_meta (compared with Mooncake's side by side)."""
    a = scenario_meta(store, compat, str(tmp_path))
    assert a[0] == 0 and a[1] == b"METADATA" + bytes(range(64))  # metadata first, then data
    assert a[3] == 0 and a[4] == compat.FILE_NOT_FOUND and a[5] == a[6] == [[0, 1, 2], [3, 4, 5]]
    assert a[7] is None and a[8] == [] and a[9] == {}
    assert a[10] == [(True, False, 3)] and a[11] == 72 and a[12] == ["m"]
    assert a[13] == -704 and a[14] == a[15] == -600 and a[16] == (None, -1400)
    assert a[17] == -1 and a[18] == {"ret": -1, "segment_ids": []}
    assert a[19] == ("allocated_size", 16 << 20) and a[21] == a[22] == 0


def test_tensor_and_multi_buffer_forms_round_trip(store: MooncakeDistributedStore) -> None:
    """Beluga's own answers to scenario_tensors (the side-by-side test compares them with
    Mooncake's where it is installed): what a user reads back is what was written."""
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    answers = scenario_tensors(store, compat)
    assert answers[0] == [0] * 8 and answers[2] == (t + 1).tolist()
    assert answers[-8] == [0] and answers[-7] == b"head-middle--tail"  # gathered, in order
    assert answers[-5] == [17] and answers[-4] == b"head-middle--tail"  # and scattered back
    assert answers[-3] is True and answers[-2] == [-600, -600]  # a miss; lists that differ
    assert answers[-1] == [0] * 8


def test_a_parallelism_request_is_refused_and_stores_nothing(
    store: MooncakeDistributedStore, caplog: pytest.LogCaptureFixture
) -> None:
    t = torch.ones(2, 2)
    request = object()  # a TensorParallelism / ReadTarget / writer_partition stand-in
    assert store.put_tensor_with_parallelism("p", t, parallelism=request) == -600
    assert store.batch_put_tensor_with_parallelism(["p"], [t], writer_partitions=[request]) == [
        -600
    ]
    assert store.is_exist("p") == 0
    assert store.put_tensor("p", t) == 0
    assert store.get_tensor_with_parallelism("p", target=request) is None
    assert "parallelism requests are not supported" in caplog.text


def test_multi_buffers_that_do_not_fit_the_value_are_refused(
    store: MooncakeDistributedStore,
) -> None:
    parts = [buffer_of(b"abc"), buffer_of(b"defg")]
    ptrs = [a for _, a in parts]
    assert store.batch_put_from_multi_buffers(["m"], [ptrs], [[3, 4]]) == [0]
    small, small_ptr = buffer_of(b"", 3)
    assert store.batch_get_into_multi_buffers(["m"], [[small_ptr]], [[3]]) == [-600]
    assert bytes(small) == b"\0\0\0"  # nothing written into a buffer the value does not fit
    assert store.batch_put_from_multi_buffers(["m", "n"], [ptrs], [[3, 4]]) == [-600, -600]
    assert store.batch_put_from_multi_buffers(["n"], [[ptrs[0], 0]], [[3, 4]]) == [-600]
    assert store.is_exist("n") == 0


def test_mooncakes_enums_and_request_classes_have_its_names_and_values() -> None:
    """Code that imports Mooncake's enums and builds parallelism requests runs unchanged;
    the values are Mooncake 0.3.13's (the side-by-side test checks them against it)."""
    assert int(compat.KVCACHE) == 1 and int(compat.GENERAL) == 9
    assert compat.ReplicaStatus.COMPLETE == compat.COMPLETE == 3
    assert compat.FAILED is compat.TaskStatus.FAILED and compat.ReplicaStatus.FAILED == 5
    assert compat.REPLICA_MOVE == compat.TaskType.REPLICA_MOVE == 1
    axis = compat.ParallelAxis()
    assert (axis.kind, axis.rank, axis.size, axis.split_dim) == ("", 0, 1, None)
    target = compat.ReadTarget()
    assert target.mode == "as_stored" and target.parallelism is None
    assert compat.TensorParallelism().axes == []


def test_soft_pin_ttl_is_an_optional_uint64() -> None:
    from beluga.compat.mooncake import ReplicateConfig

    config = ReplicateConfig()
    config.soft_pin_ttl_ms = (1 << 64) - 1
    config.soft_pin_ttl_ms = None
    for bad in (-1, 1 << 64, 1.5, True):
        with pytest.raises(TypeError):
            config.soft_pin_ttl_ms = bad  # type: ignore[assignment]


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


def test_differences_name_mooncakes_tests_with_reasons() -> None:
    files = {
        "test_distributed_object_store.py",
        "test_replicated_distributed_object_store.py",
        "test_put_get_tensor.py",
        "test_batch_replica_clear.py",
        "test_dummy_client.py",
    }
    for test_id, reason in compat.DIFFERENCES.items():
        assert test_id.split("::")[0] in files and test_id.count("::") == 2, test_id
        assert len(reason) > 20, test_id


def test_answers_match_mooncake_side_by_side(pool: Pool, tmp_path: Path) -> None:
    from beluga.bench.mooncake import MooncakeBaseline
    from beluga.errors import BackendUnavailableError
    from beluga.kv.tier.mooncake import check_available

    try:
        check_available()
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    s = connect(pool)
    ours = (
        scenario(s),
        scenario_more(s, compat),
        scenario_tensors(s, compat),
        scenario_meta(s, compat, str(tmp_path / "ours")),
        scenario_sessions(s),
    )
    s.remove_all()
    s.close()
    with MooncakeBaseline(segment_size=64 << 20, local_buffer_size=16 << 20) as mc:
        # the baseline's raw mooncake.store client, set up on its private cluster
        theirs = (
            scenario(mc.client._store),
            scenario_more(mc.client._store, sys.modules[type(mc.client._store).__module__]),
            scenario_tensors(mc.client._store, sys.modules[type(mc.client._store).__module__]),
            scenario_meta(
                mc.client._store,
                sys.modules[type(mc.client._store).__module__],
                str(tmp_path / "theirs"),
            ),
            scenario_sessions(mc.client._store),
        )
        module = sys.modules[type(mc.client._store).__module__]
    assert module is not compat
    exported = [n for n in dir(module) if n.isupper() and hasattr(getattr(module, n), "__int__")]
    assert exported and all(int(getattr(compat, n)) == int(getattr(module, n)) for n in exported)
    assert ours[0] == theirs[0]
    differing = [i for i, (a, b) in enumerate(zip(ours[1], theirs[1], strict=True)) if a != b]
    assert ours[1] == theirs[1], f"answers {differing} differ: {ours[1]} vs {theirs[1]}"
    differing = [i for i, (a, b) in enumerate(zip(ours[4], theirs[4], strict=True)) if a != b]
    assert ours[4] == theirs[4], "session answers differ: " + "; ".join(
        f"{i}: {ours[4][i]} vs {theirs[4][i]}" for i in differing
    )
    differing = [i for i, (a, b) in enumerate(zip(ours[3], theirs[3], strict=True)) if a != b]
    assert ours[3] == theirs[3], "segment/replica/file answers differ: " + "; ".join(
        f"{i}: {ours[3][i]} vs {theirs[3][i]}" for i in differing
    )
    differing = [i for i, (a, b) in enumerate(zip(ours[2], theirs[2], strict=True)) if a != b]
    assert ours[2] == theirs[2], f"tensor answers {differing} differ: " + "; ".join(
        f"{i}: {ours[2][i]} vs {theirs[2][i]}" for i in differing
    )
