"""The drop-in store's core: its tables, life cycle, and the batch steps every form uses.

:class:`StoreCore` holds the connection and every table of a handle (so that
``close`` clears them all in one place), sets up and closes, gives each call
the connected store (:meth:`StoreCore._client`, which ``close`` waits for),
keeps Mooncake's leases and the keys written here, and does the four batch
steps the public forms are made of: :meth:`~StoreCore._put_many`,
:meth:`~StoreCore._values`, :meth:`~StoreCore._into` and
:meth:`~StoreCore._remove`.  The public forms are the duty mixins' (objects,
tensors, parallel, ranges, segments), composed in
:class:`beluga.compat.mooncake.store.MooncakeDistributedStore`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from beluga.compat.mooncake.checks import (
    FAILURES,
    POOL_PREFIX,
    check_count,
    code_of,
    pool_spec_for,
    raw_view,
)
from beluga.compat.mooncake.codes import (
    INVALID_PARAMS,
    OBJECT_NOT_FOUND,
    OK,
    RPC_FAIL,
)
from beluga.compat.mooncake.records import parse_size
from beluga.errors import WriteLeaseLost
from beluga.kv import KVStore

log = logging.getLogger(__package__)

#: set to "drop" for Mooncake's teardown: ``close`` removes what this handle wrote
TEARDOWN_ENV = "BELUGA_MOONCAKE_TEARDOWN"
#: Mooncake's range for the port of a ``local_hostname`` given without one
_AUTO_PORTS = (12300, 14300)
#: Mooncake's default lease on a key after a put or get (ms), which batch_replica_clear honours
LEASE_TTL_MS = 5000
#: seconds ``close`` waits for calls in flight before it closes the store under them
CLOSE_WAIT_S = 30.0
#: the lease in ms instead of :data:`LEASE_TTL_MS`: what ``mooncake_master --default_kv_lease_ttl``
#: sets for a Mooncake cluster (read at ``setup``)
LEASE_ENV = "BELUGA_MOONCAKE_LEASE_TTL_MS"


class StoreCore:
    """The state and batch steps of a Mooncake drop-in store (see the module docstring).

    Thread-safe: threads may share one store (the ``KVStore`` is thread-safe,
    the tables here are guarded by ``_lock``), and ``close`` waits for calls
    in flight.  Not fork-safe: a forked child makes and sets up its own (the
    parent's answers ``-600`` / ``b""`` / ``None`` in the child, and closing it
    there leaves the parent connected).
    """

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._store: KVStore | None = None
        self._pid = 0
        self._active = 0
        self._hostname = ""
        self._registered: dict[int, int] = {}
        self._written: dict[bytes, str] = {}  # Beluga key -> Mooncake key, for remove_all
        self._leases: dict[bytes, float] = {}  # key -> monotonic time of its last put or get here
        self._lease_s = LEASE_TTL_MS / 1000
        self._segments: set[str] = set()  # segment ids this handle "mounted"
        self._put_sessions: dict[str, bytearray] = {}  # key -> the object being assembled
        self._get_sessions: set[str] = set()
        self._allocated: list[ctypes.Array[ctypes.c_ubyte]] = []  # alloc_from_mem_pool's memory

    # -- life cycle ----------------------------------------------------------

    def setup(
        self,
        local_hostname: str | Mapping[str, Any],
        metadata_server: str = "",
        global_segment_size: int = 16 << 20,
        local_buffer_size: int = 16 << 20,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "127.0.0.1:50051",
        engine: object = None,
        enable_ssd_offload: bool = False,
        ssd_offload_path: str = "",
        tenant_id: str = "default",
        enable_client_http_server: bool = False,
        client_http_port: int = 9300,
    ) -> int:
        """Attach the pool named by the arguments or $BELUGA_POOL; 0 or a negative code.

        Also takes Mooncake's configuration-dictionary form, ``setup(config)``.
        Setting up again closes the previous connection first.
        """
        if isinstance(local_hostname, Mapping):
            config = {str(k): str(v) for k, v in local_hostname.items()}
            if "local_hostname" not in config or "metadata_server" not in config:
                log.error("setup(config) needs 'local_hostname' and 'metadata_server'")
                return INVALID_PARAMS
            sizes = [
                parse_size(config.get(name, "0"))
                for name in ("global_segment_size", "local_buffer_size")
            ]
            if None in sizes:
                log.error("setup(config): a size is a byte count or N[KB|MB|GB|TB], not %s", config)
                return INVALID_PARAMS
            local_hostname = config["local_hostname"]
            metadata_server = config["metadata_server"]
            master_server_addr = config.get("master_server_addr", master_server_addr)
            tenant_id = config.get("tenant_id", tenant_id)
        for name, text in (
            ("local_hostname", local_hostname),
            ("metadata_server", metadata_server),
            ("master_server_addr", master_server_addr),
            ("tenant_id", tenant_id),
        ):
            if not isinstance(text, str):
                raise TypeError(f"{name} is a str, not {type(text).__name__}")
        if tenant_id != "default":
            log.error("tenant %r: Beluga has no tenants; give each tenant its own pool", tenant_id)
            return INVALID_PARAMS
        lease_ms = os.environ.get(LEASE_ENV, str(LEASE_TTL_MS))
        if not lease_ms.isdigit() or int(lease_ms) == 0:
            log.error(
                "%s=%r: give a whole number of milliseconds > 0 (a Mooncake master's "
                "--default_kv_lease_ttl), or unset it for %d",
                LEASE_ENV, lease_ms, LEASE_TTL_MS,
            )  # fmt: skip
            return INVALID_PARAMS
        self.close()
        spec = pool_spec_for(metadata_server, master_server_addr)
        try:
            store = KVStore(spec)
        except FAILURES as exc:
            log.error("setup: cannot attach pool %s: %s", spec, exc)
            return code_of(exc)
        if ":" not in local_hostname:  # Mooncake picks a port for a bare host name
            local_hostname = f"{local_hostname}:{random.randint(*_AUTO_PORTS)}"
        with self._lock:
            self._store, self._pid, self._hostname = store, os.getpid(), local_hostname
            self._lease_s = int(lease_ms) / 1000
        return OK

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Attach the pool as Mooncake's dummy client does its real client's; 0 or a code.

        A pool is shared memory, so a rank's process attaches the same pool
        itself ($BELUGA_POOL, or ``beluga:SPEC`` as ``server_address``); no
        forwarding client is needed.  The sizes are accepted and ignored.
        """
        check_count(mem_pool_size, "mem_pool_size")
        check_count(local_buffer_size, "local_buffer_size")
        if not isinstance(server_address, str):
            raise TypeError(f"server_address is a str, not {type(server_address).__name__}")
        return self.setup(
            "localhost",
            server_address if server_address.startswith(POOL_PREFIX) else "",
            master_server_addr=server_address,
        )

    def close(self) -> int:
        """Disconnect (after calls in flight finish, or :data:`CLOSE_WAIT_S`); always 0, and
        safe to call twice.

        Calls in flight end by their own deadlines; one still running after
        :data:`CLOSE_WAIT_S` is logged and the store closed under it, which
        the store survives (the call fails with a clear error, never a crash).

        With ``BELUGA_MOONCAKE_TEARDOWN=drop`` (Mooncake's behaviour, see
        ``DIFFERENCES``), the keys written through this handle are removed first.
        """
        if os.environ.get(TEARDOWN_ENV, "keep") == "drop" and self._store is not None:
            self._remove_written(None)
        with self._lock:
            store, self._store = self._store, None
            self._registered.clear()
            self._written.clear()
            self._leases.clear()
            self._put_sessions.clear()
            self._get_sessions.clear()
            self._segments.clear()
            self._allocated.clear()
            if store is None:
                return OK
            if self._pid != os.getpid():
                return OK  # the parent's connection: not ours to close
            deadline = time.monotonic() + CLOSE_WAIT_S
            while self._active and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(left)
            if self._active:
                log.warning(
                    "close: %d calls still running after %.0f s; closing under them",
                    self._active, CLOSE_WAIT_S,
                )  # fmt: skip
        store.close()
        return OK

    def health_check(self) -> int:
        """0 if the metadata server answers, 1 if not set up or closed, 2 if it does not."""
        with self._client() as store:
            if store is None:
                return 1
            try:
                store.stats()
            except FAILURES:
                return 2
            return 0

    def get_hostname(self) -> str:
        """The ``local_hostname`` given to ``setup`` ("" before it)."""
        return self._hostname

    @contextmanager
    def _client(self) -> Iterator[KVStore | None]:
        """The connected store for one call (None if not set up here); close waits for it."""
        with self._lock:
            store = self._store if self._pid == os.getpid() else None
            if store is not None:
                self._active += 1
        try:
            yield store
        finally:
            if store is not None:
                with self._lock:
                    self._active -= 1
                    self._lock.notify_all()

    def _lease(self, keys: Sequence[bytes]) -> None:
        """Note Mooncake's lease on keys just put or read (dropping leases long expired)."""
        now = time.monotonic()
        with self._lock:
            if len(self._leases) > 4 * len(keys) + 4096:
                ttl = self._lease_s
                self._leases = {k: t for k, t in self._leases.items() if now - t < ttl}
            self._leases.update(dict.fromkeys(keys, now))

    def _remember(self, keys: Sequence[bytes], names: Sequence[str | bytes]) -> None:
        self._lease(keys)
        with self._lock:
            for k, name in zip(keys, names, strict=True):
                self._written[k] = (
                    name if isinstance(name, str) else name.decode(errors="surrogateescape")
                )

    def _forget(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._written.pop(k, None)

    # -- the batch steps ------------------------------------------------------

    def _batch_step(
        self, codes: list[int], step: Callable[[KVStore, list[int]], list[int]]
    ) -> list[int]:
        """The codes of a batch, one per item: ``step(store, todo)`` does the items whose code
        is still 0 (``todo``, their positions) with the connected store and returns the codes
        of all.  ``codes`` as given when no item is left to do; ``-600`` for each item when
        this handle is not set up."""
        todo = [i for i, c in enumerate(codes) if c == OK]
        if not todo:
            return codes
        with self._client() as store:
            if store is None:
                return [INVALID_PARAMS] * len(codes)
            return step(store, todo)

    def _put_many(
        self,
        names: Sequence[str | bytes],
        keys: Sequence[bytes | None],
        values: Sequence[Any | None],
        replace: bool,
    ) -> list[int]:
        """Per-item codes of storing ``values`` (None: a refused item) under ``keys``."""
        codes = [
            INVALID_PARAMS if k is None or v is None or not len(v) else OK
            for k, v in zip(keys, values, strict=True)
        ]

        def write(store: KVStore, todo: list[int]) -> list[int]:
            out = codes
            try:
                chosen: dict[bytes, int] = {}
                for i in todo:  # put keeps the first of a repeated key, upsert the last
                    key = bytes(keys[i] or b"")
                    if replace or key not in chosen:
                        chosen[key] = i
                named = dict(chosen)
                if not replace:
                    present = store.batch_is_exist(list(chosen))
                    chosen = {
                        k: i for (k, i), p in zip(chosen.items(), present, strict=True) if not p
                    }
                store.batch_put_from(list(chosen), [values[i] for i in chosen.values()])
            except WriteLeaseLost as exc:  # the server answered: the rest are committed
                log.warning("put of %d values: %s", len(todo), exc)
                refused = set(exc.lost)
                lost = {k for n, k in enumerate(chosen) if n in refused}
                out = [
                    RPC_FAIL if c == OK and bytes(keys[i] or b"") in lost else c
                    for i, c in enumerate(codes)
                ]
                named = {k: i for k, i in named.items() if k not in lost}
            except FAILURES as exc:
                log.warning("put of %d values failed: %s", len(todo), exc)
                code = code_of(exc)
                return [code if c == OK else c for c in codes]
            self._remember(list(named), [names[i] for i in named.values()])
            return out

        return self._batch_step(codes, write)

    def _values(self, keys: Sequence[bytes | None]) -> list[bytes | None]:
        """Values of keys (None: a miss, the empty key, or a failure)."""
        found = [k for k in keys if k is not None]
        with self._client() as store:
            if store is None or not found:
                return [None] * len(keys)
            try:
                got = iter(store.get_batch(found))
            except FAILURES as exc:
                log.warning("get of %d keys failed: %s", len(found), exc)
                return [None] * len(keys)
        values = [None if k is None else next(got) for k in keys]
        self._lease([k for k, v in zip(keys, values, strict=True) if k and v is not None])
        return values

    def _into(self, keys: Sequence[bytes | None], ranges: Sequence[tuple[int, int]]) -> list[int]:
        """Bytes read into each (address, capacity), or a negative code."""
        codes = [
            OBJECT_NOT_FOUND if k is None else INVALID_PARAMS if not a else OK
            for k, (a, _) in zip(keys, ranges, strict=True)
        ]

        def read(store: KVStore, todo: list[int]) -> list[int]:
            batch = [keys[i] for i in todo]
            views = [raw_view(*ranges[i]) for i in todo]
            try:
                got = store.batch_get_into(batch, views)  # type: ignore[arg-type]
            except ValueError:  # a buffer too small: find which, one by one
                got = [self._into_one(store, k, v) for k, v in zip(batch, views, strict=True)]
            except FAILURES as exc:
                log.warning("get_into of %d keys failed: %s", len(todo), exc)
                got = [code_of(exc)] * len(todo)
            for i, n in zip(todo, got, strict=True):
                codes[i] = OBJECT_NOT_FOUND if n == -1 else n
            return codes

        return self._batch_step(codes, read)

    @staticmethod
    def _into_one(store: KVStore, key: bytes | None, view: memoryview) -> int:
        try:
            return store.get_into(key, view)  # type: ignore[arg-type]
        except FAILURES as exc:
            return code_of(exc)

    def _remove(self, keys: Sequence[bytes | None]) -> list[int]:
        codes = [OBJECT_NOT_FOUND] * len(keys)
        with self._client() as store:
            if store is None:
                return [INVALID_PARAMS] * len(keys)
            for i, k in enumerate(keys):
                if k is None:
                    continue
                try:
                    codes[i] = OK if store.remove(k) else OBJECT_NOT_FOUND
                except FAILURES as exc:
                    codes[i] = code_of(exc)
        gone = (OK, OBJECT_NOT_FOUND)
        self._forget([k for k, c in zip(keys, codes, strict=True) if k is not None and c in gone])
        return codes

    def _remove_written(self, match: re.Pattern[str] | None) -> int:
        with self._lock:
            keys = [k for k, name in self._written.items() if match is None or match.search(name)]
        codes = self._remove(keys)
        failed = next((c for c in codes if c not in (OK, OBJECT_NOT_FOUND)), None)
        return failed if failed is not None else codes.count(OK)
