"""``beluga serve``: the metadata server process.

One RpcServer thread owns a MetadataService.  SIGTERM and SIGINT stop it
cleanly: clients see the server go away (and fail fast) instead of hanging,
and the next server rebuilds everything from the pool.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

from beluga.kv.service import MetadataService
from beluga.pool import Pool
from beluga.rpc import RpcServer


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
        print(
            f"beluga serve: {spec}: {s['keys']} keys recovered, {s['blocks_used']} of "
            f"{s['blocks_total']} blocks in use; epoch {server.rpc.epoch:08x}",
            flush=True,
        )
        if ready is not None:
            ready.set()
        try:
            server.serve_forever()
        finally:
            server.close()
            print("beluga serve: stopped", file=sys.stderr, flush=True)
