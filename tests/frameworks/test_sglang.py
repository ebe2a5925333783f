"""The SGLang HiCache storage backend, created by SGLang's own factory on the CPU.

``StorageBackendFactory.create_backend("dynamic", ...)`` loads the class from
the same extra_config a user passes.  Two backends (two SGLang instances)
share one pool: pages written by one through the zero-copy v1 batch methods
are read by the other into different host pages, bit-exact, unless they serve
different weights under the same model name (a fine-tune).  One backend is
driven from several threads at once, as SGLang's prefetch and backup threads
do.  The models are tiny weights directories written by the test.

The host KV pool is a stand-in that answers ``get_page_buffer_meta`` as
SGLang's ``MHATokenToKVPoolHost`` does in its page_first layout (a K and a V
pointer per page, into one buffer with all of V after all of K): importing the
real one pulls in torchvision, whose PyPI wheels do not load against the CPU
build of torch.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.frameworks.conftest import corrupt, need, write_model

need("sglang.srt.mem_cache.hicache_storage", "sglang")

import ctypes  # noqa: E402

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from beluga.errors import KVLayoutError, PoolNotNamedError, RpcError  # noqa: E402
from beluga.integrations.sglang import BelugaHiCacheStorage  # noqa: E402
from beluga.kv import KVStore  # noqa: E402

PAGE, HEADS, DIM, LAYERS, PAGES = 16, 2, 32, 2, 8
THREADS, ROUNDS, JOIN_S = 4, 5, 120


class HostPool:
    """SGLang's page_first MHA host pool, as far as get_page_buffer_meta and its facts go."""

    def __init__(self, pages: int = PAGES) -> None:
        self.page_size = PAGE
        self.layout = "page_first"
        self.dtype = torch.bfloat16
        self.layer_num, self.head_num, self.head_dim = LAYERS, HEADS, DIM
        self.pages = pages
        self.kv_buffer = torch.zeros(2, pages * PAGE, LAYERS, HEADS, DIM, dtype=torch.bfloat16)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % PAGE == 0
        token = LAYERS * HEADS * DIM * self.kv_buffer.element_size()
        v_offset = self.pages * PAGE * token
        ptrs = []
        for start in indices.tolist()[::PAGE]:
            k = self.kv_buffer.data_ptr() + start * token
            ptrs += [k, k + v_offset]
        return ptrs, [PAGE * token] * len(ptrs)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A model and its fine-tune, each in a directory called tiny-llama."""
    root = tmp_path_factory.mktemp("models")
    return {
        "base": write_model(root / "base" / "tiny-llama", seed=0),
        "fine-tune": write_model(root / "fine-tune" / "tiny-llama", seed=1),
    }


def storage_config(pool: str | None, model: str, **extra: Any) -> HiCacheStorageConfig:
    """SGLang's storage config for the backend (``pool`` None: no "pool" key)."""
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
        model_name=model,
        extra_config={
            "backend_name": "beluga",
            "module_path": "beluga.integrations.sglang",
            "class_name": "BelugaHiCacheStorage",
            "interface_v1": 1,
            **({} if pool is None else {"pool": pool}),
            "retry_s": 3600,
            **extra,
        },
    )


def backend(pool: str | None, model: str, pages: int = PAGES, **extra: Any) -> BelugaHiCacheStorage:
    """A backend as SGLang makes one (its model name is the model path unless it is renamed)."""
    made = StorageBackendFactory.create_backend(
        "dynamic", storage_config(pool, model, **extra), None
    )
    assert isinstance(made, BelugaHiCacheStorage)
    made.register_mem_pool_host(HostPool(pages))
    return made


def fill(host: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def page_bytes(host: Any, page: int) -> bytes:
    ptrs, sizes = host.get_page_buffer_meta(torch.arange(page * PAGE, (page + 1) * PAGE))
    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes, strict=True))


def pages(*numbers: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in numbers])


def test_pages_written_by_one_instance_are_read_bit_exact_by_another(
    served_pool: str, models: dict[str, str]
) -> None:
    writer, reader = backend(served_pool, models["base"]), backend(served_pool, models["base"])
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


def test_a_corrupted_page_is_reported_missing(served_pool: str, models: dict[str, str]) -> None:
    """A byte of a committed page changed in the pool: that page is not read, the others are."""
    writer, reader = backend(served_pool, models["base"]), backend(served_pool, models["base"])
    fill(writer.mem_pool_host, seed=4)
    keys = ["h0", "h1", "h2"]
    assert writer.batch_set_v1(keys, pages(0, 1, 2)) == [True] * 3
    corrupt(served_pool, writer.key("h1"), at=len(page_bytes(writer.mem_pool_host, 1)) - 7)
    assert reader.batch_get_v1(keys, pages(3, 4, 5)) == [True, False, True]
    for src, dst in ((0, 3), (2, 5)):
        assert page_bytes(reader.mem_pool_host, dst) == page_bytes(writer.mem_pool_host, src)
    writer.close()
    reader.close()


def test_a_fine_tune_under_the_same_name_never_reads_the_base_models_pages(
    served_pool: str, models: dict[str, str]
) -> None:
    base = backend(served_pool, "tiny-llama", model_path=models["base"])
    tuned = backend(served_pool, "tiny-llama", model_path=models["fine-tune"])
    fill(base.mem_pool_host, seed=2)
    keys = ["h0", "h1"]
    assert base.batch_set_v1(keys, pages(0, 1)) == [True, True]
    assert tuned.batch_exists(keys) == 0
    assert tuned.batch_get_v1(keys, pages(2, 3)) == [False, False]
    assert not any(page_bytes(tuned.mem_pool_host, 2))
    assert tuned.batch_set_v1(keys, pages(0, 1)) == [True, True]  # its own pages, beside
    with KVStore(served_pool) as store:
        assert store.stats()["keys"] == 4
    # the user may vouch for the weights instead: one name and revision, one model
    a = backend(served_pool, "tiny-llama", model_revision="r1", model_path=models["base"])
    b = backend(served_pool, "tiny-llama", model_revision="r1", model_path=models["fine-tune"])
    assert a.batch_set_v1(keys, pages(0, 1)) == [True, True] and b.batch_exists(keys) == 2
    for made in (base, tuned, a, b):
        made.close()


def test_a_model_beluga_cannot_identify_is_refused_naming_the_setting(
    served_pool: str, tmp_path: Path
) -> None:
    with pytest.raises(KVLayoutError, match="'model_revision'"):
        backend(served_pool, "served-name-without-files")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(KVLayoutError, match="no weights files"):
        backend(served_pool, str(tmp_path))


def test_threads_sharing_one_backend_read_back_exactly_what_they_wrote(
    served_pool: str, models: dict[str, str]
) -> None:
    """SGLang's storage threads call one backend at once: every page comes back byte for byte.

    Each thread writes four pages (two of its own keys, two keys every thread
    writes with the same bytes), reads them into other pages and compares,
    round after round, and stores and reads a tensor through the per-key API.
    Every round one thread drops the connection (as a failed call would) while
    the others are starting theirs: they finish on the store they hold, or on
    the one that replaces it, never on a closed one, and never open two.
    """
    per = 8  # host pages per thread: 4 written, 4 read into
    with KVStore(served_pool) as check:
        hosts_before = sum(m["alive"] for m in check.pool.info()["members"])
    store = backend(served_pool, models["base"], pages=THREADS * per, retry_s=0)
    host = store.mem_pool_host
    fill(host, seed=3)
    shared = [page_bytes(host, p) for p in (2, 3)]
    for t in range(1, THREADS):  # the shared keys' pages hold the same bytes in every thread
        for j, p in enumerate((2, 3)):
            ptrs, sizes = host.get_page_buffer_meta(pages(t * per + p))
            for ptr, size, at in zip(ptrs, sizes, (0, sizes[0]), strict=True):
                ctypes.memmove(ptr, shared[j][at : at + size], size)
    barrier = threading.Barrier(THREADS, timeout=JOIN_S)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        keys = [f"own-{t}-0", f"own-{t}-1", "shared-0", "shared-1"]
        src = [t * per + p for p in range(4)]
        dst = [t * per + 4 + p for p in range(4)]
        value = torch.full((256,), t, dtype=torch.int32)
        out = torch.zeros(256, dtype=torch.int32)
        try:
            for _ in range(ROUNDS):
                barrier.wait()
                if t == 0:
                    store.link.lost(RpcError("dropped by the test"))
                host.kv_buffer[:, pages(*dst)] = 0
                assert store.batch_set_v1(keys, pages(*src)) == [True] * 4
                assert store.batch_exists(keys) == 4
                assert store.batch_get_v1(keys, pages(*dst)) == [True] * 4
                for s, d in zip(src, dst, strict=True):
                    assert page_bytes(host, d) == page_bytes(host, s)
                assert store.set(f"tensor-{t}", value) and store.get(f"tensor-{t}", out) is out
                assert torch.equal(out, value)
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(thread.is_alive() for thread in threads), "a thread is stuck"
    assert not errors, errors
    with KVStore(served_pool) as check:
        stats = check.stats()
        hosts = sum(m["alive"] for m in check.pool.info()["members"])
    assert stats["writes_in_flight"] == 0
    assert stats["keys"] == 3 * THREADS + 2  # own pages, tensors, and the shared pages once
    # every block holds a key, or a replaced value whose read lease has yet to expire
    assert stats["blocks_used"] == stats["keys"] + stats["retiring_extents"]
    assert hosts == hosts_before + 1  # the threads shared the backend's one connection
    store.close()


def test_per_key_methods_round_trip_tensors(served_pool: str, models: dict[str, str]) -> None:
    store = backend(served_pool, models["base"])
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
    store = backend(str(tmp_path / "gone"), "tiny-llama", model_revision="r1")
    pages = torch.arange(0, 2 * PAGE)
    assert store.batch_set_v1(["a", "b"], pages) == [False, False]
    assert store.batch_get_v1(["a", "b"], pages) == [False, False]
    assert store.batch_exists(["a"]) == 0 and not store.set("a", torch.zeros(4))
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    store.close()


def test_without_a_pool_setting_the_backend_uses_beluga_pool(
    served_pool: str, models: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BELUGA_POOL", raising=False)
    with pytest.raises(PoolNotNamedError, match="'pool' in --hicache-storage-backend-extra-config"):
        backend(None, models["base"])
    monkeypatch.setenv("BELUGA_POOL", served_pool)
    store = backend(None, models["base"])
    fill(store.mem_pool_host, seed=3)
    assert store.batch_set_v1(["h0"], pages(0)) == [True]
    with KVStore(served_pool) as direct:
        assert direct.is_exist(store.key("h0"))  # in the pool $BELUGA_POOL names
    store.close()
