"""The metadata service: the single owner of the index and the block allocator.

It runs on the server's one thread, so it needs no locks.  Data never passes
through it: clients write and read the pool themselves and only ask here
where things are.

State
  index      digest -> Entry(first block, extent, version, length, read lease),
             an OrderedDict in LRU order (oldest first)
  pending    first block -> a write in progress, under a write lease
  retiring   extents whose key is gone but whose read lease has not expired

Leases
  A write lease (ALLOC) lasts ``write_lease_s``; a writer that dies or stalls
  loses its extent when the lease expires, or at once when its host is seen
  dead.  A read lease (LOOKUP with LOOKUP_LEASE) keeps an extent from being
  evicted or reused for ``read_lease_s``; readers never depend on it for
  correctness (read_validated turns any reuse into a miss), only for fewer
  misses.

Eviction
  LRU, skipping leased entries: above ``high_watermark`` of the blocks in use
  the service evicts down to ``low_watermark``, and an allocation that does
  not fit evicts until it does.  When nothing can be evicted the allocation
  fails with CapacityError.

Recovery
  The pool, not the process, is the source of truth.  At start the service
  scans the block header table: published blocks become index entries (the
  newest version of a key wins; overlaps resolve to the newer extent), blocks
  still marked WRITING are held under a fresh write lease (so a writer that
  outlived the old server can still commit), everything else is free.
  A removed or evicted block has its header cleared, so it never comes back.
"""

from __future__ import annotations

import heapq
import json
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from beluga.coherence import LINE, BlockState, parse_header, write_line
from beluga.errors import CapacityError
from beluga.kv import protocol as p
from beluga.kv.allocator import BlockAllocator
from beluga.pool import Pool
from beluga.rpc import BatchHandler, Request, per_request

_CLEAR = bytes(LINE)
_MAGIC = np.frombuffer(b"BLKH", dtype="<u4")[0]


@dataclass
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
    host: int  # -1: found WRITING during recovery
    expires: float


class MetadataService:
    def __init__(
        self,
        pool: Pool,
        *,
        write_lease_s: float = 30.0,
        read_lease_s: float = 2.0,
        high_watermark: float = 0.95,
        low_watermark: float = 0.90,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
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
        self.alloc = BlockAllocator(self.sb.nblocks)
        self.index: OrderedDict[bytes, Entry] = OrderedDict()
        self.pending: dict[int, Pending] = {}
        self.retiring: list[tuple[float, int, int]] = []
        self.version = 0
        self.counters: Counter[str] = Counter()
        self.started = time.time()
        self.recover()

    # -- helpers -------------------------------------------------------------

    def extent(self, length: int) -> int:
        return max(1, -(-length // self.sb.block_size))

    def _clear_header(self, block: int) -> None:
        write_line(self.mem, self.sb.block_header_offset(block), _CLEAR)

    def _retire(self, e: Entry) -> None:
        """A key is gone: clear its header; free its extent once no read lease holds it."""
        self._clear_header(e.block)
        if e.lease_until > self.clock():
            heapq.heappush(self.retiring, (e.lease_until, e.block, e.nblocks))
        else:
            self.alloc.release(e.block, e.nblocks)

    def _evict_one(self) -> bool:
        now = self.clock()
        for digest, e in self.index.items():
            if e.lease_until <= now:
                del self.index[digest]
                self._retire(e)
                self.counters["evictions"] += 1
                return True
        return False

    def _allocate(self, nblocks: int) -> int:
        while (first := self.alloc.allocate(nblocks)) is None:
            if nblocks > self.alloc.nblocks or not self._evict_one():
                raise CapacityError(
                    f"no room for {nblocks} contiguous blocks: {self.alloc.used} of "
                    f"{self.alloc.nblocks} are in use and nothing can be evicted (all leased "
                    "or being written); retry later, remove keys, or use a bigger pool"
                )
        return first

    # -- operations ----------------------------------------------------------

    def op_alloc(self, req: Request) -> bytes:
        items = p.decode_alloc(req.payload)
        limit = self.sb.nblocks * self.sb.block_size
        granted: list[p.Grant] = []
        try:
            for digest, length, _key_len in items:
                if length > limit:
                    raise ValueError(
                        f"a value of {length} bytes exceeds the pool's {limit}-byte data area"
                    )
                n = self.extent(length)
                first = self._allocate(n)
                self.version += 1
                self.pending[first] = Pending(
                    digest, self.version, length, n, req.host_id, self.clock() + self.write_lease_s
                )
                granted.append(p.Grant(first, self.version))
        except BaseException:
            for g in granted:  # all or nothing
                pend = self.pending.pop(g.block)
                self.alloc.release(g.block, pend.nblocks)
            raise
        while self.alloc.used > self.high * self.alloc.nblocks:
            if not self._evict_one() or self.alloc.used <= self.low * self.alloc.nblocks:
                break
        return p.encode_grants(granted)

    def op_commit(self, req: Request) -> bytes:
        done = []
        for digest, block, version in p.decode_commit(req.payload):
            pend = self.pending.get(block)
            if pend is None or pend.digest != digest or pend.version != version:
                done.append(False)
                continue
            del self.pending[block]
            old = self.index.pop(digest, None)
            if old is not None:
                self._retire(old)
            self.index[digest] = Entry(block, pend.nblocks, version, pend.length)
            self.counters["puts"] += 1
            done.append(True)
        return p.encode_flags(done)

    def op_abort(self, req: Request) -> bytes:
        for digest, block, version in p.decode_commit(req.payload):
            pend = self.pending.get(block)
            if pend and pend.digest == digest and pend.version == version:
                del self.pending[block]
                self._clear_header(block)
                self.alloc.release(block, pend.nblocks)
        return b""

    def op_lookup(self, req: Request) -> bytes:
        flags, digests = p.decode_digests(req.payload)
        until = self.clock() + self.read_lease_s
        out: list[p.Location | None] = []
        for d in digests:
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
        for d in digests:
            e = self.index.pop(d, None)
            if e is not None:
                self._retire(e)
                self.counters["removes"] += 1
            found.append(e is not None)
        return p.encode_flags(found)

    def op_stats(self, req: Request) -> bytes:
        return json.dumps(self.stats()).encode()

    def handlers(self) -> dict[int, BatchHandler]:
        return {
            p.StoreOp.ALLOC: per_request(self.op_alloc),
            p.StoreOp.COMMIT: per_request(self.op_commit),
            p.StoreOp.ABORT: per_request(self.op_abort),
            p.StoreOp.LOOKUP: per_request(self.op_lookup),
            p.StoreOp.REMOVE: per_request(self.op_remove),
            p.StoreOp.STATS: per_request(self.op_stats),
        }

    # -- timers and hosts ----------------------------------------------------

    def tick(self) -> None:
        """Expire write leases and free retired extents whose read leases ran out."""
        now = self.clock()
        for block, pend in list(self.pending.items()):
            if pend.expires <= now:
                del self.pending[block]
                self._clear_header(block)
                self.alloc.release(block, pend.nblocks)
                self.counters["lease_expiries"] += 1
        while self.retiring and self.retiring[0][0] <= now:
            _, block, n = heapq.heappop(self.retiring)
            self.alloc.release(block, n)

    def client_gone(self, host_id: int) -> None:
        """A client host died: what it was writing goes back at once."""
        for block, pend in list(self.pending.items()):
            if pend.host == host_id:
                del self.pending[block]
                self._clear_header(block)
                self.alloc.release(block, pend.nblocks)
                self.counters["dead_writer_reclaims"] += 1

    def stats(self) -> dict[str, object]:
        bs = self.sb.block_size
        return {
            "capacity_bytes": self.sb.nblocks * bs,
            "used_bytes": self.alloc.used * bs,
            "block_size": bs,
            "blocks_total": self.sb.nblocks,
            "blocks_used": self.alloc.used,
            "keys": len(self.index),
            "value_bytes": sum(e.length for e in self.index.values()),
            "writes_in_flight": len(self.pending),
            "retiring_extents": len(self.retiring),
            "hits": self.counters["hits"],
            "misses": self.counters["misses"],
            "puts": self.counters["puts"],
            "removes": self.counters["removes"],
            "evictions": self.counters["evictions"],
            "lease_expiries": self.counters["lease_expiries"],
            "dead_writer_reclaims": self.counters["dead_writer_reclaims"],
            "recovered_keys": self.counters["recovered_keys"],
            "uptime_s": round(time.time() - self.started, 3),
        }

    # -- recovery ------------------------------------------------------------

    def recover(self) -> None:
        """Rebuild the index and the allocator from the block headers in the pool."""
        sb = self.sb
        table = sb.headers.offset
        self.mem.invalidate(table, sb.nblocks * LINE)
        self.mem.mfence()
        raw = np.frombuffer(self.mem.load(table, sb.nblocks * LINE), dtype=np.uint8)
        magic = raw.view("<u4")[:: LINE // 4]
        published, writing = [], []
        for block in np.flatnonzero(magic == _MAGIC).tolist():
            h = parse_header(raw[block * LINE : (block + 1) * LINE].tobytes())
            if h is None:
                continue
            self.version = max(self.version, h.version)
            if h.state == BlockState.PUBLISHED:
                published.append((h.version, block, h))
            elif h.state == BlockState.WRITING:
                writing.append((h.version, block, h))
        published.sort(key=lambda t: -t[0])
        for _, block, h in published:
            n = self.extent(h.length)
            if h.digest in self.index or not self.alloc.reserve(block, n):
                self._clear_header(block)  # an older copy, or overlapped by a newer extent
                continue
            self.index[h.digest] = Entry(block, n, h.version, h.length)
        self.index = OrderedDict(sorted(self.index.items(), key=lambda kv: kv[1].version))
        expires = self.clock() + self.write_lease_s
        for _, block, h in writing:
            n = self.extent(h.length)
            if self.alloc.reserve(block, n):
                self.pending[block] = Pending(h.digest, h.version, h.length, n, -1, expires)
            else:
                self._clear_header(block)
        self.counters["recovered_keys"] = len(self.index)
