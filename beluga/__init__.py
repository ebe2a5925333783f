"""Beluga: a KVCache store for LLM serving on a CXL shared memory pool."""

from beluga.errors import (
    BackendUnavailableError,
    BelugaError,
    CapacityError,
    CoherenceError,
    KVLayoutError,
    LayoutVersionError,
    PoolError,
    PoolNotNamedError,
    RpcError,
    ServingError,
    WriteLeaseLost,
)

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # `from beluga import KVStore` without importing the store for every user of the pool
    if name == "KVStore":
        from beluga.kv.store import KVStore

        return KVStore
    raise AttributeError(f"module 'beluga' has no attribute {name!r}")


__all__ = [
    "BackendUnavailableError",
    "BelugaError",
    "CapacityError",
    "CoherenceError",
    "KVLayoutError",
    "KVStore",
    "LayoutVersionError",
    "PoolError",
    "PoolNotNamedError",
    "RpcError",
    "ServingError",
    "WriteLeaseLost",
    "__version__",
]
