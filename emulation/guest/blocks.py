"""What the guest checks publish, read back and report.

A check prints one line per step, ``ok: ...`` or ``FAIL: ...``, and exits 1
when any step failed, so the console log says which one.  Blocks are made
from their index alone, so a guest that never saw the writer's memory can
still tell right data from wrong.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Iterable
from typing import NoReturn, TypeVar

from beluga.coherence import LINE, Miss, digest
from beluga.errors import PoolError
from beluga.pool import Geometry, Pool

#: Small, so that formatting a pool is quick under software emulation.
GEOMETRY = Geometry(max_hosts=4, rpc_bytes_per_host=64 << 10, block_size=64 << 10)
POOL_BYTES = 64 << 20
BLOCKS = 8
WAIT_S = 120.0  # how long a guest waits for the other one; the host's timeout is the backstop
POLL_S = 0.05
_NOT_YET = (Miss.MAGIC, Miss.STATE)  # what a block looks like before its writer publishes it
T = TypeVar("T")


class Steps:
    """Prints each step's verdict and remembers whether any failed."""

    def __init__(self) -> None:
        self.failed = 0

    def expect(self, ok: bool, what: str, detail: object = "") -> bool:
        print(f"ok: {what}" if ok else f"FAIL: {what}" + (f" ({detail})" if detail else ""))
        sys.stdout.flush()
        self.failed += not ok
        return ok

    def exit(self) -> NoReturn:
        print(f"{self.failed} step(s) failed" if self.failed else "all steps passed")
        sys.exit(1 if self.failed else 0)


def key(block: int) -> bytes:
    return f"sandbox-block-{block}".encode()


def payload(block: int, version: int = 1) -> bytes:
    """A block's bytes: random, of a length that differs per block, fixed by index and version."""
    rng = random.Random(block * 1000 + version)
    return rng.randbytes(rng.randrange(GEOMETRY.block_size // 2, GEOMETRY.block_size))


def publish(pool: Pool, block: int, version: int = 1) -> None:
    sb = pool.superblock
    pool.memory.publish(
        sb.block_header_offset(block),
        sb.block_payload_offset(block),
        digest(key(block)),
        version,
        payload(block, version),
    )


def read(pool: Pool, block: int, version: int = 1, name: bytes | None = None) -> bytes | Miss:
    """The block's payload, or why it is a miss."""
    sb = pool.superblock
    out = bytearray(sb.block_size)
    n = pool.memory.read_validated(
        sb.block_header_offset(block),
        sb.block_payload_offset(block),
        sb.block_size,
        digest(key(block) if name is None else name),
        version,
        out,
    )
    return bytes(out[:n]) if n >= 0 else Miss(n)


def poll(
    attempt: Callable[[], T],
    done: Callable[[T], bool],
    wait_s: float,
    tick: Callable[[], object] = lambda: None,
) -> T:
    """Try until ``done`` says so or ``wait_s`` passes; the last try's result either way.

    ``tick`` runs between tries (a host heartbeat, say).
    """
    deadline = time.monotonic() + wait_s
    while True:
        got = attempt()
        if done(got) or time.monotonic() > deadline:
            return got
        tick()
        time.sleep(POLL_S)


def wait_published(
    pool: Pool, block: int, wait_s: float, tick: Callable[[], object] = lambda: None
) -> bytes | Miss:
    """Read a block another host may not have published yet."""
    return poll(lambda: read(pool, block), lambda got: got not in _NOT_YET, wait_s, tick)


def wait_pool(spec: str, wait_s: float) -> Pool:
    """Attach a pool another host is creating, once its superblock is there."""

    def attach() -> Pool | PoolError:
        try:
            return Pool.attach(spec)
        except PoolError as e:
            return e

    got = poll(attach, lambda got: isinstance(got, Pool), wait_s)
    if isinstance(got, PoolError):
        raise got
    return got


def check_blocks(
    steps: Steps,
    pool: Pool,
    blocks: Iterable[int],
    wait_s: float = 0.0,
    tick: Callable[[], object] = lambda: None,
) -> None:
    """Every block reads back validated and byte-identical to what was published."""
    for block in blocks:
        got = wait_published(pool, block, wait_s, tick)
        right = got == payload(block)
        detail = got.name if isinstance(got, Miss) else f"{len(got)} bytes, differing"
        steps.expect(right, f"block {block} reads back validated", "" if right else detail)


def check_misses(steps: Steps, pool: Pool, block: int) -> None:
    """A wrong key, a stale version and a torn payload are each a miss, never data."""
    got = read(pool, block, name=b"another key")
    steps.expect(got is Miss.KEY, "a wrong key is a miss", got)
    publish(pool, block, version=2)
    got = read(pool, block, version=1)
    steps.expect(got is Miss.VERSION, "the old version of a republished block is a miss", got)
    steps.expect(read(pool, block, version=2) == payload(block, 2), "the new version reads")
    mem, off = pool.memory, pool.superblock.block_payload_offset(block)
    mem.nt_store(off, bytes(b ^ 0xFF for b in mem.load(off, LINE)))
    mem.sfence()
    got = read(pool, block, version=2)
    steps.expect(got is Miss.CHECKSUM, "a torn payload is a miss", got)
    publish(pool, block)
