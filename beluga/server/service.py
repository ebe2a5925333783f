"""The metadata service: the single owner of the index and the block allocator.

It runs on the server's one thread, so it needs no locks.  Data never passes
through it: clients write and read the pool themselves and only ask here
where things are.  Time is an input (``clock``), so leases, expiry and
eviction are tested in-process without sleeping.

It answers the client's requests (ALLOC, COMMIT, ABORT, LOOKUP, REMOVE,
DROP, RETIRED, STATS: :meth:`MetadataService.handlers`), keeps time (leases,
readers' hits, writers gone: :meth:`~MetadataService.tick`) and counts.  Its
other duties are parts of the same object, each in its own module: the life
of an extent (grants, commit words, the reuse rule, eviction) in
:mod:`beluga.server.extents`, recovery from the pool while serving (and the
argument for it) in :mod:`beluga.server.recovery`, and the decisions a request
forces ahead of recovery's scan in :mod:`beluga.server.settling`.

State
  index      digest -> Entry(first block, extent, version, length, read lease),
             in LRU order, oldest first (keyindex.KeyIndex: an OrderedDict's
             behaviour, the keys recovery found kept in numpy columns and a C
             table until an operation touches them); the same entries live
             in the pool's hash index (beluga.server.index), which this service
             alone writes and every host reads with loads, without an RPC
  by_block   first block -> the digest and version of the entry beginning
             there (extents.BlockKeys: numpy columns a block long, filled and
             looked up by the array in recovery; readers' hints name blocks)
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

Leases
  A write lease (ALLOC) lasts ``write_lease_s``.  A read lease (LOOKUP with
  LOOKUP_LEASE) keeps an extent from being evicted or reused for
  ``read_lease_s``: fewer misses, never correctness.

Hits
  One-sided readers record their hits and misses in their own hint lines
  (index.c); ``tick`` folds them in: a hit moves its key to the LRU end, and
  the counts join the statistics.
"""

from __future__ import annotations

import heapq
import itertools
import json
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable

import numpy as np

from beluga._native import step
from beluga.coherence import LINE, BlockState, Memory, parse_header
from beluga.kv import protocol as p
from beluga.pool import Pool
from beluga.rpc import BatchHandler, Request, per_request
from beluga.server.allocator import BlockAllocator
from beluga.server.extents import BlockKeys, Entry, Pending
from beluga.server.index import PoolIndex
from beluga.server.keyindex import KeyIndex
from beluga.server.recovery import Recovery, _recover_invalidate, _recover_mfence
from beluga.server.recovery_state import (
    RECOVERY_REGION,
    RECOVERY_SHARE,
    GraveLog,
    RecoveryState,
)
from beluga.server.settling import Settling

# defaults of the service's options (``beluga serve`` reads them from here)
WRITE_LEASE_S = 30.0
READ_LEASE_S = 2.0
HIGH_WATERMARK = 0.95
LOW_WATERMARK = 0.90
#: keys that left the index, kept for RETIRED (16 bytes each: 1 MiB)
RETIRED_KEEP = 65536
# a named sabotage point (beluga_native.h)
_commit_fence = step("SERVICE_COMMIT_FENCE", Memory.sfence)
_commit_word_fence = step("SERVICE_COMMIT_WORD_FENCE", Memory.sfence)


class MetadataService(Recovery, Settling):
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
        recovery_share: float = RECOVERY_SHARE,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``recover_now``: recover the whole pool before returning (a library's service,
        tests); False leaves it to :meth:`recover_some`, called while serving (a server:
        beluga.server.recovery).  ``recovery_region``: blocks a recovery step scans;
        ``recovery_share``: of a busy server's time, what recovery takes (0 < share < 1);
        ``timer``: the clock recovery's pace is kept by (seconds)."""
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
        if not 0 < recovery_share < 1:
            raise ValueError(
                f"recovery_share is a share of a busy server's time, above 0 and below 1, "
                f"not {recovery_share}"
            )
        self.recovery_share = recovery_share
        self.timer = timer
        #: called before each recovery step an operation runs itself (a full pool's
        #: census, or the scan of keys finished at once: minutes at the pod): the server
        #: heartbeats its seat with it, so no standby takes a server inside a long
        #: operation for a stalled one and fences it (raises if the seat was taken)
        self.heartbeat: Callable[[], None] = lambda: None
        self.alloc = BlockAllocator(self.sb.nblocks, frontier=0)
        self.index = KeyIndex()
        self.ix = PoolIndex(self.mem, self.sb)
        self.by_block = BlockKeys(self.sb.nblocks)  # first block -> (digest, version)
        self.pending: dict[int, Pending] = {}
        #: first block -> blocks held under a header nobody can read (extents.py's rule)
        self.unreadable: dict[int, int] = {}
        #: who may hold a host id, as (id, generation): the host table's grant lines
        #: (tests wire in their own); read once, when the first unreadable header is held
        self.writers_now: Callable[[], Iterable[tuple[int, int]]] = self._granted_writers
        self._writers_before: frozenset[tuple[int, int]] | None = None
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
        """Commit writes: each commit word first, fenced, then the pool index names each
        new copy and the copy it replaces is cleared, a grave while recovering, and one
        fence before the answer.

        The first fence keeps the pool index from naming a copy whose commit word is not
        in the pool: a server whose host dies between the two would leave readers a slot
        of a write a successor takes for one in flight (and frees if its writer aborts),
        the copy it replaced named nowhere.  Stores land in any order until a fence
        (tests/test_recovery_interleavings.py, CrashingHistory, 2026-12-06)."""
        scanning = self._scanning()
        items: list[tuple[bytes, int, int, Pending | bool | None]] = []
        for digest, block, version in p.decode_commit(req.payload):
            pend = self.pending.get(block)
            if pend is None and block in self.unreadable:  # its header reads again?
                pend = self._unreadable_write(digest, block, version)
            if pend is None and scanning:  # granted before the takeover, not scanned yet?
                pend = self._adopt_write(digest, block, version)
            if pend is None or pend.digest != digest or pend.version != version:
                items.append((digest, block, version, None))  # committed before? (below)
            elif pend.cancelled:  # too late: its writer has finished storing, so free it now
                self._free_pending(block)
                self.counters["late_commits_refused"] += 1
                items.append((digest, block, version, False))
            else:
                del self.pending[block]
                self._set_commit(block, version)
                items.append((digest, block, version, pend))
        if any(isinstance(it[3], Pending) for it in items):
            _commit_word_fence(self.mem)  # commit words before any slot names their copies
        done = []
        for digest, block, version, pend in items:
            if pend is None:  # already committed (the request was sent again to a restarted
                if scanning:  # server)?
                    self._settle(digest)
                e = self.index.get(digest)
                ok = e is not None and e.block == block and e.version == version
                if ok:  # acknowledged now: named, and a grave, as for any COMMIT (below);
                    self._name(digest)  # a scan may have indexed it where no slot named it
                    if scanning:
                        self._bury_commit(digest, version)
                done.append(ok)
                continue
            if pend is False:
                done.append(False)
                continue
            assert isinstance(pend, Pending)
            if scanning:
                self._settle(digest)
            new = Entry(block, pend.nblocks, version, pend.length)
            old = self.index.pop(digest, None)
            if not self._index(digest, new):  # only a new key (no slot yet) can fail
                self._retire(new, None)
                self.counters["index_full"] += 1
                done.append(False)
                continue
            if old is not None:  # the index points at the new value: the old one goes
                self._retire(old, None)
            if scanning:  # its key's copies not scanned yet lose to this one, now and later,
                # once the pool index names it: a grave that landed before the slot, its
                # server killed between them, made a successor clear the copy readers got
                # while the winner was named nowhere (CrashingHistory, 2026-12-06)
                self._bury_commit(digest, version)
            self.counters["puts"] += 1
            self.counters["puts_while_recovering"] += scanning
            done.append(True)
        _commit_fence(self.mem)  # every slot and clear is in the pool before the answer goes out
        return p.encode_flags(done)

    def op_abort(self, req: Request) -> bytes:
        scanning = self._scanning()
        for digest, block, version in p.decode_commit(req.payload):
            pend = self.pending.get(block)
            if pend is None and block in self.unreadable:
                pend = self._unreadable_write(digest, block, version)
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
        hints = self.ix.fold_hints()
        if not hints:
            return
        blocks, vlows = (np.array(c, dtype=np.uint64) for c in zip(*hints, strict=True))
        inside = np.flatnonzero(blocks < self.sb.nblocks)  # hints are anyone's bytes
        has, digests, versions = self.by_block.lookup(blocks[inside])
        hit = has & ((versions & 0xFFFFFFFF) == vlows[inside])
        for d in digests[hit].tolist():  # oldest hit first: the last one ends newest
            if d in self.index:
                self.index.move_to_end(d)

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
        self._release_unreadable()
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
            "value_bytes": self.index.value_bytes(),
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
            "unreadable_extents": len(self.unreadable),
            "unreadable_headers_held": self.counters["unreadable_headers_held"],
            "recovered_keys": self.counters["recovered_keys"],
            "puts_while_recovering": self.counters["puts_while_recovering"],
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
