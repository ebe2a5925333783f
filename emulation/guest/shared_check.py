"""Guest check of the shared topology: two hosts, one CXL memory file.

Each guest reaches the shared memory only through its own /dev/dax0.0, so
whatever one sees of the other went through the emulated CXL device.  Guest 0
creates the pool; guest 1 attaches once the superblock is there.  The check
then runs in phases, each a pair of roles (guest 0's, guest 1's) that meet
through the pool:

``hosts``   each claims its host id; each sees the other alive in the host table
``blocks``  guest 0 publishes blocks, guest 1 reads them back validated and
            publishes an acknowledgement that guest 0 reads in turn
``litmus``  the block protocol's litmus pattern with the writer on guest 0
            and the observer on guest 1: never wrong data

Checks of the RPC and the KV store across hosts belong in ``PHASES`` as
further pairs of roles.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from beluga.coherence import litmus
from beluga.pool import HostEntry, Pool
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


@dataclass
class Host:
    """One guest's side of the check: its pool, its host entry, its verdicts."""

    index: int
    pool: Pool
    steps: Steps
    entry: HostEntry | None = None

    def heartbeat(self) -> None:
        """Keep this host alive in the table while it waits for the other one."""
        if self.entry is not None:
            self.entry = self.pool.hosts.heartbeat(self.entry)

    def litmus_area(self) -> int:
        return self.pool.superblock.block_payload_offset(ACK + 1)


def hosts_both(host: Host) -> None:
    # each takes the id of its index, so what is checked is what one host sees
    # of the other, whichever claims first
    host.entry = host.pool.claim_host(host.index)
    own, table = host.entry.host_id, host.pool.hosts

    def other_alive() -> bool:
        return any(e.host_id != own and table.is_alive(e) for e in table.entries())

    host.steps.expect(
        poll(other_alive, bool, WAIT_S, host.heartbeat),
        f"guest {host.index} holds host id {own} and sees the other guest alive",
    )


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
        if host.entry is not None:
            pool.hosts.release(host.entry)
        pool.close()
    steps.exit()


if __name__ == "__main__":
    main()
