"""Pools: backends that map memory, the self-describing layout, the host table."""

from beluga.pool.backends import (
    DEFAULT_POOL,
    POOL_ENV,
    Backend,
    Mapping,
    ShmBackend,
    parse_spec,
    register_backend,
    resolve_pool,
)
from beluga.pool.host_records import HostEntry, HostState
from beluga.pool.hosts import HostTable
from beluga.pool.layout import LAYOUT_VERSION, Geometry, Region, Superblock
from beluga.pool.pool import Pool, removal_guard

__all__ = [
    "DEFAULT_POOL",
    "LAYOUT_VERSION",
    "POOL_ENV",
    "Backend",
    "Geometry",
    "HostEntry",
    "HostState",
    "HostTable",
    "Mapping",
    "Pool",
    "Region",
    "ShmBackend",
    "Superblock",
    "parse_spec",
    "register_backend",
    "removal_guard",
    "resolve_pool",
]
