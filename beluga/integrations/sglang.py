"""BelugaHiCacheStorage: an SGLang HiCache storage backend (its L3 tier) on a Beluga pool.

SGLang loads it through its ``dynamic`` storage backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "beluga",
        "module_path": "beluga.integrations.sglang", "class_name": "BelugaHiCacheStorage",
        "interface_v1": 1, "pool": "shm:/dev/shm/beluga"}'

With ``interface_v1`` SGLang calls the zero-copy batch methods:
``batch_set_v1`` / ``batch_get_v1`` name pages of its host KV pool by index,
the host pool says where their bytes are (``get_page_buffer_meta``), and each
batch moves as one gather-write (after one reserve RPC, then one seal) or one
scatter-read (after one lookup RPC) straight between those bytes and the pool:
no staging copy on either side.  A page whose pool block is replaced or
evicted during a read is reported as not read.  ``batch_exists`` is one
prefix lookup.  The older per-key methods (get/set/batch_get/batch_set/exists)
work too, through the store's buffer API.

Keys are SGLang's page hashes under the model name and, for non-MLA models,
the tensor-parallel rank (each rank holds its own heads); MLA ranks share.
When the pool or its server is unavailable every page is a miss and writes
report failure, with one warning per outage (:mod:`beluga.integrations._link`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from beluga.errors import CapacityError
from beluga.integrations._link import UNAVAILABLE, StoreLink, log
from beluga.kv import KVStore
from beluga.kv.store import as_buffer


class BelugaHiCacheStorage(HiCacheStorage):
    """SGLang HiCache L3 storage over a Beluga pool (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = storage_config.extra_config or {}
        self.link = StoreLink(
            str(extra.get("pool", "")),
            who="SGLang BelugaHiCacheStorage",
            coherence=extra.get("coherence"),
            timeout_s=float(extra.get("timeout_s", 5.0)),
            retry_s=float(extra.get("retry_s", 30.0)),
        )
        rank = 0 if storage_config.is_mla_model else storage_config.tp_rank
        self._prefix = (
            f"{storage_config.model_name}@{rank}/{storage_config.tp_size}"
            f"@{storage_config.pp_rank}/{storage_config.pp_size}/"
        )
        self.link.get()  # report a missing pool when SGLang starts

    def key(self, page: str) -> bytes:
        """The store key of one page (hashed when the model name makes it long)."""
        raw = (self._prefix + page).encode()
        return b"sglang/" + (raw if len(raw) <= 200 else hashlib.sha256(raw).digest())

    def _store(self) -> KVStore | None:
        return self.link.get()

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

    @staticmethod
    def _table(pages: list[list[tuple[int, int]]], offsets: list[int]) -> tuple[list, np.ndarray]:
        """Buffers and the scatter-gather table joining each page's pieces to its pool block."""
        buffers, rows = [], []
        for pieces, offset in zip(pages, offsets, strict=True):
            for address, size in pieces:
                rows.append((len(buffers), 0, offset, size))
                buffers.append(as_buffer((address, size), writable=True))
                offset += size
        return buffers, np.array(rows, dtype=np.uint64).reshape(-1, 4)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        store = self._store()
        if store is None or not keys:
            return [False] * len(keys)
        pages = self._pages(keys, host_indices)
        pool_keys = [self.key(k) for k in keys]
        try:
            present = store.batch_is_exist(pool_keys)
            new = [i for i, there in enumerate(present) if not there]
            if new:
                refs = store.reserve(
                    [pool_keys[i] for i in new], [sum(s for _, s in pages[i]) for i in new]
                )
                try:
                    buffers, table = self._table(
                        [pages[i] for i in new], [r.payload_offset for r in refs]
                    )
                    store.mem.gather_write(buffers, table)
                except BaseException:
                    store.abort(refs)
                    raise
                store.seal(refs)
        except CapacityError as e:
            log.debug("SGLang BelugaHiCacheStorage: no room for %d pages: %s", len(keys), e)
            return [False] * len(keys)
        except UNAVAILABLE as e:
            self.link.lost(e)
            return [False] * len(keys)
        return [True] * len(keys)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        store = self._store()
        if store is None or not keys:
            return [False] * len(keys)
        pages = self._pages(keys, host_indices)
        try:
            refs = store.locate([self.key(k) for k in keys], prefix=False)
            found = [
                i
                for i, r in enumerate(refs)
                if r is not None and r.length == sum(s for _, s in pages[i])
            ]
            ok = [False] * len(keys)
            if found:
                buffers, table = self._table(
                    [pages[i] for i in found],
                    [refs[i].payload_offset for i in found],  # type: ignore[union-attr]
                )
                store.mem.scatter_read(buffers, table)
                # sealed blocks are immutable: unchanged afterwards means read whole
                for i, same in zip(found, store.check([refs[i] for i in found]), strict=True):
                    ok[i] = same
        except UNAVAILABLE as e:
            self.link.lost(e)
            return [False] * len(keys)
        return ok

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Leading pages present: one batched prefix lookup."""
        store = self._store()
        if store is None:
            return 0
        try:
            return store.lookup_prefix([self.key(k) for k in keys])
        except UNAVAILABLE as e:
            self.link.lost(e)
            return 0

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
        store = self._store()
        if store is None:
            return [None] * len(keys)
        pool_keys = [self.key(k) for k in keys]
        try:
            if target_locations is None:
                return [
                    None if v is None else torch.frombuffer(bytearray(v), dtype=torch.uint8)
                    for v in store.get_batch(pool_keys)
                ]
            lengths = store.batch_get_into(pool_keys, list(target_locations))
        except UNAVAILABLE as e:
            self.link.lost(e)
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
        store = self._store()
        if store is None or data is None:
            return False
        try:
            store.batch_put_from([self.key(k) for k in keys], list(data))
        except CapacityError as e:
            log.debug("SGLang BelugaHiCacheStorage: no room for %d pages: %s", len(keys), e)
            return False
        except UNAVAILABLE as e:
            self.link.lost(e)
            return False
        return True

    def clear(self) -> None:
        """Nothing to do: pages stay in the pool for other engines, and the server evicts LRU."""

    def close(self) -> None:
        self.link.close()
