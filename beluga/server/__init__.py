"""The metadata server: ``beluga serve`` and what it owns.

:mod:`beluga.server.server` starts a server on a pool (attach, take the
seat, recover, serve) and keeps a standby; :mod:`~beluga.server.service`
answers the client's requests (grants, commits, lookups, eviction, recovery
while serving); :mod:`~beluga.server.index` writes the pool's hash index,
:mod:`~beluga.server.keyindex` keeps the service's keys in LRU order,
:mod:`~beluga.server.allocator` hands out block extents, and
:mod:`~beluga.server.metrics` exports Prometheus metrics.  The client that
talks to it is :mod:`beluga.kv`.
"""

from beluga.server.server import MetadataServer, serve

__all__ = ["MetadataServer", "serve"]
