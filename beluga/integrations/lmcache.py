"""BelugaBackend: an LMCache storage plugin that keeps KV chunks in a Beluga pool.

Configure LMCache (0.5.x) with::

    storage_plugins: ["beluga"]
    extra_config:
      storage_plugin.beluga.module_path: beluga.integrations.lmcache
      storage_plugin.beluga.class_name: BelugaBackend
      beluga.pool: shm:/dev/shm/beluga

Without ``beluga.pool`` the pool is ``$BELUGA_POOL`` (:func:`beluga.pool.resolve_pool`).

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
bytes.  Both directions go through the store's one data path: a put is one
``KVStore.save`` of each chunk's header and payload (one reserve RPC, every
header and payload moved straight from the MemoryObjs in one C call, each
block sealed with the CRC32C of the bytes it stored, one commit; a chunk the
pool holds already is skipped).  A get locates the batch in the pool index (no
RPC), peeks at the headers (``KVStore.peek``: unchecked, only to size the
reads), allocates MemoryObjs from LMCache's CPU backend, and reads header and
payload into them with one ``KVStore.load``: a chunk is kept only if its block
validated (this key and version, its checksum over the bytes as copied) and
its header is the one peeked at.  A replaced, evicted or corrupted block is a
miss, never data.

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
from beluga.integrations._link import StoreLink, log
from beluga.kv import BlockRef, KVNamespace, KVStore, ModelIdentity, resolve_model
from beluga.transfer import Pieces, host_bytes

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
    """Shape, dtype and format from a header; None for anything that is not one."""
    magic, fmt, ndim, dtype, *shape = _HEADER.unpack(header)
    if magic != _MAGIC or ndim > _MAX_DIMS or any(n < 0 for n in shape):
        return None
    try:
        kind = getattr(torch, dtype.rstrip(b"\0").decode())
        memory_format = MemoryFormat(fmt)
    except (AttributeError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(kind, torch.dtype):
        return None
    return torch.Size(shape[:ndim]), kind, memory_format


def _header_at(headers: np.ndarray, j: int) -> bytes:
    """The ``j``-th header of a buffer of headers."""
    return headers[j * _HEADER.size : (j + 1) * _HEADER.size].tobytes()


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return shape.numel() * dtype.itemsize


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
        self.link = StoreLink.from_options(
            extra, who="LMCache BelugaBackend", where="LMCache's extra_config", prefix="beluga."
        )
        self.link.available()  # report a missing pool when LMCache starts

    def __str__(self) -> str:
        return f"BelugaBackend({self.link.spec})"

    # -- lookups -------------------------------------------------------------

    def pool_key(self, key: CacheEngineKey) -> bytes:
        """The store key of a chunk."""
        return self.namespace.key(key.to_string())

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self.link.call(lambda s: s.is_exist(self.pool_key(key)), False)

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """Leading keys present: one batched prefix lookup."""
        return self.link.call(lambda s: s.lookup_prefix([self.pool_key(k) for k in keys]), 0)

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
        return self.link.call(lambda s: s.remove(self.pool_key(key)), False)

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
        """Store the chunks now (one reserve, one validated write) and report each."""
        if len(keys) != len(objs):
            raise ValueError(f"{len(keys)} keys but {len(objs)} memory objects")
        batch = [(k, o) for k, o in zip(keys, objs, strict=True) if len(o.get_shapes()) == 1]
        if not batch:
            return None
        stored = self.link.call(lambda s: self._put(s, batch), False)
        if stored and on_complete_callback is not None:
            for key, _ in batch:
                on_complete_callback(key)
        return None

    def _put(self, store: KVStore, batch: list[tuple[CacheEngineKey, MemoryObj]]) -> bool:
        """Each chunk's header and payload, one value per key (a chunk the pool holds is
        skipped); a chunk whose write lease ran out twice is dropped, as a full pool's.
        False when the pool has no room."""
        values = Pieces([[_header(obj), host_bytes(obj.tensor)] for _, obj in batch])
        try:
            saved = store.save([self.pool_key(k) for k, _ in batch], values, attempts=2)
        except CapacityError as e:
            log.debug("LMCache BelugaBackend: no room for %d chunks: %s", len(batch), e)
            return False
        if saved.lost:
            log.debug("LMCache BelugaBackend: %d chunks lost their write lease", len(saved.lost))
        return True

    # -- gets ----------------------------------------------------------------

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.batched_get_blocking([key])[0]

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return self.link.call(lambda s: self._get(s, keys), [None] * len(keys))

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
        found = [(i, r) for i, r in enumerate(located) if r is not None and r.length > _HEADER.size]
        out: list[MemoryObj | None] = [None] * len(keys)
        if not found:
            return out
        refs = [r for _, r in found]
        # An unchecked peek at the headers, only to size the memory objects: the
        # validated read below copies each header again, and it must be this one.
        peeked = store.peek(refs, _HEADER.size)
        objs = self._allocate(refs, peeked)
        try:
            self._read(store, refs, objs, peeked)
        except BaseException:
            for obj in objs:
                if obj is not None:
                    obj.ref_count_down()
            raise
        for (i, _), obj in zip(found, objs, strict=True):
            out[i] = obj
        return out

    @staticmethod
    def _read(
        store: KVStore, refs: list[BlockRef], objs: list[MemoryObj | None], peeked: list[bytes]
    ) -> None:
        """Read whole chunks into their memory objects; drop each one that is not valid."""
        wanted = [j for j, obj in enumerate(objs) if obj is not None]
        if not wanted:
            return
        payloads = [host_bytes(objs[j].tensor) for j in wanted]  # type: ignore[union-attr]
        h = _HEADER.size
        headers = np.zeros(len(wanted) * h, dtype=np.uint8)
        sink = Pieces([[headers[n * h : (n + 1) * h], p] for n, p in enumerate(payloads)])
        valid = store.load([refs[j] for j in wanted], sink, drop_corrupt=True)
        for n, j in enumerate(wanted):
            if not valid[n] or _header_at(headers, n) != peeked[j]:
                objs[j].ref_count_down()  # type: ignore[union-attr]
                objs[j] = None

    def _allocate(self, refs: list[BlockRef], headers: list[bytes]) -> list[MemoryObj | None]:
        """A MemoryObj for each block whose header parses and matches its length."""
        objs: list[MemoryObj | None] = []
        for ref, header in zip(refs, headers, strict=True):
            parsed = _parse(header)
            obj = None
            if parsed is not None and _HEADER.size + _nbytes(*parsed[:2]) == ref.length:
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
