"""A KVStore connection that an engine can lose without failing.

A framework's cache is an optimisation: when the pool is missing or its
metadata server is down, the engine must go on serving by recomputing, say so
once, and pick the pool up again when it is back.  :class:`StoreLink` is that
policy in one place for every integration:

- :meth:`StoreLink.call` runs a piece of work on the connected
  :class:`KVStore` and answers a default on an outage: the pool unavailable
  (the work does not run), or an outage met by the work (the connection is
  dropped and the outage reported); every integration's pool call goes
  through it;
- :meth:`StoreLink.connected` lends the connected store for a block of work
  (``None`` while the pool is unavailable); :meth:`StoreLink.acquire` /
  :meth:`StoreLink.release` do the same across calls;
- :meth:`StoreLink.lost` drops a connection after an error; the store is
  closed once nobody is using it any more, so a thread never has the pool
  unmapped under its copy by another thread's failure;
- :meth:`StoreLink.available` connects if it is time to try, for callers
  that only want to know.

One warning is logged per outage and process, not per call, and reconnection
is tried at most every ``retry_s`` seconds so that a dead server costs an
engine step nothing but a clock read.

What counts as an outage is :data:`UNAVAILABLE`: the transport (a server that
is absent, dead or does not answer), the pool (missing, foreign, in the wrong
state) and its device.  Anything else an integration meets is a bug and
raises: a :class:`~beluga.errors.KVLayoutError`, a ``ValueError`` or a
``TypeError`` must not pass for a dead server and switch the cache off.  A
write whose lease ran out before its commit (a slow write, not a dead server)
is the store's to retry: integrations save with ``KVStore.save(...,
attempts=2)`` and count what is still lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from beluga.errors import (
    BackendUnavailableError,
    BelugaError,
    PoolError,
    RpcError,
)
from beluga.kv import KVStore
from beluga.pool import resolve_pool

log = logging.getLogger("beluga.integrations")
T = TypeVar("T")

#: errors that mean "the pool is not usable now", as opposed to bugs: the RPC
#: transport, the pool, its device, and the OS refusing to map or open it
UNAVAILABLE = (RpcError, PoolError, BackendUnavailableError, OSError)

# Pool specs this process has warned about: an engine holds several links (vLLM's
# scheduler and worker connectors), and an outage is reported once per process.
_warned: set[str] = set()
_warned_lock = threading.Lock()
_links: weakref.WeakSet[StoreLink] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child starts with fresh locks and no connection (the parent keeps its own)."""
    global _warned_lock
    _warned_lock = threading.Lock()
    for link in list(_links):
        link._forget_parent()


os.register_at_fork(after_in_child=_after_fork_in_child)


class StoreLink:
    """A lazily (re)connected KVStore for one pool spec; ``None`` while unavailable.

    An integration resolves its pool setting with :func:`beluga.pool.resolve_pool`
    (naming the setting in the error) and passes the spec; an empty ``spec``
    is resolved here the same way, under ``who``'s name.

    Thread-safe: threads may share a link; one connection serves them all
    (:class:`KVStore` is thread-safe), only one thread connects at a time,
    and a store dropped by :meth:`lost` or :meth:`close` is closed when its
    last borrower gives it back.  Fork-safe: a forked child's link forgets
    the parent's connection (leaving it to the parent) and connects its own
    on first use.
    """

    def __init__(
        self,
        spec: str | None,
        *,
        who: str,
        coherence: str | None = None,
        timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        retry_s: float = 30.0,
    ) -> None:
        if timeout_s <= 0 or connect_timeout_s <= 0 or retry_s < 0:
            raise ValueError("timeouts must be > 0 and retry_s >= 0")
        self.spec = resolve_pool(spec, setting=f"{who}'s 'pool' option")
        self.who = who
        self._coherence = coherence
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._store: KVStore | None = None
        self._borrowed: dict[KVStore, int] = {}  # store -> borrowers, current or dropped
        self._next_try = 0.0
        self._closed = False
        _links.add(self)

    @classmethod
    def from_options(
        cls, options: Mapping[str, Any], *, who: str, where: str, prefix: str = ""
    ) -> StoreLink:
        """A link set up by a framework's options: ``pool``, ``coherence``, ``timeout_s``
        and ``retry_s``, each name after ``prefix``; ``where`` says where users set them
        (for the error when no pool is named)."""
        pool = f"{prefix}pool"
        return cls(
            resolve_pool(options.get(pool), setting=f"'{pool}' in {where}"),
            who=who,
            coherence=options.get(f"{prefix}coherence"),
            timeout_s=float(options.get(f"{prefix}timeout_s", 5.0)),
            retry_s=float(options.get(f"{prefix}retry_s", 30.0)),
        )

    def acquire(self) -> KVStore | None:
        """Borrow the connected store, or None (connecting at most every ``retry_s`` seconds).

        Give a store back with :meth:`release`; :meth:`connected` does both.
        """
        with self._lock:
            store = self._connect()
            if store is not None:
                self._borrowed[store] = self._borrowed.get(store, 0) + 1
            return store

    def release(self, store: KVStore) -> None:
        """Give back a store from :meth:`acquire`; a dropped one is closed by its last borrower."""
        with self._lock:
            left = self._borrowed[store] - 1
            if left:
                self._borrowed[store] = left
                return
            del self._borrowed[store]
            if store is self._store:
                return
        _close_quietly(store)

    @contextlib.contextmanager
    def connected(self) -> Iterator[KVStore | None]:
        """The connected store for the duration of a ``with`` block, or None."""
        store = self.acquire()
        try:
            yield store
        finally:
            if store is not None:
                self.release(store)

    def call(
        self,
        work: Callable[[KVStore], T],
        default: T,
        *,
        on_outage: Callable[[KVStore], None] | None = None,
    ) -> T:
        """``work(store)`` on the connected store, or ``default`` on an outage.

        While the pool is unavailable ``work`` does not run.  When it raises
        one of :data:`UNAVAILABLE`, ``on_outage(store)`` runs first (to count
        the error, or to let go of what the caller holds of that store), then
        the connection is dropped (:meth:`lost`: one warning per outage).  Any
        other error is a bug and is raised as it is.
        """
        with self.connected() as store:
            if store is None:
                return default
            try:
                return work(store)
            except UNAVAILABLE as e:
                if on_outage is not None:
                    on_outage(store)
                self.lost(e, store)
                return default

    def available(self) -> bool:
        """Whether the pool is connected now (trying to connect if it is time to)."""
        with self._lock:
            return self._connect() is not None

    def lost(self, error: BaseException, store: KVStore | None = None) -> None:
        """Drop the connection after ``error``; the next connection waits ``retry_s``.

        ``store`` is the one that failed: when another thread has already
        replaced it, the new connection is kept.
        """
        with self._lock:
            if store is not None and store is not self._store:
                return  # dropped already, and reported by whoever dropped it
            dropped, self._store = self._store, None
            self._next_try = time.monotonic() + self._retry_s
            idle = dropped is not None and dropped not in self._borrowed
        if idle:
            _close_quietly(dropped)
        self._warn(error)

    def close(self) -> None:
        """Close the connection and connect no more (safe to call twice).

        A store still borrowed by another thread is closed when it is given back.
        """
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
            idle = store is not None and store not in self._borrowed
        if idle:
            store.close()  # type: ignore[union-attr]

    # -- under the lock ------------------------------------------------------

    def _connect(self) -> KVStore | None:
        if self._store is not None or self._closed or time.monotonic() < self._next_try:
            return self._store
        try:
            self._store = KVStore(
                self.spec,
                coherence=self._coherence,
                timeout=self._timeout_s,
                connect_timeout=self._connect_timeout_s,
            )
        except UNAVAILABLE as e:
            self._next_try = time.monotonic() + self._retry_s
            self._warn(e)
            return None
        with _warned_lock:
            back = self.spec in _warned
            _warned.discard(self.spec)
        if back:
            log.warning("%s: pool %s is back; using it again", self.who, self.spec)
        return self._store

    def _warn(self, error: BaseException) -> None:
        with _warned_lock:
            first = self.spec not in _warned
            _warned.add(self.spec)
        if first:
            log.warning(
                "%s: pool %s is unavailable (%s); serving without it (prefixes are "
                "recomputed), retrying every %g s",
                self.who,
                self.spec,
                error,
                self._retry_s,
            )

    def _forget_parent(self) -> None:
        """In a forked child: the parent's connection and borrowers are not this process's."""
        self._lock = threading.Lock()
        self._store = None
        self._borrowed = {}
        self._next_try = 0.0


def _close_quietly(store: KVStore) -> None:
    # already dropped for an error: closing is best effort, whatever it raises
    with contextlib.suppress(BelugaError, OSError):
        store.close()
