"""LMCache's own Mooncake connector on a Beluga pool, through the switched import.

``beluga.compat.mooncake.install()`` makes ``mooncake.store`` the drop-in, and
LMCache's ``mooncakestore://`` remote connector (LMCache's code, unchanged)
is configured as its users configure it: ``remote_url`` and the Mooncake
setup keys in ``extra_config``, the master's address naming the pool as
``beluga:PATH`` (``mooncake_master_server_addr``: LMCache forwards it to
Mooncake's ``setup(dict)`` as ``master_server_addr``).  Two LMCacheEngines
built by LMCache's builder share the pool: KV one stores through LMCache's
store path is retrieved bit-exact by the other, whose local CPU cache is
empty, through LMCache's retrieve path; tokens never stored are a miss.

The GPU connector is the CPU stand-in of tests/frameworks/test_lmcache.py.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from tests.frameworks.conftest import need

need("lmcache", "lmcache")

import torch  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402

from beluga.compat import mooncake as compat  # noqa: E402
from beluga.kv import KVStore  # noqa: E402
from tests.frameworks.test_lmcache import CHUNK, HIDDEN, LAYERS, lmcache_engines  # noqa: E402


@pytest.fixture(autouse=True)
def switched_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """``mooncake.store`` is the drop-in for the test (as a user's ``install()`` makes it)."""
    for name in ("mooncake", "mooncake.store"):
        if name in sys.modules:
            monkeypatch.setitem(sys.modules, name, sys.modules[name])
        else:
            monkeypatch.delitem(sys.modules, name, raising=False)
    compat.install()
    from mooncake.store import MooncakeDistributedStore  # what LMCache's connector imports

    assert MooncakeDistributedStore is compat.MooncakeDistributedStore


def config(pool: str) -> LMCacheEngineConfig:
    """LMCache's config for its Mooncake connector, as its users write it."""
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=True,
        max_local_cpu_size=0.05,
        save_unfull_chunk=True,
        remote_url="mooncakestore://localhost:50051/",
        remote_serde="naive",
        extra_config={
            "local_hostname": "localhost",
            "metadata_server": "P2PHANDSHAKE",
            # Mooncake's setup(dict) reads "master_server_addr"; LMCache forwards a
            # "mooncake_"-prefixed key to it with the prefix taken off
            "mooncake_master_server_addr": f"{compat.POOL_PREFIX}{pool}",
            "protocol": "tcp",
            "global_segment_size": "64MB",
            "local_buffer_size": "16MB",
        },
    )


def connector_of(engine: Any) -> Any:
    """LMCache's Mooncake connector inside the engine's remote backend."""
    for backend in engine.storage_manager.storage_backends.values():
        connection = getattr(backend, "connection", None)
        while connection is not None and type(connection).__name__ != "MooncakestoreConnector":
            connection = getattr(connection, "_connector", None)  # unwrap LMCache's wrappers
        if connection is not None:
            return connection
    raise AssertionError("no MooncakestoreConnector in the engine's storage backends")


def test_lmcaches_mooncake_connector_shares_kv_through_the_pool(served_pool: str) -> None:
    with lmcache_engines(served_pool, "tiny-llama", "tiny-llama", make_config=config) as (
        first,
        second,
    ):
        assert isinstance(connector_of(first).store, compat.MooncakeDistributedStore)
        tokens = torch.arange(1, 3 * CHUNK + 6)  # three full chunks and a partial one
        gen = torch.Generator().manual_seed(5)
        kv = torch.randn(2, LAYERS, len(tokens), HIDDEN, generator=gen).to(torch.bfloat16)
        first.store(tokens, kvcaches=kv)
        with KVStore(served_pool) as native:
            assert native.stats()["keys"] == 4  # every chunk reached the pool
        assert second.lookup(tokens) == len(tokens)  # its own cache is empty: from the pool
        out = torch.zeros_like(kv)
        found = second.retrieve(tokens, kvcaches=out)
        assert int(found.sum()) == len(tokens)
        assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
        other = torch.arange(1000, 1000 + 2 * CHUNK)  # never stored
        assert second.lookup(other) == 0
