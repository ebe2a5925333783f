"""The metadata service: the single owner of the index and the block allocator.

It runs on the server's one thread, so it needs no locks.  Data never passes
through it: clients write and read the pool themselves and only ask here
where things are.  Time is an input (``clock``), so leases, expiry and
eviction are tested in-process without sleeping.

State
  index      digest -> Entry(first block, extent, version, length, read lease),
             an OrderedDict in LRU order (oldest first); the same entries live
             in the pool's hash index (beluga.server.index), which this service
             alone writes and every host reads with loads, without an RPC
  pending    first block -> a write in progress: who writes it (host id and
             that id's generation), under a write lease
  retiring   extents whose key is gone but whose read lease has not expired
  commits    in the pool: one u64 per block, the version this server
             committed at an extent's first block (0: none).  Only the server
             writes it; it is the commit record recovery trusts.
  retired    the digests of the last RETIRED_KEEP keys that left the index
             (evicted, removed, dropped as corrupt), numbered in order within
             this server's life (``epoch``, random per start), for the RETIRED
             op: how engines learn of evictions, which only this service makes
  floor      in the pool's service line: a bound above every version handed
             out, raised ahead of use, so versions never repeat across restarts
             (a version names one write of a key forever, even a removed one)

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
  - a committed value that is removed, replaced or evicted leaves the pool
    index, and its header and commit word are cleared (fenced) before its
    extent can be handed out again.  Readers hold no lease: versions never
    repeat, and a new writer publishes WRITING (fenced) before its first
    payload store, so a reader whose copy saw any later byte finds the header
    at the extent's first block changed (cleared, WRITING, or another
    version) when it checks again after the copy, and reports a miss.  The
    only leases left are those of the LOOKUP RPC, kept for callers that
    still use it; they make misses rarer, never reads correct.

Leases
  A write lease (ALLOC) lasts ``write_lease_s``.  A read lease (LOOKUP with
  LOOKUP_LEASE) keeps an extent from being evicted or reused for
  ``read_lease_s``: fewer misses, never correctness.

Hits
  One-sided readers record their hits and misses in their own hint lines
  (index.c); ``tick`` folds them in: a hit moves its key to the LRU end, and
  the counts join the statistics.

Eviction
  LRU, skipping leased entries: above ``high_watermark`` of the blocks in use
  the service evicts down to ``low_watermark``, and an allocation that does
  not fit evicts until it does.  When nothing can be evicted the allocation
  fails with CapacityError.

Recovery
  The pool, not the process, is the source of truth (the index in it is
  derived, and repaired from the headers and commit table last).  A PUBLISHED
  header whose version the commit table holds is a value (the newest version
  of a key wins; overlaps resolve to the newer extent).  Any other header with
  a writer (WRITING, or PUBLISHED but not committed: its COMMIT may still be on
  its way) is a write in progress again, under a fresh write lease, owned by
  the host id and generation its header names, so it is freed as soon as that
  writer is seen gone.  Everything else is free.  A value whose writer sealed
  it after its lease ran out was never committed, so it never comes back.
  The scan makes no object per block: the C core parses the header table into
  numpy columns, the allocator decides every extent that overlaps no other at
  once (``reserve_many``), and only values tied to another by a key or a block
  are decided one at a time, newest first, with the same outcome.

Recovering while serving (issue 36)
  A scan of the whole pool costs about a microsecond a block: minutes at the
  pod's 134 M blocks, and writers used to wait all that time.  So a server
  that takes over scans in bounded steps (``recover_some``, between polls of
  its loop: flat out while idle, ``RECOVERY_SHARE`` of a busy loop), and
  answers every operation from the first one:

  takeover   reads the service line (the version floor, the log of graves,
             the longest extent, where the last server allocated:
             recovery.py) and nothing that grows with the pool; the
             allocator, the pool index's mirror and the index start empty.
             Versions below the floor stored were handed out before; a
             header at or above it is a grant whose answer never went out
             (the floor is raised, fenced, before any answer names a version
             above it), cleared when met.
  census     region by region from where the last server allocated (wrapping
             at the pool's end), it holds the extent of every write of
             before the takeover as the rule above decides within the
             region, and frees the rest: allocation takes only blocks the
             census has passed, so no extent is handed out twice, and an
             ALLOC that finds no room runs census steps before it evicts
             anything.  Its first region first decides the extents that
             begin before it and reach into it (``_look_back``, at most the
             longest extent back), ahead of their own region.
  keys       behind the census, each region's values join the index (a key
             met again keeps its newest copy, the other is cleared and
             freed) and its writes in flight are pending again.
  buckets    then the pool index is reconciled with the index, a range of
             buckets a step, and what no slot named is put in last.

  While keys are not all known (``_scanning``), every operation on a key
  first settles it (``_settle``): the copy the pool index names (what readers
  get) is brought into the index, or cleared, by the same rules, so the
  operation sees what a finished recovery would have shown of that key.  A
  COMMIT or ABORT naming a block not scanned yet adopts the write there
  (``_adopt_write``: its header, under its writer, or a committed copy when
  the COMMIT was sent again).  Adopted blocks are skipped by the scan.

  What the promises need:
  - a read is the committed bytes of the key or a miss: readers use the pool
    index and headers only, which the scan changes with the same stores and
    fences as any server; a copy a scan has not reached yet stays readable
    only if the pool index named it, as it was before the takeover;
  - an acknowledged write is never lost: its copy is named by the pool index
    (its COMMIT's slot was fenced before the answer) and its older copies were
    cleared, so the scan finds it newest, or a COMMIT during recovery makes it
    the newest decided (below);
  - a key this server changed while copies of it lie unscanned (a REMOVE or
    DROP, an eviction, a commit of a write granted before the takeover) gets
    a grave: every copy of before the takeover but the one kept is dead when
    the scan meets it.  A commit of a new write needs none: its version is
    above every such copy.  Graves are written to the pool (the log of
    graves, recovery.py) before the answer that relies on them, so a second
    takeover in the middle of a recovery applies them too; the log goes once
    every region's keys are scanned (every grave applied, the clears fenced);
  - stats while recovering count what is known (``recovering``,
    ``recovery_blocks_left``); a ring adopted before the scan reached its
    writer's grants has them asked about (``forget_unanswered``) when the
    scan finds them, as long as the ring keeps the requests.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import json
import secrets
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np

from beluga._native import step
from beluga.coherence import (
    LINE,
    BlockHeader,
    BlockState,
    HeaderTable,
    Memory,
    parse_header,
    parse_header_table,
)
from beluga.errors import CapacityError
from beluga.kv import protocol as p
from beluga.pool import Pool
from beluga.rpc import BatchHandler, Request, per_request
from beluga.server.allocator import BlockAllocator, overlapping
from beluga.server.index import PoolIndex
from beluga.server.recovery import (
    CENSUS_REGIONS,
    CURSOR_WORD,
    EXTENT_WORD,
    RECOVERY_REGION,
    RECOVERY_SHARE,
    GraveLog,
    RecoveryState,
)

_CLEAR = bytes(LINE)
_COLUMNS = ("block", "state", "version", "digest", "length", "writer", "writer_gen")
FLOOR_STEP = 1 << 16  # versions handed out per write of the floor
# defaults of the service's options (``beluga serve`` reads them from here)
WRITE_LEASE_S = 30.0
READ_LEASE_S = 2.0
HIGH_WATERMARK = 0.95
LOW_WATERMARK = 0.90
#: keys that left the index, kept for RETIRED (16 bytes each: 1 MiB)
RETIRED_KEEP = 65536
# the fences and invalidations below are named sabotage points (beluga_native.h)
_commit_fence = step("SERVICE_COMMIT_FENCE", Memory.sfence)
_clear_fence = step("SERVICE_CLEAR_FENCE", Memory.sfence)
_recover_invalidate = step("SERVICE_RECOVER_INVALIDATE", Memory.invalidate)
_recover_mfence = step("SERVICE_RECOVER_MFENCE", Memory.mfence)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while recovery makes its objects (a few per key, no
    cycles among them): a collection every few hundred allocations rescans them all,
    which took 70% of building 32 k entries on 2026-12-03.  After, they go straight to
    the oldest generation (``freeze`` then ``unfreeze``: no scan) instead of being
    scanned by the first young collections (52 ms at 65 k keys); a full collection
    still sees them, so nothing that later becomes garbage is kept.  In a process that
    keeps its collections short (a server's) they stay frozen, as all it built before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if _freeze_survivors not in gc.callbacks:
            gc.unfreeze()
        if enabled:
            gc.enable()


def keep_collections_short() -> None:
    """In a server's own process: full collections scan only what is new since the last.

    A full (oldest-generation) collection scans every object the process holds,
    and the service holds a few per key: 28 s extrapolated to the pod's 67 M
    keys (docs/alignment.md), every RPC waiting.  The objects alive now (what
    recovery built) are frozen out of the collector (``gc.freeze``), and so are
    the survivors of every later full collection, so each scans only what was
    made since the one before.  Frozen objects are still freed by their
    reference counts (the service's entries hold no cycles); what is lost is the
    collection of a cycle that was alive at a full collection and became garbage
    later.  For ``beluga serve`` (server.serve), never for a library's host
    process (it would freeze the caller's objects too).
    """
    gc.freeze()
    if _freeze_survivors not in gc.callbacks:
        gc.callbacks.append(_freeze_survivors)


def _freeze_survivors(phase: str, info: dict[str, int]) -> None:
    """gc callback: after a full collection, its survivors leave the collector."""
    if phase == "stop" and info.get("generation") == 2:
        gc.freeze()


@dataclass(slots=True)
class Entry:
    block: int
    nblocks: int
    version: int
    length: int
    lease_until: float = 0.0


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


class MetadataService:
    """The metadata service (the module doc).  Not thread-safe: one thread calls it (the
    server's); not fork-safe: process memory rebuilt from the pool."""

    def __init__(
        self,
        pool: Pool,
        *,
        write_lease_s: float = WRITE_LEASE_S,
        read_lease_s: float = READ_LEASE_S,
        high_watermark: float = HIGH_WATERMARK,
        low_watermark: float = LOW_WATERMARK,
        clock: Callable[[], float] = time.monotonic,
        writer_alive: Callable[[int, int], bool] | None = None,
        recovery_region: int = RECOVERY_REGION,
        recover_now: bool = True,
    ) -> None:
        """``recover_now``: recover the whole pool before returning (a library's service,
        tests); False leaves it to :meth:`recover_some`, called while serving (a server:
        the module doc, "Recovery").  ``recovery_region``: blocks a recovery step scans."""
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError("watermarks must satisfy 0 < low <= high <= 1")
        self.pool = pool
        self.mem = pool.memory
        self.sb = pool.superblock
        self.write_lease_s = write_lease_s
        self.read_lease_s = read_lease_s
        self.high = high_watermark
        self.low = low_watermark
        self.clock = clock
        #: whether host id h is still held, alive, in generation g: the server wires in
        #: its host registry; without one every writer is presumed alive, so a write
        #: whose lease ran out stays quarantined until its writer commits or aborts
        self.writer_alive = writer_alive or (lambda host, generation: True)
        if recovery_region < 1:
            raise ValueError(
                f"recovery_region is a number of blocks above 0, not {recovery_region}"
            )
        self.alloc = BlockAllocator(self.sb.nblocks, frontier=0)
        self.index: OrderedDict[bytes, Entry] = OrderedDict()
        self.ix = PoolIndex(self.mem, self.sb)
        self.by_block: dict[int, tuple[bytes, int]] = {}  # first block -> (digest, version)
        self.pending: dict[int, Pending] = {}
        self.retiring: list[tuple[float, int, int]] = []
        self.version = 0
        self.floor = 0
        self.counters: Counter[str] = Counter()
        #: called with (digest, bytes) for each evicted value before its extent is freed
        #: (the server wires in the cross-pod tier's demotion queue); None: nothing to do
        self.on_evict: Callable[[bytes, bytes], None] | None = None
        #: more counters for ``stats`` (the tier's), or None
        self.extra_stats: Callable[[], dict[str, object]] | None = None
        #: names this server's life in RETIRED answers (a cursor of another life is stale)
        self.epoch = secrets.randbits(63) | 1
        self.retired: deque[bytes] = deque(maxlen=RETIRED_KEEP)
        self.retired_next = 0  # the number the next key to leave the index gets
        self.started = time.time()
        self.graves = GraveLog(
            self.mem, self.sb, self._allocate_known, lambda first, n: self.alloc.release(first, n)
        )
        self.max_extent = 0  # the most blocks one extent was granted (the service line's)
        self._extent_known = False  # whether the service line's word can be trusted
        self._cursor_hint = -1  # the cursor's region last written to the service line
        self.rec: RecoveryState | None = None
        self._take_over(recovery_region)
        if recover_now:
            self.recover()

    # -- helpers -------------------------------------------------------------

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
        self.by_block[e.block] = (digest, e.version)
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
        if self.by_block.get(e.block, (b"", 0))[1] == e.version:
            del self.by_block[e.block]
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
        while (first := self.alloc.allocate(nblocks)) is None:
            if self.rec is not None and self.rec.census < self.sb.nblocks:
                self._census_step(self.rec.region)  # room is known after each, before evicting
                continue
            if nblocks > self.alloc.nblocks or not self._evict_one():
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
            self._census_step()
        return first

    # -- operations ----------------------------------------------------------

    def op_alloc(self, req: Request) -> bytes:
        flags, items = p.decode_alloc(req.payload)
        limit = self.sb.nblocks * self.sb.block_size
        granted: list[p.Grant] = []
        skip = bool(flags & p.ALLOC_SKIP_PRESENT)
        writing = self._writing() if skip else set()
        scanning = skip and self._scanning()
        try:
            for digest, length, _key_len in items:
                if length > limit:
                    raise ValueError(
                        f"a value of {length} bytes exceeds the pool's {limit}-byte data area"
                    )
                if scanning:
                    self._settle(digest)
                if skip and (digest in self.index or digest in writing):
                    why = p.PRESENT_COMMITTED if digest in self.index else p.PRESENT_WRITING
                    granted.append(p.Grant(p.NO_BLOCK, why))
                    self.counters["duplicate_writes_skipped"] += 1
                    continue
                n = self.extent(length)
                self._note_extent(n)
                first = self._allocate(n)
                version = self._next_version()
                self.pending[first] = Pending(
                    digest,
                    version,
                    length,
                    n,
                    req.host_id,
                    req.generation,
                    self.clock() + self.write_lease_s,
                )
                granted.append(p.Grant(first, version))
                if skip:  # a key twice in one batch is written once
                    writing.add(digest)
        except BaseException:
            for g in granted:  # all or nothing (no header was written yet)
                if g.block != p.NO_BLOCK:
                    pend = self.pending.pop(g.block)
                    self.alloc.release(g.block, pend.nblocks)
            raise
        self._note_cursor()
        self._announce(granted, items, req)
        while self.alloc.used > self.high * self.alloc.nblocks:
            if not self._evict_one() or self.alloc.used <= self.low * self.alloc.nblocks:
                break
        return p.encode_grants(granted)

    def _announce(self, granted: list[p.Grant], items: list[tuple], req: Request) -> None:
        """Mark every granted extent WRITING in the pool, by its writer, before the answer.

        A grant lives in this process's memory only until its writer's own
        WRITING header lands.  A writer stopped between the answer and that
        store, with this server killed meanwhile, held an extent that the next
        server's recovery found free and granted again: the stopped writer
        then overwrote a value acknowledged since (chaos seed 3028221332, key
        chaos/w1/k10).  With the header here first (each fenced before the
        answer), recovery finds every grant, with its writer and generation,
        and holds the extent until that writer commits, aborts or is gone.
        The header's stamp is the request's RPC seq: a server that recovers a
        grant whose request was never answered frees it (forget_unanswered).
        """
        for (digest, length, key_len), g in zip(items, granted, strict=True):
            if g.block == p.NO_BLOCK:
                continue
            self.mem.begin_write(
                self.sb.block_header_offset(g.block),
                self.sb.block_payload_offset(g.block),
                digest,
                g.version,
                length,
                key_len=key_len,
                writer=req.host_id,
                writer_gen=req.generation,
                stamp=req.seq,
            )

    def _writing(self) -> set[bytes]:
        """Keys being written under a live lease (a cancelled write never commits, so an
        ALLOC_SKIP_PRESENT request may write its key again)."""
        return {pend.digest for pend in self.pending.values() if not pend.cancelled}

    def op_commit(self, req: Request) -> bytes:
        done = []
        scanning = self._scanning()
        for digest, block, version in p.decode_commit(req.payload):
            pend = self.pending.get(block)
            if pend is None and scanning:  # granted before the takeover, not scanned yet?
                pend = self._adopt_write(digest, block, version)
            if pend is None or pend.digest != digest or pend.version != version:
                # already committed (the request was sent again to a restarted server)?
                if scanning:
                    self._settle(digest)
                e = self.index.get(digest)
                done.append(e is not None and e.block == block and e.version == version)
                continue
            if pend.cancelled:  # too late: its writer has finished storing, so free it now
                self._free_pending(block)
                self.counters["late_commits_refused"] += 1
                done.append(False)
                continue
            del self.pending[block]
            self._set_commit(block, version)
            if scanning:  # its key's copies not scanned yet lose to this one, now and later
                self._settle(digest)
                if version < self.rec.first:  # type: ignore[union-attr]
                    self._bury(digest, version)
            new = Entry(block, pend.nblocks, version, pend.length)
            old = self.index.pop(digest, None)
            if not self._index(digest, new):  # only a new key (no slot yet) can fail
                self._retire(new, None)
                self.counters["index_full"] += 1
                done.append(False)
                continue
            if old is not None:  # the index points at the new value: the old one goes
                self._retire(old, None)
            self.counters["puts"] += 1
            done.append(True)
        _commit_fence(self.mem)  # every commit word is in the pool before the answer goes out
        return p.encode_flags(done)

    def op_abort(self, req: Request) -> bytes:
        scanning = self._scanning()
        for digest, block, version in p.decode_commit(req.payload):
            pend = self.pending.get(block)
            if pend is None and scanning:
                pend = self._adopt_write(digest, block, version)
            if pend and pend.digest == digest and pend.version == version:
                self._free_pending(block)
        return b""

    def op_lookup(self, req: Request) -> bytes:
        flags, digests = p.decode_digests(req.payload)
        until = self.clock() + self.read_lease_s
        out: list[p.Location | None] = []
        scanning = self._scanning()
        for d in digests:
            if scanning:
                self._settle(d)
            e = self.index.get(d)
            if e is None:
                self.counters["misses"] += 1
                out.append(None)
                if flags & p.LOOKUP_PREFIX:
                    break
                continue
            self.counters["hits"] += 1
            self.index.move_to_end(d)
            if flags & p.LOOKUP_LEASE:
                e.lease_until = max(e.lease_until, until)
            out.append(p.Location(e.block, e.version, e.length))
        return p.encode_locations(out)

    def op_remove(self, req: Request) -> bytes:
        _, digests = p.decode_digests(req.payload)
        found = []
        scanning = self._scanning()
        for d in digests:
            if scanning:
                self._settle(d)
            e = self.index.pop(d, None)
            if e is not None:
                self._retire(e, d)
                self.counters["removes"] += 1
            elif scanning:  # a copy the scan has not reached must not come back either
                self._bury(d, 0)
            found.append(e is not None)
        return p.encode_flags(found)

    def op_drop(self, req: Request) -> bytes:
        """Remove values a reader found corrupt, each only if the index still holds that very
        version: a value replaced since (a good one) stays."""
        dropped = []
        scanning = self._scanning()
        for digest, block, version in p.decode_commit(req.payload):
            if scanning:
                self._settle(digest)
            e = self.index.get(digest)
            hit = e is not None and e.block == block and e.version == version
            if hit:
                self._retire(self.index.pop(digest), digest)
                self.counters["corrupt_dropped"] += 1
            dropped.append(hit)
        return p.encode_flags(dropped)

    def op_retired(self, req: Request) -> bytes:
        """The keys that left the index from a cursor on, at most ``most`` of them.

        A cursor of another server life (or none: epoch 0) is answered from
        the oldest key kept (none: from now, for a first call); a cursor older
        than what is kept, from the oldest kept.  The caller sees either as an
        answer whose ``first`` is past its cursor or whose epoch changed: a gap.
        """
        epoch, cursor, most = p.decode_retired_request(req.payload)
        oldest = self.retired_next - len(self.retired)
        if epoch == 0:
            start = self.retired_next
        elif epoch != self.epoch:
            start = oldest
        else:
            start = min(max(cursor, oldest), self.retired_next)
        taken = list(itertools.islice(self.retired, start - oldest, start - oldest + most))
        return p.encode_retirements(p.Retirements(self.epoch, start, start + len(taken), taken))

    def op_stats(self, req: Request) -> bytes:
        self.fold_hints()
        return json.dumps(self.stats()).encode()

    def handlers(self) -> dict[int, BatchHandler]:
        return {
            p.StoreOp.ALLOC: per_request(self.op_alloc),
            p.StoreOp.COMMIT: per_request(self.op_commit),
            p.StoreOp.ABORT: per_request(self.op_abort),
            p.StoreOp.LOOKUP: per_request(self.op_lookup),
            p.StoreOp.REMOVE: per_request(self.op_remove),
            p.StoreOp.STATS: per_request(self.op_stats),
            p.StoreOp.DROP: per_request(self.op_drop),
            p.StoreOp.RETIRED: per_request(self.op_retired),
        }

    # -- timers and hosts ----------------------------------------------------

    def fold_hints(self) -> None:
        """Fold readers' hint lines in: their hits move keys to the LRU end."""
        for block, vlow in self.ix.fold_hints():
            hit = self.by_block.get(block)
            if hit is not None and hit[1] & 0xFFFFFFFF == vlow and hit[0] in self.index:
                self.index.move_to_end(hit[0])

    def tick(self) -> None:
        """Fold hints; cancel writes whose lease ran out, free those whose writer is gone,
        end retirements."""
        self.fold_hints()
        if self.ix.scrub():  # a bucket hit by stray or hostile bytes is rewritten
            self.mem.sfence()
        now = self.clock()
        alive: dict[tuple[int, int], bool] = {}  # one look per writer per tick
        for block, pend in list(self.pending.items()):
            if not pend.cancelled and pend.expires <= now:
                pend.cancelled = True
                self.counters["lease_expiries"] += 1
            if pend.generation == 0:  # writer unknown: the lease alone decides
                gone = pend.cancelled
            else:
                who = (pend.host, pend.generation)
                if who not in alive:
                    alive[who] = self.writer_alive(*who)
                gone = not alive[who]
                self.counters["dead_writer_reclaims"] += gone
            if gone:
                self._free_pending(block)
        while self.retiring and self.retiring[0][0] <= now:
            _, block, n = heapq.heappop(self.retiring)
            self.alloc.release(block, n)

    def forget_unanswered(
        self, host_id: int, generation: int, unanswered: Callable[[int], bool]
    ) -> None:
        """Free the grants a gone server made for requests of this writer it never answered.

        Called (RpcServer.on_adopt) as the writer's ring is adopted, before its
        pending requests are refused: a recovered write still WRITING as its
        server announced it (stamp: the request's seq; a writer's own header
        stores carry 0) whose request ``unanswered(seq)`` says no answer
        reached can have no store of its writer coming, who will send the
        request again (rpc.c, GRANTS NOBODY LEARNED).  Kept, it would wait
        for a COMMIT that never comes, quarantined while that writer lives.  While the
        scan has not reached every block, the writer's grants it finds later are asked
        about then (``unanswered`` still answers for a request its ring keeps).
        """
        if self._scanning():
            self.rec.unanswered[(host_id, generation)] = unanswered  # type: ignore[union-attr]
        for block, pend in list(self.pending.items()):
            if pend.host != host_id or pend.generation != generation:
                continue
            off = self.sb.block_header_offset(block)
            _recover_invalidate(self.mem, off, LINE)  # stored by the server that is gone
            _recover_mfence(self.mem)
            header = parse_header(self.mem.load(off, LINE))
            if (
                header is not None
                and header.state == BlockState.WRITING
                and header.stamp
                and header.version == pend.version
                and unanswered(header.stamp)
            ):
                self._free_pending(block)
                self.counters["unanswered_grants_freed"] += 1

    def client_gone(self, host_id: int) -> None:
        """A client host died or left: what it was writing goes back at once."""
        for block, pend in list(self.pending.items()):
            if pend.host == host_id:
                self._free_pending(block)
                self.counters["dead_writer_reclaims"] += 1

    def stats(self) -> dict[str, object]:
        block_bytes = self.sb.block_size
        return {
            "capacity_bytes": self.sb.nblocks * block_bytes,
            "used_bytes": self.alloc.used * block_bytes,
            "block_size": block_bytes,
            "blocks_total": self.sb.nblocks,
            "blocks_used": self.alloc.used,
            "keys": len(self.index),
            "value_bytes": sum(e.length for e in self.index.values()),
            "writes_in_flight": len(self.pending),
            "quarantined_extents": sum(pend.cancelled for pend in self.pending.values()),
            "retiring_extents": len(self.retiring),
            "hits": self.counters["hits"] + self.ix.hits,
            "misses": self.counters["misses"] + self.ix.misses,
            "puts": self.counters["puts"],
            "removes": self.counters["removes"],
            "duplicate_writes_skipped": self.counters["duplicate_writes_skipped"],
            "corrupt_dropped": self.counters["corrupt_dropped"],
            "evictions": self.counters["evictions"],
            "lease_expiries": self.counters["lease_expiries"],
            "late_commits_refused": self.counters["late_commits_refused"],
            "dead_writer_reclaims": self.counters["dead_writer_reclaims"],
            "unanswered_grants_freed": self.counters["unanswered_grants_freed"],
            "recovered_keys": self.counters["recovered_keys"],
            "recovering": int(self.rec is not None),
            "recovery_blocks_left": self._blocks_left(),
            "recovery_graves": len(self.rec.graves) if self.rec is not None else 0,
            "index_buckets": self.ix.nbuckets,
            "index_moves": self.ix.moves,
            "index_scrub_repairs": self.ix.scrubbed,
            "index_evictions": self.counters["index_evictions"],
            "index_repaired": self.counters["index_repaired"],
            "tier_hits": self.ix.tier_hits,
            "promotions": self.ix.promotions,
            "uptime_s": round(time.time() - self.started, 3),
            **(self.extra_stats() if self.extra_stats is not None else {}),
        }

    # -- recovery ------------------------------------------------------------

    @staticmethod
    def _newest_first(headers: HeaderTable, rows: np.ndarray) -> np.ndarray:
        """Rows of the header table by version, newest first; ties by block, lowest first."""
        return rows[np.lexsort((headers.block[rows], ~headers.version[rows]))]

    def _reserve_values(
        self, headers: HeaderTable, rows: np.ndarray, extents: np.ndarray
    ) -> np.ndarray:
        """Which committed values (rows, newest first) recovery keeps: each in turn, unless
        a newer copy of its key was kept or a kept extent overlaps its own."""
        firsts, counts = headers.block[rows], extents[rows]
        keys = headers.digest[rows].tolist()
        if len(set(keys)) == len(keys):
            return self.alloc.reserve_many(firsts, counts)
        copies = Counter(keys)  # a key committed twice: a crash during an overwrite
        shared = np.fromiter((copies[k] > 1 for k in keys), dtype=bool, count=len(keys))
        # only values tied to another by a key or a block depend on the order
        tangled = shared | overlapping(firsts, counts)
        won = np.zeros(rows.size, dtype=bool)
        won[~tangled] = self.alloc.reserve_many(firsts[~tangled], counts[~tangled])
        kept: set[bytes] = set()
        for i in np.flatnonzero(tangled).tolist():
            key = keys[i]
            if key not in kept and self.alloc.reserve(int(firsts[i]), int(counts[i])):
                kept.add(key)
                won[i] = True
        return won

    def _scanning(self) -> bool:
        """Whether some blocks' keys are still unknown (graves and settling apply)."""
        return self.rec is not None and self.rec.keys < self.sb.nblocks

    def _blocks_left(self) -> int:
        """Blocks whose keys recovery has not scanned yet."""
        return 0 if self.rec is None else self.sb.nblocks - self.rec.keys

    @property
    def recovering(self) -> bool:
        """Whether recovery still runs (:meth:`recover_some`)."""
        return self.rec is not None

    def _take_over(self, region: int) -> None:
        """What a server does before its first answer: the version floor and the graves a
        server before it left; nothing that grows with the pool."""
        sb = self.sb
        _recover_invalidate(self.mem, sb.service_offset, LINE)
        _recover_mfence(self.mem)
        stored = int.from_bytes(self.mem.load(sb.service_offset, 8), "little")
        # every version any answer named is below the floor stored (_next_version); a
        # header at or above it is a grant never answered, cleared as the scan meets it
        self.version = self.floor = stored
        n = sb.nblocks
        self.max_extent = self._service_word(EXTENT_WORD)
        self._extent_known = self.max_extent > 0
        # the census starts where the last server allocated (free blocks are likely
        # there), and looks back max_extent blocks for extents reaching into its start
        hint = self._service_word(CURSOR_WORD) if self._extent_known else 0
        origin = hint - hint % region if hint < n else 0
        self.alloc = BlockAllocator(n, frontier=0, origin=origin)
        self.rec = RecoveryState(
            first=self.version,
            expires=self.clock() + self.write_lease_s,
            nblocks=n,
            origin=origin,
            region=region,
        )
        for digest, below, keep in self.graves.read(_recover_invalidate):
            self.rec.graves[digest] = (below, keep)
        if self.graves.nblocks:
            self.alloc.reserve(self.graves.first, self.graves.nblocks)

    def _service_word(self, at: int) -> int:
        """A word of the service line (recovery.py; read fresh by the takeover)."""
        return int.from_bytes(self.mem.load(self.sb.service_offset + at, 8), "little")

    def _note_extent(self, n: int) -> None:
        """An extent of ``n`` blocks exists: the service line's word covers it before any
        header of it can be in the pool (the grant's fence follows)."""
        if n > self.max_extent:
            self.max_extent = n
            if self._extent_known:
                self._write_extent()

    def _write_extent(self) -> None:
        word = self.max_extent.to_bytes(8, "little")
        self.mem.nt_store(self.sb.service_offset + EXTENT_WORD, word)

    def _note_cursor(self) -> None:
        """Where allocation goes on, for the next server's census (a hint: unfenced)."""
        at = self.alloc.cursor
        if at // RECOVERY_REGION != self._cursor_hint:
            self._cursor_hint = at // RECOVERY_REGION
            self.mem.nt_store(self.sb.service_offset + CURSOR_WORD, at.to_bytes(8, "little"))

    def recover(self) -> None:
        """Recover the whole pool now: every step of :meth:`recover_some`."""
        with _gc_paused():
            while self.rec is not None:
                self._recover_step()

    def recover_some(self, served: int = 0) -> bool:
        """One bounded step of recovery (a few ms); whether more remains.

        The server's loop calls it between polls with how many requests its last
        poll served: an idle server recovers flat out, a busy one gives recovery at
        most ``RECOVERY_SHARE`` of its time (the module doc, "Recovery").
        """
        rec = self.rec
        if rec is None:
            return False
        now = time.perf_counter()
        if served and rec.spent > RECOVERY_SHARE * (now - rec.since):
            return True
        with _gc_paused():
            self._recover_step()
        rec.spent += time.perf_counter() - now
        return self.rec is not None

    def _recover_step(self) -> None:
        rec = self.rec
        assert rec is not None
        n = self.sb.nblocks
        if rec.census < n and rec.keys == rec.census:  # caught up: one read for both
            self._keys_step(self._census_step(rec.region))
        elif rec.census < n:
            self._census_step()
        elif rec.keys < n:
            self._keys_step()
        elif rec.buckets < self.ix.nbuckets:
            self._reconcile_step()
        else:
            self._naming_step()
        if rec.keys == n and (rec.graves or rec.unanswered or self.graves.nblocks):
            self.graves.close()  # every grave applied, the clears fenced: the log can go
            rec.graves.clear()
            rec.unanswered.clear()

    def _read_region(self, lo: int, hi: int) -> tuple[HeaderTable, np.ndarray]:
        """The valid headers of blocks [lo, hi) (absolute block numbers) and their commit
        words, read fresh."""
        sb = self.sb
        _recover_invalidate(self.mem, sb.block_header_offset(lo), (hi - lo) * LINE)
        _recover_invalidate(self.mem, sb.block_commit_offset(lo), (hi - lo) * 8)
        _recover_mfence(self.mem)
        headers = parse_header_table(self.mem.load(sb.block_header_offset(lo), (hi - lo) * LINE))
        committed = np.frombuffer(self.mem.load(sb.block_commit_offset(lo), (hi - lo) * 8), "<u8")
        return replace(headers, block=headers.block + lo), committed

    def _classify(
        self, headers: HeaderTable, committed: np.ndarray, lo: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Masks of a region's headers: live (a write of before the takeover, not decided
        ahead of the scan), committed among them, and stray (a version this server's
        floor says was never handed out: no grant's)."""
        rec = self.rec
        assert rec is not None
        ours = np.ones(len(headers), dtype=bool)
        if rec.adopted:
            ours = ~np.isin(headers.block, np.fromiter(rec.adopted, np.int64, len(rec.adopted)))
        before = headers.version < rec.first
        live = (
            ours
            & before
            & ((headers.state == BlockState.WRITING) | (headers.state == BlockState.PUBLISHED))
        )
        rel = headers.block - lo
        done = live & (headers.state == BlockState.PUBLISHED) & (committed[rel] == headers.version)
        return live, done, ours & ~before

    def _extents(self, headers: HeaderTable) -> np.ndarray:
        size = self.sb.block_size
        return np.maximum(1, headers.length // size + (headers.length % size != 0))

    def _census_step(self, most: int = 0) -> tuple[HeaderTable, np.ndarray, int, int]:
        """Make the next region's free blocks allocatable: every write of before the
        takeover there keeps its extent (overlaps and copies of a key within the region
        decided as the one-at-a-time rule does), the rest is free.  ``most``: blocks at
        most (default: a census's usual span).  Returns what the key pass needs of the
        region: its headers as the census left them, commit words, first block, blocks."""
        rec = self.rec
        assert rec is not None
        if rec.census == 0 and rec.origin:
            self._look_back()
        lo, count = rec.span(rec.census, most or CENSUS_REGIONS * rec.region)
        hi = lo + count
        headers, committed = self._read_region(lo, hi)
        live, done, stray = self._classify(headers, committed, lo)
        extents = self._extents(headers)
        # newest first (ties: lower block first), as the one-at-a-time rule reads them
        published = self._newest_first(headers, np.flatnonzero(done))
        won = self._reserve_values(headers, published, extents)
        unfinished = self._newest_first(headers, np.flatnonzero(live & ~done))
        held = self.alloc.reserve_many(headers.block[unfinished], extents[unfinished])
        lost = np.concatenate((published[~won], unfinished[~held], np.flatnonzero(stray)))
        for block in headers.block[lost].tolist():
            self._drop_copy(block)
        words = committed != 0  # commit words of nothing kept
        words[headers.block[published[won]] - lo] = False
        for block in rec.adopted:
            if lo <= block < hi:
                words[block - lo] = False
        for block in np.flatnonzero(words).tolist():
            self._set_commit(lo + block, 0)
        if len(headers):
            self._note_extent(int(extents[live].max(initial=0)))
        rec.census += count
        self.alloc.advance(rec.census)
        if rec.census == self.sb.nblocks and not self._extent_known:  # every extent seen
            self._extent_known = True
            self._write_extent()
        self.mem.sfence()  # no sabotage point: a clear lost in a crash is redone by the next scan
        kept = np.ones(len(headers), dtype=bool)
        kept[lost] = False
        left = replace(headers, **{f: getattr(headers, f)[kept] for f in _COLUMNS})
        return left, committed, lo, count

    def _keys_step(self, read: tuple[HeaderTable, np.ndarray, int, int] | None = None) -> None:
        """Know the keys of the next region the census has done: each committed value
        joins the index unless a grave or a newer copy of its key says otherwise; each
        write in flight is pending again, under its writer."""
        rec = self.rec
        assert rec is not None
        if read is None:
            lo, count = rec.span(rec.keys, min(rec.region, rec.census - rec.keys))
            headers, committed = self._read_region(lo, lo + count)
        else:  # the census's read of the region, just now
            headers, committed, lo, count = read
        live, done, _ = self._classify(headers, committed, lo)
        extents = self._extents(headers)
        # what the census held: a write it did not see (it read the table stale) never joins
        held = np.zeros(len(headers), dtype=bool)
        held[live] = self.alloc.held(headers.block[live], extents[live])
        for block in headers.block[live & ~held].tolist():
            self._drop_copy(block)
        live &= held
        done &= held
        values = self._newest_first(headers, np.flatnonzero(done))
        keys = headers.digest[values].tolist()
        index, graves = self.index, rec.graves
        known = np.fromiter((k in index or k in graves for k in keys), bool, len(keys))
        self._index_recovered(headers, values[~known], extents)
        for i in values[known].tolist():
            self._recover_copy(
                headers.digest[i].tobytes(),
                int(headers.block[i]),
                int(headers.version[i]),
                int(headers.length[i]),
                int(extents[i]),
            )
        self._recover_writes(headers, np.flatnonzero(live & ~done), extents)
        rec.keys += count
        self.counters["recovered_keys"] = len(self.index)
        self.mem.sfence()  # no sabotage point: a clear lost in a crash is redone by the next scan

    def _index_recovered(self, headers: HeaderTable, rows: np.ndarray, extents: np.ndarray) -> None:
        """Index values of keys met for the first time, as older than everything indexed
        (the LRU order's start), oldest first among themselves."""
        rows = rows[np.lexsort((headers.block[rows], headers.version[rows]))]
        blocks = headers.block[rows].tolist()
        versions = headers.version[rows].tolist()
        keys = headers.digest[rows].tolist()
        entries = map(
            Entry, blocks, extents[rows].tolist(), versions, headers.length[rows].tolist()
        )
        before = len(self.index)
        self.index.update(zip(keys, entries, strict=True))
        if before:
            for key in reversed(keys):
                self.index.move_to_end(key, last=False)
        self.by_block.update(zip(blocks, zip(keys, versions, strict=True), strict=True))

    def _recover_copy(self, digest: bytes, block: int, version: int, length: int, n: int) -> None:
        """A committed copy of a key the index or a grave knows, found by the scan (its
        extent reserved by the census): kept if it is the newest alive, else dropped."""
        rec = self.rec
        assert rec is not None
        e = self.index.get(digest)
        if rec.dead(digest, version) or (e is not None and e.version > version):
            self._drop_copy(block, n)
            return
        named = digest in self.ix.where
        if e is not None:  # an older copy found before (the newer one's commit was in flight)
            del self.index[digest]
            self._retire(e, None)
        self._index_copy(digest, Entry(block, n, version, length))
        if named:
            self.ix.put(digest, block, version)

    def _index_copy(self, digest: bytes, e: Entry) -> None:
        """A value of before the takeover joins the index, at the LRU order's start."""
        self.index[digest] = e
        self.index.move_to_end(digest, last=False)
        self.by_block[e.block] = (digest, e.version)

    def _recover_writes(self, headers: HeaderTable, rows: np.ndarray, extents: np.ndarray) -> None:
        """Writes found in flight: pending again under their writers (the census holds
        their extents); a slot of the pool index naming one goes."""
        rec = self.rec
        assert rec is not None
        writers = set()
        for i in self._newest_first(headers, rows).tolist():
            block = int(headers.block[i])
            self.pending[block] = Pending(
                headers.digest[i].tobytes(),
                int(headers.version[i]),
                int(headers.length[i]),
                int(extents[i]),
                int(headers.writer[i]),
                int(headers.writer_gen[i]),
                rec.expires,
            )
            writers.add((int(headers.writer[i]), int(headers.writer_gen[i])))
            key, version = headers.digest[i].tobytes(), int(headers.version[i])
            if self.ix.find(key) == (block, version):
                self.ix.drop(key)
        for who in writers & rec.unanswered.keys():  # rings adopted before the scan came
            self.forget_unanswered(*who, rec.unanswered[who])
        self.counters["recovered_writes"] = len(self.pending)

    def _reconcile_step(self) -> None:
        """Make the next buckets of the pool index name exactly what the index holds."""
        rec = self.rec
        assert rec is not None
        lo = rec.buckets
        hi = min(self.ix.nbuckets, lo + rec.region)
        got = self.ix.reconcile(lo, hi, lambda blocks: [self.by_block.get(b) for b in blocks])
        self.counters["index_repaired"] += got["dropped"]
        rec.buckets = hi
        if hi == self.ix.nbuckets:
            self.ix.loaded_all()
        self.mem.sfence()  # no sabotage point: a repair lost in a crash is redone by the next

    def _naming_step(self) -> None:
        """Name in the pool index the values no slot named (their insertion was lost in a
        crash); then recovery is over."""
        rec = self.rec
        assert rec is not None
        if rec.naming is None:  # the index names a subset of the keys: equal sizes, all named
            rec.naming = [] if len(self.ix) == len(self.index) else list(self.index)
        todo = rec.naming[-rec.region :]
        del rec.naming[-rec.region :]
        for d in todo:
            e = self.index.get(d)
            if e is None or d in self.ix.where:
                continue
            self.counters["index_repaired"] += 1
            if not self.ix.put(d, e.block, e.version):  # could not be placed
                self._retire(self.index.pop(d), None)
                self.counters["index_evictions"] += 1
        self.mem.sfence()  # no sabotage point: an insertion lost in a crash is redone
        if not rec.naming:
            self.rec = None
            self.counters["recovered_keys"] = len(self.index)

    # -- decisions ahead of the scan -----------------------------------------

    def _claim(self, block: int, n: int) -> bool:
        """Hold an extent the scan has not reached: the census holds it already below its
        frontier (a live header there kept its extent), else it is reserved now."""
        rec = self.rec
        assert rec is not None
        return rec.censused(block) or self.alloc.reserve(block, n)

    def _read_copy(self, block: int) -> tuple[BlockHeader | None, int]:
        """A block's header and commit word, read fresh."""
        sb = self.sb
        _recover_invalidate(self.mem, sb.block_header_offset(block), LINE)
        _recover_invalidate(self.mem, sb.block_commit_offset(block), 8)
        _recover_mfence(self.mem)
        header = parse_header(self.mem.load(sb.block_header_offset(block), LINE))
        word = int.from_bytes(self.mem.load(sb.block_commit_offset(block), 8), "little")
        return header, word

    def _settle(self, digest: bytes) -> None:
        """Before an operation on a key while the scan runs: bring the copy the pool
        index names (what readers get) into the index, or drop it, by the scan's rules.

        Afterwards the index's answer for the key is what it will be once the scan is
        done, as far as any copy a reader can see goes: the newest live copy, or none.
        """
        rec = self.rec
        assert rec is not None
        named = self.ix.find(digest)
        if named is None:
            return
        block, version = named
        e = self.index.get(digest)
        if e is not None and e.block == block and e.version == version:
            return
        if version >= rec.first or rec.scanned(block) or block in rec.adopted:
            self._name(digest)  # the slot names nothing the index holds: stale
            return
        header, word = self._read_copy(block)
        if (
            header is None
            or header.digest != digest
            or header.version != version
            or header.state != BlockState.PUBLISHED
            or word != version
        ):
            self._name(digest)  # a write in flight, or nothing: not a value to read
            return
        self._adopt_copy(digest, block, version, header.length)

    def _adopt_copy(self, digest: bytes, block: int, version: int, length: int) -> bool:
        """A committed copy of before the takeover met ahead of the scan: indexed (and
        named) if no grave and no newer copy known says otherwise, else cleared."""
        rec = self.rec
        assert rec is not None
        n = self.extent(length)
        e = self.index.get(digest)
        if rec.dead(digest, version) or (e is not None and e.version > version):
            self._drop_copy(block, n if rec.censused(block) else 0)
        elif self._claim(block, n):
            rec.adopted.add(block)
            if e is not None:
                del self.index[digest]
                self._retire(e, None)
            self._index_copy(digest, Entry(block, n, version, length))
            if self.ix.find(digest) != (block, version):
                self.ix.put(digest, block, version)
            return True
        else:  # its extent overlaps one held already: not a value
            self._drop_copy(block)
        self._name(digest)
        return False

    def _name(self, digest: bytes) -> None:
        """Make the pool index name what the index holds of a key (or nothing)."""
        e = self.index.get(digest)
        if e is None:
            self.ix.drop(digest)
        elif not self.ix.put(digest, e.block, e.version):
            self._retire(self.index.pop(digest), digest)
            self.counters["index_evictions"] += 1

    def _adopt_write(self, digest: bytes, block: int, version: int) -> Pending | None:
        """A COMMIT or ABORT of a block the scan has not reached: the write there, granted
        before the takeover, becomes pending now (a committed one is adopted as a value:
        its COMMIT was sent again); None if the block holds no such write."""
        rec = self.rec
        assert rec is not None
        if not 0 <= block < self.sb.nblocks or rec.scanned(block) or version >= rec.first:
            return None
        if block in rec.adopted:
            return None
        header, word = self._read_copy(block)
        if header is None or header.digest != digest or header.version != version:
            return None
        if header.state == BlockState.PUBLISHED and word == version:
            self._settle(digest)
            if self.index.get(digest) is None or self.index[digest].block != block:
                self._adopt_copy(digest, block, version, header.length)
            return None
        if header.state not in (BlockState.WRITING, BlockState.PUBLISHED):
            return None
        return self._adopt_pending(block, header)

    def _adopt_pending(self, block: int, header: BlockHeader) -> Pending | None:
        """A write in flight met ahead of the scan, pending again under its writer (None if
        its extent overlaps one held already)."""
        rec = self.rec
        assert rec is not None
        n = self.extent(header.length)
        if not self._claim(block, n):
            return None
        rec.adopted.add(block)
        pend = Pending(
            header.digest,
            header.version,
            header.length,
            n,
            header.writer,
            header.writer_gen,
            rec.expires,
        )
        self.pending[block] = pend
        return pend

    def _look_back(self) -> None:
        """Before the census's first region (not the pool's first block): the extents that
        begin before it and reach into it are decided now, ahead of the scan, so that none
        of their blocks is taken for free."""
        rec = self.rec
        assert rec is not None
        start = max(0, rec.origin - max(0, self.max_extent - 1))
        if start == rec.origin:
            return
        headers, committed = self._read_region(start, rec.origin)
        live, done, _ = self._classify(headers, committed, start)
        reach = headers.block + self._extents(headers) > rec.origin
        for i in np.flatnonzero(live & reach).tolist():
            block = int(headers.block[i])
            header, _ = self._read_copy(block)
            if header is None:
                continue
            if done[i]:
                self._adopt_copy(header.digest, block, header.version, header.length)
            elif self._adopt_pending(block, header) is None:
                self._drop_copy(block)

    def _bury(self, digest: bytes, keep: int) -> None:
        """Every copy of ``digest`` of before the takeover but ``keep`` is gone: in the
        scan's rules now and, through the log of graves, a successor's (recovery.py)."""
        rec = self.rec
        assert rec is not None
        rec.graves[digest] = (rec.first, keep)
        self.graves.append(digest, rec.first, keep)
        self.mem.sfence()  # no sabotage point yet: in the pool before the answer relying on it
