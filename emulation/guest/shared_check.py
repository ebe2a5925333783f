"""Guest check of the shared topology: two hosts, one CXL memory file.

Each guest reaches the shared memory only through its own /dev/dax0.0, so
whatever one sees of the other went through the emulated CXL device.  Guest 0
creates the pool; guest 1 attaches once the superblock is there.  The check
then runs in phases, each a pair of roles (guest 0's, guest 1's) that meet
through the pool:

``hosts``   guest 0 runs the RPC server (the grantor of host ids); both guests
            claim host ids at once from several threads; every id each guest
            believes it holds is granted to it and to no one else, and each
            sees the other's holders alive
``blocks``  guest 0 publishes blocks, guest 1 reads them back validated and
            publishes an acknowledgement that guest 0 reads in turn
``litmus``  the block protocol's litmus pattern with the writer on guest 0
            and the observer on guest 1: never wrong data
``takeover`` guest 0 runs ``beluga serve`` and acknowledges a put; guest 1
            runs ``beluga serve --standby --fence`` (the fence: guest 0's
            agent, :mod:`emulation.guest.fence`); guest 0 SIGSTOPs its server
            (a paused host); guest 1's standby sees the heartbeat stand still,
            fences it, takes the seat and serves: guest 1's put sent during
            the stall is acknowledged, guest 0's acknowledged value reads back
            on both guests, and the old server died by the fence

Checks of the RPC and the KV store across hosts belong in ``PHASES`` as
further pairs of roles.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from beluga import litmus
from beluga.errors import BelugaError
from beluga.kv import KVStore
from beluga.pool import HostEntry, Pool
from beluga.pool.host_records import BOOT_ID
from beluga.rpc import RpcServer
from emulation.guest.blocks import (
    BLOCKS,
    GEOMETRY,
    POOL_BYTES,
    WAIT_S,
    Steps,
    check_blocks,
    poll,
    publish,
    wait_pool,
)

ACK = BLOCKS  # the block guest 1 publishes once it has read the others
LITMUS_TRIALS = 200
CLAIMS = 2  # host ids each guest claims, from as many threads at once


@dataclass
class Host:
    """One guest's side of the check: its pool, its host entry, its verdicts."""

    index: int
    pool: Pool
    steps: Steps
    entries: list[HostEntry] = field(default_factory=list)
    server: RpcServer | None = None

    def heartbeat(self) -> None:
        """Keep this guest's holders alive in the table while it waits for the other one."""
        self.entries = [self.pool.hosts.heartbeat(e) for e in self.entries]

    def litmus_area(self) -> int:
        return self.pool.superblock.block_payload_offset(ACK + 1)


def hosts_both(host: Host) -> None:
    table = host.pool.hosts
    if host.index == 0:
        host.server = RpcServer.open(host.pool, refresh_s=0.05)
        host.server.start_thread()
    claimed: list[HostEntry | BaseException] = []

    def claim() -> None:
        try:
            claimed.append(table.claim(timeout=WAIT_S))
        except BaseException as e:
            claimed.append(e)

    threads = [threading.Thread(target=claim) for _ in range(CLAIMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S + 10)
    host.entries = [e for e in claimed if isinstance(e, HostEntry)]
    host.steps.expect(
        len(host.entries) == CLAIMS, f"guest {host.index} claimed {CLAIMS} host ids", claimed
    )

    def others() -> list[HostEntry]:
        return [e for e in table.entries() if e.boot_id != BOOT_ID and table.is_alive(e)]

    theirs = poll(others, lambda got: len(got) == CLAIMS, WAIT_S, host.heartbeat)
    mine = {e.host_id for e in host.entries}
    host.steps.expect(
        len(theirs) == CLAIMS and not mine & {e.host_id for e in theirs},
        f"guest {host.index} holds ids {sorted(mine)} and sees the other guest's "
        f"{sorted(e.host_id for e in theirs)}: no id held twice",
    )
    host.steps.expect(
        all(table.holds(e) for e in host.entries),
        f"guest {host.index}: the server's grant of each id it holds is its own",
    )
    # the server may go once both guests hold their ids (each sees the other's)
    if host.server is not None:
        host.server.close()
        host.server = None


def blocks_writer(host: Host) -> None:
    for block in range(BLOCKS):
        publish(host.pool, block)
    check_blocks(host.steps, host.pool, [ACK], WAIT_S, host.heartbeat)


def blocks_reader(host: Host) -> None:
    check_blocks(host.steps, host.pool, range(BLOCKS), WAIT_S, host.heartbeat)
    publish(host.pool, ACK)


def litmus_writer(host: Host) -> None:
    litmus.run_role(host.pool.memory, host.litmus_area(), "publish", "writer", LITMUS_TRIALS)


def litmus_observer(host: Host) -> None:
    r = litmus.run_role(host.pool.memory, host.litmus_area(), "publish", "observer", LITMUS_TRIALS)
    host.steps.expect(
        not r.caught and r.confirmed > 0,
        "litmus publish across guests: never wrong data",
        f"first violation at {r.first_violation}, {r.confirmed} confirmed",
    )


TAKEOVER_AFTER_S = 2.0
FENCE = f"{sys.executable} /work/main/emulation/guest/fence.py"
BEFORE, DURING = b"acknowledged before the stall " * 100, b"put while the server stalled " * 99


def _serve(spec: str, *more: str) -> subprocess.Popen[bytes]:
    """``beluga serve`` as an operator starts it, on this guest."""
    return subprocess.Popen([sys.executable, "-m", "beluga", "serve", "--pool", spec, *more])


def _wait_value(store: KVStore, key: str, host: Host) -> bytes | None:
    return poll(lambda: store.get(key), lambda got: got is not None, WAIT_S, host.heartbeat)


def _put(steps: Any, store: KVStore, key: str, value: bytes, what: str) -> bool:
    """A put that must be acknowledged (return without raising); the step says so."""
    try:
        store.put(key, value)
    except BelugaError as e:
        return steps.expect(False, what, e)
    return steps.expect(True, what)


def _stalled(pool: Pool, window_s: float = 1.0) -> bool:
    """Wait until the seat's heartbeat stands still for ``window_s`` (its server stopped)."""

    def beat() -> int | None:
        seat = pool.hosts.seat()
        return None if seat is None else seat.heartbeat_ns

    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        before = beat()
        time.sleep(window_s)
        if before is not None and beat() == before:
            return True
    return False


def _release_entries(host: Host) -> None:
    """The raw host ids of the earlier phases go back: the stores below claim their own."""
    for entry in host.entries:
        host.pool.hosts.release(entry)
    host.entries = []


def takeover_primary(host: Host) -> None:
    from emulation.guest.fence import Agent, Mailbox

    _release_entries(host)
    spec, steps = host.pool.spec, host.steps
    server = _serve(spec)
    box = Mailbox(os.environ["BELUGA_DAX"])
    agent = Agent(box, server)
    try:
        seat = poll(host.pool.hosts.seat, lambda s: s is not None and s.epoch > 0 and
                    s.identity.pid == server.pid, WAIT_S)  # fmt: skip
        steps.expect(seat is not None and seat.identity.pid == server.pid, "guest 0 serves")
        with KVStore(spec, timeout=WAIT_S) as store:
            _put(steps, store, "takeover/before", BEFORE, "guest 0's put is acknowledged")
            ready = _wait_value(store, "takeover/standby", host)
            steps.expect(ready is not None, "guest 1's standby waits")
        server.send_signal(signal.SIGSTOP)  # the paused host
        stopped = time.monotonic()
        steps.expect(agent.fenced.wait(WAIT_S), "guest 1's standby fenced the stopped server")
        steps.expect(server.wait(5) == -signal.SIGKILL, "the old server died by the fence")
        print(f"fenced {time.monotonic() - stopped:.2f} s after the stop")
        with KVStore(spec, timeout=WAIT_S) as store:
            steps.expect(
                _wait_value(store, "takeover/during", host) == DURING,
                "guest 0 reads guest 1's put made during the stall, from the new server",
            )
            steps.expect(store.get("takeover/before") == BEFORE, "guest 0's value survived")
            seat = host.pool.hosts.seat()
            steps.expect(
                seat is not None and not seat.identity.same_kernel(),
                "the seat is held by guest 1's server",
            )
            _put(steps, store, "takeover/done", b"1", "guest 0 says it is done")
    finally:
        agent.close()
        box.close()
        if server.poll() is None:
            server.kill()
            server.wait(10)


def takeover_standby(host: Host) -> None:
    _release_entries(host)
    spec, steps = host.pool.spec, host.steps
    theirs = poll(host.pool.hosts.seat, lambda s: s is not None and s.epoch > 0, WAIT_S)
    steps.expect(theirs is not None, "guest 1 sees guest 0's server in the seat")
    standby = _serve(spec, "--standby", "--takeover-after", str(TAKEOVER_AFTER_S),
                     "--fence", FENCE)  # fmt: skip
    try:
        with KVStore(spec, timeout=WAIT_S) as store:
            steps.expect(_wait_value(store, "takeover/before", host) == BEFORE,
                         "guest 1 reads guest 0's value")  # fmt: skip
            time.sleep(0.5)  # the standby is standing by (it logs so)
            _put(steps, store, "takeover/standby", b"1", "guest 1 says its standby waits")
            # sent once guest 0's server has stopped: only the standby can acknowledge it
            steps.expect(_stalled(host.pool), "guest 1 sees the server's heartbeat stop")
            started, failed = time.monotonic(), 0
            while True:  # as an application does: the same store, the put tried again
                try:
                    store.put("takeover/during", DURING)
                    break
                except BelugaError as e:  # the call outlived the client's restart grace
                    failed += 1
                    if failed == 1:
                        print(f"put failed during the takeover ({e}); trying again")
                    if time.monotonic() - started > WAIT_S:
                        break
                    time.sleep(0.05)
            steps.expect(
                store.get("takeover/during") == DURING,
                "guest 1's put sent during the stall is acknowledged, by the same store",
                f"{failed} tries failed",
            )
            print(f"put acknowledged {time.monotonic() - started:.2f} s after it was first sent, "
                  f"{failed} tries failed first")  # fmt: skip
            seat = host.pool.hosts.seat()
            steps.expect(
                seat is not None and seat.identity.pid == standby.pid,
                "guest 1's standby holds the seat",
            )
            steps.expect(store.get("takeover/before") == BEFORE, "guest 0's value survived")
            steps.expect(_wait_value(store, "takeover/done", host) == b"1", "guest 0 is done")
    finally:
        standby.send_signal(signal.SIGTERM)
        try:
            standby.wait(30)
        except subprocess.TimeoutExpired:
            standby.kill()
            standby.wait(10)


Role = Callable[[Host], None]
PHASES: list[tuple[str, Role, Role]] = [
    ("hosts", hosts_both, hosts_both),
    ("blocks", blocks_writer, blocks_reader),
    ("litmus", litmus_writer, litmus_observer),
    ("takeover", takeover_primary, takeover_standby),
]


def main() -> None:
    steps = Steps()
    index = int(os.environ["BELUGA_GUEST_INDEX"])
    spec = f"dax:{os.environ['BELUGA_DAX']}"
    if index == 0:
        pool = Pool.create(spec, POOL_BYTES, geometry=GEOMETRY)
        litmus.reset_area(pool.memory, pool.superblock.block_payload_offset(ACK + 1))
    else:
        pool = wait_pool(spec, WAIT_S)
    host = Host(index, pool, steps)
    try:
        print(f"guest {index} attached pool {pool.superblock.uuid.hex()}")
        for name, first, second in PHASES:
            print(f"phase {name}")
            (first if index == 0 else second)(host)
    finally:
        if host.server is not None:
            host.server.close()
        for entry in host.entries:
            pool.hosts.release(entry)
        pool.close()
    steps.exit()


if __name__ == "__main__":
    main()
