"""StoreTier: what a KVStore does beyond its pool when a tier is configured.

:class:`~beluga.kv.store.KVStore` is the pool alone unless a tier is given
(``KVStore(..., tier=...)``) or configured (``BELUGA_TIER``): then it holds a
:class:`StoreTier` (``store.tier``; None without one), and its calls hand
what the pool did not have to it.  Every difference lives here:

- a read that the pool misses asks the tier (:mod:`beluga.kv.tier`) for the
  keys it missed; what the tier holds is promoted into the pool (a replacing
  save of the store's) and returned, so the pod's next reader loads it at
  pool speed;
- ``is_exist``, ``batch_is_exist`` and ``lookup_prefix`` count what the tier
  holds as stored (a later read promotes it);
- with ``write_through``, every value a save commits (a promotion's too) is
  queued for the tier, read back from the pool;
- ``stats`` carries the client's tier counters, and ``close`` closes a tier
  the store made.

The store passes itself to each call; this module imports nothing of it.

Thread-safe and not fork-safe, as :class:`~beluga.kv.store.KVStore` and
:class:`~beluga.kv.tier.MooncakeTier` are.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from beluga._native import _core
from beluga.errors import BelugaError
from beluga.kv.tier import MooncakeTier, TierConfig, make_tier
from beluga.transfer import Buffers, as_buffer

log = logging.getLogger("beluga.store")

Key = str | bytes


class _Ref(Protocol):
    """What the tier reads of a value a save committed (a :class:`~beluga.kv.store.BlockRef`)."""

    digest: bytes
    version: int
    header_offset: int
    payload_offset: int
    capacity: int


class _Store(Protocol):
    """What the tier uses of its store (a :class:`~beluga.kv.store.KVStore`)."""

    mem: Any
    index: Any

    def save(self, keys: Sequence[Key], source: Buffers, *, replace: bool = ...) -> Any: ...


class StoreTier:
    """The cross-pod tier behind one store's pool (the module doc).  Thread-safe and not
    fork-safe, as its store and its tier are."""

    def __init__(self, tier: MooncakeTier, owned: bool) -> None:
        #: the tier beyond this pod: pool misses are looked up there
        self.tier = tier
        self._owned = owned  # made by the store from a config: closed with it

    @classmethod
    def make(cls, tier: MooncakeTier | TierConfig | str | None) -> StoreTier | None:
        """The store's tier from ``tier`` (an object, a config, a spec string; None:
        ``BELUGA_TIER``), or None when neither names one."""
        made = make_tier(tier)
        return None if made is None else cls(made, not isinstance(tier, MooncakeTier))

    def fetch(self, store: _Store, keys: Sequence[Key]) -> list[bytes | None]:
        """Values of keys the pool missed, from the tier; found ones are promoted into the
        pool (best effort: a full pool or an absent server still returns the value)."""
        values = self.tier.fetch(_core.key_digests(keys))
        found = [(k, v) for k, v in zip(keys, values, strict=True) if v is not None]
        promoted = 0
        if found:
            try:
                saved = store.save(
                    [k for k, _ in found], Buffers([v for _, v in found]), replace=True
                )
                promoted = len(saved.stored)
            except (BelugaError, OSError) as exc:
                log.debug("promotion of %d values from the tier failed: %s", len(found), exc)
        store.index.count_tier(len(found), promoted)
        return values

    def committed(self, store: _Store, refs: Sequence[_Ref]) -> None:
        """With write-through, queue what a save committed for the tier (read back)."""
        if not self.tier.config.write_through:
            return
        for r in refs:
            value = store.mem.read_bytes(
                r.header_offset, r.payload_offset, r.capacity, r.digest, r.version
            )
            if isinstance(value, bytes):
                self.tier.submit(r.digest, value, "write-through")

    def promote_missing(
        self, store: _Store, keys: Sequence[Key], found: Sequence[object], prefix: bool
    ) -> bool:
        """For a locate that missed: promote what the tier holds of the keys it missed
        (with ``prefix``, from the first miss on); whether any was there."""
        first = found.index(None)
        missing = list(keys[first:]) if prefix else [keys[i] for i in _misses(found, None)]
        return any(v is not None for v in self.fetch(store, missing))

    def fill(self, store: _Store, keys: Sequence[Key], out: list[bytes | None]) -> None:
        """A batch get's pool misses (None), from the tier, in place."""
        misses = _misses(out, None)
        if misses:
            for i, v in zip(misses, self.fetch(store, [keys[i] for i in misses]), strict=True):
                out[i] = v

    def get_into(self, store: _Store, key: Key, buffer: Any) -> int:
        """A pool miss of ``get_into``, from the tier: the length, or -1."""
        value = self.fetch(store, [key])[0]
        return -1 if value is None else _into(value, buffer)

    def fill_into(
        self, store: _Store, keys: Sequence[Key], buffers: Sequence[Any], out: list[int]
    ) -> None:
        """A batch get into buffers: its pool misses (-1), from the tier, in place."""
        misses = _misses(out, -1)
        if misses:
            for i, v in zip(misses, self.fetch(store, [keys[i] for i in misses]), strict=True):
                if v is not None:
                    out[i] = _into(v, buffers[i])

    def fill_exists(self, keys: Sequence[Key], out: list[bool]) -> None:
        """Keys the pool does not hold count as stored where the tier holds them."""
        misses = _misses(out, False)
        if misses:
            digests = _core.key_digests([keys[i] for i in misses])
            for i, there in zip(misses, self.tier.exists(digests), strict=True):
                out[i] = there

    def exists(self, key: Key) -> bool:
        return self.tier.exists(_core.key_digests([key]))[0]

    def prefix(self, keys: Sequence[Key]) -> int:
        """How many leading keys (after the pool's prefix) the tier holds."""
        there = self.tier.exists(_core.key_digests(keys))
        return next((i for i, t in enumerate(there) if not t), len(there))

    def stats(self) -> dict[str, Any]:
        return self.tier.stats()

    def close(self) -> None:
        """Close the tier if the store made it."""
        if self._owned:
            self.tier.close()


def _into(value: bytes, buffer: Any) -> int:
    """A value from the tier into a caller's buffer (the checks of get_into)."""
    view = as_buffer(buffer, writable=True)
    if len(view) < len(value):
        raise ValueError(
            f"the buffer holds {len(view)} bytes but the value is {len(value)} bytes; "
            "pass a buffer of at least that size"
        )
    view[: len(value)] = value
    return len(value)


def _misses(found: Sequence[object], miss: object) -> list[int]:
    """Positions of ``found`` that are ``miss`` (the pool's answer for a miss)."""
    return [i for i, f in enumerate(found) if f == miss]
