"""The drop-in's byte values: Mooncake's writes, reads, removal and buffer forms.

:class:`ObjectStore` adds to :class:`~beluga.compat.mooncake.core.StoreCore`
the forms of bytes-like values: ``put`` / ``upsert`` (single, parts, batch,
from addresses), ``get`` (bytes, buffers, into addresses), ``is_exist``,
``get_size``, the removals and the buffer registry.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Sequence
from typing import Any

from beluga.compat.mooncake.checks import (
    FAILURES,
    check_count,
    check_key,
    check_keys,
    check_list,
    check_ranges,
    check_value,
    code_of,
    raw_view,
)
from beluga.compat.mooncake.codes import INVALID_PARAMS, OBJECT_NOT_FOUND, OK
from beluga.compat.mooncake.core import StoreCore, log
from beluga.compat.mooncake.records import BufferHandle, config_code


class ObjectStore(StoreCore):
    """Mooncake's forms for bytes-like values, over the core's batch steps.

    Uses from :class:`StoreCore`: ``_put_many``, ``_values``, ``_into``,
    ``_remove``, ``_remove_written``, ``_client``, and the tables ``_lock``,
    ``_store``, ``_registered`` and ``_allocated``.  Thread- and fork-safety:
    the core's.
    """

    # -- writes --------------------------------------------------------------

    def _put_values(self, key: object, value: object, replace: bool) -> int:
        k = check_key(key)
        view = check_value(value)
        return self._put_many([key], [k], [view], replace)[0]  # type: ignore[list-item]

    def put(self, key: str, value: Any, config: Any = None) -> int:
        """Store bytes-like ``value`` under ``key`` unless the key exists; 0 or a negative code."""
        return config_code(config) or self._put_values(key, value, replace=False)

    def upsert(self, key: str, value: Any, config: Any = None) -> int:
        """Store ``value`` under ``key``, replacing any value; 0 or a negative code."""
        return config_code(config) or self._put_values(key, value, replace=True)

    def _parts(self, key: object, parts: Sequence[object], replace: bool) -> int:
        k = check_key(key)
        joined = b"".join(bytes(check_value(p)) for p in parts)
        return self._put_many([key], [k], [joined], replace)[0]  # type: ignore[list-item]

    def put_parts(self, key: str, *parts: Any, config: Any = None) -> int:
        """Store the concatenation of ``parts`` as one value (put semantics)."""
        return self._parts(key, parts, replace=False)

    def upsert_parts(self, key: str, *parts: Any, config: Any = None) -> int:
        """Store the concatenation of ``parts`` as one value, replacing any."""
        return self._parts(key, parts, replace=True)

    def _batch(self, keys: object, values: object, replace: bool) -> int:
        names = check_list(keys, "keys")
        ks = check_keys(names)
        views = [check_value(v) for v in check_list(values, "values")]
        if len(ks) != len(views):
            return INVALID_PARAMS
        if any(k is None or not len(v) for k, v in zip(ks, views, strict=True)):
            return INVALID_PARAMS
        codes = self._put_many(names, ks, views, replace)
        return next((c for c in codes if c != OK), OK)

    def put_batch(self, keys: list[str], values: list[Any], config: Any = None) -> int:
        """Store many values (existing keys keep theirs); 0, or the first failure's code."""
        return self._batch(keys, values, replace=False)

    def upsert_batch(self, keys: list[str], values: list[Any], config: Any = None) -> int:
        """Store many values, replacing existing ones; 0, or the first failure's code."""
        return self._batch(keys, values, replace=True)

    def _from(self, keys: object, ptrs: object, sizes: object, replace: bool) -> list[int]:
        names = check_list(keys, "keys")
        ks = check_keys(names)
        addresses, lengths = check_ranges(ptrs, sizes)
        if not len(ks) == len(addresses) == len(lengths):
            return [INVALID_PARAMS] * len(ks)
        raw = [(a, n) if a else None for a, n in zip(addresses, lengths, strict=True)]
        views = [None if r is None else raw_view(*r) for r in raw]
        return self._put_many(names, ks, views, replace)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int:
        """Store ``size`` bytes at address ``buffer_ptr`` unless the key exists."""
        return self._from([key], [buffer_ptr], [size], replace=False)[0]

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int:
        """Store ``size`` bytes at address ``buffer_ptr``, replacing any value."""
        return self._from([key], [buffer_ptr], [size], replace=True)[0]

    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: Any = None
    ) -> list[int]:
        """Store many (address, size) ranges; one code per key (one ALLOC and COMMIT RPC)."""
        return self._from(keys, buffer_ptrs, sizes, replace=False)

    def batch_upsert_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: Any = None
    ) -> list[int]:
        """As :meth:`batch_put_from`, replacing existing values."""
        return self._from(keys, buffer_ptrs, sizes, replace=True)

    # -- reads ---------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """The value of ``key``; ``b""`` for a miss."""
        return self._values([check_key(key)])[0] or b""

    def get_batch(self, keys: list[str]) -> list[bytes]:
        """Values of many keys (``b""`` for each miss); one lookup RPC per batch."""
        return [v or b"" for v in self._values(check_keys(keys))]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value of ``key`` as a :class:`BufferHandle`; None for a miss."""
        (value,) = self._values([check_key(key)])
        return None if value is None else BufferHandle(value)

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        """As :meth:`get_buffer` for many keys."""
        return [None if v is None else BufferHandle(v) for v in self._values(check_keys(keys))]

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Copy the value into ``size`` bytes at ``buffer_ptr``; its length, or a negative code.

        ``-704`` for a miss, ``-600`` when the value is longer than ``size``.
        """
        (k,) = check_keys([key])
        addresses, sizes = check_ranges([buffer_ptr], [size])
        return self._into([k], [(addresses[0], sizes[0])])[0]

    def batch_get_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        """As :meth:`get_into` for many keys; one lookup RPC per batch."""
        ks = check_keys(keys)
        addresses, lengths = check_ranges(buffer_ptrs, sizes)
        if not len(ks) == len(addresses) == len(lengths):
            return [INVALID_PARAMS] * len(ks)
        return self._into(ks, list(zip(addresses, lengths, strict=True)))

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """1 where a key exists, 0 where not, a negative code on failure."""
        ks = check_keys(keys)
        found = [k for k in ks if k is not None]
        with self._client() as store:
            if store is None:
                return [INVALID_PARAMS] * len(ks)
            try:
                exists = iter(store.batch_is_exist(found) if found else [])
            except FAILURES as exc:
                log.warning("is_exist of %d keys failed: %s", len(found), exc)
                return [code_of(exc)] * len(ks)
        return [0 if k is None else int(next(exists)) for k in ks]

    def is_exist(self, key: str) -> int:
        """1 if ``key`` exists, 0 if not, a negative code on failure."""
        return self.batch_is_exist([key])[0]

    def get_size(self, key: str) -> int:
        """The value's length in bytes; ``-704`` for a miss."""
        k = check_key(key)
        if k is None:
            return OBJECT_NOT_FOUND
        with self._client() as store:
            if store is None:
                return INVALID_PARAMS
            try:
                (ref,) = store.locate([k], prefix=False)
            except FAILURES as exc:
                return code_of(exc)
        return OBJECT_NOT_FOUND if ref is None else ref.length

    # -- removal -------------------------------------------------------------

    def remove(self, key: str, force: bool = False) -> int:
        """Delete ``key``; 0, or ``-704`` if it was not there."""
        return self._remove([check_key(key)])[0]

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        """Delete many keys; one code per key."""
        return self._remove(check_keys(keys))

    def remove_all(self, force: bool = False) -> int:
        """Delete every key written through this store; how many there were, or a negative code."""
        if self._store is None:
            return INVALID_PARAMS
        return self._remove_written(None)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Delete the keys written through this store that ``re.search`` matches; how many."""
        if not isinstance(regex_pattern, str):
            raise TypeError(f"regex_pattern is a str, not {type(regex_pattern).__name__}")
        try:
            match = re.compile(regex_pattern)
        except re.error:
            return INVALID_PARAMS
        if self._store is None:
            return INVALID_PARAMS
        return self._remove_written(match)

    # -- buffers -------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Note a buffer for zero-copy calls; 0, or ``-600`` if already registered."""
        check_count(buffer_ptr, "buffer_ptr")
        check_count(size, "size")
        with self._lock:
            if self._store is None or not buffer_ptr or buffer_ptr in self._registered:
                return INVALID_PARAMS
            self._registered[buffer_ptr] = size
        return OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Forget a registered buffer; 0, or ``-600`` if it was not registered."""
        check_count(buffer_ptr, "buffer_ptr")
        with self._lock:
            return OK if self._registered.pop(buffer_ptr, None) is not None else INVALID_PARAMS

    def alloc_from_mem_pool(self, size: int) -> int:
        """The address of ``size`` new zeroed bytes of host memory (0 if not set up).

        Mooncake's dummy client hands out memory shared with its real client;
        on a pool every copy is the CPU's, so any host memory serves.  The
        memory lives until this store is closed.
        """
        check_count(size, "size")
        with self._lock:
            if self._store is None or not size:
                return 0
            block = (ctypes.c_ubyte * size)()
            self._allocated.append(block)
            return ctypes.addressof(block)
