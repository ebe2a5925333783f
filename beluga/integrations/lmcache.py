"""BelugaBackend: an LMCache storage plugin that keeps KV chunks in a Beluga pool.

Configure LMCache (0.5.x) with::

    storage_plugins: ["beluga"]
    extra_config:
      storage_plugin.beluga.module_path: beluga.integrations.lmcache
      storage_plugin.beluga.class_name: BelugaBackend
      beluga.pool: shm:/dev/shm/beluga

Every LMCache instance that names the same pool shares its chunks: a chunk
stored by one engine is found, by its CacheEngineKey, by any other instance
of the same model.  Keys are CacheEngineKeys in a :class:`beluga.kv.KVNamespace`
of the model's identity (its Hugging Face commit, or a fingerprint of its
weights files, found from LMCache's model name, which vLLM sets to the model
path or repo id; see :func:`model_identity`) and LMCache's KV shape and dtype:
a fine-tune served under the same name is another model and never reads these
chunks.

A stored value is a 64-byte header (shape, dtype and memory format of the
MemoryObj, so a reader can allocate before copying) followed by the chunk's
bytes.  Both directions are one C call per batch: a put reserves the batch's
pool blocks (one RPC), gather-writes every header and payload straight from
the MemoryObjs, and seals; a get locates the batch (one RPC), scatter-reads
the headers, allocates MemoryObjs from LMCache's CPU backend, scatter-reads
the payloads into them, and keeps only chunks whose pool block stayed the same
version throughout (a replaced or evicted block is a miss, never data).

When the pool or its server is unavailable the backend answers "not here" and
drops puts, with one warning per outage (:mod:`beluga.integrations._link`).
Pins are not kept: Beluga evicts by LRU under read leases, so a chunk found
by ``contains`` can still be a miss at retrieve time, which LMCache handles
as any miss.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from beluga.errors import CapacityError
from beluga.integrations._link import UNAVAILABLE, StoreLink, log
from beluga.kv import BlockRef, KVNamespace, KVStore, ModelIdentity, resolve_model
from beluga.transfer import host_bytes

_HEADER = struct.Struct("<4sBB2x16s5q")  # magic, format, ndim, dtype name, shape
_MAGIC = b"BLMC"
_MAX_DIMS = 5


SETTING = "extra_config 'beluga.model_revision' (or 'beluga.model_path')"


def model_identity(metadata: Any, extra: dict[str, Any]) -> ModelIdentity:
    """The identity of LMCache's model; refused, naming the setting, when it cannot be found.

    In order: ``beluga.model_revision`` (an explicit revision), the files at
    ``beluga.model_path``, then LMCache's model name taken as a path or a repo
    id in the Hugging Face cache (LMCache does not know the revision: a repo
    with several cached snapshots needs ``beluga.model_revision``).
    """
    return resolve_model(
        getattr(metadata, "model_name", None),
        path=extra.get("beluga.model_path"),
        explicit_revision=extra.get("beluga.model_revision"),
        setting=SETTING,
    )


def kv_namespace(model: ModelIdentity, metadata: Any) -> KVNamespace:
    """Where this model's chunks live: its identity, and LMCache's KV shape and dtype."""
    shape = tuple(getattr(metadata, "kv_shape", ()))
    layout = f"{shape}/{getattr(metadata, 'kv_dtype', None)}/mla={getattr(metadata, 'use_mla', 0)}"
    return KVNamespace(model, layout, ("lmcache",))


def _header(obj: MemoryObj) -> bytes:
    shape = tuple(obj.metadata.shape)
    dtype = str(obj.metadata.dtype).removeprefix("torch.")
    if len(shape) > _MAX_DIMS:
        raise ValueError(f"a chunk of {len(shape)} dimensions does not fit the header")
    padded = (*shape, *([0] * (_MAX_DIMS - len(shape))))
    return _HEADER.pack(_MAGIC, obj.metadata.fmt.value, len(shape), dtype.encode(), *padded)


def _parse(header: bytes) -> tuple[torch.Size, torch.dtype, MemoryFormat] | None:
    magic, fmt, ndim, dtype, *shape = _HEADER.unpack(header)
    if magic != _MAGIC or ndim > _MAX_DIMS:
        return None
    name = dtype.rstrip(b"\0").decode()
    return torch.Size(shape[:ndim]), getattr(torch, name), MemoryFormat(fmt)


class BelugaBackend(StoragePluginInterface):
    """LMCache storage plugin over a Beluga pool (see the module docstring).

    Thread-safe as far as Beluga goes: calls from several threads (LMCache's
    event loop and its callers) share one pool connection (:class:`StoreLink`)
    and keep their state on the stack; memory objects come from LMCache's
    local CPU backend, under its own rules.  Fork-safe as far as Beluga goes:
    a forked child connects its own.
    """

    def __init__(
        self,
        dst_device: str = "cpu",
        config: Any = None,
        metadata: Any = None,
        local_cpu_backend: Any = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(dst_device, config, metadata, local_cpu_backend, loop)
        extra = (config.extra_config if config is not None else None) or {}
        self.namespace = kv_namespace(model_identity(metadata, extra), metadata)
        self.link = StoreLink(
            str(extra.get("beluga.pool", "")),
            who="LMCache BelugaBackend",
            coherence=extra.get("beluga.coherence"),
            timeout_s=float(extra.get("beluga.timeout_s", 5.0)),
            retry_s=float(extra.get("beluga.retry_s", 30.0)),
        )
        self.link.available()  # report a missing pool when LMCache starts

    def __str__(self) -> str:
        return f"BelugaBackend({self.link.spec})"

    # -- lookups -------------------------------------------------------------

    def pool_key(self, key: CacheEngineKey) -> bytes:
        """The store key of a chunk."""
        return self.namespace.key(key.to_string())

    def _call(self, fn: Callable[[KVStore], Any], default: Any) -> Any:
        """``fn(store)``, or ``default`` while the pool is unavailable."""
        with self.link.connected() as store:
            if store is None:
                return default
            try:
                return fn(store)
            except UNAVAILABLE as e:
                self.link.lost(e, store)
                return default

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self._call(lambda s: s.is_exist(self.pool_key(key)), False)

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """Leading keys present: one batched prefix lookup."""
        return self._call(lambda s: s.lookup_prefix([self.pool_key(k) for k in keys]), 0)

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        return self.batched_contains(keys, pin)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return False  # puts finish before batched_submit_put_task returns

    def pin(self, key: CacheEngineKey) -> bool:
        return self.contains(key)

    def unpin(self, key: CacheEngineKey) -> bool:
        return self.contains(key)

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        return self._call(lambda s: s.remove(self.pool_key(key)), False)

    def touch_cache(self) -> None:
        """The pool's server keeps LRU order from lookups itself."""

    # -- puts ----------------------------------------------------------------

    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> list[Future] | None:
        """Store the chunks now (one reserve, one gather-write, one seal) and report each."""
        if len(keys) != len(objs):
            raise ValueError(f"{len(keys)} keys but {len(objs)} memory objects")
        batch = [(k, o) for k, o in zip(keys, objs, strict=True) if len(o.get_shapes()) == 1]
        if not batch:
            return None
        with self.link.connected() as store:
            if store is None:
                return None
            try:
                self._put(store, batch)
            except CapacityError as e:
                log.debug("LMCache BelugaBackend: no room for %d chunks: %s", len(batch), e)
                return None
            except UNAVAILABLE as e:
                self.link.lost(e, store)
                return None
        if on_complete_callback is not None:
            for key, _ in batch:
                on_complete_callback(key)
        return None

    def _put(self, store: KVStore, batch: list[tuple[CacheEngineKey, MemoryObj]]) -> None:
        payloads = [host_bytes(obj.tensor) for _, obj in batch]
        headers = np.frombuffer(b"".join(_header(obj) for _, obj in batch), dtype=np.uint8)
        refs = store.reserve(
            [self.pool_key(k) for k, _ in batch], [_HEADER.size + p.size for p in payloads]
        )
        try:
            table = np.array(
                [(0, i * _HEADER.size, r.payload_offset, _HEADER.size) for i, r in enumerate(refs)]
                + [
                    (i + 1, 0, r.payload_offset + _HEADER.size, p.size)
                    for i, (r, p) in enumerate(zip(refs, payloads, strict=True))
                ],
                dtype=np.uint64,
            )
            store.mem.gather_write([headers, *payloads], table)
        except BaseException:
            store.abort(refs)
            raise
        store.seal(refs)

    # -- gets ----------------------------------------------------------------

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.batched_get_blocking([key])[0]

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return self._call(lambda s: self._get(s, keys), [None] * len(keys))

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey], transfer_spec: Any = None
    ) -> list[MemoryObj]:
        """The leading chunks found, as LMCache's prefix retrieval expects."""
        out = []
        for obj in self.batched_get_blocking(keys):
            if obj is None:
                break
            out.append(obj)
        return out

    def _get(self, store: KVStore, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        located = store.locate([self.pool_key(k) for k in keys], prefix=False)
        found = [(i, r) for i, r in enumerate(located) if r is not None]
        out: list[MemoryObj | None] = [None] * len(keys)
        if not found:
            return out
        refs = [r for _, r in found]
        headers = np.zeros(len(refs) * _HEADER.size, dtype=np.uint8)
        rows = [(0, j * _HEADER.size, r.payload_offset, _HEADER.size) for j, r in enumerate(refs)]
        store.mem.scatter_read([headers], np.array(rows, dtype=np.uint64))
        objs = self._allocate(refs, headers)
        try:
            wanted = [j for j, obj in enumerate(objs) if obj is not None]
            if wanted:
                buffers = [host_bytes(objs[j].tensor) for j in wanted]  # type: ignore[union-attr]
                table = np.array(
                    [
                        (n, 0, refs[j].payload_offset + _HEADER.size, buffers[n].size)
                        for n, j in enumerate(wanted)
                    ],
                    dtype=np.uint64,
                )
                store.mem.scatter_read(buffers, table)
            for j, ok in enumerate(store.check(refs)):
                if objs[j] is not None and not ok:  # replaced or evicted meanwhile
                    objs[j].ref_count_down()  # type: ignore[union-attr]
                    objs[j] = None
        except BaseException:
            for obj in objs:
                if obj is not None:
                    obj.ref_count_down()
            raise
        for (i, _), obj in zip(found, objs, strict=True):
            out[i] = obj
        return out

    def _allocate(self, refs: list[BlockRef], headers: np.ndarray) -> list[MemoryObj | None]:
        """A MemoryObj for each block whose header parses and matches its length."""
        objs: list[MemoryObj | None] = []
        for j, ref in enumerate(refs):
            parsed = _parse(headers[j * _HEADER.size : (j + 1) * _HEADER.size].tobytes())
            obj = None
            if parsed is not None:
                obj = self.local_cpu_backend.allocate(*parsed)
            if obj is not None and _HEADER.size + obj.get_size() != ref.length:
                obj.ref_count_down()
                obj = None
            objs.append(obj)
        return objs

    def get_allocator_backend(self) -> Any:
        if self.local_cpu_backend is None:
            raise ValueError("BelugaBackend needs LMCache's local CPU backend to allocate reads")
        return self.local_cpu_backend

    def close(self) -> None:
        self.link.close()
