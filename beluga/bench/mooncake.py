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

The client is the cross-pod tier's (:mod:`beluga.kv.tier.mooncake`): a
:class:`~beluga.kv.tier.mooncake.MooncakeClient` offers the operation names of
Beluga's store, so one benchmark loop can drive either.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from beluga.errors import CapacityError, RpcError
from beluga.kv.tier.mooncake import (
    LOOPBACK,
    MooncakeClient,
    MooncakeInstall,
    check_available,
    child_env,
    connect,
)
from beluga.units import MiB


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
        env = child_env(install.libdir)
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


def _signal_session(process: subprocess.Popen[bytes], signum: int) -> None:
    """Signal the process group the program leads, only while it is unreaped (so still ours)."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)


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
