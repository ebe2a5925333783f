"""Mooncake Store, run on this machine as the baseline Beluga's store is measured against.

Mooncake Store (the paper's main baseline) has three parts, and this module runs
all of them for the length of one ``with`` block:

* ``mooncake_master``: metadata and allocation, plus the HTTP metadata server;
* ``mooncake_client``: a storage process that contributes its memory (the
  *segment*) to the store, as a serving host does;
* ``MooncakeDistributedStore`` in this process: the client whose operations are
  timed.  Its bytes cross to the segment through Mooncake's transfer engine over
  TCP, because the wheel that installs here has no RDMA or CXL transport.

Every host and port flag points at 127.0.0.1 and ``MC_TCP_BIND_ADDRESS`` makes
the transfer engines advertise 127.0.0.1, so all traffic stays on loopback.  Some
listening sockets still bind every interface whatever is passed (the HTTP
metadata server and the TCP transport), which is why nothing here outlives the
``with`` block: both programs run in their own sessions, die with this process
(``setpriv --pdeathsig``) and are stopped with SIGTERM, then SIGKILL.

``MooncakeClient`` offers the operation names of Beluga's store (``put``, ``get``,
``put_from`` ...), so one benchmark loop can drive either.  Its zero-copy forms
use Mooncake's own path: ``put_from``/``get_into`` on memory first handed to
``register_buffer``, as an engine registers its KV cache once.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

import numpy as np

from beluga.errors import BackendUnavailableError, CapacityError, RpcError

MiB = 1 << 20
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


class MooncakeBaseline:
    """A private Mooncake Store on loopback for the length of a ``with`` block.

    ::

        with MooncakeBaseline() as mooncake:
            mooncake.client.put("k", b"v")

    Entering checks the install (``BackendUnavailableError`` if unusable), starts
    the master and one storage process of ``segment_size`` bytes, connects a
    client with a ``local_buffer_size`` staging buffer, and proves the store
    works with a probe put/get.  Leaving, however the block ended, stops
    everything and removes the log folder.  A failed start cleans up the same
    way and puts the tail of the logs in its error.
    """

    def __init__(
        self,
        segment_size: int = 256 * MiB,
        local_buffer_size: int = 64 * MiB,
        start_timeout: float = 30.0,
        stop_timeout: float = 5.0,
        storage_processes: int = 1,
    ) -> None:
        if storage_processes < 1:
            raise ValueError("a Mooncake Store needs at least one storage process")
        self.storage_processes = storage_processes
        if segment_size < MiB or local_buffer_size < MiB:
            raise ValueError("segment_size and local_buffer_size must be at least 1 MiB")
        if start_timeout <= 0 or stop_timeout <= 0:
            raise ValueError("start_timeout and stop_timeout must be positive")
        self.segment_size = segment_size
        self.local_buffer_size = local_buffer_size
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.install: MooncakeInstall | None = None
        self._client: MooncakeClient | None = None
        self._processes: list[subprocess.Popen[bytes]] = []
        self._logdir: Path | None = None
        self.metadata_url = ""  # where other clients connect (:func:`connect`), once running
        self.master_address = ""
        self.metrics_url = ""  # the master's Prometheus counters (evictions, ...), once running

    @property
    def client(self) -> MooncakeClient:
        """The connected client; only inside the ``with`` block."""
        if self._client is None:
            raise RuntimeError("MooncakeBaseline is not running: use it in a `with` block")
        return self._client

    @property
    def pids(self) -> list[int]:
        """Process ids of the master and the storage process, for leak checks."""
        return [process.pid for process in self._processes]

    def __enter__(self) -> MooncakeBaseline:
        if self._processes:
            raise RuntimeError("this MooncakeBaseline is already running")
        self.install = check_available()
        try:
            self._start(self.install)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _start(self, install: MooncakeInstall) -> None:
        deadline = time.monotonic() + self.start_timeout
        self._logdir = Path(tempfile.mkdtemp(prefix="beluga-mooncake-"))
        rpc_port, metadata_port, metrics_port, *storage_ports = _free_loopback_ports(
            3 + self.storage_processes
        )
        metadata_url = f"http://{LOOPBACK}:{metadata_port}/metadata"
        master_address = f"{LOOPBACK}:{rpc_port}"
        env = _child_env(install.libdir)
        master = self._spawn(
            "master",
            [
                str(install.master),
                f"--rpc_address={LOOPBACK}",
                f"--rpc_port={rpc_port}",
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_host={LOOPBACK}",
                f"--http_metadata_server_port={metadata_port}",
                f"--metrics_host={LOOPBACK}",
                f"--metrics_port={metrics_port}",
                "--logtostderr=true",
            ],
            env,
        )
        self._wait_for_port(master, "master", rpc_port, deadline)
        self._wait_for_port(master, "master", metadata_port, deadline)
        for i, storage_port in enumerate(storage_ports):
            name = "storage" if i == 0 else f"storage-{i}"
            storage = self._spawn(
                name,
                [
                    str(install.storage),
                    f"--host={LOOPBACK}",
                    f"--port={storage_port}",
                    "--protocol=tcp",
                    f"--global_segment_size={self.segment_size}",
                    f"--master_server_address={master_address}",
                    f"--metadata_server={metadata_url}",
                    "--logtostderr=true",
                ],
                env,
            )
            # The storage process listens only after its segment is mounted.
            self._wait_for_port(storage, name, storage_port, deadline)
        try:
            self._client = connect(install, metadata_url, master_address, self.local_buffer_size)
        except RpcError as exc:
            raise RpcError(self._start_failure(str(exc))) from exc
        self.metadata_url, self.master_address = metadata_url, master_address
        self.metrics_url = f"http://{LOOPBACK}:{metrics_port}/metrics"
        self._probe(deadline)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """Start one program in its own session, logging to the log folder.

        ``setpriv --pdeathsig KILL`` makes the kernel end it if this process dies
        without reaching ``stop`` (SIGKILL, a crash).  The kernel watches the
        *thread* that started it, so enter the baseline from a long-lived thread.
        """
        assert self._logdir is not None
        if shutil.which("setpriv"):
            argv = ["setpriv", "--pdeathsig", "KILL", "--", *argv]
        with open(self._logdir / f"{name}.log", "wb") as log:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self._processes.append(process)
        return process

    def _wait_for_port(
        self, process: subprocess.Popen[bytes], name: str, port: int, deadline: float
    ) -> None:
        while not _port_open(port):
            if process.poll() is not None:
                raise RpcError(self._start_failure(f"{name} exited with {process.returncode}"))
            if time.monotonic() > deadline:
                raise RpcError(
                    self._start_failure(
                        f"{name} did not listen on port {port} within {self.start_timeout:g} s"
                    )
                )
            time.sleep(0.05)

    def _probe(self, deadline: float) -> None:
        """Retry a put/get until it works: the master may not yet list the new segment."""
        key, value = "beluga-mooncake-probe", b"probe"
        assert self._client is not None
        while True:
            try:
                self._client.put(key, value)
                if self._client.get(key) == value:
                    self._client.remove(key)
                    return
            except (RpcError, CapacityError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RpcError(
                    self._start_failure(
                        f"a probe put/get did not succeed within {self.start_timeout:g} s"
                    )
                )
            time.sleep(0.1)

    def _start_failure(self, what: str) -> str:
        tails = []
        for log in sorted(self._logdir.glob("*.log")) if self._logdir else []:
            lines = log.read_text(errors="replace").splitlines()[-5:]
            tails.append(f"--- {log.name}\n" + "\n".join(line[:200] for line in lines))
        return (
            f"Mooncake failed to start: {what}; everything started was stopped. "
            "Last log lines:\n" + "\n".join(tails)
        )

    def stop(self) -> None:
        """Close the client, stop both programs, remove the logs.  Safe to call twice."""
        client, self._client = self._client, None
        self.metadata_url = self.master_address = self.metrics_url = ""
        try:
            if client is not None:
                client.close()
        finally:
            self._stop_processes()

    def _stop_processes(self) -> None:
        processes, self._processes = self._processes, []
        logdir, self._logdir = self._logdir, None
        try:
            for process in processes:
                _signal_session(process, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout
            for process in processes:
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_session(process, signal.SIGKILL)
                    process.wait(timeout=self.stop_timeout)
        finally:
            if logdir is not None:
                shutil.rmtree(logdir, ignore_errors=True)


def connect(
    install: MooncakeInstall, metadata_url: str, master_address: str, local_buffer_size: int
) -> MooncakeClient:
    """A client of a running Mooncake Store, contributing no memory, talking TCP on loopback.

    Each process that uses the store (the benchmark, every engine process)
    connects its own client: a Mooncake client is not fork-safe.
    """
    os.environ["MC_TCP_BIND_ADDRESS"] = LOOPBACK
    store = install.store_module.MooncakeDistributedStore()
    status = store.setup(LOOPBACK, metadata_url, 0, local_buffer_size, "tcp", "", master_address)
    if status != 0:
        store.close()
        raise RpcError(f"the client's setup returned {status}")
    return MooncakeClient(store)


def _signal_session(process: subprocess.Popen[bytes], signum: int) -> None:
    """Signal the process group the program leads, only while it is unreaped (so still ours)."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)


def _child_env(libdir: Path | None) -> dict[str, str]:
    env = dict(os.environ, MC_TCP_BIND_ADDRESS=LOOPBACK)
    if libdir is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [str(libdir), env.get("LD_LIBRARY_PATH")])
        )
    return env


def _free_loopback_ports(count: int) -> list[int]:
    """Ports free on 127.0.0.1 now; all held open together so that they differ."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((LOOPBACK, 0))
        return [sock.getsockname()[1] for sock in sockets]


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((LOOPBACK, port)) == 0


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
            "start MooncakeBaseline with a larger segment_size or local_buffer_size"
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
