"""Free-block bookkeeping of the data area: a bitmap searched from a cursor.

Values occupy extents of contiguous blocks.  The metadata server is the only
caller (single-threaded), so there are no locks.  Searches scan forward in
chunks from a rotating cursor, so a full pool costs one pass and an empty one
almost nothing.

The bitmap marks blocks in use (``used``), so a new allocator costs nothing
however large the pool (the zero pages of ``np.zeros`` are mapped on first
touch).  While a restarted server still recovers, only the blocks below the
``frontier`` are known: allocation searches below it alone, and a block above
it is marked only by ``reserve`` (an extent recovery has decided, or one that
spills over the frontier); the rest is unknown, neither free nor in use.
"""

from __future__ import annotations

import numpy as np

CHUNK = 1 << 14
_USED = np.ones(1, dtype=np.int8)  # a used block either side of a window searched


class BlockAllocator:
    """The in-use bitmap of the data area.  Not thread-safe (the server's one thread owns
    it) and not fork-safe: it is process memory, rebuilt from the pool by recovery.

    The known blocks are the ``frontier`` blocks from ``origin`` on, wrapping at the
    pool's end (a recovery may start its scan anywhere: beluga.server.recovery).
    """

    def __init__(self, nblocks: int, frontier: int | None = None, origin: int = 0) -> None:
        if nblocks < 1:
            raise ValueError("an allocator needs at least one block")
        self.nblocks = nblocks
        self.used_map = np.zeros(nblocks, dtype=bool)
        self.frontier = nblocks if frontier is None else frontier
        if not 0 <= self.frontier <= nblocks or not 0 <= origin < nblocks:
            raise ValueError(
                f"a frontier lies in [0, {nblocks}] and an origin in [0, {nblocks}), not at "
                f"{frontier} and {origin}"
            )
        self.origin = origin
        self.used = 0  # blocks marked, wherever they are
        self._below = 0  # blocks marked among the known ones
        self._cursor = origin

    @property
    def nfree(self) -> int:
        """Blocks known free: known and not in use."""
        return self.frontier - self._below

    @property
    def cursor(self) -> int:
        """Where the next search starts."""
        return self._cursor

    @property
    def free(self) -> np.ndarray:
        """Which blocks are not marked in use (a copy)."""
        return ~self.used_map

    def _segments(self, frontier: int | None = None) -> list[tuple[int, int]]:
        """The known blocks (the first ``frontier`` from the origin) as physical ranges."""
        end = self.origin + (self.frontier if frontier is None else frontier)
        if end <= self.nblocks:
            return [(self.origin, end)]
        return [(self.origin, self.nblocks), (0, end - self.nblocks)]

    def _known(self, firsts: np.ndarray, counts: np.ndarray) -> int:
        """How many blocks of these extents are known."""
        ends = firsts + counts
        return sum(
            int(np.maximum(0, np.minimum(ends, hi) - np.maximum(firsts, lo)).sum())
            for lo, hi in self._segments()
        )

    def _count(self, first: int, count: int, sign: int) -> None:
        """Mark or unmark bookkeeping of an extent (``sign`` +1 or -1)."""
        self.used += sign * count
        if self.frontier == self.nblocks:
            self._below += sign * count
            return
        end = first + count
        for lo, hi in self._segments():
            self._below += sign * max(0, min(end, hi) - max(first, lo))

    def advance(self, frontier: int) -> None:
        """The first ``frontier`` blocks from the origin are known now: those not marked
        become allocatable."""
        if not self.frontier <= frontier <= self.nblocks:
            raise ValueError(f"the frontier moves forward within the pool, not to {frontier}")
        before = self._segments()
        for lo, hi in self._segments(frontier):
            for done_lo, done_hi in before:  # what was known already is counted
                if done_lo <= lo < done_hi:
                    lo = min(hi, done_hi)
            if lo < hi:
                self._below += int(np.count_nonzero(self.used_map[lo:hi]))
        self.frontier = frontier

    def _find(self, count: int) -> int | None:
        """Start of a run of ``count`` known free blocks, from the cursor."""
        segments = self._segments()
        if self.frontier < self.nblocks:  # the segment holding the cursor first
            segments.sort(key=lambda s: not s[0] <= self._cursor < s[1])
        for base, end in segments:
            if end > base:
                at = self._cursor if base <= self._cursor < end else base
                first = self._find_in(base, end, count, at)
                if first is not None:
                    return first
        return None

    def _find_in(self, base: int, end: int, count: int, at: int) -> int | None:
        """A run in blocks [base, end), searching from ``at`` and wrapping within them."""
        n = end - base
        start = at - base
        scanned = 0
        while scanned < n + count:
            lo = base + (start + scanned) % n
            hi = min(end, lo + CHUNK + count)
            window = self.used_map[lo:hi]
            if count == 1:  # argmin stops at the first False: no index array of the window
                first = int(window.argmin())
                if not window[first]:
                    return lo + first
            elif window.size >= count:
                # the first free run at least `count` long, from where each run begins and
                # ends: O(window) whatever `count` (a sliding sum cost O(window * count),
                # ~150 s for one failed search of 1,500 blocks in the pod's 134 M)
                edges = np.diff(np.concatenate((_USED, window.view(np.int8), _USED)))
                starts = np.flatnonzero(edges == -1)  # used, then free
                ends = np.flatnonzero(edges == 1)  # free, then used
                long = np.flatnonzero(ends - starts >= count)
                if long.size:
                    return lo + int(starts[long[0]])
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
        self.used_map[first : first + count] = True
        self._count(first, count, 1)
        self._cursor = (first + count) % self.nblocks
        return first

    def reserve(self, first: int, count: int) -> bool:
        """Mark a known extent used (recovery); False if any block of it is taken."""
        if first < 0 or count < 1 or first + count > self.nblocks:
            return False
        if self.used_map[first : first + count].any():
            return False
        self.used_map[first : first + count] = True
        self._count(first, count, 1)
        return True

    def reserve_many(self, firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """``reserve`` of many extents at once, exactly as if called in the order given:
        an extent out of range, or with a block taken before the call or by an earlier
        extent of the list, is refused.  The booleans of ``reserve``, one an extent.

        Extents that overlap no other of the list are decided and marked with array
        operations over the span they cover; only the tangled ones (overlapping
        another) go one at a time.
        """
        firsts = np.asarray(firsts, dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        if firsts.ndim != 1 or firsts.shape != counts.shape:
            raise ValueError("reserve_many takes two flat arrays of the same length")
        ok = (firsts >= 0) & (counts >= 1) & (firsts <= self.nblocks - counts)
        if not ok.any():
            return ok
        lo = int(firsts[ok].min())
        hi = int((firsts + counts)[ok].max())
        # taken[i]: used blocks in [lo, lo + i)
        taken = np.concatenate(([0], np.cumsum(self.used_map[lo:hi])))
        start = np.where(ok, firsts - lo, 0)
        ok &= taken[np.where(ok, firsts + counts - lo, 0)] == taken[start]
        tangled = np.zeros_like(ok)
        tangled[ok] = overlapping(firsts[ok], counts[ok])
        clear = ok & ~tangled
        self._mark(firsts[clear], counts[clear])
        for i in np.flatnonzero(tangled).tolist():
            ok[i] = self.reserve(int(firsts[i]), int(counts[i]))
        return ok

    def held(self, firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Which extents (within the pool) have every block marked in use."""
        firsts = np.asarray(firsts, dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        if not firsts.size:
            return np.zeros(0, dtype=bool)
        lo = int(firsts.min())
        taken = np.concatenate(([0], np.cumsum(self.used_map[lo : int((firsts + counts).max())])))
        return taken[firsts + counts - lo] - taken[firsts - lo] == counts

    def _mark(self, firsts: np.ndarray, counts: np.ndarray) -> None:
        """Mark free extents that overlap each other nowhere as used."""
        if not firsts.size:
            return
        lo = int(firsts.min())
        hi = int((firsts + counts).max())
        edges = np.zeros(hi - lo + 1, dtype=np.int64)
        np.add.at(edges, firsts - lo, 1)
        np.add.at(edges, firsts + counts - lo, -1)
        self.used_map[lo:hi][np.cumsum(edges[:-1]) > 0] = True
        self.used += int(counts.sum())
        self._below += self._known(firsts, counts)

    def release(self, first: int, count: int) -> None:
        """Return an extent; releasing a free block is a bug and raises."""
        extent = self.used_map[first : first + count]
        if extent.size != count or not extent.all():
            raise AssertionError(f"double free of blocks [{first}, +{count})")
        extent[:] = False
        self._count(first, count, -1)


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
