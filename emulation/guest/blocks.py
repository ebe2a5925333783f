"""What the guest checks publish, read back and report.

A check prints one line per step, ``ok: ...`` or ``FAIL: ...``, and exits 1
when any step failed, so the console log says which one.  Blocks are made
from their index alone, so a guest that never saw the writer's memory can
still tell right data from wrong.
"""

from __future__ import annotations

import mmap
import os
import random
import sys
import time
from collections.abc import Callable, Iterable
from typing import NoReturn, Protocol

from beluga.coherence import LINE, Memory, Miss, attach, digest

BLOCKS = 8
BLOCK_SIZE = 64 << 10
WAIT_S = 120.0  # how long a guest waits for the other one; the host's timeout is the backstop
_HUGE = 2 << 20


class Layout(Protocol):
    """Where block slots lie: a pool's Superblock, or RawLayout on a bare mapping."""

    block_size: int

    def block_header_offset(self, block: int) -> int: ...

    def block_payload_offset(self, block: int) -> int: ...


class RawLayout:
    """Block slots on a bare mapping: headers from offset 0, payloads from 2 MiB."""

    block_size = BLOCK_SIZE

    def block_header_offset(self, block: int) -> int:
        return block * LINE

    def block_payload_offset(self, block: int) -> int:
        return _HUGE + block * self.block_size


def map_dax(path: str, mode: str = "native") -> tuple[Memory, Callable[[], None]]:
    """Map a whole device-DAX device and attach to it; returns the memory and its closer."""
    name = os.path.basename(path)
    with open(f"/sys/bus/dax/devices/{name}/size") as f:
        size = int(f.read())
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    mem = attach(mm, mode)

    def close() -> None:
        mem.release()
        mm.close()

    return mem, close


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
    return rng.randbytes(rng.randrange(BLOCK_SIZE // 2, BLOCK_SIZE))


def publish(mem: Memory, layout: Layout, block: int, version: int = 1) -> None:
    mem.publish(
        layout.block_header_offset(block),
        layout.block_payload_offset(block),
        digest(key(block)),
        version,
        payload(block, version),
    )


def read(
    mem: Memory, layout: Layout, block: int, version: int = 1, name: bytes | None = None
) -> bytes | Miss:
    """The block's payload, or why it is a miss."""
    out = bytearray(layout.block_size)
    n = mem.read_validated(
        layout.block_header_offset(block),
        layout.block_payload_offset(block),
        layout.block_size,
        digest(key(block) if name is None else name),
        version,
        out,
    )
    return bytes(out[:n]) if n >= 0 else Miss(n)


def wait_published(
    mem: Memory, layout: Layout, block: int, version: int = 1, wait_s: float = WAIT_S
) -> bytes | Miss:
    """Read a block another host may not have published yet, polling up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        got = read(mem, layout, block, version)
        if not isinstance(got, Miss) or got not in (Miss.MAGIC, Miss.STATE):
            return got
        if time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def check_blocks(
    steps: Steps,
    mem: Memory,
    layout: Layout,
    blocks: Iterable[int],
    wait_s: float = 0.0,
) -> None:
    """Every block reads back validated and byte-identical to what was published."""
    for block in blocks:
        got = wait_published(mem, layout, block, wait_s=wait_s)
        right = got == payload(block)
        detail = got.name if isinstance(got, Miss) else f"{len(got)} bytes, differing"
        steps.expect(right, f"block {block} reads back validated", "" if right else detail)


def check_misses(steps: Steps, mem: Memory, layout: Layout, block: int) -> None:
    """A wrong key, a stale version and a torn payload are each a miss, never data."""
    got = read(mem, layout, block, name=b"another key")
    steps.expect(got is Miss.KEY, "a wrong key is a miss", got)
    publish(mem, layout, block, version=2)
    got = read(mem, layout, block, version=1)
    steps.expect(got is Miss.VERSION, "the old version of a republished block is a miss", got)
    steps.expect(read(mem, layout, block, version=2) == payload(block, 2), "the new version reads")
    off = layout.block_payload_offset(block)
    torn = bytes(b ^ 0xFF for b in mem.load(off, LINE))
    mem.nt_store(off, torn)
    mem.sfence()
    got = read(mem, layout, block, version=2)
    steps.expect(got is Miss.CHECKSUM, "a torn payload is a miss", got)
    publish(mem, layout, block)
