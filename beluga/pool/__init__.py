"""Pools: backends that map memory, the self-describing layout, the host table."""

from beluga.pool.backends import Backend, Mapping, ShmBackend, parse_spec, register_backend
from beluga.pool.hosts import HostEntry, HostState, HostTable
from beluga.pool.layout import LAYOUT_VERSION, Geometry, Region, Superblock
from beluga.pool.pool import Pool

__all__ = [
    "LAYOUT_VERSION",
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
]
