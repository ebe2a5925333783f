"""The LMCache storage plugin, driven by real LMCacheEngines on the CPU.

Two LMCacheEngine instances (two "engines" sharing one pool) are built by
LMCache's own builder from a config that names the plugin the way a user's
does (``storage_plugins`` and ``extra_config``).  Engine 1 stores KV through
LMCache's store path; engine 2, whose local CPU cache is empty, retrieves it
through LMCache's retrieve path, which can only find it in the pool, and must
get every byte back.  An engine serving other weights from the same model
path (a fine-tune saved over the model) must find none of it.  The GPU
connector is a small CPU stand-in (LMCache's own connectors need a GPU): a
paged buffer ``[2, layers, tokens, hidden]``.  The models are tiny weights
directories written by the test (LMCache's model name is vLLM's model path).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.frameworks.conftest import corrupt, need, write_model

need("lmcache", "lmcache")
os.environ.setdefault("PYTHONHASHSEED", "0")  # LMCache's chunk hashes must agree across engines
# LMCache's usage telemetry probes the CPU in a subprocess from a background thread
# (racing the leak check) and then tries to reach the network: not from tests
os.environ["LMCACHE_TRACK_USAGE"] = "false"

import torch  # noqa: E402
from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

from beluga.errors import KVLayoutError, PoolNotNamedError  # noqa: E402
from beluga.integrations.lmcache import BelugaBackend  # noqa: E402
from beluga.kv import KVStore  # noqa: E402

LAYERS, HEADS, DIM, CHUNK = 2, 2, 16, 16
HIDDEN = HEADS * DIM


class CPUConnector(GPUConnectorInterface):
    """Copies chunks between MemoryObjs and a CPU tensor [2, layers, tokens, hidden]."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, LAYERS, num_tokens, HIDDEN])

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.copy_(kwargs["kvcaches"][:, :, start:end])

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        kwargs["kvcaches"][:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)


def config(pool: str | None, **extra: Any) -> LMCacheEngineConfig:
    """LMCache's config with the plugin (``pool`` None: no "beluga.pool" key)."""
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=True,
        max_local_cpu_size=0.05,
        save_unfull_chunk=True,
        storage_plugins=["beluga"],
        extra_config={
            "storage_plugin.beluga.module_path": "beluga.integrations.lmcache",
            "storage_plugin.beluga.class_name": "BelugaBackend",
            **({} if pool is None else {"beluga.pool": pool}),
            "beluga.retry_s": 3600,
            **extra,
        },
    )


def metadata(model: str) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=model,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, DIM),
        chunk_size=CHUNK,
    )


@contextlib.contextmanager
def lmcache_engines(
    pool: str, *models: str, make_config: Callable[[str], LMCacheEngineConfig] | None = None
) -> Iterator[list[Any]]:
    """One LMCacheEngine per model path, built as LMCache builds them, destroyed after;
    ``make_config`` (default :func:`config`): LMCache's config for the pool."""
    names = [f"engine-{i}" for i in range(len(models))]
    try:
        built = [
            LMCacheEngineBuilder.get_or_create(
                name,
                (make_config or config)(pool),
                metadata(model),
                CPUConnector(torch.bfloat16),
                lambda tensor, rank: None,
                lambda obj, rank: obj,
            )
            for name, model in zip(names, models, strict=True)
        ]
        for engine in built:
            engine.post_init()
        yield built
    finally:
        for name in names:
            LMCacheEngineBuilder.destroy(name)


@pytest.fixture
def model_path(tmp_path: Path) -> str:
    return write_model(tmp_path / "tiny-llama", seed=0)


@pytest.fixture
def engines(served_pool: str, model_path: str) -> Iterator[tuple[Any, Any]]:
    with lmcache_engines(served_pool, model_path, model_path) as built:
        yield tuple(built)


def plugin(engine: Any) -> BelugaBackend:
    (backend,) = [
        b for b in engine.storage_manager.storage_backends.values() if isinstance(b, BelugaBackend)
    ]
    return backend


def test_kv_stored_by_one_engine_is_retrieved_bit_exact_by_another(
    engines: tuple[Any, Any], served_pool: str
) -> None:
    first, second = engines
    tokens = torch.arange(1, 3 * CHUNK + 6)  # three full chunks and a partial one
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(2, LAYERS, len(tokens), HIDDEN, generator=gen).to(torch.bfloat16)
    first.store(tokens, kvcaches=kv)
    with KVStore(served_pool) as store:
        assert store.stats()["keys"] == 4  # every chunk reached the pool
    assert second.lookup(tokens) == len(tokens)  # found in the pool: its own cache is empty
    # Reads are one-sided: a store counts its hits in its own hint lines, and its
    # stats() folds them into the server's counters before answering.
    hits = plugin(second).link.call(lambda s: s.stats()["hits"], None)
    out = torch.zeros_like(kv)
    found = second.retrieve(tokens, kvcaches=out)
    assert plugin(second).link.call(lambda s: s.stats()["hits"], None) >= hits + 4  # from the pool
    assert int(found.sum()) == len(tokens)
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16))


@pytest.mark.parametrize("at", [100, 8], ids=["payload", "header dtype"])
def test_a_corrupted_chunk_is_not_retrieved(
    engines: tuple[Any, Any], served_pool: str, at: int
) -> None:
    """A byte of a committed chunk changed in the pool: LMCache gets the chunks before it only."""
    first, second = engines
    tokens = torch.arange(1, 3 * CHUNK + 1)
    kv = torch.randn(2, LAYERS, len(tokens), HIDDEN).to(torch.bfloat16)
    first.store(tokens, kvcaches=kv)
    keys = [key for _, _, key in first.token_database.process_tokens(tokens)]
    assert len(keys) == 3
    corrupt(served_pool, plugin(first).pool_key(keys[1]), at=at)
    out = torch.zeros_like(kv)
    found = second.retrieve(tokens, kvcaches=out)
    assert found[:CHUNK].all() and not found[CHUNK:].any()
    assert torch.equal(out[:, :, :CHUNK].view(torch.int16), kv[:, :, :CHUNK].view(torch.int16))
    assert not out[:, :, CHUNK:].any()  # the corrupted bytes never reached the engine


def test_a_fine_tune_saved_over_the_model_never_reads_its_chunks(
    served_pool: str, model_path: str
) -> None:
    tokens = torch.arange(1, 2 * CHUNK + 1)
    kv = torch.randn(2, LAYERS, len(tokens), HIDDEN).to(torch.bfloat16)
    with lmcache_engines(served_pool, model_path) as (base,):
        base.store(tokens, kvcaches=kv)
    write_model(Path(model_path), seed=1)  # the same path and name, other weights
    with lmcache_engines(served_pool, model_path) as (tuned,), KVStore(served_pool) as store:
        assert store.stats()["keys"] == 2
        assert tuned.lookup(tokens) == 0
        tuned.store(tokens, kvcaches=kv)  # its own chunks, beside the base model's
        assert store.stats()["keys"] == 4


def test_a_model_beluga_cannot_identify_is_refused_naming_the_setting(
    served_pool: str,
) -> None:
    with pytest.raises(KVLayoutError, match=r"'beluga\.model_revision'"):
        BelugaBackend("cpu", config(served_pool), metadata("tiny-llama"), None, None)
    explicit = config(served_pool, **{"beluga.model_revision": "r1"})
    BelugaBackend("cpu", explicit, metadata("tiny-llama"), None, None).close()


def test_a_missing_pool_is_a_miss_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="beluga.integrations")
    gone = config(str(tmp_path / "gone"), **{"beluga.model_revision": "r1"})
    backend = BelugaBackend("cpu", gone, metadata("tiny-llama"), None, None)
    key = pytest.importorskip("lmcache.utils").CacheEngineKey("m", 1, 0, 42, torch.bfloat16)
    assert not backend.contains(key) and backend.batched_contains([key, key]) == 0
    assert backend.batched_get_blocking([key]) == [None]
    assert backend.batched_submit_put_task([], []) is None
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    backend.close()


def test_without_a_pool_setting_the_plugin_uses_beluga_pool(
    served_pool: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    unnamed = config(None, **{"beluga.model_revision": "r1"})
    monkeypatch.delenv("BELUGA_POOL", raising=False)
    with pytest.raises(PoolNotNamedError, match=r"'beluga\.pool' in LMCache's extra_config"):
        BelugaBackend("cpu", unnamed, metadata("tiny-llama"), None, None)
    monkeypatch.setenv("BELUGA_POOL", served_pool)
    backend = BelugaBackend("cpu", unnamed, metadata("tiny-llama"), None, None)
    assert backend.link.spec == served_pool and backend.link.available()
    backend.close()
