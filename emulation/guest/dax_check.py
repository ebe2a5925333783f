"""Guest check of the dax topology: a Beluga pool on the CXL device, /dev/dax0.0.

Creates the pool through the ``dax:`` backend, publishes blocks through it
and reads them back validated through a second attachment (a second host's
view), checks that a wrong key, a stale version and a torn payload are
misses, then runs the coherence litmus patterns across processes on the
device: under the non-coherent model each buggy pattern is caught and each
correct one never is, and natively the block protocol never returns wrong
data.
"""

from __future__ import annotations

import os

from beluga import litmus
from beluga.pool import Pool
from emulation.guest.blocks import (
    BLOCKS,
    GEOMETRY,
    POOL_BYTES,
    Steps,
    check_blocks,
    check_misses,
    publish,
)

BUG_TRIALS = 200  # as tests/test_litmus.py: a bug must show within this many trials
TRIALS = 100


def check_litmus(steps: Steps, spec: str, base: int) -> None:
    for name, pattern in litmus.PATTERNS.items():
        if pattern.is_bug:
            r = litmus.run_local(spec, base, name, BUG_TRIALS, mode="model", seed=1)
            steps.expect(r.caught, f"litmus {name}: caught under the model", f"{r.trials} trials")
        else:
            r = litmus.run_local(spec, base, name, TRIALS, mode="model", seed=3)
            steps.expect(
                not r.caught and r.confirmed > 0,
                f"litmus {name}: never caught under the model",
                f"first violation at {r.first_violation}, {r.confirmed} confirmed",
            )
    r = litmus.run_local(spec, base, "publish", TRIALS, mode="native")
    steps.expect(
        not r.caught and r.confirmed > 0,
        "litmus publish: never wrong natively",
        f"first violation at {r.first_violation}, {r.confirmed} confirmed",
    )


def main() -> None:
    steps = Steps()
    spec = f"dax:{os.environ['BELUGA_DAX']}"
    writer = Pool.create(spec, POOL_BYTES, geometry=GEOMETRY)
    try:
        steps.expect(writer.info()["device_size"] >= POOL_BYTES, f"pool created on {spec}")
        reader = Pool.attach(spec)
        try:
            for block in range(BLOCKS):
                publish(writer, block)
            check_blocks(steps, reader, range(BLOCKS))
            check_misses(steps, writer, 0)
        finally:
            reader.close()
        litmus_area = writer.superblock.block_payload_offset(BLOCKS)  # a block nobody uses
    finally:
        writer.close()
    check_litmus(steps, spec, litmus_area)
    Pool.destroy(spec)
    steps.exit()


if __name__ == "__main__":
    main()
