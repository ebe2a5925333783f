"""The host table: exact claims granted by the server, liveness, reuse of dead ids.

Claims race among forked children of one attachment (they share its file
descriptors, which is what broke the old flock-based claim), among threads
that are each a model-mode host with stalls injected between every step of
the protocol, and with claimants forced onto one lobby line.  Liveness and
staleness are driven by an injected clock: no sleeping for time to pass.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import random
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from beluga.child import server_process
from beluga.coherence import read_line, write_line
from beluga.errors import PoolError, RpcError
from beluga.pool import Geometry, HostState, Pool
from beluga.pool.host_records import (
    HOST_MAGIC,
    ClaimRequest,
    Grant,
    HostEntry,
    Identity,
    Seat,
    boot_id,
)
from beluga.pool.hosts import HostRegistry, HostTable, Staleness
from beluga.pool.seat import SEAT_SETTLE_S, leave_seat, take_seat
from beluga.rpc import RpcServer
from beluga.server.standby import seat_free
from beluga.signals import stop_on_signals
from tests.conftest import serving
from tests.test_native import crc32c_reference

CTX = mp.get_context("fork")
HOSTS16 = Geometry(max_hosts=16, rpc_bytes_per_host=64 << 10, block_size=64 << 10)


@pytest.fixture
def pool16(shm_path: str) -> Iterator[Pool]:
    p = Pool.create(shm_path, 32 << 20, geometry=HOSTS16)
    yield p
    p.close()
    Pool.destroy(shm_path)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_claim_heartbeat_release(pool: Pool) -> None:
    with serving(pool):
        me = pool.claim_host()
        assert me.pid == os.getpid() and pool.hosts.is_alive(me) and pool.hosts.holds(me)
        assert pool.hosts.read(me.host_id) == me
        later = pool.hosts.heartbeat(me)
        assert later.heartbeat_ns > me.heartbeat_ns
        pool.hosts.release(later)
        left = pool.hosts.read(me.host_id)
        assert left is not None and left.state == HostState.LEFT
        assert not pool.hosts.is_alive(left)
        again = pool.claim_host()  # a released id is free again, in a new generation
        assert again.host_id == me.host_id and again.generation == me.generation + 1


def test_no_server_is_a_clear_error_and_the_request_is_withdrawn(pool: Pool) -> None:
    with pytest.raises(RpcError, match="beluga serve"):
        pool.claim_host(timeout=0.2)
    assert HostRegistry(pool.hosts).serve_lobby() == 0  # a server started later grants nothing


def _serve_rpc(spec: str, ready: mp.Event) -> None:
    with Pool.attach(spec) as pool, stop_on_signals() as stopping:
        server = RpcServer.open(pool, refresh_s=0.005, stopping=stopping)
        ready.set()
        server.serve_forever()
        server.close()


def _claim_in_child(pool: Pool, barrier: mp.Barrier, out: mp.Queue) -> None:
    try:
        entry = pool.claim_host(timeout=20)  # through the parent's attachment
        out.put((entry.host_id, entry.generation, os.getpid()))
        barrier.wait(30)  # nobody exits (freeing its id) before every one has claimed
        pool.hosts.release(entry)
    except BaseException as e:
        out.put(repr(e))


def test_forked_children_of_one_attachment_get_distinct_ids(pool16: Pool) -> None:
    """8 concurrent claimants forked from one attached pool, many rounds: never one id twice."""
    with server_process(_serve_rpc, pool16.spec):
        for _ in range(25):
            barrier, out = CTX.Barrier(8), CTX.Queue()
            kids = [
                CTX.Process(target=_claim_in_child, args=(pool16, barrier, out)) for _ in range(8)
            ]
            for k in kids:
                k.start()
            got = [out.get(timeout=60) for _ in kids]
            for k in kids:
                k.join(30)
            out.close()
            out.join_thread()
            assert all(isinstance(g, tuple) for g in got), got
            assert len({g[0] for g in got}) == 8, f"two live processes share an id: {got}"
            assert len({g[2] for g in got}) == 8


def _stalling(rng: random.Random, seen: list[str]) -> object:
    """A step hook that stalls a claimant for a random while at every step."""

    def step(name: str) -> None:
        seen.append(name)
        time.sleep(rng.choice([0, 0, 0.0005, 0.002, 0.01]))

    return step


@pytest.mark.parametrize("seed", range(6))
def test_model_hosts_with_stalls_at_every_step_and_one_lobby_line(pool16: Pool, seed: int) -> None:
    """Claimants are model-mode hosts (stale caches, lines written back whole), stalled at
    random between every step, and all forced onto lobby line 0, so their requests
    overwrite and tear each other: every id granted is still granted to one live claimant."""
    rng = random.Random(seed)
    steps: list[str] = []
    results: list[object] = []
    hosts = [Pool.attach(pool16.spec, coherence="model") for _ in range(6)]
    for h in hosts:
        h.hosts._lobby_line = lambda rng: 0  # type: ignore[method-assign]  # all on one line
    try:
        with serving(pool16):

            def claim(h: Pool, i: int) -> None:
                try:
                    step = _stalling(random.Random(rng.random()), steps)
                    results.append(h.hosts.claim(timeout=30, step=step))  # type: ignore[arg-type]
                except BaseException as e:
                    results.append(e)

            threads = [threading.Thread(target=claim, args=(h, i)) for i, h in enumerate(hosts)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert all(not t.is_alive() for t in threads)
            assert all(not isinstance(r, BaseException) for r in results), results
            ids = [r.host_id for r in results]  # type: ignore[union-attr]
            assert len(set(ids)) == len(hosts), ids
            for r in results:
                assert pool16.hosts.holds(r)  # type: ignore[arg-type]
            # the window was hit: claimants had to post again after a collision
            assert steps.count("post") > len(hosts), steps
    finally:
        for h in hosts:
            h.close()


def test_a_wanted_id_held_by_a_live_process_is_refused(pool: Pool) -> None:
    with serving(pool):
        mine = pool.claim_host(2)
        assert mine.host_id == 2
        with pytest.raises(PoolError, match=f"held by live pid {os.getpid()}"):
            pool.claim_host(2)
        with pytest.raises(ValueError, match=r"0\.\.3"):
            pool.claim_host(9)
        others = [pool.claim_host() for _ in range(3)]
        assert sorted(e.host_id for e in others) == [0, 1, 3]
        with pytest.raises(PoolError, match="all 4 host ids"):
            pool.claim_host()


def _claim_then_die(spec: str, out: mp.Queue) -> None:
    with Pool.attach(spec) as pool:
        out.put(pool.claim_host(timeout=20).host_id)
    out.close()
    out.join_thread()  # the id is on its way to the parent ...
    os._exit(0)  # ... and this process ends without releasing it


def test_a_dead_holders_id_is_granted_again(pool: Pool) -> None:
    with serving(pool):
        out = CTX.Queue()
        p = CTX.Process(target=_claim_then_die, args=(pool.spec, out))
        p.start()
        dead = out.get(timeout=30)
        p.join(30)
        out.close()
        out.join_thread()
        heir = pool.claim_host(dead)
        assert heir.host_id == dead and heir.generation == 2


def test_a_stopped_holder_is_alive(pool: Pool) -> None:
    """On one kernel liveness is exact: a SIGSTOPped holder keeps its id however long."""
    with serving(pool) as server:
        out = CTX.Queue()
        ready = CTX.Event()

        def hold(spec: str) -> None:
            with Pool.attach(spec) as p:
                out.put(p.claim_host(1, timeout=20).host_id)
                ready.wait(60)

        proc = CTX.Process(target=hold, args=(pool.spec,))
        proc.start()
        try:
            assert out.get(timeout=30) == 1
            os.kill(proc.pid, signal.SIGSTOP)
            ages = itertools.count(time.monotonic(), 1e6)  # each look is 1e6 s after the last
            server.registry.stale.clock = lambda: next(ages)
            assert server.registry.alive(1) is not None  # seen now; the claim's look is later
            with pytest.raises(PoolError, match=f"held by live pid {proc.pid}"):
                pool.claim_host(1)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            ready.set()
            proc.join(30)
        out.close()
        out.join_thread()


# -- liveness and staleness with an injected clock ------------------------------------


def test_staleness_is_judged_by_the_observers_clock() -> None:
    clock = FakeClock()
    s = Staleness(10.0, clock)
    assert s.fresh("h", 1)
    clock.now += 9.9
    assert s.fresh("h", 1)
    clock.now += 0.2
    assert not s.fresh("h", 1)  # unchanged for 10.1 s of our clock
    assert s.fresh("h", 2)  # it moved: fresh again, whatever its value says
    clock.now += 9.9
    assert s.fresh("h", 2)


def _table(pool: Pool, clock: FakeClock) -> HostTable:
    sb = pool.superblock
    return HostTable(pool.memory, sb.hosts, sb.max_hosts, clock=clock, wall=lambda: 5)


def _remote_grant(table: HostTable, host_id: int, gen: int) -> Grant:
    """Grant an id to a process of another machine (another boot id), as the server would."""
    from beluga.coherence import write_line

    g = Grant(host_id, gen, Identity(4242, 1, b"elsewher"), 99)
    write_line(table.mem, table._grant_off(host_id), g.pack())
    return g


def test_another_hosts_holder_lives_while_its_heartbeat_moves(pool: Pool) -> None:
    clock = FakeClock()
    table = _table(pool, clock)
    registry = HostRegistry(table, stale_s=10.0)
    g = _remote_grant(table, 1, 3)
    assert registry.alive(1) == g  # granted, not yet confirmed: fresh from now
    clock.now += 11
    assert registry.alive(1) is None  # never confirmed within stale_s
    from beluga.coherence import write_line
    from beluga.pool.host_records import HostEntry

    entry = HostEntry(1, HostState.ALIVE, 4242, 1, b"elsewher", 100, 3, 99)
    write_line(table.mem, table._host_off(1), entry.pack())
    assert registry.alive(1) == g  # confirmed, and its heartbeat is new to us
    clock.now += 9
    write_line(table.mem, table._host_off(1), replace(entry, heartbeat_ns=101).pack())
    assert registry.alive(1) == g
    clock.now += 9.5
    assert registry.alive(1) == g  # 9.5 s since it moved
    clock.now += 1
    assert registry.alive(1) is None  # stalled past stale_s: taken for dead
    left = replace(entry, state=HostState.LEFT, heartbeat_ns=102)
    write_line(table.mem, table._host_off(1), left.pack())
    assert registry.alive(1) is None


def _remote_holder(table: HostTable, host_id: int, gen: int, beat: int) -> HostEntry:
    """A holder on another machine that confirmed its grant and has beaten ``beat``."""
    _remote_grant(table, host_id, gen)
    entry = HostEntry(host_id, HostState.ALIVE, 4242, 1, b"elsewher", beat, gen, 99)
    write_line(table.mem, table._host_off(host_id), entry.pack())
    return entry


def test_a_successor_judges_a_dead_holder_by_what_its_predecessor_watched(pool: Pool) -> None:
    """With a takeover every few seconds no server watches a dead client for stale_s: its id
    must come back after stale_s of the servers' watch together (issue 36: 4,046 connects
    refused in a 1,000-fault round, every id held by the dead)."""
    clock = FakeClock()
    table = _table(pool, clock)
    first = HostRegistry(table, stale_s=10.0)
    dead = _remote_holder(table, 1, 3, beat=100)  # it never beats again
    moving = _remote_holder(table, 2, 5, beat=200)
    assert first.alive(1) is not None and first.alive(2) is not None
    clock.now += 6
    assert first.alive(1) is not None  # 6 s still: not yet
    watched = first.watch(1)
    assert watched is not None and (watched.generation, watched.beat) == (3, 100)
    assert watched.still_s == pytest.approx(6.0)
    second = HostRegistry(table, stale_s=10.0)  # the next server, 6 s into the stall
    second.inherit(1, watched)
    second.inherit(2, first.watch(2))  # type: ignore[arg-type]
    write_line(table.mem, table._host_off(2), replace(moving, heartbeat_ns=201).pack())
    clock.now += 3
    assert second.alive(1) is not None  # 9 s of the two servers' watch
    clock.now += 1.5
    assert second.alive(1) is None  # 10.5 s: dead, though this server watched 4.5 s
    assert second.alive(2) is not None  # it beat meanwhile: nothing inherited counts
    assert HostRegistry(table, stale_s=10.0).alive(1) is not None  # alone, it starts over
    assert table.read(1) == dead


def test_the_watch_travels_in_the_status_lines_to_the_next_server(pool: Pool) -> None:
    """What a server watched is in each id's ring status line, written every refresh and at
    a clean stop; the server that takes the seat next starts from it."""
    from beluga.rpc.protocol import STATUS_LINE, RingControl, ServerStatus, ring_offset

    clock = FakeClock()
    pool.hosts.clock = clock  # every registry on this pool judges by it
    _remote_holder(pool.hosts, 1, 3, beat=100)
    ring = RingControl(1, 3, 8, 4242, 1, 0)  # its ring: each refresh judges its holder
    write_line(pool.memory, ring_offset(pool.superblock, 1), ring.pack())
    with RpcServer.open(pool, stale_s=10.0) as first:
        clock.now += 7
        first.refresh()
        line = read_line(pool.memory, ring_offset(pool.superblock, 1) + STATUS_LINE)
        status = ServerStatus.unpack(line)
        assert status is not None and status.watch is not None
        assert (status.watch.generation, status.watch.beat) == (3, 100)
        assert status.watch.still_s == pytest.approx(7.0)
    with RpcServer.open(pool, stale_s=10.0) as second:
        clock.now += 2
        assert second.registry.alive(1) is not None  # 9 s
        clock.now += 1.5
        assert second.registry.alive(1) is None  # 10.5 s of the two servers' watch


def test_a_holder_taken_for_dead_finds_its_grant_gone(pool: Pool) -> None:
    clock = FakeClock()
    table = _table(pool, clock)
    regrants: list[tuple[int, int]] = []
    registry = HostRegistry(
        table, 10.0, before_grant=lambda h, old: regrants.append((h, old.generation))
    )
    from beluga.coherence import write_line
    from beluga.pool.host_records import HostEntry

    _remote_grant(table, 0, 1)
    stalled = HostEntry(0, HostState.ALIVE, 4242, 1, b"elsewher", 7, 1, 99)
    write_line(table.mem, table._host_off(0), stalled.pack())
    assert table.holds(stalled) and registry.alive(0) is not None
    clock.now += 30  # its heartbeat never moves again
    me = Identity.mine()
    write_line(table.mem, table._lobby_off(0), ClaimRequest(0, me, 1234).pack())
    assert registry.serve_lobby() == 1
    assert regrants == [(0, 1)]  # the old holder's state is dropped before the new grant
    assert not table.holds(stalled)  # a resumed holder sees this and stops writing its line
    new = table.grant(0)
    assert new is not None and new.generation == 2 and new.identity == me
    table.release(stalled)  # a late release by the old holder changes nothing
    assert table.read(0) == stalled


def test_torn_and_foreign_lobby_lines_are_ignored(pool: Pool) -> None:
    from beluga.coherence import write_line

    table = pool.hosts
    registry = HostRegistry(table)
    write_line(table.mem, table._lobby_off(0), os.urandom(64))
    torn = bytearray(ClaimRequest(-1, Identity.mine(), 5).pack())
    torn[20] ^= 0xFF
    write_line(table.mem, table._lobby_off(1), bytes(torn))
    assert registry.serve_lobby() == 0
    assert all(table.grant(h) is None for h in range(table.max_hosts))


def test_a_second_server_is_refused_while_one_serves(pool: Pool) -> None:
    with serving(pool):
        with pytest.raises(PoolError, match=r"server seat .* is held by another process"):
            RpcServer.open(pool)
        with Pool.attach(pool.spec) as other, pytest.raises(PoolError, match="another"):
            RpcServer.open(other)
    with serving(pool) as again:  # the seat and the lock were given back
        assert again.registry.table.seat() is not None


def test_a_host_line_is_its_fields_padded_then_their_crc32c() -> None:
    """The byte format of a host line, built here by hand: it must never change."""
    entry = HostEntry(3, HostState.ALIVE, 1234, 5678, b"bootid!!", 99, 7, 42)
    fields = (HOST_MAGIC, 3, 1, 1234, 5678, b"bootid!!", 99, 7, 42)
    body = struct.pack("<IIIIQ8sQQQ", *fields).ljust(60, b"\0")
    line = body + struct.pack("<I", crc32c_reference(body))
    assert entry.pack() == line and HostEntry.unpack(line) == entry
    assert HostEntry.unpack(line[:60] + bytes(4)) is None


def _foreign_seat(table: HostTable, pid: int, boot: bytes, epoch: int = 7) -> Seat:
    """A seat line of a server on another host (its boot id ``boot``), heartbeat now."""
    now = table.wall()
    return Seat(epoch, Identity(pid, 1, boot), now, now, 1, 0)


def test_a_rival_standby_that_stores_the_seat_at_once_wins_and_the_other_waits(
    pool: Pool,
) -> None:
    """Two standbys on two hosts fenced one stalled server and both store the seat line:
    the one whose store lands last keeps the seat; the other raises during the settle
    (its standby waits again) instead of serving beside it."""
    table = pool.hosts
    stalled = _foreign_seat(table, 4242, b"\x01" * 8)
    write_line(table.mem, table._seat_off, stalled.pack())
    rival = _foreign_seat(table, 5151, b"\x02" * 8, epoch=9)
    mine_pid = os.getpid()

    def rival_stores_after_ours() -> None:  # it looked before our store, stores after it
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seat = table.seat()
            if seat is not None and seat.identity.pid == mine_pid:
                write_line(table.mem, table._seat_off, rival.pack())
                return
            time.sleep(0.001)

    thread = threading.Thread(target=rival_stores_after_ours)
    thread.start()
    with pytest.raises(PoolError, match="took the seat at once"):
        take_seat(table, 11, wait_s=1.0, fenced=stalled)
    thread.join(10)
    assert table.seat() == rival  # the rival's line stands: nothing of ours overwrote it


def test_a_seat_taken_from_another_host_without_a_rival_is_held(pool: Pool) -> None:
    table = pool.hosts
    stalled = _foreign_seat(table, 4242, b"\x01" * 8)
    write_line(table.mem, table._seat_off, stalled.pack())
    started = time.monotonic()
    mine = take_seat(table, 11, wait_s=1.0, fenced=stalled)
    assert time.monotonic() - started >= SEAT_SETTLE_S  # it held the seat through the settle
    seat = table.seat()
    assert seat is not None and seat.identity == mine.identity and seat.epoch == 11
    assert seat.takeovers == 1
    leave_seat(table, mine)


def _store_after_ours(table: HostTable, rival: Seat) -> threading.Thread:
    """A rival standby that looked at the seat before our store and stores its line just
    after ours (CXL memory has no atomic to stop it)."""
    mine = os.getpid()

    def store() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seat = table.seat()
            if seat is not None and seat.identity.pid == mine:
                write_line(table.mem, table._seat_off, rival.pack())
                return
            time.sleep(0.001)

    thread = threading.Thread(target=store)
    thread.start()
    return thread


def test_an_empty_seat_last_held_on_another_host_is_taken_through_the_settle(
    pool: Pool,
) -> None:
    """A server on another host left the seat (epoch 0): it may be taken unfenced, but a
    standby on a third host that saw the same empty seat may store its line at once.  Ours
    is held through the settle, re-read: the rival's later store wins, and ours raises
    instead of serving beside it."""
    table = pool.hosts
    left = _foreign_seat(table, 4242, b"\x01" * 8, epoch=0)
    write_line(table.mem, table._seat_off, left.pack())
    rival = _foreign_seat(table, 5151, b"\x02" * 8, epoch=9)
    thread = _store_after_ours(table, rival)
    with pytest.raises(PoolError, match="took the seat at once"):
        take_seat(table, 11, wait_s=1.0)
    thread.join(10)
    assert table.seat() == rival


def test_a_seat_is_free_unfenced_only_when_empty_or_its_server_is_gone_from_this_kernel(
    pool: Pool,
) -> None:
    """``seat_free``: a seat line naming a pid that runs nowhere here is free only when the
    line's boot id is this kernel's; with another host's boot id that pid says nothing (the
    server runs there, perhaps), so the seat is not free.  An empty seat is free whoever
    held it last."""
    table = pool.hosts
    ended = subprocess.Popen(["true"])
    ended.wait(10)
    now = table.wall()
    for boot, free in ((b"\x01" * 8, False), (boot_id(), True)):
        gone = Seat(7, Identity(ended.pid, 1, boot), now, now, 1, 0)
        assert not gone.identity.running()
        write_line(table.mem, table._seat_off, gone.pack())
        assert seat_free(pool) is free, f"boot id {boot.hex()}"
    for boot in (b"\x01" * 8, boot_id()):
        write_line(table.mem, table._seat_off, _foreign_seat(table, 4242, boot, epoch=0).pack())
        assert seat_free(pool)
    mine = Seat(7, Identity.mine(), now, now, 1, 0)
    write_line(table.mem, table._seat_off, mine.pack())
    assert not seat_free(pool)  # a running server of this kernel
