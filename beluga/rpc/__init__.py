"""Shared-memory RPC: slot rings in the pool, polled in user space.

``protocol`` holds the formats, ``client`` the caller's end, ``server`` the
polling loop and handler dispatch; the hot paths live in ``_native/rpc.c``.
"""

from beluga.rpc.client import RpcClient
from beluga.rpc.protocol import FIRST_SERVICE_OP, Op, RemoteValueError, Status
from beluga.rpc.server import BatchHandler, Request, RpcServer, per_request

__all__ = [
    "FIRST_SERVICE_OP",
    "BatchHandler",
    "Op",
    "RemoteValueError",
    "Request",
    "RpcClient",
    "RpcServer",
    "Status",
    "per_request",
]
