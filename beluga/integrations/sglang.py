"""BelugaHiCacheStorage: an SGLang HiCache storage backend (its L3 tier) on a Beluga pool.

SGLang loads it through its ``dynamic`` storage backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "beluga",
        "module_path": "beluga.integrations.sglang", "class_name": "BelugaHiCacheStorage",
        "interface_v1": 1, "pool": "shm:/dev/shm/beluga"}'

Without ``"pool"`` the pool is ``$BELUGA_POOL`` (:func:`beluga.pool.resolve_pool`).

With ``interface_v1`` SGLang calls the zero-copy batch methods:
``batch_set_v1`` / ``batch_get_v1`` name pages of its host KV pool by index,
the host pool says where their bytes are (``get_page_buffer_meta``), and each
batch moves straight between those bytes and the pool, with no staging copy
on either side, through the store's one data path: one ``KVStore.save`` of
the pages' pieces (one reserve RPC, each block sealed with the CRC32C of the
bytes it stored, one commit; pages the pool holds already are skipped), or
one ``KVStore.load`` after a one-sided lookup (each block's header and the
checksum of the bytes as copied checked).  A page whose pool block is replaced, evicted or corrupted
is reported as not read.  ``batch_exists`` is one prefix lookup.  The older
per-key methods (get/set/batch_get/batch_set/exists) work too, through the
store's buffer API.

Keys are SGLang's page hashes in a :class:`beluga.kv.KVNamespace`: the
model's identity (see :func:`model_identity`: its Hugging Face commit or a
fingerprint of its weights files, so a fine-tune served under the same name
is another model), the host pool's page format (layout, dtype, layers, heads),
and, for non-MLA models, the tensor- and pipeline-parallel ranks (each rank
holds its own heads); MLA ranks share.  When the pool or its server is
unavailable every page is a miss and writes report failure, with one warning
per outage (:mod:`beluga.integrations._link`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from beluga.errors import CapacityError
from beluga.integrations._link import StoreLink, log
from beluga.kv import KVNamespace, KVStore, ModelIdentity, Saved, resolve_model
from beluga.transfer import Buffers, Pieces, Values

SETTING = "--hicache-storage-backend-extra-config 'model_revision' (or 'model_path')"
# what the host KV pool says about its pages, when it says it (MHA, MLA and other pools)
_HOST_POOL_FACTS = (
    "layout",
    "dtype",
    "page_size",
    "layer_num",
    "head_num",
    "head_dim",
    "v_head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "size_per_token",
    "storage_format_tag",
)


def model_identity(storage_config: HiCacheStorageConfig) -> ModelIdentity:
    """The identity of the model SGLang serves; refused, naming the setting, when unknown.

    In order: ``model_revision`` from the extra config (an explicit revision),
    the files at ``model_path`` from the extra config, the model path and
    revision SGLang was started with (when its runtime context is
    published), and SGLang's model name taken as a path or a cached repo id.
    """
    extra = storage_config.extra_config or {}
    path, revision = extra.get("model_path"), None
    if path is None:
        path, revision = _served_model()
    return resolve_model(
        storage_config.model_name,
        path=path,
        revision=revision,
        explicit_revision=extra.get("model_revision"),
        setting=SETTING,
    )


def _served_model() -> tuple[str | None, str | None]:
    """The model path and revision of this SGLang process, if its runtime context has them."""
    try:
        from sglang.srt.runtime_context import get_model

        served = get_model()
        return str(served.model_path), str(served.revision or "main")
    except (ImportError, ValueError, AttributeError):
        return None, None


class BelugaHiCacheStorage(HiCacheStorage):
    """SGLang HiCache L3 storage over a Beluga pool (see the module docstring).

    Thread-safe: SGLang's prefetch and backup threads may call any method at
    once; calls share one pool connection (:class:`StoreLink`) and keep their
    state on the stack.  Fork-safe as far as Beluga goes: a forked child
    connects its own (SGLang creates backends in the process that uses them).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = storage_config.extra_config or {}
        self.model = model_identity(storage_config)
        self.link = StoreLink.from_options(
            extra, who="SGLang BelugaHiCacheStorage", where="--hicache-storage-backend-extra-config"
        )
        rank = 0 if storage_config.is_mla_model else storage_config.tp_rank
        self._scope = (
            "sglang",
            f"tp{rank}/{storage_config.tp_size}",
            f"pp{storage_config.pp_rank}/{storage_config.pp_size}",
        )
        self.namespace: KVNamespace | None = None  # once the host pool is registered
        self.link.available()  # report a missing pool when SGLang starts

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host KV pool; its page format completes the key namespace."""
        super().register_mem_pool_host(mem_pool_host)
        facts = {name: getattr(mem_pool_host, name, None) for name in _HOST_POOL_FACTS}
        layout = type(mem_pool_host).__name__ + repr(sorted((k, str(v)) for k, v in facts.items()))
        self.namespace = KVNamespace(self.model, layout, self._scope)

    def key(self, page: str) -> bytes:
        """The store key of one page."""
        if self.namespace is None:
            raise ValueError(
                "BelugaHiCacheStorage keys pages by the host KV pool's format: call "
                "register_mem_pool_host first (SGLang does when it attaches the backend)"
            )
        return self.namespace.key(page)

    # -- zero-copy batch interface (interface_v1) ----------------------------

    def _pages(
        self, keys: Sequence[str], host_indices: torch.Tensor
    ) -> list[list[tuple[int, int]]]:
        """(address, size) of each page's pieces in the host pool, per key."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if not keys or len(ptrs) % len(keys):
            raise ValueError(
                f"the host pool gave {len(ptrs)} buffers for {len(keys)} pages; "
                "pass host indices for whole pages, one page per key"
            )
        per = len(ptrs) // len(keys)
        pieces = list(zip(ptrs, sizes, strict=True))
        return [pieces[i * per : (i + 1) * per] for i in range(len(keys))]

    def _on_pages(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        move: Callable[[KVStore, list[bytes], list[list[tuple[int, int]]]], list[bool]],
    ) -> list[bool]:
        """``move`` the pages of ``keys`` (in the host pool at ``host_indices``) between the
        host pool and the pool; which pages moved (none while the pool is unavailable)."""
        if not keys:
            return []
        pages = self._pages(keys, host_indices)
        pool_keys = [self.key(k) for k in keys]
        return self.link.call(lambda s: move(s, pool_keys, pages), [False] * len(keys))

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        return self._on_pages(keys, host_indices, self._set_pages)

    def _set_pages(
        self, store: KVStore, pool_keys: list[bytes], pages: list[list[tuple[int, int]]]
    ) -> list[bool]:
        """Save pages (a page the pool holds already is skipped, one another host is saving is
        waited for); which are in the pool."""
        saved = self._save(store, pool_keys, Pieces(pages))
        if saved is None:
            return [False] * len(pages)
        there = set(saved.stored) | set(saved.present)
        return [i in there for i in range(len(pages))]

    @staticmethod
    def _save(store: KVStore, pool_keys: list[bytes], values: Values) -> Saved | None:
        """Save values, a lost write lease tried once more; None when the pool has no room."""
        try:
            return store.save(pool_keys, values, attempts=2)
        except CapacityError as e:
            log.debug("SGLang BelugaHiCacheStorage: no room for %d pages: %s", len(pool_keys), e)
            return None

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        return self._on_pages(keys, host_indices, self._get_pages)

    @staticmethod
    def _get_pages(
        store: KVStore, pool_keys: list[bytes], pages: list[list[tuple[int, int]]]
    ) -> list[bool]:
        """Read pages straight into the host pool, each validated; which were read."""
        located = store.locate(pool_keys, prefix=False)
        return store.load(located, Pieces(pages), drop_corrupt=True)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Leading pages present: one batched prefix lookup."""
        pool_keys = [self.key(k) for k in keys]
        return self.link.call(lambda s: s.lookup_prefix(pool_keys), 0)

    # -- per-key interface ---------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        (value,) = self.batch_get([key], [target_location] if target_location is not None else None)
        return value

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Values as uint8 tensors, or read into ``target_locations`` (tensors) when given."""
        pool_keys = [self.key(k) for k in keys]
        if target_locations is None:
            values = self.link.call(lambda s: s.get_batch(pool_keys), [None] * len(keys))
            return [
                None if v is None else torch.frombuffer(bytearray(v), dtype=torch.uint8)
                for v in values
            ]
        lengths = self.link.call(
            lambda s: s.batch_get_into(pool_keys, list(target_locations)), None
        )
        if lengths is None:
            return [None] * len(keys)
        return [t if n >= 0 else None for t, n in zip(target_locations, lengths, strict=True)]

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store contiguous CPU tensors (``values``, or ``target_locations``)."""
        data = values if values is not None else target_locations
        if data is None:
            return False
        pool_keys = [self.key(k) for k in keys]

        def stored_all(store: KVStore) -> bool:
            saved = self._save(store, pool_keys, Buffers(list(data)))
            return saved is not None and len(saved.stored) + len(saved.present) == len(keys)

        return self.link.call(stored_all, False)

    def clear(self) -> None:
        """Nothing to do: pages stay in the pool for other engines, and the server evicts LRU."""

    def close(self) -> None:
        self.link.close()
