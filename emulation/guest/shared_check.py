"""Guest check of the shared topology: two guests, one CXL memory file.

Guest 0 publishes blocks through its /dev/dax0.0; guest 1, whose device maps
the same file, waits for them and reads them back validated, then publishes
an acknowledgement block that guest 0 must read in turn, so each direction
is seen.
"""

from __future__ import annotations

import os

from emulation.guest.blocks import (
    BLOCKS,
    WAIT_S,
    RawLayout,
    Steps,
    check_blocks,
    map_dax,
    publish,
)

ACK = BLOCKS  # the block guest 1 publishes once it has read the others


def main() -> None:
    steps = Steps()
    index = int(os.environ["BELUGA_GUEST_INDEX"])
    layout = RawLayout()
    mem, close = map_dax(os.environ["BELUGA_DAX"])
    try:
        if index == 0:
            for block in range(BLOCKS):
                publish(mem, layout, block)
            print(f"guest 0 published {BLOCKS} blocks")
            check_blocks(steps, mem, layout, [ACK], wait_s=WAIT_S)
        else:
            check_blocks(steps, mem, layout, range(BLOCKS), wait_s=WAIT_S)
            publish(mem, layout, ACK)
            print("guest 1 published its acknowledgement")
    finally:
        close()
    steps.exit()


if __name__ == "__main__":
    main()
