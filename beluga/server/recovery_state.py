"""What a recovery keeps: where it stands, and the words and the log of graves it keeps
in the pool's service line.

The argument for recovering while serving, graves included, is
:mod:`beluga.server.recovery`'s; this module holds its state
(:class:`RecoveryState`) and the one thing of it that lives in the pool: the
log of graves (:class:`GraveLog`, its format below).

The service line (one line, written by the server alone) holds four words:
the version floor (beluga.server.service), the log of graves (below), the most
blocks one extent was ever granted, and the block the allocator was at
(``max_extent`` and ``cursor``: where the next server's census starts, and
how far back before it an extent can begin that reaches into it).

The log of graves is an extent of data blocks, taken from the allocator
like any value's, with no block header (so no scan mistakes it for a value):
one 64-byte line an entry, ``digest (16) | below (u64) | keep (u64) | number
(u64, from 1) | CRC32C of the 40 bytes before (u32) | zeros``.  The service
line's second word names it: ``first block | blocks << 32`` (0: no log).  A
new extent is zeroed and fenced before that word points at it, so a line
left in it by an older log never reads as an entry; entries are read in
order up to the first whose CRC or number is wrong (a torn or unfenced
append, which no answer relied on).  A full log moves to an extent twice as
large (copied, fenced, then pointed at, then the old one freed).  A server
that finds a log at its start reserves its extent, takes its graves as its
own and appends to it; once it has scanned the whole pool (every grave
applied, the clears fenced) it points the word at nothing, fences and frees
the extent.  The log holds only keys decided during recoveries, so it is
small: a grave costs 64 bytes of the pool until the recovery ends.

Not thread-safe and not fork-safe: it lives on the server's one thread.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from beluga.coherence import LINE, Memory, crc32c
from beluga.pool.layout import Superblock

if TYPE_CHECKING:
    from beluga.server.keyindex import KeyWalk

#: blocks a recovery step scans for keys, or buckets it reconciles: a few milliseconds of
#: the server's thread at a time (docs/notes/alignment.md has the figures)
RECOVERY_REGION = 1 << 12
#: keys recovery's last step (naming) looks at in C a step, to find the few no slot names
#: (a crash lost their insertion); at most a region of those found a step gets Python work
NAMING_ROWS = 16 * RECOVERY_REGION
#: a census step covers this many regions (it does a tenth of the work a block)
CENSUS_REGIONS = 4
#: the share of a busy server's time recovery takes (an idle server recovers flat out):
#: writes while recovering cost more than after (each key's first write settles it), so
#: writers lose less in all when recovery ends sooner; 0.2 until 2026-12-07, when one
#: step a poll paced it (docs/benchmarks.md, "Takeover", has both)
RECOVERY_SHARE = 0.5
#: the longest recovery holds a busy server's loop between two polls: what a request that
#: arrives meanwhile waits for it, a step's few milliseconds at most beyond it
RECOVERY_SLICE_S = 0.02
_ENTRY = struct.Struct("<16sQQQ")  # digest, below, keep, number (the CRC follows)
_LOG_WORD = 8  # the log's word: the service line's second u64
EXTENT_WORD = 16  # the most blocks one extent was granted (raised before the grant)
CURSOR_WORD = 24  # where allocation was going on (a hint, written as it moves on)


@dataclass
class RecoveryState:
    """Where a background recovery stands (beluga.server.recovery).

    Not thread-safe, not fork-safe: the server's one thread owns it.

    ``census`` and ``keys``: blocks done, counted from ``origin`` (census >= keys);
    ``buckets``: pool index buckets reconciled; ``first``: the version floor at the
    takeover (every copy a scan finds is below it, every version this server hands
    out above it).
    """

    first: int  # versions below it were handed out before the takeover
    expires: float  # the write lease of writes found in flight
    nblocks: int
    origin: int = 0  # the block the scans start at (they wrap at the pool's end)
    region: int = RECOVERY_REGION
    census: int = 0
    keys: int = 0
    buckets: int = 0
    naming: KeyWalk | None = None  # keys to check that the index names them (last phase)
    graves: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # digest -> below, keep
    #: at each block, whether it is the first block of an extent decided ahead of the scan
    #: (a map, not a set: the scan asks of a whole region at once, each step)
    adopted: np.ndarray = field(init=False)
    #: at the first block of each extent the census held (its read of their headers said
    #: a write of before the takeover), the extent's blocks (255: more, in ``held_long``);
    #: 0 elsewhere: what a block it passed holds, not the bitmap, which says only that
    #: something has the blocks now
    held: np.ndarray = field(init=False)
    held_long: dict[int, int] = field(default_factory=dict)
    #: writers whose rings were adopted meanwhile: which of their requests went unanswered
    unanswered: dict[tuple[int, int], Callable[[int], bool]] = field(default_factory=dict)
    #: the scan of keys is being finished at once (a grave found no room in a full pool)
    finishing: bool = False
    #: the service's timer when recovery last ran or was asked to (recover_some)
    last: float = 0.0
    #: seconds of steps a busy server owes recovery (below 0: recovery overran)
    credit: float = 0.0

    def __post_init__(self) -> None:
        self.held = np.zeros(self.nblocks, dtype=np.uint8)
        self.adopted = np.zeros(self.nblocks, dtype=bool)

    def hold(self, firsts: np.ndarray, extents: np.ndarray) -> None:
        """The census holds these extents (first blocks, blocks each)."""
        self.held[firsts] = np.minimum(extents, 255)
        long = extents >= 255
        self.held_long.update(zip(firsts[long].tolist(), extents[long].tolist(), strict=True))

    def held_extent(self, first: int) -> int:
        """The blocks of the extent the census held at ``first`` (0: none)."""
        n = int(self.held[first])
        return self.held_long.get(first, n) if n == 255 else n

    def unhold(self, first: int) -> None:
        """The extent the census held at ``first`` was freed ahead of the scan of keys."""
        self.held[first] = 0
        self.held_long.pop(first, None)

    def censused(self, block: int) -> bool:
        """Whether the census has passed a block (its extent, if any, is held)."""
        return (block - self.origin) % self.nblocks < self.census

    def scanned(self, block: int) -> bool:
        """Whether the scan of keys has passed a block."""
        return (block - self.origin) % self.nblocks < self.keys

    def span(self, done: int, most: int) -> tuple[int, int]:
        """The next blocks to scan after ``done`` of them, at most ``most``, not across the
        pool's end: (first block, how many)."""
        first = (self.origin + done) % self.nblocks
        return first, min(most, self.nblocks - done, self.nblocks - first)

    def dead(self, digest: bytes, version: int) -> bool:
        """Whether a grave says this copy of a key is gone."""
        grave = self.graves.get(digest)
        return grave is not None and version < grave[0] and version != grave[1]


def _line(number: int, digest: bytes, below: int, keep: int) -> bytes:
    body = _ENTRY.pack(digest, below, keep, number)
    return body + crc32c(body).to_bytes(4, "little") + bytes(LINE - _ENTRY.size - 4)


def _entry(line: bytes, number: int) -> tuple[bytes, int, int] | None:
    """An entry's (digest, below, keep) if the line is entry ``number``, else None."""
    body = line[: _ENTRY.size]
    if int.from_bytes(line[_ENTRY.size : _ENTRY.size + 4], "little") != crc32c(body):
        return None
    digest, below, keep, got = _ENTRY.unpack(body)
    return (digest, below, keep) if got == number else None


class GraveLog:
    """The graves of a recovery, in the pool (the module doc).  Not thread-safe, not
    fork-safe: the server's one thread owns it.

    ``allocate(n)`` gives the first block of n free blocks (or raises) and
    ``release(first, n)`` frees them: the service's allocator.
    """

    def __init__(
        self,
        mem: Memory,
        sb: Superblock,
        allocate: Callable[[int], int],
        release: Callable[[int, int], None],
    ) -> None:
        self.mem, self.sb = mem, sb
        self._allocate, self._release = allocate, release
        self.first = self.nblocks = self.count = 0

    @property
    def capacity(self) -> int:
        return self.nblocks * self.sb.block_size // LINE

    def _offset(self, number: int) -> int:
        return self.sb.block_payload_offset(self.first) + (number - 1) * LINE

    def read(self, invalidate: Callable[[Memory, int, int], None]) -> list[tuple[bytes, int, int]]:
        """The graves of the log the service line names (the caller has invalidated that
        line and fenced); ``invalidate`` reads the extent fresh.  The log is this one's now."""
        word = int.from_bytes(self.mem.load(self.sb.service_offset + _LOG_WORD, 8), "little")
        first, nblocks = word & 0xFFFFFFFF, word >> 32
        if not nblocks or first + nblocks > self.sb.nblocks:
            return []
        self.first, self.nblocks = first, nblocks
        start, size = self.sb.block_payload_offset(first), nblocks * self.sb.block_size
        invalidate(self.mem, start, size)
        self.mem.mfence()
        table = self.mem.load(start, size)
        out = []
        for number in range(1, self.capacity + 1):
            got = _entry(table[(number - 1) * LINE : number * LINE], number)
            if got is None:
                break
            out.append(got)
        self.count = len(out)
        return out

    def append(self, digest: bytes, below: int, keep: int) -> None:
        """One more grave (unfenced: it is in the pool at the caller's next fence)."""
        if self.count == self.capacity:
            self._move(max(1, 2 * self.nblocks))
        self.count += 1
        self.mem.nt_store(self._offset(self.count), _line(self.count, digest, below, keep))

    def _move(self, nblocks: int) -> None:
        """Into a zeroed extent of ``nblocks``: entries copied, fenced, then pointed at."""
        old = (self.first, self.nblocks)
        kept = self.mem.load(self._offset(1), self.count * LINE) if self.count else b""
        first = self._allocate(nblocks)
        start, size = self.sb.block_payload_offset(first), nblocks * self.sb.block_size
        self.mem.nt_store(start, kept + bytes(size - len(kept)))
        self.mem.sfence()  # no sabotage point: an unfenced log is one no answer relied on yet
        self._point(first, nblocks)
        if old[1]:
            self._release(*old)

    def _point(self, first: int, nblocks: int) -> None:
        """Make the service line name the log, fenced."""
        self.first, self.nblocks = first, nblocks
        word = first | nblocks << 32 if nblocks else 0
        self.mem.nt_store(self.sb.service_offset + _LOG_WORD, word.to_bytes(8, "little"))
        self.mem.sfence()

    def close(self) -> None:
        """Every grave applied (and fenced): the line names no log, the extent is freed."""
        if not self.nblocks:
            return
        old = (self.first, self.nblocks)
        self._point(0, 0)
        self.count = 0
        self._release(*old)
