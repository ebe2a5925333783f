"""The server's side of the pool-resident index (index.c owns the formats).

The metadata server is the index's only writer.  It keeps a mirror of the
buckets (``_core.IndexMirror``, mirror.c: flat arrays, ~33 bytes a slot and
no Python object a key; the operations below run there, one call each) and
rewrites a bucket as one line with a non-temporal store; its
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

A mirror that starts lazily.  A new server holds no bucket yet (``loaded``):
the pool's buckets are what the last server left, and readers keep using
them.  A bucket comes into the mirror when the server first touches it
(``put``, ``drop``, ``find``, a move's search), as the pool holds it, its
slots unresolved (tag, block and version, no key).  A slot is resolved when
its key matters (a key with its tag is looked for, an entry must move): the
header of its block names the key, with the slot's version, published, and
the slot lies in a bucket of that key; a slot the header does not confirm
names nothing a reader could get, and is dropped.  So the first write after
a takeover reads two lines, not the whole index, whatever the pool's size.

Recovery (``reconcile``, a range of buckets at a time, and ``repair``, all
of them; the array work here, the mirror's update one call into C) keeps
every slot that a recovered entry confirms (same block, version, tag and a
bucket of its digest), drops the rest, and inserts what is missing,
rewriting only buckets that change: readers keep hitting while a new server
starts.  Once every bucket is reconciled the mirror holds them all
(``loaded`` is None) and nothing is read back again.

Scrub: the pool's lines can be hit by a stray host or hostile bytes; the
server compares a few buckets per tick with its mirror (``scrub``) and
rewrites any that differ, so a damaged bucket costs misses for a bounded
time, never other bytes (readers confirm every entry anyway).  Buckets the
mirror does not hold yet are skipped: the pool is all there is of them.

Hints: each host id owns a counts line and a ring of hints (the blocks it
hit); ``fold_hints`` reads them back for the LRU order and the statistics.

Not thread-safe and not fork-safe: it lives on the server's one thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from beluga._native import _core
from beluga.coherence import LINE, Memory
from beluga.pool.layout import Superblock
from beluga.server.extents import BlockKeys

SLOTS = _core.IX_SLOTS
HINT_RING = _core.IX_HINT_RING

#: for an array of blocks, whether an entry begins at each, and its digest (16-byte void
#: items) and version, as arrays (``extents.BlockKeys.lookup``)
Entries = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]
# the numpy types of the packed columns of _core.ix_columns and _core.ix_hash_many
_IX_COLUMNS = ("u1", "=u8", "=u4", "=u4", "=u8")
_HASH_COLUMNS = ("=u4", "=u8", "=u8")


class Placed(Mapping[bytes, int]):
    """The keys the mirror has resolved, each to its slot number (bucket * SLOTS + slot):
    a view, read from the mirror as it is (nothing is loaded or resolved to answer).  Not
    thread-safe and not fork-safe, as its ``PoolIndex``."""

    def __init__(self, mirror: _core.IndexMirror) -> None:
        self._mirror = mirror

    def __getitem__(self, digest: bytes) -> int:
        at = self._mirror.slot_of(digest) if len(digest) == 16 else None
        if at is None:
            raise KeyError(digest)
        return int(at)

    def __contains__(self, digest: object) -> bool:
        return (
            isinstance(digest, bytes)
            and len(digest) == 16
            and self._mirror.slot_of(digest) is not None
        )

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._mirror.digests())

    def among(self, digests: np.ndarray) -> np.ndarray:
        """Whether each of ``digests`` (16-byte void items) is resolved in a slot: ``in``
        for each, in one call."""
        digests = np.ascontiguousarray(digests, dtype="V16")
        return np.frombuffer(self._mirror.placed(digests), dtype=bool)

    def __len__(self) -> int:
        return len(self._mirror)


class PoolIndex:
    """The mirror of the index region and the only code that writes it (its state and
    operations in C, mirror.c; recovery's array work and the hints here)."""

    def __init__(self, mem: Memory, sb: Superblock) -> None:
        self.mem = mem
        self.sb = sb
        self.nbuckets = sb.nbuckets
        self.base = sb.index.offset
        self.mirror = _core.IndexMirror(
            mem,
            sb.index.offset,
            sb.nbuckets,
            sb.headers.offset,
            sb.payloads.offset,
            sb.block_size,
            sb.nblocks,
            sb.commits.offset,
        )
        #: digest -> slot number, of the keys the mirror has resolved
        self.where = Placed(self.mirror)
        # per host id: (owner, hints, hits, misses, tier hits, promotions) as last folded
        self.seen: dict[int, tuple[int, ...]] = {}
        self.hits = 0
        self.misses = 0
        self.tier_hits = 0
        self.promotions = 0

    # -- the mirror ----------------------------------------------------------

    @property
    def loaded(self) -> np.ndarray | None:
        """Which buckets the mirror holds (a copy); None once it holds them all."""
        got = self.mirror.loaded
        return None if got is None else np.frombuffer(got, dtype=bool).copy()

    @property
    def moves(self) -> int:
        return int(self.mirror.moves)

    @property
    def failed(self) -> int:
        return int(self.mirror.failed)

    @property
    def scrubbed(self) -> int:
        """Buckets found damaged and rewritten."""
        return int(self.mirror.scrubbed)

    @property
    def unconfirmed(self) -> int:
        """Slots dropped because their block's header did not name them."""
        return int(self.mirror.unconfirmed)

    def find(self, digest: bytes) -> tuple[int, int] | None:
        """Where the index names ``digest``: (block, version), or None.  Loads its buckets
        and resolves the slots that carry its tag, as needed."""
        return self.mirror.find(digest)

    # -- writing -------------------------------------------------------------

    def put(self, digest: bytes, block: int, version: int) -> bool:
        """Point ``digest`` at (block, version); False when no slot could be made free.

        A key already placed gets a new slot in one of its buckets if one is free: the new
        slot is fenced in the pool before the old one is cleared, as a move is, so a server
        killed in the middle of the rewrite leaves one of them whole.  Only when both
        buckets are full is the slot rewritten in place.
        """
        return self.mirror.put(digest, block, version)

    def crowd(self, digest: bytes) -> list[bytes]:
        """The keys in ``digest``'s two buckets (to evict from when it cannot be placed)."""
        return self.mirror.crowd(digest)

    def drop(self, digest: bytes) -> None:
        """Take ``digest`` out of the index (unfenced: callers fence)."""
        self.mirror.drop(digest)

    def __len__(self) -> int:
        return len(self.mirror)

    def scrub(self, n: int = 64) -> int:
        """Compare the next ``n`` buckets (round robin) with the mirror; rewrite those that
        differ (unfenced: the caller fences).  Returns how many were rewritten.  Buckets the
        mirror does not hold yet are skipped."""
        return self.mirror.scrub(n)

    # -- recovery ------------------------------------------------------------

    def reconcile(self, lo: int, hi: int, entries: Entries) -> dict[str, int]:
        """Make buckets [lo, hi) hold exactly the slots that name an entry, as the pool's
        lines are now; they are in the mirror after, resolved.

        ``entries(blocks)`` says, for the block each slot names, whether an entry begins
        there, and its digest and version (``Entries``).  A slot is kept when its entry has
        its version and tag and the slot lies in a bucket of the entry's digest, and no
        other slot names that digest (the first one kept stays); every other slot is
        dropped.  Returns counts of what was kept and dropped.  Unfenced: the caller fences.

        Array operations over the buckets' lines and the entries, then one call into the
        mirror: no Python object a bucket or a slot.
        """
        if not 0 <= lo <= hi <= self.nbuckets:
            raise ValueError(f"a range of buckets lies in [0, {self.nbuckets}]")
        mem = self.mem
        mem.invalidate(self.base + lo * LINE, (hi - lo) * LINE)
        mem.mfence()
        lines = mem.load(self.base + lo * LINE, (hi - lo) * LINE)
        _, _, tags, at_block, at_version = (
            np.frombuffer(c, t) for c, t in zip(_core.ix_columns(lines), _IX_COLUMNS, strict=True)
        )
        cand = np.flatnonzero((tags != 0) & (at_block < self.sb.nblocks))
        hit, digests, versions = entries(at_block[cand])
        cand, digests, versions = cand[hit], digests[hit], versions[hit]
        hashed = _core.ix_hash_many(digests.tobytes(), self.nbuckets)
        want_tag, b1, b2 = (np.frombuffer(c, t) for c, t in zip(hashed, _HASH_COLUMNS, strict=True))
        bucket = cand // SLOTS + lo
        confirms = (
            (versions == at_version[cand])
            & (want_tag == tags[cand])
            & ((b1 == bucket) | (b2 == bucket))
        )
        ok = np.flatnonzero(confirms)
        keep = cand[ok].astype(np.int64)
        kept, dropped = self.mirror.reconcile(
            lo, hi, lines, keep.tobytes(), np.ascontiguousarray(digests[ok]).tobytes()
        )
        return {"kept": kept, "dropped": dropped}

    def loaded_all(self) -> None:
        """Every bucket has been reconciled: the mirror holds the whole index from now on."""
        self.mirror.loaded_all()

    def repair(
        self, digests: Sequence[bytes], blocks: np.ndarray, versions: np.ndarray
    ) -> dict[str, int]:
        """Make the pool's index hold exactly the entries digests[i] -> (blocks[i], versions[i]).

        Every bucket is reconciled (``reconcile``) against these entries, then missing
        entries are inserted in the order given.  The mirror holds every bucket after.
        Returns counts of what was kept, dropped and inserted.  Unfenced: the caller fences.
        """
        blocks = np.asarray(blocks, dtype=np.int64)
        versions = np.asarray(versions, dtype=np.uint64)
        if not len(digests) == blocks.size == versions.size:
            raise ValueError("repair takes a block and a version for each digest")
        if blocks.size and not 0 <= int(blocks.min()) <= int(blocks.max()) < self.sb.nblocks:
            raise ValueError(f"repair's blocks lie in [0, {self.sb.nblocks})")
        if any(len(d) != 16 for d in digests):
            raise ValueError("repair takes 16-byte digests")
        entries = BlockKeys(self.sb.nblocks)
        entries.set_many(blocks, np.frombuffer(b"".join(digests), dtype="V16"), versions)
        self.mirror.reset()
        got = self.reconcile(0, self.nbuckets, entries.lookup)
        self.loaded_all()
        inserted = 0
        for i in range(len(digests)):
            if digests[i] not in self.where:
                inserted += self.put(digests[i], int(blocks[i]), int(versions[i]))
        return {**got, "inserted": inserted}

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
