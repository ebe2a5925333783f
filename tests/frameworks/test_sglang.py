"""The SGLang HiCache storage backend, created by SGLang's own factory on the CPU.

``StorageBackendFactory.create_backend("dynamic", ...)`` loads the class from
the same extra_config a user passes.  Two backends (two SGLang instances)
share one pool: pages written by one through the zero-copy v1 batch methods
are read by the other into different host pages, bit-exact.

The host KV pool is a stand-in that answers ``get_page_buffer_meta`` as
SGLang's ``MHATokenToKVPoolHost`` does in its page_first layout (a K and a V
pointer per page, into one buffer with all of V after all of K): importing the
real one pulls in torchvision, whose PyPI wheels do not load against the CPU
build of torch.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tests.frameworks.conftest import need

need("sglang.srt.mem_cache.hicache_storage", "sglang")

import ctypes  # noqa: E402

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from beluga.integrations.sglang import BelugaHiCacheStorage  # noqa: E402

PAGE, HEADS, DIM, LAYERS, PAGES = 16, 2, 32, 2, 8


class HostPool:
    """SGLang's page_first MHA host pool, as far as get_page_buffer_meta goes."""

    def __init__(self) -> None:
        self.page_size = PAGE
        self.kv_buffer = torch.zeros(2, PAGES * PAGE, LAYERS, HEADS, DIM, dtype=torch.bfloat16)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % PAGE == 0
        token = LAYERS * HEADS * DIM * self.kv_buffer.element_size()
        v_offset = PAGES * PAGE * token
        ptrs = []
        for start in indices.tolist()[::PAGE]:
            k = self.kv_buffer.data_ptr() + start * token
            ptrs += [k, k + v_offset]
        return ptrs, [PAGE * token] * len(ptrs)


def storage_config(pool: str) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="tiny-llama",
        extra_config={
            "backend_name": "beluga",
            "module_path": "beluga.integrations.sglang",
            "class_name": "BelugaHiCacheStorage",
            "interface_v1": 1,
            "pool": pool,
            "retry_s": 3600,
        },
    )


def backend(pool: str) -> BelugaHiCacheStorage:
    made = StorageBackendFactory.create_backend("dynamic", storage_config(pool), None)
    assert isinstance(made, BelugaHiCacheStorage)
    made.register_mem_pool_host(HostPool())
    return made


def fill(host: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def page_bytes(host: Any, page: int) -> bytes:
    ptrs, sizes = host.get_page_buffer_meta(torch.arange(page * PAGE, (page + 1) * PAGE))
    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes, strict=True))


def test_pages_written_by_one_instance_are_read_bit_exact_by_another(served_pool: str) -> None:
    writer, reader = backend(served_pool), backend(served_pool)
    fill(writer.mem_pool_host, seed=1)
    keys = ["h0", "h1", "h2"]
    written = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in (3, 0, 5)])
    assert writer.batch_set_v1(keys, written) == [True] * 3
    assert writer.batch_set_v1(keys[:1], written[:PAGE]) == [True]  # present: no new block
    assert reader.batch_exists([*keys, "h9"]) == 3
    assert reader.batch_exists(["h9", *keys]) == 0
    read_into = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in (1, 2, 4, 6)])
    assert reader.batch_get_v1([*keys, "h9"], read_into) == [True, True, True, False]
    for src, dst in ((3, 1), (0, 2), (5, 4)):
        assert page_bytes(reader.mem_pool_host, dst) == page_bytes(writer.mem_pool_host, src)
    assert not any(page_bytes(reader.mem_pool_host, 6))
    writer.close()
    reader.close()


def test_per_key_methods_round_trip_tensors(served_pool: str) -> None:
    store = backend(served_pool)
    value = torch.arange(64, dtype=torch.int32)
    assert store.set("k", value) and store.exists("k") and not store.exists("other")
    out = torch.zeros(64, dtype=torch.int32)
    assert store.get("k", out) is out and torch.equal(out, value)
    (raw,) = store.batch_get(["k"])
    assert raw is not None and torch.equal(raw.view(torch.int32), value)
    assert store.batch_get(["missing"]) == [None]
    store.close()


def test_a_missing_pool_misses_and_fails_writes_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="beluga.integrations")
    store = backend(str(tmp_path / "gone"))
    pages = torch.arange(0, 2 * PAGE)
    assert store.batch_set_v1(["a", "b"], pages) == [False, False]
    assert store.batch_get_v1(["a", "b"], pages) == [False, False]
    assert store.batch_exists(["a"]) == 0 and not store.set("a", torch.zeros(4))
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    store.close()
