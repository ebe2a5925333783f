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
    """The free bitmap of the data area.  Not thread-safe (the server's one thread owns
    it) and not fork-safe: it is process memory, rebuilt from the pool by recovery."""

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

    def reserve_many(self, firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """``reserve`` of many extents at once, exactly as if called in the order given:
        an extent out of range, or with a block taken before the call or by an earlier
        extent of the list, is refused.  The booleans of ``reserve``, one an extent.

        Extents that overlap no other of the list are decided and marked with array
        operations; only the tangled ones (overlapping another) go one at a time.
        """
        firsts = np.asarray(firsts, dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        if firsts.ndim != 1 or firsts.shape != counts.shape:
            raise ValueError("reserve_many takes two flat arrays of the same length")
        ok = (firsts >= 0) & (counts >= 1) & (firsts <= self.nblocks - counts)
        taken = np.concatenate(([0], np.cumsum(~self.free)))  # taken[i]: used blocks below i
        lo = np.where(ok, firsts, 0)
        ok &= taken[np.where(ok, firsts + counts, 0)] == taken[lo]
        tangled = np.zeros_like(ok)
        tangled[ok] = overlapping(firsts[ok], counts[ok])
        clear = ok & ~tangled
        self._mark(firsts[clear], counts[clear])
        for i in np.flatnonzero(tangled).tolist():
            ok[i] = self.reserve(int(firsts[i]), int(counts[i]))
        return ok

    def _mark(self, firsts: np.ndarray, counts: np.ndarray) -> None:
        """Mark free extents that overlap each other nowhere as used."""
        if not firsts.size:
            return
        edges = np.zeros(self.nblocks + 1, dtype=np.int64)
        np.add.at(edges, firsts, 1)
        np.add.at(edges, firsts + counts, -1)
        self.free[np.cumsum(edges[:-1]) > 0] = False
        self.nfree -= int(counts.sum())

    def release(self, first: int, count: int) -> None:
        """Return an extent; releasing a free block is a bug and raises."""
        extent = self.free[first : first + count]
        if extent.size != count or extent.any():
            raise AssertionError(f"double free of blocks [{first}, +{count})")
        extent[:] = True
        self.nfree += count


def overlapping(firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Which extents (first, count >= 1) share a block with another extent of the list."""
    order = np.argsort(firsts, kind="stable")
    lo = firsts[order]
    hi = lo + counts[order]
    hit = np.zeros(lo.size, dtype=bool)
    if lo.size > 1:
        reach = np.maximum.accumulate(hi)  # the furthest end of the extents sorted before
        hit[1:] = lo[1:] < reach[:-1]
        hit[:-1] |= lo[1:] < hi[:-1]
    out = np.empty_like(hit)
    out[order] = hit
    return out
