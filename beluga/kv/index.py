"""The server's side of the pool-resident index (index.c owns the formats).

The metadata server is the index's only writer.  It keeps a mirror of every
bucket and rewrites a bucket as one line with a non-temporal store; its
callers fence (the commit fence before COMMIT's answer, the clear fence
before REMOVE's).  Readers on every host probe the buckets with loads
(``beluga._native._core.Index``) and confirm each entry against the block
header, so an entry is a hint: a stale one costs a miss, never other bytes.

Placement is two-choice cuckoo hashing: a key lives in one of its two
buckets (``ix_hash``), three slots each, with at least as many buckets as
blocks (so at most a third of the slots are ever full).  When both buckets
are full, a breadth-first search finds a short chain of entries to move to
their other bucket.  Each move writes the entry's new bucket, fences, and
only then its old one (sabotage point INDEX_MOVE_FENCE), so a reader always
finds a key in at least one of its buckets; a reader that probes across a
move sees the bucket's sequence change and probes again.

Recovery (``repair``) keeps every slot that a recovered entry confirms
(same block, version, tag and a bucket of its digest), drops the rest, and
inserts what is missing, rewriting only buckets that change: readers keep
hitting while a new server starts.

Scrub: the pool's lines can be hit by a stray host or hostile bytes; the
server compares a few buckets per tick with its mirror (``scrub``) and
rewrites any that differ, so a damaged bucket costs misses for a bounded
time, never other bytes (readers confirm every entry anyway).

Hints: each host id owns a counts line and a ring of hints (the blocks it
hit); ``fold_hints`` reads them back for the LRU order and the statistics.

Not thread-safe and not fork-safe: it lives on the server's one thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from beluga._native import _core, step
from beluga.coherence import LINE, Memory
from beluga.pool.layout import Superblock

SLOTS = _core.IX_SLOTS
HINT_RING = _core.IX_HINT_RING
MAX_PATH = 5  # cuckoo moves per insertion
MAX_VISIT = 256  # buckets a search looks at
_move_fence = step("INDEX_MOVE_FENCE", Memory.sfence)

Slot = tuple[bytes, int, int, int]  # digest, tag, block, version
# the numpy types of the packed columns of _core.ix_columns and _core.ix_hash_many
_IX_COLUMNS = ("u1", "=u8", "=u4", "=u4", "=u8")
_HASH_COLUMNS = ("=u4", "=u8", "=u8")


class PoolIndex:
    """The mirror of the index region and the only code that writes it."""

    def __init__(self, mem: Memory, sb: Superblock) -> None:
        self.mem = mem
        self.sb = sb
        self.nbuckets = sb.nbuckets
        self.base = sb.index.offset
        self.slots: list[Slot | None] = [None] * (self.nbuckets * SLOTS)
        self.seq = [0] * self.nbuckets
        self.where: dict[bytes, int] = {}  # digest -> slot number (bucket * SLOTS + slot)
        self.moves = 0
        self.failed = 0
        self.scrubbed = 0  # buckets found damaged and rewritten
        self._scrub_at = 0
        # per host id: (owner, hints, hits, misses, tier hits, promotions) as last folded
        self.seen: dict[int, tuple[int, ...]] = {}
        self.hits = 0
        self.misses = 0
        self.tier_hits = 0
        self.promotions = 0

    # -- writing -------------------------------------------------------------

    def _write(self, bucket: int) -> None:
        """Rewrite one bucket line from the mirror (unfenced: callers fence)."""
        self.seq[bucket] += 1
        at = bucket * SLOTS
        line = _core.ix_pack(
            self.seq[bucket],
            [(s[1], s[2], s[3]) if s else (0, 0, 0) for s in self.slots[at : at + SLOTS]],
        )
        self.mem.nt_store(self.base + bucket * LINE, line)

    def _buckets(self, digest: bytes) -> tuple[int, int, int]:
        return _core.ix_hash(digest, self.nbuckets)

    def _free_slot(self, bucket: int) -> int | None:
        at = bucket * SLOTS
        for i in range(at, at + SLOTS):
            if self.slots[i] is None:
                return i
        return None

    def _path(self, starts: Iterable[int]) -> list[int] | None:
        """Slots from a start bucket's slot to a free slot, each entry movable to the next."""
        parent: dict[int, int | None] = {}  # bucket -> slot number that leads into it
        queue: deque[tuple[int, int]] = deque()
        for b in starts:
            if b not in parent:
                parent[b] = None
                queue.append((b, 0))
        while queue and len(parent) < MAX_VISIT:
            bucket, depth = queue.popleft()
            free = self._free_slot(bucket)
            if free is not None:
                path = [free]
                while (came := parent[path[-1] // SLOTS]) is not None:
                    path.append(came)
                return path[::-1]
            if depth >= MAX_PATH:
                continue
            for i in range(bucket * SLOTS, (bucket + 1) * SLOTS):
                s = self.slots[i]
                assert s is not None
                _, b1, b2 = self._buckets(s[0])
                other = b2 if bucket == b1 else b1
                if other not in parent:
                    parent[other] = i
                    queue.append((other, depth + 1))
        return None

    def put(self, digest: bytes, block: int, version: int) -> bool:
        """Point ``digest`` at (block, version); False when no slot could be made free."""
        tag, b1, b2 = self._buckets(digest)
        entry = (digest, tag, block, version)
        at = self.where.get(digest)
        if at is not None:
            self.slots[at] = entry
            self._write(at // SLOTS)
            return True
        path = self._path((b1, b2))
        if path is None:
            self.failed += 1
            return False
        # path[0] is a slot of b1 or b2; each entry moves into the next slot, last first
        for src, dst in zip(path[-2::-1], path[:0:-1], strict=True):
            moved = self.slots[src]
            assert moved is not None
            self.slots[dst] = moved
            self.where[moved[0]] = dst
            self._write(dst // SLOTS)
            _move_fence(self.mem)  # the new bucket holds it before the old one lets go
            self.moves += 1
        self.slots[path[0]] = entry
        self.where[digest] = path[0]
        self._write(path[0] // SLOTS)
        return True

    def crowd(self, digest: bytes) -> list[bytes]:
        """The keys in ``digest``'s two buckets (to evict from when it cannot be placed)."""
        _, b1, b2 = self._buckets(digest)
        out = []
        for b in (b1, b2):
            for s in self.slots[b * SLOTS : (b + 1) * SLOTS]:
                if s is not None:
                    out.append(s[0])
        return out

    def drop(self, digest: bytes) -> None:
        """Take ``digest`` out of the index (unfenced: callers fence)."""
        at = self.where.pop(digest, None)
        if at is not None:
            self.slots[at] = None
            self._write(at // SLOTS)

    def __len__(self) -> int:
        return len(self.where)

    def scrub(self, n: int = 64) -> int:
        """Compare the next ``n`` buckets (round robin) with the mirror; rewrite those that
        differ (unfenced: the caller fences).  Returns how many were rewritten."""
        mem, n = self.mem, min(n, self.nbuckets)
        first = self._scrub_at
        buckets = [(first + i) % self.nbuckets for i in range(n)]
        self._scrub_at = (first + n) % self.nbuckets
        for b in buckets:
            mem.invalidate(self.base + b * LINE, LINE)
        mem.mfence()
        fixed = 0
        for b in buckets:
            got = _core.ix_unpack(mem.load(self.base + b * LINE, LINE))
            want = [
                (s[1], s[2], s[3]) if s else (0, 0, 0)
                for s in self.slots[b * SLOTS : (b + 1) * SLOTS]
            ]
            if got is None or got[1] != want:
                self._write(b)
                fixed += 1
        self.scrubbed += fixed
        return fixed

    # -- recovery ------------------------------------------------------------

    def repair(
        self, digests: Sequence[bytes], blocks: np.ndarray, versions: np.ndarray
    ) -> dict[str, int]:
        """Make the pool's index hold exactly the entries digests[i] -> (blocks[i], versions[i]).

        Slots that an entry confirms (same block, version and tag, in a bucket of its
        digest; the first such slot of an entry in bucket order) stay where they are;
        every other slot is cleared, then missing entries are inserted in the order
        given.  The mirror starts again from what the pool holds.  Returns counts of
        what was kept, dropped and inserted.  Unfenced: the caller fences.

        The scan is array operations over every bucket: no Python object per bucket,
        one per kept entry.
        """
        mem, n = self.mem, self.nbuckets
        blocks = np.asarray(blocks, dtype=np.int64)
        versions = np.asarray(versions, dtype=np.uint64)
        if not len(digests) == blocks.size == versions.size:
            raise ValueError("repair takes a block and a version for each digest")
        if blocks.size and not 0 <= int(blocks.min()) <= int(blocks.max()) < self.sb.nblocks:
            raise ValueError(f"repair's blocks lie in [0, {self.sb.nblocks})")
        mem.invalidate(self.base, n * LINE)
        mem.mfence()
        raw = _core.ix_columns(mem.load(self.base, n * LINE))
        whole, seqs, tags, at_block, at_version = (
            np.frombuffer(c, t) for c, t in zip(raw, _IX_COLUMNS, strict=True)
        )
        hashed = _core.ix_hash_many(b"".join(digests), n)
        want_tag, b1, b2 = (np.frombuffer(c, t) for c, t in zip(hashed, _HASH_COLUMNS, strict=True))
        b1, b2 = b1.astype(np.int64), b2.astype(np.int64)  # bucket numbers: far below 2**63
        # the entry each slot names by its block (-1: none), then whether it confirms it
        entry_of = np.full(self.sb.nblocks + 1, -1, dtype=np.int64)
        entry_of[blocks] = np.arange(blocks.size)
        tagged = tags != 0
        hit = entry_of[np.minimum(at_block, self.sb.nblocks)]
        cand = np.flatnonzero(tagged & (hit >= 0))
        e = hit[cand]
        bucket = cand // SLOTS
        confirms = (
            (versions[e] == at_version[cand])
            & (want_tag[e] == tags[cand])
            & ((b1[e] == bucket) | (b2[e] == bucket))
        )
        cand = cand[confirms]
        _, first = np.unique(hit[cand], return_index=True)  # one slot an entry
        keep = np.sort(cand[first])
        dropped = tagged.copy()
        dropped[keep] = False
        self.seq = seqs.tolist()
        self.slots = slots = [None] * (n * SLOTS)
        ent = hit[keep].tolist()
        kept = [digests[i] for i in ent]
        at = keep.tolist()
        found = zip(
            kept,
            tags[keep].tolist(),
            at_block[keep].tolist(),
            at_version[keep].tolist(),
            strict=True,
        )
        for pos, slot in zip(at, found, strict=True):  # a kept slot holds its entry's values
            slots[pos] = slot
        self.where = dict(zip(kept, at, strict=True))
        for b in np.flatnonzero((whole == 0) | dropped.reshape(n, SLOTS).any(axis=1)).tolist():
            self._write(b)
        missing = np.ones(blocks.size, dtype=bool)
        missing[ent] = False
        inserted = 0
        for i in np.flatnonzero(missing).tolist():
            inserted += self.put(digests[i], int(blocks[i]), int(versions[i]))
        return {"kept": len(ent), "dropped": int(dropped.sum()), "inserted": inserted}

    # -- hints ---------------------------------------------------------------

    def fold_hints(self, hosts: Iterable[int] | None = None) -> list[tuple[int, int]]:
        """Read hosts' hint lines: add their hit and miss counts; the (block, version low
        32 bits) of every hit recorded since the last fold, oldest first."""
        sb, mem = self.sb, self.mem
        ids = range(sb.max_hosts) if hosts is None else hosts
        out: list[tuple[int, int]] = []
        for h in ids:
            off = sb.hint_offset(h)
            mem.invalidate(off, LINE)
            mem.mfence()
            got = _core.ix_counts(mem.load(off, LINE))
            if got is None:
                continue  # torn (being written): next time
            seq, hits, misses, owner, tier_hits, promotions = got
            last = self.seen.get(h, (owner, 0, 0, 0, 0, 0))
            if last[0] != owner or any(a < b for a, b in zip(got[:3], last[1:4], strict=True)):
                last = (owner, 0, 0, 0, 0, 0)  # a new holder of the id counts from zero
            self.hits += hits - last[2]
            self.misses += misses - last[3]
            self.tier_hits += max(0, tier_hits - last[4])
            self.promotions += max(0, promotions - last[5])
            self.seen[h] = (owner, seq, hits, misses, tier_hits, promotions)
            first = max(last[1], seq - HINT_RING)
            if first < seq:
                mem.invalidate(off + LINE, HINT_RING * 8)
                mem.mfence()
                out += _core.ix_hints(mem.load(off + LINE, HINT_RING * 8), first, seq)
        return out
