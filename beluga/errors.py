"""The one exception tree of Beluga.

Every error says what happened, what was rolled back, and what the user can
do. Bad arguments raise ``ValueError`` (or a subclass) early instead.
"""

from __future__ import annotations


class BelugaError(Exception):
    """Root of every error Beluga raises on purpose."""


class PoolError(BelugaError):
    """The pool is missing, malformed, foreign, or in the wrong state."""


class LayoutVersionError(PoolError):
    """The pool was made by a different (usually newer) layout version."""


class BackendUnavailableError(BelugaError):
    """A backend cannot be used here (no device, no NUMA node, no permission)."""


class CoherenceError(BelugaError):
    """A coherence-layer operation was used wrongly (bounds, mode, alignment)."""


class RpcError(BelugaError):
    """An RPC failed: timeout, server gone, or a bad request."""


class KVLayoutError(BelugaError, ValueError):
    """Engine KV tensors, a KV layout and a pool block format do not agree."""


class CapacityError(BelugaError):
    """The pool has no room left and nothing can be evicted."""


class ServingError(BelugaError):
    """An engine process failed to start, died, or did not answer in time."""
