"""Decisions ahead of recovery's scan: a request on a key, or a COMMIT or ABORT of a
block, that the scan has not reached yet (the argument: :mod:`beluga.server.recovery`,
"Recovering while serving").

While keys are not all known, the metadata service settles each key a request
names (the copy the pool index names is adopted or cleared), adopts a write a
COMMIT or ABORT names, decides before the census's first region the extents
reaching into it, and writes a grave for a key it decides with copies of it
still unscanned.
"""

from __future__ import annotations

import numpy as np

from beluga.coherence import LINE, BlockHeader, BlockState, parse_header
from beluga.errors import CapacityError
from beluga.server.extents import Entry, ExtentKeeping, Pending
from beluga.server.recovery import _recover_invalidate, _recover_mfence


class Settling(ExtentKeeping):
    """The metadata service's decisions ahead of the scan (the module doc).  Not
    thread-safe, not fork-safe: the service's."""

    def _claim(self, block: int, n: int) -> bool:
        """Hold an extent the scan has not reached: the census holds it already if it held
        the write there (``RecoveryState.held``), else it is reserved now, if its blocks are
        free.  A block the census passed without holding a write there was freed, and may
        have been handed out since: the frontier alone says nothing of it.  (Every grant is
        announced before its answer and a line nobody can read is held as unreadable, so a
        write met there now is one the census cleared, whose writer sealed it since, or one
        no server granted: a stray host's or hostile bytes.)"""
        rec = self.rec
        assert rec is not None
        return bool(rec.censused(block) and rec.held[block]) or self.alloc.reserve(block, n)

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
        if version >= rec.first or rec.scanned(block) or rec.adopted[block]:
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
            self._name_first(digest)
            held = rec.censused(block) and rec.held[block]
            self._drop_copy(block, n if held else 0)
            if held:
                rec.unhold(block)  # freed now: the scan of keys must not free it again
            return False
        if self._claim(block, n):
            rec.adopted[block] = True
            if e is not None:
                del self.index[digest]
            self._index_copy(digest, Entry(block, n, version, length))
            if self.ix.find(digest) != (block, version):
                self.ix.put(digest, block, version)
                self.mem.sfence()  # readers get this copy before the older one is cleared
            if e is not None:
                self._retire(e, None)
            return True
        self._name_first(digest)  # its extent overlaps one held already: not a value
        self._drop_copy(block)
        return False

    def _name_first(self, digest: bytes) -> None:
        """Before a copy readers may get is cleared: the pool index names what the index
        holds of its key (or nothing), fenced.  Cleared first, a server killed between
        the two left the key named nowhere, its value unnamed until recovery's end
        (tests/test_dying_servers.py, 2026-12-06)."""
        self._name(digest)
        self.mem.sfence()  # no sabotage point: the crash fuzz and its test catch the order

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
        if rec.adopted[block]:
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

    def _unreadable_write(self, digest: bytes, block: int, version: int) -> Pending | None:
        """A COMMIT or ABORT naming a block held under an unreadable header: the write it
        names, if the header now reads as that write of before the takeover (its writer
        sealed it since)."""
        header, _ = self._read_copy(block)
        if header is None or header.digest != digest or header.version != version:
            return None
        return self._readable_again(block, header)

    def _adopt_pending(self, block: int, header: BlockHeader) -> Pending | None:
        """A write in flight met ahead of the scan, pending again under its writer (None if
        its extent overlaps one held already, or if it is a grant nobody learned of: a ring
        adopted before said so, ``forget_unanswered``, and it is freed)."""
        rec = self.rec
        assert rec is not None
        n = self.extent(header.length)
        if not self._claim(block, n):
            return None
        rec.adopted[block] = True
        pend = self.pending[block] = Pending.of(header, n, rec.expires)
        ask = rec.unanswered.get((pend.host, pend.generation))
        if ask is not None:  # its writer's ring was adopted before: did anyone learn of it?
            self.forget_unanswered(pend.host, pend.generation, ask)
            if block not in self.pending:
                return None
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
        headers, committed, marked = self._read_region(start, rec.origin)
        live, done, _ = self._classify(headers, committed, start)
        reach = headers.block + self._extents(headers) > rec.origin
        for i in np.flatnonzero(live & reach).tolist():
            block = int(headers.block[i])
            header, _ = self._read_copy(block)
            if header is None:
                continue
            if done[i]:
                self._settle(header.digest)  # the copy readers get first: maybe a newer one
                e = self.index.get(header.digest)
                if e is None or e.block != block:
                    self._adopt_copy(header.digest, block, header.version, header.length)
            elif self._adopt_pending(block, header) is None:
                self._drop_copy(block)
        lines = np.flatnonzero(marked)
        if lines.size:  # the last header before the start, if nobody can read it, may reach in
            last = start + int(lines[-1])
            if last not in headers.block and last + max(1, self.max_extent) > rec.origin:
                self._hold_unreadable(last, self._marked, start=rec.origin)

    def _bury(self, digest: bytes, keep: int) -> None:
        """Every copy of ``digest`` of before the takeover but ``keep`` is gone: in the
        scan's rules now and, through the log of graves, a successor's (recovery_state.py)."""
        rec = self.rec
        assert rec is not None
        if rec.keys == self.sb.nblocks:
            return  # every copy scanned and decided (the log is closed or about to be)
        if rec.graves.get(digest) == (rec.first, keep):
            return  # this very grave is in the log already (or the scan is finishing)
        rec.graves[digest] = (rec.first, keep)
        if rec.finishing:
            return  # the scan under way meets every copy left before any answer
        try:
            self.graves.append(digest, rec.first, keep)
        except CapacityError:  # a full pool has no room for the log: no copy left to bury,
            self._finish_keys()  # and the log goes: an older grave of this key in it would
            return  # outlive this decision (tests/test_dying_servers.py, 2026-12-06)
        self.mem.sfence()  # no sabotage point yet: in the pool before the answer relying on it

    def _bury_commit(self, digest: bytes, version: int) -> None:
        """A COMMIT acknowledged while the scan runs (or sent again and acknowledged):
        every copy of ``digest`` of before the takeover but this one, if it is one, is
        dead (a grave even for a new version: recovery.py's doc)."""
        rec = self.rec
        assert rec is not None
        self._bury(digest, version if version < rec.first else 0)

    def _finish_keys(self) -> None:
        """Scan every key left now (the census first where it is behind), fenced: a grave
        that found no room in the log is applied to every copy before its answer, and
        none is needed after, so the log goes now (a successor must not apply its older
        graves over this server's decisions).  Rare (a full pool while recovering) and
        as slow as a recovery at once of what is left."""
        rec = self.rec
        assert rec is not None
        rec.finishing = True
        try:
            while self._scanning():
                self.heartbeat()  # minutes at the pod, inside one operation
                if rec.keys == rec.census:
                    self._census_step()
                else:
                    self._keys_step()
        finally:
            rec.finishing = False
        self.mem.sfence()
        self._close_graves(rec)
