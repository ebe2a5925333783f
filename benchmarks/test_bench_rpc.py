"""pytest-benchmark: slot RPC round trip (server in another process, C echo loop)."""

from __future__ import annotations

import pytest

from beluga.bench.rpc import PAYLOAD, ring_server
from beluga.child import server_process
from beluga.pool import Pool
from beluga.rpc import Op, RpcClient

pytestmark = pytest.mark.benchmark


@pytest.mark.parametrize("mode", ["c", "python"])
def test_round_trip(benchmark, pool: Pool, mode: str) -> None:
    with server_process(ring_server, pool.spec, mode), RpcClient(pool, depth=8) as client:
        assert benchmark(client.call, Op.ECHO, PAYLOAD) == PAYLOAD
