"""Free-block bookkeeping of the data area: a bitmap searched from a cursor.

Values occupy extents of contiguous blocks.  The metadata server is the only
caller (single-threaded), so there are no locks.  Searches scan forward in
chunks from a rotating cursor, so a full pool costs one pass and an empty one
almost nothing.
"""

from __future__ import annotations

import numpy as np

CHUNK = 1 << 14


class BlockAllocator:
    def __init__(self, nblocks: int) -> None:
        if nblocks < 1:
            raise ValueError("an allocator needs at least one block")
        self.nblocks = nblocks
        self.free = np.ones(nblocks, dtype=bool)
        self.nfree = nblocks
        self._cursor = 0

    @property
    def used(self) -> int:
        return self.nblocks - self.nfree

    def _find(self, count: int) -> int | None:
        """Start of a run of ``count`` free blocks, searching from the cursor."""
        n = self.nblocks
        start = self._cursor
        scanned = 0
        while scanned < n + count:
            lo = (start + scanned) % n
            hi = min(n, lo + CHUNK + count)
            window = self.free[lo:hi]
            if count == 1:  # argmax stops at the first True: no index array of the window
                first = int(window.argmax())
                if window[first]:
                    return lo + first
            elif window.size >= count:
                # free blocks in each window of `count`: a full window is a run
                run = np.convolve(window.astype(np.int32), np.ones(count, dtype=np.int32), "valid")
                hits = np.flatnonzero(run == count)
                if hits.size:
                    return lo + int(hits[0])
            scanned += max(1, hi - lo - count + 1)
        return None

    def allocate(self, count: int) -> int | None:
        """Reserve ``count`` contiguous blocks; their first index, or None when none fit."""
        if count < 1 or count > self.nblocks:
            return None
        if count > self.nfree:
            return None
        first = self._find(count)
        if first is None:
            return None
        self.free[first : first + count] = False
        self.nfree -= count
        self._cursor = (first + count) % self.nblocks
        return first

    def reserve(self, first: int, count: int) -> bool:
        """Mark a known extent used (recovery); False if any block of it is taken."""
        if first < 0 or count < 1 or first + count > self.nblocks:
            return False
        if not self.free[first : first + count].all():
            return False
        self.free[first : first + count] = False
        self.nfree -= count
        return True

    def release(self, first: int, count: int) -> None:
        """Return an extent; releasing a free block is a bug and raises."""
        extent = self.free[first : first + count]
        if extent.size != count or extent.any():
            raise AssertionError(f"double free of blocks [{first}, +{count})")
        extent[:] = True
        self.nfree += count
