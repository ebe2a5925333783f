"""TieredStore: a KVStore whose pool misses go on to the tier beyond the pod.

:class:`~beluga.kv.store.KVStore` is the pool alone.  Given a tier
(``KVStore(..., tier=...)`` or ``BELUGA_TIER``), ``KVStore(...)`` makes this
subclass instead, and every difference lives here:

- a read that the pool misses asks the tier (:mod:`beluga.kv.tier`) for the
  keys it missed; what the tier holds is promoted into the pool (a plain
  replacing save, never written back to the tier) and returned, so the
  pod's next reader loads it at pool speed;
- ``is_exist``, ``batch_is_exist`` and ``lookup_prefix`` count what the tier
  holds as stored (a later read promotes it);
- with ``write_through``, every value a save commits is queued for the tier,
  read back from the pool;
- ``stats`` carries the client's tier counters, and ``close`` closes a tier
  the store made.

Thread-safe and not fork-safe, as :class:`~beluga.kv.store.KVStore` and
:class:`~beluga.kv.tier.MooncakeTier` are.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from beluga._native import _core
from beluga.errors import BelugaError
from beluga.kv.store import BlockRef, Key, KVStore
from beluga.kv.tier import MooncakeTier, TierConfig, make_tier
from beluga.transfer import Buffers, as_buffer

log = logging.getLogger("beluga.store")


class TieredStore(KVStore):
    """A KVStore with the cross-pod tier behind its pool (see the module docstring)."""

    def __init__(
        self,
        pool: Any,
        *,
        tier: MooncakeTier | TierConfig | str | None = None,
        **options: Any,
    ) -> None:
        made = make_tier(tier)
        assert made is not None, "KVStore makes a TieredStore only when a tier is configured"
        super().__init__(pool, **options)
        #: the tier beyond this pod: pool misses are looked up there
        self.tier: MooncakeTier = made
        self._owns_tier = not isinstance(tier, MooncakeTier)

    def _from_tier(self, keys: Sequence[Key]) -> list[bytes | None]:
        """Values of keys the pool missed, from the tier; found ones are promoted into the
        pool (best effort: a full pool or an absent server still returns the value)."""
        values = self.tier.fetch(_core.key_digests(keys))
        found = [(k, v) for k, v in zip(keys, values, strict=True) if v is not None]
        promoted = 0
        if found:
            try:  # the pool's own save: a promoted value is not written back to the tier
                saved = KVStore.save(
                    self, [k for k, _ in found], Buffers([v for _, v in found]), replace=True
                )
                promoted = len(saved.stored)
            except (BelugaError, OSError) as exc:
                log.debug("promotion of %d values from the tier failed: %s", len(found), exc)
        self.index.count_tier(len(found), promoted)
        return values

    def _committed(self, refs: Sequence[BlockRef]) -> None:
        """With write-through, queue what a save committed for the tier (read back)."""
        if not self.tier.config.write_through:
            return
        for r in refs:
            value = self.mem.read_bytes(
                r.header_offset, r.payload_offset, r.capacity, r.digest, r.version
            )
            if isinstance(value, bytes):
                self.tier.submit(r.digest, value, "write-through")

    def locate(self, keys: Sequence[Key], prefix: bool = True) -> list[BlockRef | None]:
        found = super().locate(keys, prefix)
        if None in found:  # promote what the tier holds, then look again
            first = found.index(None)
            missing = list(keys[first:]) if prefix else [keys[i] for i in _misses(found, None)]
            if any(v is not None for v in self._from_tier(missing)):
                found = super().locate(keys, prefix)
        return found

    def get(self, key: Key) -> bytes | None:
        value = super().get(key)
        return self._from_tier([key])[0] if value is None else value

    def get_batch(self, keys: Sequence[Key]) -> list[bytes | None]:
        out = super().get_batch(keys)
        misses = _misses(out, None)
        if misses:
            for i, v in zip(misses, self._from_tier([keys[i] for i in misses]), strict=True):
                out[i] = v
        return out

    def get_into(self, key: Key, buffer: Any) -> int:
        n = super().get_into(key, buffer)
        if n >= 0:
            return n
        value = self._from_tier([key])[0]
        return -1 if value is None else _into(value, buffer)

    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[int]:
        out = super().batch_get_into(keys, buffers)
        misses = _misses(out, -1)
        if misses:
            for i, v in zip(misses, self._from_tier([keys[i] for i in misses]), strict=True):
                if v is not None:
                    out[i] = _into(v, buffers[i])
        return out

    def batch_is_exist(self, keys: Sequence[Key]) -> list[bool]:
        out = super().batch_is_exist(keys)
        misses = _misses(out, False)
        if misses:
            digests = _core.key_digests([keys[i] for i in misses])
            for i, there in zip(misses, self.tier.exists(digests), strict=True):
                out[i] = there
        return out

    def is_exist(self, key: Key) -> bool:
        return super().is_exist(key) or self.tier.exists(_core.key_digests([key]))[0]

    def lookup_prefix(self, keys: Sequence[Key]) -> int:
        n = super().lookup_prefix(keys)
        if n < len(keys):
            there = self.tier.exists(_core.key_digests(keys[n:]))
            n += next((i for i, t in enumerate(there) if not t), len(there))
        return n

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats["client_tier"] = self.tier.stats()
        return stats

    def close(self) -> None:
        if self._owns_tier:
            self.tier.close()
        super().close()


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
