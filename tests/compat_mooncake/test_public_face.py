"""The Mooncake drop-in's public face: Mooncake code runs with its import changed,
``install`` makes ``mooncake.store`` the drop-in, Mooncake's enums and request classes, and
the documented differences name Mooncake's tests."""

from __future__ import annotations

import sys

import pytest

from beluga.compat import mooncake as compat
from beluga.compat.mooncake import MooncakeDistributedStore
from beluga.pool import Pool

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
