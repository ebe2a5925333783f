"""The life of an extent in the pool: granted, committed, retired, evicted, freed.

These are :class:`ExtentKeeping`'s methods, one part of the metadata service
(:class:`~beluga.server.service.MetadataService`, whose module doc lists the
state they share): versions and their floor, commit words, the pool index's
entries, retiring a key, eviction and allocation.

Reuse of an extent (the one rule readers and writers rely on)
  An extent goes back to the allocator only when no host can still store into
  it, and a reader that raced its reuse sees the header change:

  - a write in progress is freed when its writer commits (or its COMMIT is
    refused), aborts, or is gone: its host id is no longer held, alive, in the
    generation that wrote.  A write lease that runs out *cancels* the write
    (its COMMIT is refused) but does not free the extent while its writer
    lives: a writer stopped mid-payload (SIGSTOP, a paused VM) may resume and
    store the rest of its payload and its header, and those stores must land
    on nothing but its own dead extent.  Until then the extent is quarantined.
    On one kernel "alive" is exact (pid and start time); across hosts it is a
    heartbeat seen moving within the host table's stale_s.
  - an extent under a header nobody can read (hostile bytes in it, or a
    seal a recovery read torn) that a recovery meets is held, writer
    unknown: the header may have been the WRITING header of a grant whose
    writer still lives and will store into it.  It is held from its first
    block up to the longest extent ever granted (the service line's word),
    stopping short of a block held already or a block with a header of its
    own, and freed once every writer that held a host id when the server
    first looked is gone (``writers_now``, then ``writer_alive``); a new
    writer cannot have been granted it.  A COMMIT or ABORT naming it once
    its header reads again (its writer sealed it) makes it that writer's
    write in progress again.  Before 2026-12-06 such blocks were taken for
    free, granted again, and the first writer's late stores overwrote an
    acknowledged value (docs/protocol.md, "Headers nobody can read").
  - a committed value that is removed, replaced or evicted leaves the pool
    index, and its header and commit word are cleared (fenced) before its
    extent can be handed out again.  Readers hold no lease: versions never
    repeat, and a new writer publishes WRITING (fenced) before its first
    payload store, so a reader whose copy saw any later byte finds the header
    at the extent's first block changed (cleared, WRITING, or another
    version) when it checks again after the copy, and reports a miss.  The
    only leases left are those of the LOOKUP RPC, kept for callers that
    still use it; they make misses rarer, never reads correct.

Eviction
  LRU, skipping leased entries: above ``high_watermark`` of the blocks in use
  the service evicts down to ``low_watermark``, and an allocation that does
  not fit evicts until it does.  When nothing can be evicted the allocation
  fails with CapacityError.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from beluga._native import step
from beluga.coherence import LINE, BlockHeader, BlockState, Memory
from beluga.errors import CapacityError

_CLEAR = bytes(LINE)
FLOOR_STEP = 1 << 16  # versions handed out per write of the floor
# a named sabotage point (beluga_native.h)
_clear_fence = step("SERVICE_CLEAR_FENCE", Memory.sfence)


@dataclass(slots=True)
class Entry:
    block: int
    nblocks: int
    version: int
    length: int
    lease_until: float = 0.0


class BlockKeys:
    """Which key's committed entry begins at each block, and its version: the service's
    map from a block back to its key (a reader's hint names a block; the pool index's
    slots name blocks).  Numpy columns a block long, not a Python object a key: recovery
    fills them a region at a time (``set_many``) and reconciles the pool index against
    them an array at a time (``lookup``).  Not thread-safe, not fork-safe: the service's."""

    def __init__(self, nblocks: int) -> None:
        self.has = np.zeros(nblocks, dtype=bool)
        self.version = np.zeros(nblocks, dtype=np.uint64)
        self.digest = np.zeros(nblocks, dtype="V16")

    def set(self, block: int, digest: bytes, version: int) -> None:
        self.has[block] = True
        self.version[block] = version
        self.digest[block] = digest

    def discard(self, block: int, version: int) -> None:
        """Forget the entry at ``block`` if it is still the one of ``version``."""
        if self.has[block] and int(self.version[block]) == version:
            self.has[block] = False

    def set_many(self, blocks: np.ndarray, digests: np.ndarray, versions: np.ndarray) -> None:
        """Entries begin at ``blocks`` (distinct), with 16-byte ``digests`` and ``versions``."""
        self.has[blocks] = True
        self.version[blocks] = versions
        self.digest[blocks] = digests

    def lookup(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For blocks inside the pool: whether an entry begins at each, and its digest
        (16-byte void items) and version (meaningless where it does not)."""
        return self.has[blocks], self.digest[blocks], self.version[blocks]


@dataclass
class Pending:
    digest: bytes
    version: int
    length: int
    nblocks: int
    host: int  # host id of the writer
    generation: int  # of that host id, when it wrote (grants start at 1; 0: unknown)
    expires: float
    cancelled: bool = False  # its lease ran out: COMMIT is refused; freed once the writer is done

    @classmethod
    def of(cls, header: BlockHeader, nblocks: int, expires: float) -> Pending:
        """The write a header in the pool names, under the writer it names."""
        return cls(
            header.digest,
            header.version,
            header.length,
            nblocks,
            header.writer,
            header.writer_gen,
            expires,
        )


class ExtentKeeping:
    """The metadata service's extents (the module doc); recovery's steps, on the same
    object, are :class:`~beluga.server.recovery.Recovery`'s and
    :class:`~beluga.server.settling.Settling`'s.  Not thread-safe, not fork-safe: the
    service's (its one thread; process memory rebuilt from the pool)."""

    def extent(self, length: int) -> int:
        return max(1, -(-length // self.sb.block_size))

    def _clear_header(self, block: int) -> None:
        """Clear a header, fenced with whatever was stored before it (a commit word)."""
        self.mem.nt_store(self.sb.block_header_offset(block), _CLEAR)
        _clear_fence(self.mem)

    def _drop_copy(self, block: int, reserved: int = 0) -> None:
        """A copy recovery found dead or beaten: commit word and header cleared (unfenced:
        a clear lost in a crash is redone by the next scan), ``reserved`` blocks freed."""
        self._set_commit(block, 0)
        self.mem.nt_store(self.sb.block_header_offset(block), _CLEAR)
        if reserved:
            self.alloc.release(block, reserved)

    def _next_version(self) -> int:
        """A version never handed out before, by this server or any before it."""
        self.version += 1
        if self.version >= self.floor:
            self.floor = self.version + FLOOR_STEP
            self.mem.nt_store(self.sb.service_offset, self.floor.to_bytes(8, "little"))
            # persisted before the version is used: every version goes into the WRITING
            # header of its grant (_announce), whose fence precedes the answer, and
            # recovery takes the highest of the floor and every header's version
        return self.version

    def _set_commit(self, block: int, version: int) -> None:
        """Record (or, with 0, erase) the committed version of an extent; fenced by callers."""
        self.mem.nt_store(self.sb.block_commit_offset(block), version.to_bytes(8, "little"))

    def _free_pending(self, block: int) -> Pending:
        """A write is over without a commit: clear its header, free its extent."""
        pend = self.pending.pop(block)
        self._clear_header(block)
        self.alloc.release(block, pend.nblocks)
        return pend

    def _hold_unreadable(
        self, block: int, ahead: Callable[[int, int], np.ndarray], start: int | None = None
    ) -> int:
        """Hold the blocks from ``block``, whose header nobody can read, as an extent of an
        unknown writer (the module doc): up to the longest extent (to the pool's end while
        no server has known it: ``_extent_known``), short of a used block or of one whose
        header line ``ahead(first, end)`` says is not all zero; only from ``start`` on if
        given (the census's look-back).  Blocks held (0: none free)."""
        first = block if start is None else start
        if self.alloc.used_map[first] or first in self.unreadable:
            return 0
        longest = max(1, self.max_extent) if self._extent_known else self.sb.nblocks
        end = min(self.sb.nblocks, block + longest)
        stop = np.flatnonzero(self.alloc.used_map[first + 1 : end]) + first + 1
        if stop.size:
            end = int(stop[0])
        after = first if start is not None else first + 1  # block's own line is marked
        if end > after:
            marked = np.flatnonzero(ahead(after, end)) + after
            if marked.size:
                end = int(marked[0])
        n = end - first
        if n < 1:
            return 0
        if not self.alloc.reserve(first, n):
            raise AssertionError(f"blocks {first}..{end} were free a moment ago")
        self.unreadable[first] = n
        self.counters["unreadable_headers_held"] += 1
        return n

    def _readable_again(self, block: int, header: BlockHeader) -> Pending | None:
        """A header held unreadable reads as a write of before the takeover again (its
        writer sealed it): that writer's write in progress, under a fresh lease, if its
        extent fits where it lies (else it stays held; None)."""
        if header.version >= self.takeover_floor or header.state not in (
            BlockState.WRITING,
            BlockState.PUBLISHED,
        ):
            return None
        n = self.extent(header.length)
        # the holds within its extent (the look-back's part of it is one of its own)
        parts = {b: m for b, m in self.unreadable.items() if block <= b < block + n}
        for b, m in parts.items():
            del self.unreadable[b]
            self.alloc.release(b, m)
        if not self.alloc.reserve(block, n):
            for b, m in parts.items():  # free a moment ago: it cannot fail
                self.alloc.reserve(b, m)
            self.unreadable.update(parts)
            return None
        pend = self.pending[block] = Pending.of(header, n, self.clock() + self.write_lease_s)
        if self.rec is not None:
            self.rec.adopted[block] = True  # the scan of keys leaves it be
        self.counters["unreadable_headers_read_again"] += 1
        return pend

    def _release_unreadable(self) -> None:
        """Free the extents held under unreadable headers once every writer that held a
        host id when this server first looked (``writers_now``) is gone."""
        if not self.unreadable:
            return
        if self._writers_before is None:
            self._writers_before = frozenset(self.writers_now())
        if any(self.writer_alive(host, gen) for host, gen in self._writers_before):
            return
        for block, n in self.unreadable.items():
            self._set_commit(block, 0)
            self._clear_header(block)
            self.alloc.release(block, n)
            self.counters["unreadable_extents_freed"] += 1
        self.unreadable.clear()

    def _granted_writers(self) -> set[tuple[int, int]]:
        """Every (host id, generation) the pool's host table has a grant line for."""
        hosts = self.pool.hosts
        return {
            (g.host_id, g.generation)
            for i in range(hosts.max_hosts)
            if (g := hosts.grant(i)) is not None
        }

    def _index(self, digest: bytes, e: Entry) -> bool:
        """Make ``digest`` a committed entry, in memory and in the pool index.

        When the pool index cannot place it, other keys of its two buckets are
        evicted (never seen at the index's load of at most a third); False if
        none can be (all leased).
        """
        while not self.ix.put(digest, e.block, e.version):
            now = self.clock()
            crowd = [d for d in self.ix.crowd(digest) if self.index[d].lease_until <= now]
            if not crowd:
                return False
            self._retire(self.index.pop(crowd[0]), crowd[0])
            self.counters["index_evictions"] += 1
        self.index[digest] = e
        self.by_block.set(e.block, digest, e.version)
        return True

    def _retire(self, e: Entry, digest: bytes | None) -> None:
        """A key is gone: out of the pool index (``digest``: None when a new value of the
        key already took its slot), commit word and header cleared; the extent is freed
        (after the read leases of RPC lookups, if any).

        Any of the clears alone keeps readers and recovery from finding the value, so
        they need no fence between them, only one before the answer goes out.
        """
        if digest is not None:
            self.ix.drop(digest)
            self.retired.append(digest)
            self.retired_next += 1
        self.by_block.discard(e.block, e.version)
        self._set_commit(e.block, 0)
        self._clear_header(e.block)
        if e.lease_until > self.clock():
            heapq.heappush(self.retiring, (e.lease_until, e.block, e.nblocks))
        else:
            self.alloc.release(e.block, e.nblocks)
        if digest is not None and self._scanning():
            self._bury(digest, 0)

    def _evict_one(self) -> bool:
        now = self.clock()
        for digest, e in self.index.items():
            if e.lease_until <= now:
                del self.index[digest]
                if self.on_evict is not None:
                    self._demote(digest, e)
                self._retire(e, digest)
                self.counters["evictions"] += 1
                return True
        return False

    def _demote(self, digest: bytes, e: Entry) -> None:
        """Hand an evicted value's bytes (read validated, before the extent is freed) on."""
        assert self.on_evict is not None
        value = self.mem.read_bytes(
            self.sb.block_header_offset(e.block),
            self.sb.block_payload_offset(e.block),
            e.nblocks * self.sb.block_size,
            digest,
            e.version,
        )
        if isinstance(value, bytes):
            self.on_evict(digest, value)
        else:
            self.counters["demotions_unreadable"] += 1

    def _allocate(self, nblocks: int) -> int:
        """Free blocks for a grant: found by the census first, else by evicting the least
        recently used value, scanning more keys for one if none is known yet."""
        while (first := self.alloc.allocate(nblocks)) is None:
            if self.rec is not None and self.rec.census < self.sb.nblocks:
                self.heartbeat()  # a full pool's census can take minutes at the pod
                self._census_step(self.rec.region)  # room is known after each, before evicting
                continue
            if nblocks <= self.alloc.nblocks and self._evict_one():
                continue
            if self.rec is not None and self.rec.keys < self.sb.nblocks:
                self.heartbeat()
                self._keys_step()  # values not known yet are what eviction can take
                continue
            raise CapacityError(
                f"no room for {nblocks} contiguous blocks: {self.alloc.used} of "
                f"{self.alloc.nblocks} are in use and nothing can be evicted (all leased "
                "or being written); retry later, remove keys, or use a bigger pool"
            )
        return first

    def _allocate_known(self, nblocks: int) -> int:
        """Free blocks for the log of graves: found by the census if need be, never by an
        eviction (whose grave would need the log)."""
        while (first := self.alloc.allocate(nblocks)) is None:
            if self.rec is None or self.rec.census >= self.sb.nblocks:
                raise CapacityError(
                    f"no room for the {nblocks} blocks of the recovery's log of removed keys: "
                    "the pool is full; retry once the server has recovered"
                )
            self.heartbeat()
            self._census_step()
        return first
