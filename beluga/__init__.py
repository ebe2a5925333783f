"""Beluga: a KVCache store for LLM serving on a CXL shared memory pool."""

from beluga.errors import (
    BackendUnavailableError,
    BelugaError,
    CapacityError,
    CoherenceError,
    KVLayoutError,
    LayoutVersionError,
    PoolError,
    RpcError,
)

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "BelugaError",
    "CapacityError",
    "CoherenceError",
    "KVLayoutError",
    "LayoutVersionError",
    "PoolError",
    "RpcError",
    "__version__",
]
