"""The tier beyond one pod: a Mooncake Store cluster that every pod shares.

A *pod* is one CXL pool and its metadata server; a pool ends at one switch
domain.  Pods share KV through a second tier, a Mooncake Store cluster:

- a miss in the pod's pool is looked up in Mooncake and, when found, promoted:
  put into the pool, so the pod's next reader loads it at pool speed;
- a block the pod's server evicts is demoted to Mooncake (write-back,
  asynchronous, through a bounded queue; what does not fit is dropped and
  counted, never waited for);
- with ``write_through`` every put is also queued for Mooncake.

Keys are the same everywhere: a value's Mooncake key is its 16-byte pool
digest in hex (``beluga-<digest>``), and the digest already names the model,
the KV shape, the layout and the hash (:mod:`beluga.kv.identity`), so a block
written in pod A is found by an engine in pod B.

The tier is optional and off by default.  ``KVStore(..., tier=...)`` and
``beluga serve --tier`` take it, or ``BELUGA_TIER`` in the environment
(``mooncake:METADATA_URL,MASTER_ADDRESS[,write-through]``), which is how
engine processes and framework integrations get it without new arguments.
When Mooncake is unreachable the pod keeps serving from its pool: calls to
the tier return misses, one warning is logged per outage, and the tier is
tried again every few seconds.

:class:`MooncakeTier` is thread-safe (one lock around the Mooncake client;
the demotion queue has its own) and not fork-safe: a forked child makes its
own tier (a Mooncake client cannot be shared across a fork).

The Mooncake client it talks through is :mod:`beluga.kv.tier.mooncake` (the
benchmarks' Mooncake baseline drives the same client).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from beluga.kv.tier.mooncake import MooncakeClient, check_available, connect

log = logging.getLogger("beluga.tier")

TIER_ENV = "BELUGA_TIER"
RETRY_S = 5.0  # how long an unreachable tier is left alone before the next try
KEY_PREFIX = "beluga-"


@dataclass(frozen=True)
class TierConfig:
    """Where the cross-pod tier is and how it is used.  Immutable."""

    metadata_url: str
    master_address: str
    write_through: bool = False
    max_backlog: int = 4096  # values waiting to be written to the tier
    max_backlog_bytes: int = 512 << 20
    local_buffer_size: int = 64 << 20

    @classmethod
    def parse(cls, spec: str) -> TierConfig:
        """``mooncake:METADATA_URL,MASTER_ADDRESS[,write-through]``."""
        kind, _, rest = spec.partition(":")
        parts = [p for p in rest.split(",") if p]
        if (
            kind != "mooncake"
            or len(parts) not in (2, 3)
            or parts[2:] not in ([], ["write-through"])
        ):
            raise ValueError(
                f"a tier is 'mooncake:METADATA_URL,MASTER_ADDRESS[,write-through]', not {spec!r} "
                "(e.g. mooncake:http://10.0.0.5:8080/metadata,10.0.0.5:50051)"
            )
        return cls(parts[0], parts[1], write_through=len(parts) == 3)

    def spec(self) -> str:
        """The string :meth:`parse` reads back (for ``BELUGA_TIER``)."""
        tail = ",write-through" if self.write_through else ""
        return f"mooncake:{self.metadata_url},{self.master_address}{tail}"


def tier_key(digest: bytes) -> str:
    """A value's key in the tier: its pool digest, the same in every pod."""
    return KEY_PREFIX + digest.hex()


def _connect(config: TierConfig) -> MooncakeClient:
    return connect(
        check_available(), config.metadata_url, config.master_address, config.local_buffer_size
    )


class MooncakeTier:
    """A pod's connection to the shared Mooncake tier, and its write-back queue."""

    def __init__(
        self, config: TierConfig, *, connect: Callable[[TierConfig], Any] = _connect
    ) -> None:
        self.config = config
        self._connect_fn = connect
        self._client: Any = None
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._pid = os.getpid()
        self.counters = {
            "tier_lookups": 0,
            "tier_hits": 0,
            "tier_errors": 0,
            "tier_outages": 0,
            "demotions": 0,
            "demotions_dropped": 0,
            "write_throughs": 0,
        }
        self._queue: deque[tuple[str, bytes, str]] = deque()
        self._queued_bytes = 0
        self._cv = threading.Condition()
        self._busy = False
        self._closing = False
        self._writer = threading.Thread(target=self._drain, name="beluga-tier", daemon=True)
        self._writer.start()

    # -- the client, and outages ---------------------------------------------

    def _call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        """fn(client), or None while the tier is unreachable (one warning per outage)."""
        if os.getpid() != self._pid:
            raise RuntimeError("a MooncakeTier cannot be used in a forked child; make a new one")
        with self._lock:
            now = time.monotonic()
            if self._down_since is not None and now < self._retry_at:
                return None
            try:
                if self._client is None:
                    self._client = self._connect_fn(self.config)
                out = fn(self._client)
            except Exception as exc:  # any failure of the tier is an outage
                self.counters["tier_errors"] += 1
                self._retry_at = now + RETRY_S
                if self._down_since is None:
                    self._down_since = now
                    self.counters["tier_outages"] += 1
                    log.warning(
                        "the Mooncake tier (%s) failed on %s: %s; serving from the pool alone "
                        "and trying again every %.0f s",
                        self.config.master_address,
                        what,
                        exc,
                        RETRY_S,
                    )
                with_client, self._client = self._client, None
                if with_client is not None:
                    with contextlib.suppress(Exception):  # a broken client may fail to close
                        with_client.close()
                return None
            if self._down_since is not None:
                log.warning("the Mooncake tier (%s) is back", self.config.master_address)
                self._down_since = None
            return out

    @property
    def up(self) -> bool:
        return self._down_since is None

    # -- reads ---------------------------------------------------------------

    def fetch(self, digests: Sequence[bytes]) -> list[bytes | None]:
        """Values of pool digests from the tier (None: not there, or the tier is down)."""
        if not digests:
            return []
        got = self._call("get", lambda c: c.get_batch([tier_key(d) for d in digests]))
        self.counters["tier_lookups"] += len(digests)
        if got is None:
            return [None] * len(digests)
        out = [v if v else None for v in got]
        self.counters["tier_hits"] += sum(v is not None for v in out)
        return out

    def exists(self, digests: Sequence[bytes]) -> list[bool]:
        """Whether the tier holds each digest (False while it is down)."""
        if not digests:
            return []
        got = self._call("is_exist", lambda c: c.batch_is_exist([tier_key(d) for d in digests]))
        return [False] * len(digests) if got is None else [bool(x) for x in got]

    # -- the write-back queue ------------------------------------------------

    def submit(self, digest: bytes, value: bytes, why: str = "demotion") -> bool:
        """Queue a value for the tier; False (counted as dropped) when the queue is full."""
        n = len(value)
        with self._cv:
            if self._closing or (
                len(self._queue) >= self.config.max_backlog
                or self._queued_bytes + n > self.config.max_backlog_bytes
            ):
                self.counters["demotions_dropped"] += 1
                return False
            self._queue.append((tier_key(digest), value, why))
            self._queued_bytes += n
            self._cv.notify()
        return True

    def _drain(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue and self._closing:
                    return
                batch = [self._queue.popleft() for _ in range(min(32, len(self._queue)))]
                self._queued_bytes -= sum(len(v) for _, v, _ in batch)
                self._busy = True
            try:
                self._write(batch)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _write(self, batch: list[tuple[str, bytes, str]]) -> None:
        keys = [k for k, _, _ in batch]
        done = self._call("put", lambda c: c.put_batch(keys, [v for _, v, _ in batch]) or True)
        if done is None:  # down: what was queued is dropped (the pool still holds it, or not)
            self.counters["demotions_dropped"] += len(batch)
            return
        for _, _, why in batch:
            self.counters["write_throughs" if why == "write-through" else "demotions"] += 1

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the queue is empty and nothing is being written; False at the timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def stats(self) -> dict[str, Any]:
        with self._cv:
            backlog, nbytes = len(self._queue), self._queued_bytes
        return {
            **self.counters,
            "tier": "mooncake",
            "tier_up": self.up,
            "demotion_backlog": backlog,
            "demotion_backlog_bytes": nbytes,
        }

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (up to ``timeout``), then disconnect."""
        self.flush(timeout)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._writer.join(timeout)
        with self._lock:
            client, self._client = self._client, None
        if client is not None and os.getpid() == self._pid:
            with contextlib.suppress(Exception):  # closing a client of a tier that is gone
                client.close()


def make_tier(tier: MooncakeTier | TierConfig | str | None) -> MooncakeTier | None:
    """A tier from an object, a config, a spec string, or ``BELUGA_TIER`` (None: no tier)."""
    if isinstance(tier, MooncakeTier):
        return tier
    if tier is None:
        spec = os.environ.get(TIER_ENV, "").strip()
        if not spec:
            return None
        tier = spec
    config = tier if isinstance(tier, TierConfig) else TierConfig.parse(tier)
    return MooncakeTier(config)
