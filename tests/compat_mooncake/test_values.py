"""The Mooncake drop-in's byte values: what Mooncake's own store tests assert (puts, gets,
zero-copy forms, batches, tensors, removal), its codes for each edge case and failure, and
a batch that loses one write lease."""

from __future__ import annotations

import ctypes
import hashlib
from typing import Any

import numpy as np
import pytest
import torch

from beluga.chaos.roles import Midway
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
)
from beluga.errors import CapacityError, RpcError
from beluga.kv import KVStore
from beluga.kv import store as store_module
from beluga.pool import Pool
from tests.compat_mooncake.conftest import buffer_of

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
