"""The one exception tree of Beluga.

Every error says what happened, what was rolled back, and what the user can
do. Bad arguments raise ``ValueError`` (or a subclass) early instead.
"""

from __future__ import annotations


class BelugaError(Exception):
    """Root of every error Beluga raises on purpose."""


class PoolError(BelugaError):
    """The pool is missing, malformed, foreign, or in the wrong state."""


class PoolChangedError(PoolError):
    """The pool this handle maps was reformatted, unlinked or replaced under it.

    Nothing more is written through the handle: close it and attach again
    (a server exits; a client reconnects to whatever pool the spec now names).
    """


class PoolNotNamedError(BelugaError, ValueError):
    """No pool is named: no argument, no setting and no ``$BELUGA_POOL``."""


class LayoutVersionError(PoolError):
    """The pool was made by a different (usually newer) layout version."""


class BackendUnavailableError(BelugaError):
    """A backend cannot be used here (no device, no NUMA node, no permission)."""


class CoherenceError(BelugaError):
    """A coherence-layer operation was used wrongly (bounds, mode, alignment)."""


class RpcError(BelugaError):
    """An RPC failed: timeout, server gone, or a bad request."""


class WriteLeaseLost(RpcError):
    """The server refused to commit some writes of a call: their write lease ran out first.

    The server answered, so the outcome of each write is known: the writes at
    ``lost`` (positions in the call's keys or refs) are not in the pool; every
    other write of the call was committed.  Put the lost ones again.
    """

    def __init__(self, lost: list[int], total: int) -> None:
        super().__init__(
            f"{len(lost)} of {total} writes lost their write lease before commit (the "
            "server restarted or the write took too long); the others were committed: "
            "put those again (positions in .lost)"
        )
        self.lost = lost
        self.total = total

    def __reduce__(self) -> tuple[type[WriteLeaseLost], tuple[list[int], int]]:
        return WriteLeaseLost, (self.lost, self.total)


class KVLayoutError(BelugaError, ValueError):
    """Engine KV tensors, a KV layout and a pool block format do not agree."""


class CapacityError(BelugaError):
    """The pool has no room left and nothing can be evicted."""


class ServingError(BelugaError):
    """An engine process failed to start, died, or did not answer in time."""
