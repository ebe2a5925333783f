"""A KVStore connection that an engine can lose without failing.

A framework's cache is an optimisation: when the pool is missing or its
metadata server is down, the engine must go on serving by recomputing, say so
once, and pick the pool up again when it is back.  :class:`StoreLink` is that
policy in one place for every integration: :meth:`StoreLink.get` returns a
connected :class:`KVStore` or ``None``; :meth:`StoreLink.lost` drops a
connection after an error.  One warning is logged per outage and process, not per call,
and reconnection is tried at most every ``retry_s`` seconds so that a dead
server costs an engine step nothing but a clock read.
"""

from __future__ import annotations

import contextlib
import logging
import time

from beluga.errors import BelugaError
from beluga.kv import KVStore

log = logging.getLogger("beluga.integrations")

#: errors that mean "the pool is not usable now", as opposed to bugs
UNAVAILABLE = (BelugaError, OSError)

# Pool specs this process has warned about: an engine holds several links (vLLM's
# scheduler and worker connectors), and an outage is reported once per process.
_warned: set[str] = set()


class StoreLink:
    """A lazily (re)connected KVStore for one pool spec; ``None`` while unavailable."""

    def __init__(
        self,
        spec: str,
        *,
        who: str,
        coherence: str | None = None,
        timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        retry_s: float = 30.0,
    ) -> None:
        if not spec:
            raise ValueError(
                f"{who} needs a pool: set its 'pool' option (a spec such as "
                "shm:/dev/shm/beluga) or the BELUGA_POOL environment variable"
            )
        if timeout_s <= 0 or connect_timeout_s <= 0 or retry_s < 0:
            raise ValueError("timeouts must be > 0 and retry_s >= 0")
        self.spec = spec
        self.who = who
        self._coherence = coherence
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._retry_s = retry_s
        self._store: KVStore | None = None
        self._next_try = 0.0

    def get(self) -> KVStore | None:
        """The connected store, or None (connecting at most every ``retry_s`` seconds)."""
        if self._store is not None:
            return self._store
        if time.monotonic() < self._next_try:
            return None
        try:
            self._store = KVStore(
                self.spec,
                coherence=self._coherence,
                timeout=self._timeout_s,
                connect_timeout=self._connect_timeout_s,
            )
        except UNAVAILABLE as e:
            self._outage(e)
            return None
        if self.spec in _warned:
            _warned.discard(self.spec)
            log.warning("%s: pool %s is back; using it again", self.who, self.spec)
        return self._store

    def lost(self, error: BaseException) -> None:
        """Drop the connection after ``error``; the next :meth:`get` waits ``retry_s``."""
        store, self._store = self._store, None
        if store is not None:
            with contextlib.suppress(*UNAVAILABLE):  # already broken: closing is best effort
                store.close()
        self._outage(error)

    def _outage(self, error: BaseException) -> None:
        self._next_try = time.monotonic() + self._retry_s
        if self.spec not in _warned:
            _warned.add(self.spec)
            log.warning(
                "%s: pool %s is unavailable (%s); serving without it (prefixes are "
                "recomputed), retrying every %g s",
                self.who,
                self.spec,
                error,
                self._retry_s,
            )

    def close(self) -> None:
        """Close the connection (safe to call twice)."""
        store, self._store = self._store, None
        if store is not None:
            store.close()
