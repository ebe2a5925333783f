"""The Mooncake drop-in as a chaos writer's client (``beluga.chaos.roles.CLIENTS``).

Importing this module registers it as "mooncake".  A chaos run whose
``ChaosConfig.writer_client`` is "mooncake" (``beluga chaos`` and the CI
rounds) then writes through the drop-in in writer slots 2, 5, ...: batch
upserts from raw ranges, single upserts and removes, under every fault, while
readers check every byte through the store's own read paths.  A put's code
per value becomes its outcome, so a lost write lease reported on the wrong
value of a batch shows as an acknowledged write the pool does not hold.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from beluga.chaos.roles import CLIENTS, RoleSpec
from beluga.compat.mooncake import OK, POOL_PREFIX, ErrorCode, MooncakeDistributedStore
from beluga.errors import RpcError


def _outcome(code: int) -> str:
    """A drop-in code as a chaos outcome: 0 is stored; any failure is of unknown effect
    (a lost write lease and a failed RPC share Mooncake's RPC_FAIL)."""
    if code == OK:
        return "ack"
    try:
        return f"error:{ErrorCode(code).name}"
    except ValueError:
        return f"error:{code}"


class DropInWriter:
    """One chaos role's Mooncake drop-in store over the run's pool.

    Not thread-safe (a role's one thread uses it); not fork-safe (a role makes
    its own, in its own process).
    """

    def __init__(self, spec: RoleSpec) -> None:
        self.store = MooncakeDistributedStore()
        code = self.store.setup(
            "localhost", "", 16 << 20, 16 << 20, "tcp", "", POOL_PREFIX + spec.pool
        )
        if code != OK:
            raise RpcError(f"the Mooncake drop-in could not set up on {spec.pool}: code {code}")
        native = self.store._store
        assert native is not None
        native.rpc.timeout = spec.rpc_timeout_s  # the round's bound on a call, as its roles'

    def put(self, keys: Sequence[str], values: Sequence[bytes]) -> list[str]:
        """Upsert the values (one through ``upsert``, more from raw ranges); an outcome each."""
        if len(keys) == 1:
            return [_outcome(self.store.upsert(keys[0], values[0]))]
        ranges = [bytearray(v) for v in values]  # caller-owned memory, as Mooncake's callers pass
        ptrs = [ctypes.addressof((ctypes.c_char * len(r)).from_buffer(r)) for r in ranges]
        codes = self.store.batch_upsert_from(list(keys), ptrs, [len(r) for r in ranges])
        return [_outcome(c) for c in codes]

    def remove(self, key: str) -> str:
        code = self.store.remove(key)
        return "ack" if code == ErrorCode.OBJECT_NOT_FOUND else _outcome(code)

    def close(self) -> None:
        self.store.close()


CLIENTS["mooncake"] = DropInWriter
