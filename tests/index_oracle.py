"""Today's pure-Python pool index writer, kept as the oracle of tests/test_index_mirror.py.

A verbatim copy of beluga/server/index.py as of commit 9e19262 (before the mirror moved to C,
beluga/_native/mirror.c).  Tests only: the service uses beluga.server.index.PoolIndex.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from beluga._native import _core, step
from beluga.coherence import LINE, BlockState, Memory, parse_header
from beluga.pool.layout import Superblock
from beluga.server.extents import BlockKeys

SLOTS = _core.IX_SLOTS
HINT_RING = _core.IX_HINT_RING
MAX_PATH = 5  # cuckoo moves per insertion
MAX_VISIT = 256  # buckets a search looks at
_move_fence = step("INDEX_MOVE_FENCE", Memory.sfence)

#: digest (None: not resolved yet, see the module doc), tag, block, version
Slot = tuple[bytes | None, int, int, int]
#: for an array of blocks, whether an entry begins at each, and its digest (16-byte void
#: items) and version, as arrays (``extents.BlockKeys.lookup``)
Entries = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]
# the numpy types of the packed columns of _core.ix_columns and _core.ix_hash_many
_IX_COLUMNS = ("u1", "=u8", "=u4", "=u4", "=u8")
_HASH_COLUMNS = ("=u4", "=u8", "=u8")


def _salvage(line: bytes) -> tuple[int, list[tuple[int, int, int]]]:
    """A bucket line that is not whole, field by field as read (``ix_columns``): its
    sequence and what each slot holds."""
    _, seq, tags, blocks, versions = (
        np.frombuffer(c, t) for c, t in zip(_core.ix_columns(line), _IX_COLUMNS, strict=True)
    )
    return int(seq[0]), list(zip(tags.tolist(), blocks.tolist(), versions.tolist(), strict=True))


class PoolIndex:
    """The mirror of the index region and the only code that writes it."""

    def __init__(self, mem: Memory, sb: Superblock) -> None:
        self.mem = mem
        self.sb = sb
        self.nbuckets = sb.nbuckets
        self.base = sb.index.offset
        self.slots: dict[int, Slot] = {}  # slot number (bucket * SLOTS + slot) -> what it holds
        self.seq = np.zeros(self.nbuckets, dtype=np.uint64)
        #: which buckets the mirror holds; None once it holds them all
        self.loaded: np.ndarray | None = np.zeros(self.nbuckets, dtype=bool)
        self.where: dict[bytes, int] = {}  # digest -> slot number, of resolved slots
        self.moves = 0
        self.failed = 0
        self.scrubbed = 0  # buckets found damaged and rewritten
        self.unconfirmed = 0  # slots dropped because their block's header did not name them
        self._scrub_at = 0
        # per host id: (owner, hints, hits, misses, tier hits, promotions) as last folded
        self.seen: dict[int, tuple[int, ...]] = {}
        self.hits = 0
        self.misses = 0
        self.tier_hits = 0
        self.promotions = 0

    # -- the mirror ----------------------------------------------------------

    def _write(self, bucket: int) -> None:
        """Rewrite one bucket line from the mirror (unfenced: callers fence)."""
        seq = int(self.seq[bucket]) + 1
        self.seq[bucket] = seq
        get, at = self.slots.get, bucket * SLOTS
        line = _core.ix_pack(
            seq,
            [(s[1], s[2], s[3]) if (s := get(i)) else (0, 0, 0) for i in range(at, at + SLOTS)],
        )
        self.mem.nt_store(self.base + bucket * LINE, line)

    def _load(self, buckets: Iterable[int]) -> None:
        """Bring buckets into the mirror as the pool holds them, their slots unresolved.  A
        line that is not whole (a server killed while it rewrote it, or hostile bytes) is
        salvaged: its slots are hints like any, kept unresolved, and the line is rewritten
        whole with them (unfenced).  Rewriting it empty would hide every key it names from
        readers until recovery's last step."""
        loaded = self.loaded
        if loaded is None:
            return
        todo = [b for b in buckets if not loaded[b]]
        if not todo:
            return
        for b in todo:
            self.mem.invalidate(self.base + b * LINE, LINE)
        self.mem.mfence()
        for b in todo:
            loaded[b] = True
            line = self.mem.load(self.base + b * LINE, LINE)
            got = _core.ix_unpack(line)
            seq, held = _salvage(line) if got is None else got
            self.seq[b] = seq
            for i, (tag, block, version) in enumerate(held):
                if tag:
                    self.slots[b * SLOTS + i] = (None, tag, block, version)
            if got is None:
                self._write(b)

    def _resolve(self, at: int) -> bytes | None:
        """The key of an unresolved slot, by the header of its block and its commit word; a
        slot they do not confirm (or a second slot of a key) is dropped and None returned.

        The commit word matters where a reader's confirm does not look: a server whose host
        died in the middle of a COMMIT may have left the new copy's slot in the pool
        without its commit word (unfenced stores land in any order), beside the slot of the
        copy it replaces.  That copy is a write in flight, not the key's value."""
        _, tag, block, version = self.slots[at]
        key = None
        if block < self.sb.nblocks:
            off, word = self.sb.block_header_offset(block), self.sb.block_commit_offset(block)
            self.mem.invalidate(off, LINE)
            self.mem.invalidate(word, 8)
            self.mem.mfence()
            h = parse_header(self.mem.load(off, LINE))
            committed = int.from_bytes(self.mem.load(word, 8), "little") == version
            if (
                h is not None
                and h.state == BlockState.PUBLISHED
                and h.version == version
                and committed
            ):
                t, b1, b2 = self._buckets(h.digest)
                if t == tag and at // SLOTS in (b1, b2) and h.digest not in self.where:
                    key = h.digest
        if key is None:
            del self.slots[at]
            self._write(at // SLOTS)
            self.unconfirmed += 1
            return None
        self.slots[at] = (key, tag, block, version)
        self.where[key] = at
        return key

    def _resolve_bucket(self, bucket: int) -> None:
        """Resolve every slot of a bucket the mirror holds."""
        for i in range(bucket * SLOTS, (bucket + 1) * SLOTS):
            s = self.slots.get(i)
            if s is not None and s[0] is None:
                self._resolve(i)

    def find(self, digest: bytes) -> tuple[int, int] | None:
        """Where the index names ``digest``: (block, version), or None.  Loads its buckets
        and resolves the slots that carry its tag, as needed."""
        at = self._find(digest)
        if at is None:
            return None
        s = self.slots[at]
        return s[2], s[3]

    def _find(self, digest: bytes) -> int | None:
        """The slot number of ``digest``, its buckets loaded first.  Every unresolved slot
        with its tag is resolved: a second slot of the key (a server died between the two
        writes of a replacement) is dropped before anything changes the key, or readers
        would find it once the slot kept is replaced."""
        tag, b1, b2 = self._buckets(digest)
        self._load((b1, b2))
        if self.loaded is not None:
            for b in (b1, b2):
                for i in range(b * SLOTS, (b + 1) * SLOTS):
                    s = self.slots.get(i)
                    if s is not None and s[0] is None and s[1] == tag:
                        self._resolve(i)
        return self.where.get(digest)

    # -- writing -------------------------------------------------------------

    def _buckets(self, digest: bytes) -> tuple[int, int, int]:
        return _core.ix_hash(digest, self.nbuckets)

    def _free_slot(self, bucket: int) -> int | None:
        at = bucket * SLOTS
        for i in range(at, at + SLOTS):
            if self.slots.get(i) is None:
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
            if self.loaded is not None:  # a move needs the keys of the entries it moves
                self._load((bucket,))
                self._resolve_bucket(bucket)
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
                assert s is not None and s[0] is not None
                _, b1, b2 = self._buckets(s[0])
                other = b2 if bucket == b1 else b1
                if other not in parent:
                    parent[other] = i
                    queue.append((other, depth + 1))
        return None

    def put(self, digest: bytes, block: int, version: int) -> bool:
        """Point ``digest`` at (block, version); False when no slot could be made free.

        A key already placed gets a new slot in one of its buckets if one is free: the new
        slot is fenced in the pool before the old one is cleared (``_replace``), as a move
        is, so a server killed in the middle of the rewrite leaves one of them whole.
        Only when both buckets are full is the slot rewritten in place.
        """
        tag, b1, b2 = self._buckets(digest)
        entry = (digest, tag, block, version)
        at = self._find(digest)
        if at is not None:
            if self.slots[at] != entry:
                self._replace(at, entry, (b1, b2))
            return True
        path = self._path((b1, b2))
        if path is None:
            self.failed += 1
            return False
        # path[0] is a slot of b1 or b2; each entry moves into the next slot, last first
        for src, dst in zip(path[-2::-1], path[:0:-1], strict=True):
            moved = self.slots[src]
            assert moved is not None and moved[0] is not None
            self.slots[dst] = moved
            self.where[moved[0]] = dst
            self._write(dst // SLOTS)
            _move_fence(self.mem)  # the new bucket holds it before the old one lets go
            self.moves += 1
        self.slots[path[0]] = entry
        self.where[digest] = path[0]
        self._write(path[0] // SLOTS)
        return True

    def _replace(self, at: int, entry: Slot, buckets: tuple[int, int]) -> None:
        """Point a placed key's entry (slot ``at``) at a new block and version."""
        free = next((f for b in buckets if (f := self._free_slot(b)) is not None), None)
        if free is None:  # both buckets full (rare at a third full): in place, fenced
            self.slots[at] = entry  # before the caller clears the old copy
            self._write(at // SLOTS)
            _move_fence(self.mem)
            return
        assert entry[0] is not None
        self.slots[free] = entry
        self.where[entry[0]] = free
        self._write(free // SLOTS)
        _move_fence(self.mem)  # the new slot is in the pool before the old one goes
        del self.slots[at]
        self._write(at // SLOTS)

    def crowd(self, digest: bytes) -> list[bytes]:
        """The keys in ``digest``'s two buckets (to evict from when it cannot be placed)."""
        _, b1, b2 = self._buckets(digest)
        self._load((b1, b2))
        out = []
        for b in (b1, b2):
            self._resolve_bucket(b)
            for i in range(b * SLOTS, (b + 1) * SLOTS):
                s = self.slots.get(i)
                if s is not None and s[0] is not None:
                    out.append(s[0])
        return out

    def drop(self, digest: bytes) -> None:
        """Take ``digest`` out of the index (unfenced: callers fence)."""
        at = self._find(digest)
        if at is not None:
            del self.slots[at]
            del self.where[digest]
            self._write(at // SLOTS)

    def __len__(self) -> int:
        return len(self.where)

    def scrub(self, n: int = 64) -> int:
        """Compare the next ``n`` buckets (round robin) with the mirror; rewrite those that
        differ (unfenced: the caller fences).  Returns how many were rewritten.  Buckets the
        mirror does not hold yet are skipped."""
        mem, n = self.mem, min(n, self.nbuckets)
        first = self._scrub_at
        buckets = [(first + i) % self.nbuckets for i in range(n)]
        self._scrub_at = (first + n) % self.nbuckets
        if self.loaded is not None:
            buckets = [b for b in buckets if self.loaded[b]]
        for b in buckets:
            mem.invalidate(self.base + b * LINE, LINE)
        mem.mfence()
        fixed = 0
        get = self.slots.get
        for b in buckets:
            got = _core.ix_unpack(mem.load(self.base + b * LINE, LINE))
            want = [
                (s[1], s[2], s[3]) if (s := get(i)) else (0, 0, 0)
                for i in range(b * SLOTS, (b + 1) * SLOTS)
            ]
            if got is None or got[1] != want:
                self._write(b)
                fixed += 1
        self.scrubbed += fixed
        return fixed

    # -- recovery ------------------------------------------------------------

    def reconcile(self, lo: int, hi: int, entries: Entries) -> dict[str, int]:
        """Make buckets [lo, hi) hold exactly the slots that name an entry, as the pool's
        lines are now; they are in the mirror after, resolved.

        ``entries(blocks)`` says, for the block each slot names, whether an entry begins
        there, and its digest and version (``Entries``).  A slot is kept when its entry has
        its version and tag and the slot lies in a bucket of the entry's digest, and no
        other slot names that digest (the first one kept stays); every other slot is
        dropped.  Returns counts of what was kept and dropped.  Unfenced: the caller fences.

        Array operations over the buckets' lines and the entries: no Python object per
        bucket, one per slot kept (the mirror's).
        """
        if not 0 <= lo <= hi <= self.nbuckets:
            raise ValueError(f"a range of buckets lies in [0, {self.nbuckets}]")
        mem, slots, where = self.mem, self.slots, self.where
        mem.invalidate(self.base + lo * LINE, (hi - lo) * LINE)
        mem.mfence()
        raw = _core.ix_columns(mem.load(self.base + lo * LINE, (hi - lo) * LINE))
        whole, seqs, tags, at_block, at_version = (
            np.frombuffer(c, t) for c, t in zip(raw, _IX_COLUMNS, strict=True)
        )
        held = np.arange(lo, hi) if self.loaded is None else np.flatnonzero(self.loaded[lo:hi]) + lo
        numbers = (held[:, None] * SLOTS + np.arange(SLOTS)).ravel().tolist()
        for i in slots.keys() & numbers:  # the mirror of these buckets starts again
            s = slots.pop(i)
            if s[0] is not None and where.get(s[0]) == i:
                del where[s[0]]
        tagged = tags != 0
        cand = np.flatnonzero(tagged & (at_block < self.sb.nblocks))
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
        at = cand[ok]
        dropped = tagged.copy()
        named_keys = digests[ok].tolist()
        pos = (at + lo * SLOTS).tolist()
        found = zip(
            named_keys,
            tags[at].tolist(),
            at_block[at].tolist(),
            versions[ok].tolist(),
            strict=True,
        )
        if where.keys().isdisjoint(named_keys) and len(set(named_keys)) == len(named_keys):
            where.update(zip(named_keys, pos, strict=True))
            slots.update(zip(pos, found, strict=True))
            dropped[at] = False
            kept = len(pos)
        else:
            kept = 0
            for key, i, slot in zip(named_keys, pos, found, strict=True):
                other = where.get(key)
                if other is not None:  # a key named twice: the first slot of its entry stays
                    if slots[other][2:] == slot[2:]:
                        continue
                    del slots[other]
                    self._write(other // SLOTS)
                where[key] = i
                slots[i] = slot
                dropped[i - lo * SLOTS] = False
                kept += 1
        self.seq[lo:hi] = seqs
        if self.loaded is not None:
            self.loaded[lo:hi] = True
        rewrite = (whole == 0) | dropped.reshape(hi - lo, SLOTS).any(axis=1)
        for b in np.flatnonzero(rewrite).tolist():
            self._write(b + lo)
        return {"kept": kept, "dropped": int(dropped.sum())}

    def loaded_all(self) -> None:
        """Every bucket has been reconciled: the mirror holds the whole index from now on."""
        self.loaded = None

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
        self.slots.clear()
        self.where.clear()
        self.loaded = np.zeros(self.nbuckets, dtype=bool)
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
