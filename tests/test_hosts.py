"""The host table: claims, liveness by pid + start time, reuse of dead slots."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from beluga.errors import PoolError
from beluga.pool import HostState, Pool


def test_claim_heartbeat_release(pool: Pool) -> None:
    me = pool.claim_host()
    assert me.pid == os.getpid() and pool.hosts.is_alive(me)
    assert pool.hosts.read(me.host_id) == me
    later = pool.hosts.heartbeat(me)
    assert later.heartbeat_ns >= me.heartbeat_ns
    pool.hosts.release(later)
    left = pool.hosts.read(me.host_id)
    assert left is not None and left.state == HostState.LEFT and not pool.hosts.is_alive(left)


def _claim_and_report(spec: str, q: mp.Queue) -> None:
    with Pool.attach(spec, coherence="model") as p:
        q.put(p.claim_host().host_id)


def test_concurrent_claims_get_distinct_ids(pool: Pool) -> None:
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_claim_and_report, args=(pool.spec, q)) for _ in range(3)]
    for p in procs:
        p.start()
    ids = sorted(q.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    q.close()
    q.join_thread()
    assert len(set(ids)) == 3
    # those processes exited: their slots count as dead and are reclaimable
    assert all(not pool.hosts.is_alive(pool.hosts.read(i)) for i in ids)
    assert pool.claim_host().host_id in range(4)


def test_a_reused_pid_is_not_the_old_host(pool: Pool) -> None:
    me = pool.claim_host()
    impostor = type(me)(**{**me.__dict__, "start_ms": me.start_ms - 5000})
    pool.hosts._write(impostor)
    assert not pool.hosts.is_alive(pool.hosts.read(me.host_id))


def test_a_live_explicit_id_is_refused_and_a_full_table_says_so(pool: Pool) -> None:
    ctx = mp.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()

    def hold(spec: str) -> None:
        with Pool.attach(spec) as p:
            p.claim_host(2)
            ready.set()
            done.wait(30)

    proc = ctx.Process(target=hold, args=(pool.spec,))
    proc.start()
    try:
        assert ready.wait(30)
        with pytest.raises(PoolError, match="held by live pid"):
            pool.claim_host(2)
        with pytest.raises(ValueError, match=r"0\.\.3"):
            pool.claim_host(9)
    finally:
        done.set()
        proc.join(30)


def test_heartbeat_staleness_decides_for_other_boots(pool: Pool) -> None:
    me = pool.claim_host()
    remote = type(me)(**{**me.__dict__, "boot_id": b"elsewhr", "heartbeat_ns": 1})
    assert not pool.hosts.is_alive(remote)
    fresh = pool.hosts.heartbeat(remote)
    assert pool.hosts.is_alive(fresh)
