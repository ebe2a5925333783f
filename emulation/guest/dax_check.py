"""Guest check of the dax topology: blocks on the CXL device through /dev/dax0.0.

Publishes blocks through one mapping of the device, reads them back validated
through another, and checks that a wrong key, a stale version and a torn
payload are misses.
"""

from __future__ import annotations

import os

from emulation.guest.blocks import (
    BLOCKS,
    RawLayout,
    Steps,
    check_blocks,
    check_misses,
    map_dax,
    publish,
)


def main() -> None:
    steps = Steps()
    dax = os.environ["BELUGA_DAX"]
    layout = RawLayout()
    writer, close_writer = map_dax(dax)
    reader, close_reader = map_dax(dax)
    try:
        for block in range(BLOCKS):
            publish(writer, layout, block)
        check_blocks(steps, reader, layout, range(BLOCKS))
        check_misses(steps, writer, layout, 0)
    finally:
        close_reader()
        close_writer()
    steps.exit()


if __name__ == "__main__":
    main()
