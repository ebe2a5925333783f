"""The connector's settings: ``kv_role`` and ``kv_connector_extra_config``, read and checked once.

:class:`Options` is built when vLLM builds the connector, so a bad value
stops the engine at start with a message that names the setting, and every
later decision reads a field instead of the raw dictionary.

Roles (``kv_role``), as vLLM's disaggregated-serving connectors read them:

``kv_both`` (the default)
    loads the longest cached prefix and saves every full block: a prefix
    cache shared by engines.
``kv_producer``
    a prefill engine: never loads; saves every full block of every prompt
    (also of a request that stops after its first token) inside the step
    that computed it, so when vLLM reports the request finished its blocks
    are committed and a decode engine sent the request next finds them.  It
    tells the decode engine how many blocks to expect in the request's
    ``kv_transfer_params`` (``beluga_blocks``).
``kv_consumer``
    a decode engine: loads every block the pool has (down to the last full
    one, so it computes at most ``block_size - 1`` prompt tokens), saves
    nothing unless ``consumer_saves`` is true, and counts the blocks it was
    told to expect and did not find (the producer died, a block was evicted
    or failed its checksum): it recomputes those, never guesses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from beluga.pool import resolve_pool

TRANSFERS = ("whole", "layerwise")
ROLES = ("kv_both", "kv_producer", "kv_consumer")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")

#: ``"async": "auto"``: a request's load runs off the engine step when it moves at least
#: this many bytes (per rank); a smaller one is read inside the step that needs it
ASYNC_MIN_BYTES = 64 << 20

#: every key ``kv_connector_extra_config`` may hold, and what it sets
KEYS = {
    "pool": "the pool spec (default $BELUGA_POOL)",
    "coherence": "native or model (default: the pool's)",
    "model_revision": "names the model's weights instead of fingerprinting its files",
    "namespace": "one more partition of the keys, e.g. per tenant",
    "transfer": "whole or layerwise: how synchronous loads are split",
    "async": 'true, false or "auto": loads and saves off the engine step',
    "async_min_bytes": 'with "async": "auto", the smallest load that runs off the step',
    "consumer_saves": "kv_consumer: save the blocks it computes, too",
    "timeout_s": "seconds an RPC to the pool's server may take",
    "retry_s": "seconds between attempts to reach an unavailable pool",
}


def _setting(name: str) -> str:
    return f"kv_connector_extra_config '{name}'"


def _flag(extra: dict[str, Any], name: str, default: bool) -> bool:
    value = extra.get(name, default)
    text = str(value).lower()
    if isinstance(value, bool) or text in _TRUE + _FALSE:
        return text in _TRUE
    raise ValueError(f"{_setting(name)} must be true or false, not {value!r}")


def _seconds(extra: dict[str, Any], name: str, default: float) -> float:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{_setting(name)} must be a number of seconds > 0, not {value!r}")
    return float(value)


def async_threshold(extra: dict[str, Any]) -> int | None:
    """The smallest load (bytes per rank) that runs off the engine step; None: none does.

    From the ``async`` option: ``"auto"`` (the default) loads asynchronously from
    ``async_min_bytes`` (64 MiB) up, true always, false never.  Saves run off
    the step unless ``async`` is false (or the engine is a ``kv_producer``).
    """
    value = extra.get("async", "auto")
    text = str(value).lower()
    if text == "auto":
        least = extra.get("async_min_bytes", ASYNC_MIN_BYTES)
        if isinstance(least, bool) or not isinstance(least, int) or least < 0:
            raise ValueError(
                f"{_setting('async_min_bytes')} must be a whole number of bytes >= 0, not {least!r}"
            )
        return least
    if isinstance(value, bool) or text in _TRUE + _FALSE:
        return 0 if text in _TRUE else None
    raise ValueError(f'{_setting("async")} must be true, false or "auto", not {value!r}')


@dataclass(frozen=True)
class Options:
    """What the connector was told to do (see the module docstring); immutable."""

    role: str
    pool: str
    coherence: str | None
    transfer: str
    async_min_bytes: int | None  # loads of at least this many bytes run off the step
    save_async: bool  # saves run on the worker's save thread
    consumer_saves: bool
    timeout_s: float
    retry_s: float

    @property
    def loads(self) -> bool:
        """Whether this engine loads blocks from the pool (every role but the producer)."""
        return self.role != "kv_producer"

    @property
    def saves(self) -> bool:
        """Whether this engine saves blocks (every role but a consumer not told to)."""
        return self.role != "kv_consumer" or self.consumer_saves

    @classmethod
    def of(cls, kv_role: str | None, extra: dict[str, Any] | None) -> Options:
        """Read ``kv_role`` and ``kv_connector_extra_config``; a bad value raises ValueError."""
        extra = dict(extra or {})
        role = kv_role or "kv_both"
        if role not in ROLES:
            raise ValueError(
                f"kv_role {role!r} is not one BelugaConnector serves: use one of {ROLES}"
            )
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            known = ", ".join(f"{k!r} ({why})" for k, why in KEYS.items())
            raise ValueError(
                f"kv_connector_extra_config has keys BelugaConnector does not know: {unknown}; "
                f"it knows {known}"
            )
        transfer = str(extra.get("transfer", "whole"))
        if transfer not in TRANSFERS:
            raise ValueError(f"{_setting('transfer')} must be one of {TRANSFERS}, not {transfer!r}")
        threshold = async_threshold(extra)
        if role == "kv_producer" and "async" in extra and threshold is not None:
            raise ValueError(
                f"{_setting('async')} {extra['async']!r} does not suit kv_role 'kv_producer': a "
                "producer saves inside the step that computed the blocks, so a request is "
                "reported finished only once its blocks are committed; remove 'async'"
            )
        consumer_saves = _flag(extra, "consumer_saves", False)
        if consumer_saves and role != "kv_consumer":
            raise ValueError(f"{_setting('consumer_saves')} is for kv_role 'kv_consumer' only")
        coherence = extra.get("coherence")
        return cls(
            role=role,
            pool=resolve_pool(extra.get("pool"), setting=_setting("pool")),
            coherence=None if coherence is None else str(coherence),
            transfer=transfer,
            async_min_bytes=None if role == "kv_producer" else threshold,
            save_async=threshold is not None and role != "kv_producer",
            consumer_saves=consumer_saves,
            timeout_s=_seconds(extra, "timeout_s", 5.0),
            retry_s=_seconds(extra, "retry_s", 30.0),
        )
