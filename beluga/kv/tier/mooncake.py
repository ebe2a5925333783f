"""Mooncake Store's client, as the cross-pod tier (and the benchmarks) reach it.

:func:`check_available` finds an importable Mooncake or says exactly what to
install; :func:`connect` makes a ``MooncakeDistributedStore`` client of a
running store (its master and metadata server), contributing no memory and
talking TCP; :class:`MooncakeClient` offers the operation names of Beluga's
store (``put``, ``get``, ``put_from`` ...) over it, with Mooncake's status
codes turned into Beluga's errors.  Running a store of one's own on loopback
is the baseline's business (:class:`beluga.bench.mooncake.MooncakeBaseline`).

The zero-copy forms use Mooncake's own path: ``put_from``/``get_into`` on
memory first handed to ``register_buffer``, as an engine registers its KV
cache once.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.metadata
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from beluga.errors import BackendUnavailableError, CapacityError, RpcError

LOOPBACK = "127.0.0.1"
MOONCAKE_PIP = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
INSTALL_HINT = (
    f"install it with `pip install {MOONCAKE_PIP}` and `apt-get install libibverbs1` "
    "(or run ci/install-mooncake.sh; with --user-libs it needs no root and unpacks "
    "libibverbs1 into $BELUGA_MOONCAKE_LIBDIR, default ~/.cache/beluga/mooncake-libs)"
)
#: Debian's libibverbs1 and the libraries it needs, in the order they must load.
VERBS_LIBRARIES = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")

# Mooncake's status codes that callers can act on (mooncake-store's ErrorCode).
BUFFER_OVERFLOW = -10
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704


def verbs_libdir() -> Path:
    """Where ``ci/install-mooncake.sh --user-libs`` unpacks libibverbs1 (the script's default)."""
    if os.environ.get("BELUGA_MOONCAKE_LIBDIR"):
        return Path(os.environ["BELUGA_MOONCAKE_LIBDIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "beluga" / "mooncake-libs"


@dataclass(frozen=True)
class MooncakeInstall:
    """An importable Mooncake: its store module, its two programs, and where libibverbs is.

    ``libdir`` is None when libibverbs is installed system-wide; otherwise the
    programs need it on ``LD_LIBRARY_PATH``.
    """

    version: str
    store_module: ModuleType
    master: Path
    storage: Path
    libdir: Path | None


def child_env(libdir: Path | None) -> dict[str, str]:
    """The environment of a Mooncake program this process starts (master, storage): TCP on
    loopback, and ``libdir`` (the extracted libibverbs, when there is one) on its library path."""
    env = dict(os.environ, MC_TCP_BIND_ADDRESS=LOOPBACK)
    if libdir is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [str(libdir), env.get("LD_LIBRARY_PATH")])
        )
    return env


def check_available() -> MooncakeInstall:
    """Find Mooncake and load it, or say exactly what to install.

    Loading sets ``MC_LOG_LEVEL=ERROR`` unless it is set already: the library
    reads it once, at load, and its INFO lines would bury a benchmark's output.

    Raises:
        BackendUnavailableError: Mooncake, its programs or libibverbs are missing.
    """
    if importlib.util.find_spec("mooncake") is None:
        raise BackendUnavailableError(f"Mooncake is not installed; {INSTALL_HINT}")
    libdir = _load_verbs()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        store_module = importlib.import_module("mooncake.store")
    except ImportError as exc:
        raise BackendUnavailableError(f"Mooncake cannot be loaded ({exc}); {INSTALL_HINT}") from exc
    package_dir = Path(store_module.__file__ or "").parent
    master, storage = package_dir / "mooncake_master", package_dir / "mooncake_client"
    missing = [path.name for path in (master, storage) if not os.access(path, os.X_OK)]
    if missing:
        raise BackendUnavailableError(
            f"Mooncake's programs {', '.join(missing)} are missing from {package_dir}; "
            f"reinstall: {INSTALL_HINT}"
        )
    return MooncakeInstall(_installed_version(), store_module, master, storage, libdir)


def _load_verbs() -> Path | None:
    """Make libibverbs.so.1 loadable in this process; return its folder if not system-wide.

    Preloading with RTLD_GLOBAL is what lets an unpacked copy serve Mooncake's
    shared objects: LD_LIBRARY_PATH is read only when a process starts.
    """
    with contextlib.suppress(OSError):
        ctypes.CDLL("libibverbs.so.1", mode=ctypes.RTLD_GLOBAL)
        return None
    libdir = verbs_libdir()
    try:
        for name in VERBS_LIBRARIES:
            ctypes.CDLL(str(libdir / name), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise BackendUnavailableError(
            "Mooncake needs libibverbs.so.1 even for TCP, and it is neither installed "
            f"system-wide nor unpacked in {libdir} ({exc}); {INSTALL_HINT}"
        ) from exc
    return libdir


def _installed_version() -> str:
    """The version of whichever distribution provides the ``mooncake`` package."""
    for distribution in importlib.metadata.packages_distributions().get("mooncake", []):
        return importlib.metadata.version(distribution)
    return "unknown"


def connect(
    install: MooncakeInstall, metadata_url: str, master_address: str, local_buffer_size: int
) -> MooncakeClient:
    """A client of a running Mooncake Store, contributing no memory, talking TCP on loopback.

    Each process that uses the store (a pod's tier, the benchmark, every
    engine process) connects its own client: a Mooncake client is not
    fork-safe.
    """
    os.environ["MC_TCP_BIND_ADDRESS"] = LOOPBACK
    store = install.store_module.MooncakeDistributedStore()
    status = store.setup(LOOPBACK, metadata_url, 0, local_buffer_size, "tcp", "", master_address)
    if status != 0:
        store.close()
        raise RpcError(f"the client's setup returned {status}")
    return MooncakeClient(store)


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"a Mooncake key must be a non-empty str, not {key!r}")


def _check_value(key: str, value: Any) -> None:
    _check_key(key)
    if memoryview(value).nbytes == 0:
        raise ValueError(f"value of {key!r} is empty; Mooncake cannot store empty values")


def _address(buffer: Any, writable: bool) -> tuple[int, int, memoryview]:
    """Address and size of a C-contiguous buffer, and the view that pins it."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("zero-copy transfers need a C-contiguous buffer")
    if writable and view.readonly:
        raise ValueError("get_into and register_buffer need a writable buffer")
    if view.nbytes == 0:
        raise ValueError("zero-copy transfers need a non-empty buffer")
    flat = view.cast("B")
    return int(np.frombuffer(flat, dtype=np.uint8).ctypes.data), flat.nbytes, flat


def _fail(status: int, operation: str, key: str) -> Exception:
    """The exception for a Mooncake status code, naming what the caller can do."""
    if status == OBJECT_NOT_FOUND:
        return KeyError(key)
    if status in (NO_AVAILABLE_HANDLE, BUFFER_OVERFLOW):
        return CapacityError(
            f"Mooncake {operation} of {key!r} found no room (status {status}); "
            "give the store larger segments (MooncakeBaseline's segment_size) or the client "
            "a larger local_buffer_size"
        )
    if status == INVALID_PARAMS:
        return ValueError(
            f"Mooncake rejected {operation} of {key!r} (INVALID_PARAMS): for get_into, "
            "the buffer is smaller than the value; otherwise the value is too large for "
            "local_buffer_size"
        )
    return RpcError(f"Mooncake {operation} of {key!r} failed with status {status}")


class MooncakeClient:
    """Beluga's store operations, done by Mooncake.

    Keys are non-empty str and values non-empty bytes-like objects.  As for
    content-hashed KV blocks, a key is written once: putting a key that exists
    succeeds and keeps the first value (Mooncake's behaviour).  A missing key is
    ``KeyError`` for single gets and ``None`` in a batch, where misses are normal.
    """

    def __init__(self, store: Any) -> None:
        self._store = store
        self._registered: list[tuple[int, int, memoryview]] = []

    def close(self) -> None:
        """Unregister every buffer and disconnect."""
        for address, _, view in self._registered:
            self._store.unregister_buffer(address)
            view.release()
        self._registered = []
        self._store.close()

    def put(self, key: str, value: Any) -> None:
        _check_value(key, value)
        status = self._store.put(key, value)
        if status != 0:
            raise _fail(status, "put", key)

    def get(self, key: str) -> bytes:
        _check_key(key)
        value = self._store.get(key)
        if not value:
            raise KeyError(key)
        return bytes(value)

    def is_exist(self, key: str) -> bool:
        _check_key(key)
        status = self._store.is_exist(key)
        if status < 0:
            raise _fail(status, "is_exist", key)
        return status == 1

    def batch_is_exist(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored (one round trip to the master)."""
        for key in keys:
            _check_key(key)
        statuses = self._store.batch_is_exist(list(keys))
        for key, status in zip(keys, statuses, strict=True):
            if status < 0:
                raise _fail(status, "batch_is_exist", key)
        return [status == 1 for status in statuses]

    def remove(self, key: str) -> bool:
        """Remove ``key``; False if it was absent.

        Forced, because a read leaves a lease on the object (10 s by default)
        that would otherwise refuse the removal.
        """
        _check_key(key)
        status = self._store.remove(key, True)
        if status == OBJECT_NOT_FOUND:
            return False
        if status != 0:
            raise _fail(status, "remove", key)
        return True

    def put_batch(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        _check_lengths(keys, values)
        for key, value in zip(keys, values, strict=True):
            _check_value(key, value)
        status = self._store.put_batch(list(keys), list(values))
        if status != 0:
            raise _fail(status, "put_batch", keys[0])

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        for key in keys:
            _check_key(key)
        return [bytes(value) if value else None for value in self._store.get_batch(list(keys))]

    def register_buffer(self, buffer: Any) -> None:
        """Register memory for zero-copy transfers, once, as an engine registers its KV cache.

        The buffer stays pinned (it cannot be resized or closed) until
        ``unregister_buffer`` or the end of the baseline.
        """
        address, size, view = _address(buffer, writable=True)
        for start, length, _ in self._registered:
            if address < start + length and start < address + size:
                view.release()
                raise ValueError("buffer overlaps one already registered")
        status = self._store.register_buffer(address, size)
        if status != 0:
            view.release()
            raise RpcError(f"Mooncake register_buffer failed with status {status}")
        self._registered.append((address, size, view))

    def unregister_buffer(self, buffer: Any) -> None:
        address, _, view = _address(buffer, writable=False)
        view.release()
        for entry in self._registered:
            if entry[0] == address:
                self._registered.remove(entry)
                self._store.unregister_buffer(address)
                entry[2].release()
                return
        raise ValueError("buffer was not registered with register_buffer")

    def _registered_address(self, buffer: Any, writable: bool) -> tuple[int, int]:
        address, size, view = _address(buffer, writable)
        view.release()
        for start, length, _ in self._registered:
            if start <= address and address + size <= start + length:
                return address, size
        raise ValueError(
            "zero-copy transfers need memory inside a buffer passed to register_buffer() first"
        )

    def put_from(self, key: str, buffer: Any) -> None:
        _check_key(key)
        address, size = self._registered_address(buffer, writable=False)
        status = self._store.put_from(key, address, size)
        if status != 0:
            raise _fail(status, "put_from", key)

    def get_into(self, key: str, buffer: Any) -> int:
        """Copy the value of ``key`` into ``buffer``; return its length."""
        _check_key(key)
        address, size = self._registered_address(buffer, writable=True)
        status = self._store.get_into(key, address, size)
        if status < 0:
            raise _fail(status, "get_into", key)
        return int(status)

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any]) -> None:
        _check_lengths(keys, buffers)
        for key in keys:
            _check_key(key)
        places = [self._registered_address(buffer, writable=False) for buffer in buffers]
        statuses = self._store.batch_put_from(
            list(keys), [address for address, _ in places], [size for _, size in places]
        )
        for key, status in zip(keys, statuses, strict=True):
            if status != 0:
                raise _fail(status, "batch_put_from", key)

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int | None]:
        """Copy each value into its buffer; return the lengths, None where the key is missing."""
        _check_lengths(keys, buffers)
        for key in keys:
            _check_key(key)
        places = [self._registered_address(buffer, writable=True) for buffer in buffers]
        statuses = self._store.batch_get_into(
            list(keys), [address for address, _ in places], [size for _, size in places]
        )
        lengths: list[int | None] = []
        for key, status in zip(keys, statuses, strict=True):
            if status == OBJECT_NOT_FOUND:
                lengths.append(None)
            elif status < 0:
                raise _fail(status, "batch_get_into", key)
            else:
                lengths.append(int(status))
        return lengths


def _check_lengths(keys: Sequence[str], items: Sequence[Any]) -> None:
    if len(keys) != len(items):
        raise ValueError(f"{len(keys)} keys but {len(items)} values or buffers")
    if not keys:
        raise ValueError("a batch needs at least one key")
