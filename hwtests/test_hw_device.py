# THEORY OF OPERATION
#
# Assumed: each BELUGA_HW_DAX entry is a scratch device-DAX character device
# (sysfs subsystem "dax") holding at least 64 MiB after its offset, which this
# host may map read-write, MAP_SHARED, in 2 MiB pages; BELUGA_HW_NUMA names a
# CPU-less NUMA node (CXL memory onlined as RAM) with at least 64 MiB free.
# Both are scratch: these tests overwrite what is there.
#
# Checked:
# - the configuration itself, each wrong setting failing with what is wrong
#   (missing, not device-DAX, too small, named twice; no such node, a node
#   with CPUs, too little free memory);
# - on every device and on the node: a pool can be created, a second process
#   attaching it sees bytes the first wrote with non-temporal stores and the
#   first sees the second's, and after destroy no host finds a pool there;
# - a numa pool's pages are bound to the node and were placed on it.
"""Device and node checks (see the THEORY OF OPERATION above)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from beluga.coherence import crc32c
from beluga.errors import PoolError
from beluga.pool import Geometry, Pool
from hwtests.hwconfig import HwConfig, dax_problems, numa_problems, numa_spec

pytestmark = pytest.mark.hw

MiB = 1 << 20
POOL_BYTES = 32 * MiB
GEOMETRY = Geometry(max_hosts=4, rpc_bytes_per_host=64 << 10, block_size=64 << 10)
PATTERN_BYTES = MiB


def test_configured_devices_are_device_dax(dax_config: HwConfig) -> None:
    problems = dax_problems(dax_config)
    assert not problems, "; ".join(problems)


def test_configured_node_is_cpuless_memory(numa_config: HwConfig) -> None:
    problems = numa_problems(numa_config)
    assert not problems, "; ".join(problems)


def _peer(spec: str, offset: int, reply: mp.Queue) -> None:
    """Second host: report the checksum of what it sees, then write its own bytes."""
    try:
        with Pool.attach(spec, coherence="native") as pool:
            mem = pool.memory
            mem.invalidate(offset, PATTERN_BYTES)
            mem.mfence()
            seen = crc32c(mem.load(offset, PATTERN_BYTES))
            mem.nt_store(offset, bytes([0xC3]) * PATTERN_BYTES)
            mem.sfence()
            reply.put(seen)
    except BaseException as e:  # surface it in the parent's assertion
        reply.put(repr(e))


def round_trip(spec: str) -> None:
    """Create, share with a second process both ways, destroy; every step must hold."""
    ours = os.urandom(PATTERN_BYTES)
    with Pool.create(spec, POOL_BYTES, geometry=GEOMETRY, force=True, coherence="native") as pool:
        mem, offset = pool.memory, pool.superblock.payloads.offset
        mem.nt_store(offset, ours)
        mem.sfence()
        ctx = mp.get_context("fork")
        reply: mp.Queue = ctx.Queue()
        peer = ctx.Process(target=_peer, args=(spec, offset, reply), daemon=True)
        peer.start()
        try:
            seen = reply.get(timeout=60)
        finally:
            peer.join(10)
            if peer.is_alive():
                peer.kill()
                peer.join()
            reply.close()
            reply.join_thread()
        assert seen == crc32c(ours), f"the second process saw other bytes: {seen}"
        mem.invalidate(offset, PATTERN_BYTES)
        mem.mfence()
        assert mem.load(offset, PATTERN_BYTES) == bytes([0xC3]) * PATTERN_BYTES
    Pool.destroy(spec)
    with pytest.raises(PoolError):
        Pool.attach(spec).close()


def test_each_device_round_trip(hw_dax: list[str]) -> None:
    for spec in hw_dax:
        round_trip(spec)


def test_numa_round_trip_and_placement(hw_numa: int) -> None:
    from beluga.pool.numa import memory_policy, page_node

    spec = numa_spec(hw_numa)
    path = spec.split(":", 2)[2]
    try:
        with Pool.create(spec, POOL_BYTES, geometry=GEOMETRY) as pool:
            assert memory_policy(pool.mapping.buffer) == ("bind", frozenset({hw_numa}))
            for offset in range(0, POOL_BYTES, 2 * MiB):
                assert page_node(pool.mapping.buffer, offset) == hw_numa
        Pool.destroy(spec)
        round_trip(spec)
    finally:
        for leftover in (path, path + ".creating"):
            if os.path.exists(leftover):
                os.unlink(leftover)
