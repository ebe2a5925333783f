"""``beluga serve``: the metadata server process.

One RpcServer thread owns a MetadataService.  SIGTERM and SIGINT stop it
cleanly: clients see the server go away (and fail fast) instead of hanging,
and the next server rebuilds everything from the pool.

It logs through ``logging`` (logger ``beluga.kv.server``); the ``beluga``
command prints those records as ``beluga serve: ...`` lines on stderr.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from beluga.kv.service import MetadataService
from beluga.pool import Pool
from beluga.rpc import RpcServer

log = logging.getLogger(__name__)


class MetadataServer:
    """A metadata service behind the pool's RPC; ``start_thread`` for in-process use."""

    def __init__(
        self,
        pool: Pool,
        *,
        refresh_s: float = 0.1,
        **service_options: Any,
    ) -> None:
        self.pool = pool
        self.service = MetadataService(pool, **service_options)
        self.rpc = RpcServer(
            pool,
            self.service.handlers(),
            refresh_s=refresh_s,
            on_client_gone=self.service.client_gone,
            tick=self.service.tick,
        )
        self.service.writer_alive = self.rpc.holder_alive

    def serve_forever(self) -> None:
        self.rpc.serve_forever()

    def start_thread(self) -> threading.Thread:
        return self.rpc.start_thread()

    def stop(self) -> None:
        self.rpc.stop()

    def close(self) -> None:
        self.rpc.close()

    def __enter__(self) -> MetadataServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(spec: str, coherence: str | None = None, ready: Any = None, **options: Any) -> None:
    """Attach, serve until SIGTERM / SIGINT, then shut down cleanly."""
    with Pool.attach(spec, coherence=coherence) as pool:
        server = MetadataServer(pool, **options)
        stop = lambda *_: server.stop()  # noqa: E731 - a signal handler
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        s = server.service.stats()
        log.info(
            "%s: %s keys recovered, %s of %s blocks in use; epoch %08x",
            spec,
            s["keys"],
            s["blocks_used"],
            s["blocks_total"],
            server.rpc.epoch,
        )
        if ready is not None:
            ready.set()
        try:
            server.serve_forever()
        finally:
            server.close()
            log.info("stopped")
