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

Checks of the RPC and the KV store across hosts belong in ``PHASES`` as
further pairs of roles.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from beluga import litmus
from beluga.pool import HostEntry, Pool
from beluga.pool.hosts import BOOT_ID
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
        host.server = RpcServer(host.pool, refresh_s=0.05)
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


Role = Callable[[Host], None]
PHASES: list[tuple[str, Role, Role]] = [
    ("hosts", hosts_both, hosts_both),
    ("blocks", blocks_writer, blocks_reader),
    ("litmus", litmus_writer, litmus_observer),
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
