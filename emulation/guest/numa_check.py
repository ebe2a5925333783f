"""Guest check of the numa topology: a Beluga pool on the guest's CPU-less node.

The guest has node 0 with the CPU and node 1 with memory only, backed by a
host file, as CXL memory onlined as RAM looks.  Creates the pool through the
``numa:NODE:PATH`` backend, checks that its pages sit on that node, publishes
blocks and reads them back validated through a second attachment.
"""

from __future__ import annotations

import os

from beluga.pool import Pool
from beluga.pool.numa import list_nodes, page_node
from emulation.guest.blocks import BLOCKS, GEOMETRY, POOL_BYTES, Steps, check_blocks, publish


def main() -> None:
    steps = Steps()
    node = int(os.environ["BELUGA_NUMA_NODE"])
    info = next((n for n in list_nodes() if n.node == node), None)
    steps.expect(
        info is not None and info.cpuless and info.total_bytes > POOL_BYTES,
        f"node {node} is CPU-less and can hold the pool",
        info,
    )
    spec = f"numa:{node}:/dev/shm/beluga-sandbox-numa"
    writer = Pool.create(spec, POOL_BYTES, geometry=GEOMETRY)
    try:
        sb = writer.superblock
        offsets = [0, sb.block_payload_offset(0), sb.block_payload_offset(sb.nblocks - 1)]
        found = {off: page_node(writer.mapping.buffer, off) for off in offsets}
        steps.expect(set(found.values()) == {node}, f"the pool's pages are on node {node}", found)
        reader = Pool.attach(spec)
        try:
            for block in range(BLOCKS):
                publish(writer, block)
            check_blocks(steps, reader, range(BLOCKS))
        finally:
            reader.close()
    finally:
        writer.close()
        Pool.destroy(spec)
    steps.exit()


if __name__ == "__main__":
    main()
