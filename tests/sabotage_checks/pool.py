"""The pool's own structures: the host table (pool/hosts.py) and formatting (pool/pool.py)."""

from __future__ import annotations

import numpy as np

from beluga import litmus
from beluga.coherence import LINE, ModelConfig, read_line, write_line
from beluga.errors import PoolError
from beluga.litmus import Seen
from beluga.pool import HostState
from beluga.pool.host_records import ClaimAnswer, ClaimRequest, Grant, HostEntry, Identity
from beluga.pool.hosts import HostRegistry, HostTable
from beluga.pool.layout import Region, host_region_lines, plan, unpack
from beluga.pool.pool import format_pool
from tests.sabotage_checks.base import GEOMETRY, SEEDS, Violation, _host, _still, _window_seen

# -- host table (pool/hosts.py) ---------------------------------------------------

HOSTS = 4
ELSEWHERE = Identity(4242, 1, b"elsewher")  # a process of another machine (boot id)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _tables(model: ModelConfig, n: int, clock: _Clock, seed: int = 1) -> list[HostTable]:
    """n model hosts' views of one host table, their wall clocks ticking on every stamp."""
    region = Region(0, host_region_lines(HOSTS) * LINE)
    shared = bytearray(region.length)
    beats = iter(range(100, 10**9))
    return [
        HostTable(
            _host(shared, model, seed + i), region, HOSTS, clock=clock, wall=lambda: next(beats)
        )
        for i in range(n)
    ]


def _grant_elsewhere(server: HostTable, holder: HostTable, host_id: int) -> HostEntry:
    """The server grants an id to a process of another machine, which confirms it."""
    g = Grant(host_id, 3, ELSEWHERE, 99)
    write_line(server.mem, server._grant_off(host_id), g.pack())
    entry = HostEntry(host_id, HostState.ALIVE, 4242, 1, b"elsewher", 100, 3, 99)
    write_line(holder.mem, holder._host_off(host_id), entry.pack())
    return entry


def hosts_remote_heartbeat(model: ModelConfig) -> None:
    """Two model hosts: the server sees a remote holder's heartbeat move, so it stays alive."""
    clock = _Clock()
    server, holder = _tables(model, 2, clock)
    registry = HostRegistry(server, stale_s=10.0)
    entry = _grant_elsewhere(server, holder, 1)
    for beat in range(12):
        clock.now += 4.0
        entry = holder.heartbeat(entry)
        seen = server.read(1)
        if seen != entry:
            raise Violation(f"beat {beat}: the server read a stale host line")
        if registry.alive(1) is None:
            raise Violation(f"beat {beat}: a live remote holder was taken for dead")


def hosts_grant_gone(model: ModelConfig) -> None:
    """A holder taken for dead (another host's claim) finds its grant gone."""
    clock = _Clock()
    server, holder, claimant = _tables(model, 3, clock)
    registry = HostRegistry(server, stale_s=10.0)
    entry = _grant_elsewhere(server, holder, 0)
    if not holder.holds(entry) or registry.alive(0) is None:
        raise Violation("a fresh grant was not seen by its holder and the server")
    clock.now += 30  # its heartbeat never moved: taken for dead
    write_line(claimant.mem, claimant._lobby_off(0), ClaimRequest(0, Identity.mine(), 7).pack())
    if registry.serve_lobby() != 1:
        raise Violation("the server did not grant the dead holder's id again")
    if holder.holds(entry):
        raise Violation("a holder whose id was granted again still reads its old grant")


def hosts_grant_sweep(model: ModelConfig) -> None:
    """Every state inside answering a claim: an answer never lands before its grant."""
    request = ClaimRequest(-1, Identity.mine(), 0x5EED)

    def attempt(k: int | None, seed: int) -> tuple[Seen, int]:
        server, claimant, look = _tables(model, 3, _Clock(), seed)
        write_line(claimant.mem, claimant._lobby_off(3), request.pack())
        registry = HostRegistry(server, stale_s=10.0)
        before = server.mem.model_stats()["landed"]
        if k is not None:
            server.mem.crash_after(k)
        registry.serve_lobby()
        landed = server.mem.model_stats()["landed"] - before
        answer = ClaimAnswer.unpack(read_line(look.mem, look._answer_off(3)))
        if answer is None or answer.nonce != request.nonce:
            return Seen.NOTHING, landed
        grant = look.grant(answer.result)
        ok = grant is not None and (grant.nonce, grant.generation) == (
            request.nonce,
            answer.generation,
        )
        return litmus.judge(ok), landed

    for seed in SEEDS:
        r = litmus.sweep_crashes(lambda k, s=seed: attempt(k, s), name="grant")
        if r.caught:
            raise Violation(f"a claim's answer landed before its grant (seed {seed})")
        _window_seen(r)


# -- pool format (pool/pool.py) ----------------------------------------------------

FORMAT_SIZE = 12 << 20


_OLD_POOL = bytearray(b"\xa5" * FORMAT_SIZE)  # a device holding an old pool: a valid
_OLD_POOL[:4096] = plan(FORMAT_SIZE, GEOMETRY, "old").pack()  # superblock over its state


def format_sweep(model: ModelConfig) -> None:
    """Every state inside formatting a device: a new superblock never shows old regions."""
    new = plan(FORMAT_SIZE, GEOMETRY, "new")

    def attempt(k: int | None, seed: int) -> tuple[Seen, int]:
        shared = bytearray(_OLD_POOL)
        fmt = _host(shared, model, seed)
        if k is not None:
            fmt.crash_after(k)
        format_pool(fmt, new, clear=True)
        landed = fmt.model_stats()["landed"]
        fmt.release()
        try:
            sb = unpack(bytes(shared[:4096]), FORMAT_SIZE)
        except PoolError:
            return Seen.NOTHING, landed  # no pool at all: nothing to trust
        if sb.uuid != new.uuid:
            return Seen.NOTHING, landed  # still the old pool, untouched
        view = np.frombuffer(shared, dtype=np.uint8)
        regions = (sb.hosts, sb.rpc, sb.index, sb.headers)
        clear = not any(view[r.offset : r.end].any() for r in regions)
        return litmus.judge(clear), landed

    for seed in range(2):
        r = litmus.sweep_crashes(lambda k, s=seed: attempt(k, s), last=30, name="format")
        if r.caught:
            raise Violation(f"a new superblock landed over the old pool's regions (seed {seed})")
        _window_seen(r)


def format_visible_at_return(model: ModelConfig) -> None:
    """A formatted pool is there for every host when format_pool returns."""
    sb = plan(FORMAT_SIZE, GEOMETRY, "new")
    shared = bytearray(FORMAT_SIZE)
    fmt = _host(shared, _still(model), 1)
    format_pool(fmt, sb, clear=False)
    look = _host(shared, model, 2)
    try:
        if unpack(look.load(0, 4096), FORMAT_SIZE).uuid != sb.uuid:
            raise Violation("another host found an old superblock after format returned")
    except PoolError as e:
        raise Violation(f"another host found no pool after format returned: {e}") from e
    fmt.release(), look.release()
