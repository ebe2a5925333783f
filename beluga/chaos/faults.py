"""Hostile bytes: random bytes stored into the pool where a bug or a stray host could.

Each injector writes through the driver's own attachment of the pool (native
mode: non-temporal stores and a fence, so the bytes reach memory at once) and
returns a :class:`Hit` that says what it overwrote, so that the driver can
account for keys whose committed block it corrupted.

Targets
  rpc lines     a request or response line of a live client's ring
  rpc buffers   the out-of-line payload buffer of a request or a response
  headers       a block header line (usually a published one, sometimes any)
  payloads      bytes inside a published block's payload
  index         a bucket line of the pool index (usually one holding entries)

Ring offsets come from the slot layout that ``beluga/_native/rpc.c`` owns,
through ``beluga.rpc.protocol`` (a slot's request and response lines and its
two payload buffers of ``buf_size(superblock, depth)`` bytes).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from beluga.coherence import (
    LINE,
    BlockHeader,
    BlockState,
    Memory,
    parse_header,
    parse_headers,
    read_line,
)
from beluga.pool.hosts import HostTable
from beluga.pool.layout import Superblock
from beluga.rpc.protocol import (
    RingControl,
    buf_size,
    request_buffer,
    request_line,
    response_buffer,
    response_line,
    ring_offset,
)

RPC_PARTS = ("request-line", "response-line", "request-buffer", "response-buffer")


@dataclass(frozen=True)
class Hit:
    """Where hostile bytes went, and the published block they hit, if any.

    Immutable: thread-safe and fork-safe.
    """

    target: str
    offset: int
    length: int
    block: int = -1
    header: BlockHeader | None = None  # the published header of the block hit


def _store(mem: Memory, offset: int, data: bytes) -> None:
    mem.nt_store(offset, data)
    mem.sfence()


def _garbage(rng: random.Random, room: int, most: int) -> tuple[int, bytes]:
    """A random run of 1..most bytes at a random place in ``room`` bytes."""
    n = rng.randint(1, min(most, room))
    return rng.randrange(0, room - n + 1), rng.randbytes(n)


def live_rings(mem: Memory, sb: Superblock, hosts: HostTable) -> list[tuple[int, RingControl]]:
    """Rings whose control line is intact and whose client is alive."""
    out = []
    for h in range(sb.max_hosts):
        ctl = RingControl.unpack(read_line(mem, ring_offset(sb, h)))
        if ctl is not None and ctl.host_id == h and hosts.is_alive(hosts.read(h)):
            out.append((h, ctl))
    return out


def corrupt_rpc(
    mem: Memory, sb: Superblock, hosts: HostTable, rng: random.Random, part: str
) -> Hit | None:
    """Random bytes into one slot line or buffer of a live client's ring (None: no client)."""
    rings = live_rings(mem, sb, hosts)
    if not rings:
        return None
    host, ctl = rng.choice(rings)
    base, slot, depth = ring_offset(sb, host), rng.randrange(ctl.depth), ctl.depth
    if part in ("request-line", "response-line"):
        line = request_line(depth, slot) if part == "request-line" else response_line(depth, slot)
        at, data = _garbage(rng, LINE, LINE)
        offset = base + line + at
    else:
        buffer = request_buffer if part == "request-buffer" else response_buffer
        at, data = _garbage(rng, buf_size(sb, depth), 256)
        offset = base + buffer(sb, depth, slot) + at
    _store(mem, offset, data)
    return Hit(f"{part} of host {host} slot {slot}", offset, len(data))


def published_blocks(mem: Memory, sb: Superblock) -> list[tuple[int, BlockHeader]]:
    """Every block whose header is an intact published header, with that header."""
    table = sb.headers.offset
    mem.invalidate(table, sb.nblocks * LINE)
    mem.mfence()
    headers = parse_headers(mem.load(table, sb.nblocks * LINE))
    return [(block, h) for block, h in headers if h.state == BlockState.PUBLISHED]


def _header_of(mem: Memory, sb: Superblock, block: int) -> BlockHeader | None:
    h = parse_header(read_line(mem, sb.block_header_offset(block)))
    return h if h is not None and h.state == BlockState.PUBLISHED else None


def corrupt_header(mem: Memory, sb: Superblock, rng: random.Random) -> Hit:
    """Random bytes into a block header: a published one three times in four."""
    published = published_blocks(mem, sb)
    if published and rng.random() < 0.75:
        block = rng.choice(published)[0]
    else:
        block = rng.randrange(sb.nblocks)
    header = _header_of(mem, sb, block)
    at, data = _garbage(rng, LINE, LINE)
    offset = sb.block_header_offset(block) + at
    _store(mem, offset, data)
    return Hit(f"header of block {block}", offset, len(data), block, header)


def corrupt_index(mem: Memory, sb: Superblock, rng: random.Random) -> tuple[Hit, int]:
    """Random bytes into an index bucket (one holding entries, when a few tries find one)."""
    bucket = rng.randrange(sb.nbuckets)
    for _ in range(32):
        if any(read_line(mem, sb.index.offset + bucket * LINE)):
            break
        bucket = rng.randrange(sb.nbuckets)
    at, data = _garbage(rng, LINE, LINE)
    offset = sb.index.offset + bucket * LINE + at
    _store(mem, offset, data)
    return Hit(f"index bucket {bucket}", offset, len(data)), bucket


def corrupt_payload(mem: Memory, sb: Superblock, rng: random.Random) -> Hit | None:
    """Random bytes inside the payload of a published block (None: nothing published)."""
    published = published_blocks(mem, sb)
    if not published:
        return None
    block, header = rng.choice(published)
    at, data = _garbage(rng, max(1, header.length), 64)
    offset = sb.block_payload_offset(block) + at
    _store(mem, offset, data)
    return Hit(f"payload of block {block}", offset, len(data), block, header)
