"""Recovery: a new server rebuilds what it knows from the pool, while it serves.

This is the one place of the argument; the service's other parts
(:mod:`beluga.server.service`, :mod:`~beluga.server.extents`,
:mod:`~beluga.server.settling`) and the state a recovery keeps
(:mod:`beluga.server.recovery_state`: where it stands, the log of graves and
its format) point here.

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
  its loop: flat out while idle, ``RECOVERY_SHARE`` of a busy loop's time,
  at most ``RECOVERY_SLICE_S`` between two polls), and
  answers every operation from the first one:

  takeover   reads the service line (the version floor, the log of graves,
             the longest extent, where the last server allocated:
             recovery_state.py) and nothing that grows with the pool; the
             allocator, the pool index's mirror and the index start empty.
             Versions below the floor stored were handed out before; a
             header at or above it is a grant whose answer never went out
             (the floor is raised, fenced, before any answer names a version
             above it), cleared when met.
  census     region by region from where the last server allocated (wrapping
             at the pool's end), it holds the extent of every write of
             before the takeover as the rule above decides within the
             region, holds the blocks under a header nobody can read
             (extents.py's rule), and frees the rest: allocation takes only
             blocks the census has passed, so no extent is handed out
             twice, and an ALLOC that finds no room runs census steps
             before it evicts anything.  Its first region first decides the extents that
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
  the COMMIT was sent again).  Adopted blocks are skipped by the scan.  A
  block the census passed is held only if the census held a write there
  (``RecoveryState.held``), not because the census passed it: a header it
  read torn (a seal racing its read) was freed with its blocks, which may
  have been handed out since, so such a COMMIT is acknowledged only once
  its blocks are reserved again, still free, and refused otherwise.

  What the promises need:
  - a read is the committed bytes of the key or a miss: readers use the pool
    index and headers only, which the scan changes with the same stores and
    fences as any server; a copy a scan has not reached yet stays readable
    only if the pool index named it, as it was before the takeover;
  - an acknowledged write is never lost: its copy is named by the pool index
    (its COMMIT's slot was fenced before the answer) and its older copies were
    cleared, so the scan finds it newest, or a COMMIT during recovery makes it
    the newest decided (below);
  - a reader never misses a key while the scan decides between its copies:
    every decision of a copy first settles the copy the pool index names (it
    may be newer and not scanned yet: ``_recover_copy``, ``_look_back``), and
    the copy kept is named, fenced, before the other is cleared (the census's
    ``_name_winners``, ``_recover_copy``, ``_adopt_copy``); the census lets no
    copy a grave buried beat the grave's kept one (``_buried``);
  - a full pool while recovering: an ALLOC that finds no room after the
    census scans keys until it can evict one; a grave that finds no room for
    the log finishes the scan of keys instead (``_finish_keys``), so no answer
    relies on a grave a successor could not read;
  - a key this server changed while copies of it lie unscanned (a REMOVE or
    DROP, an eviction, any COMMIT) gets a grave: every copy of before the
    takeover but the one kept is dead when the scan meets it.  A commit of a
    new write needs one too, though its version is above every such copy:
    hostile bytes in its header would otherwise let a successor's scan bring
    back an older copy nobody had cleared yet (one whose COMMIT landed
    unanswered), a stale read of an overwritten key (the hostile-header
    histories of tests/test_recovery_interleavings.py, 2026-12-05).  A key
    gets one grave per recovery however often it is written (``_bury`` keeps
    no second copy of a grave it holds).  Graves are written to the pool (the log of
    graves, recovery_state.py) before the answer that relies on them, so a second
    takeover in the middle of a recovery applies them too; the log goes once
    every region's keys are scanned (every grave applied, the clears fenced);
  - stats while recovering count what is known (``recovering``,
    ``recovery_blocks_left``); a ring adopted before the scan reached its
    writer's grants has them asked about (``forget_unanswered``) when the
    scan finds them, as long as the ring keeps the requests.

Graves
  While a server recovers, it decides keys whose copies in the part
  of the pool it has not scanned yet it cannot see: a REMOVE of a key, a
  commit of a write granted before the takeover, an eviction.  Each such key
  gets a grave, ``(digest, below, keep)``: any copy of the key with a version
  below ``below`` other than ``keep`` is dead, wherever recovery finds it.
  The server checks its graves as it scans; and because the server can itself
  be taken over before it has scanned everything, the graves are also written
  to the pool before the answer that relies on them goes out, so that the
  next server applies them too (the second takeover in the middle of a
  recovery).  Without that, a copy the first server never reached (say, the
  older copy of a key whose overwrite was in flight when the last server but
  one died) would come back after a REMOVE of the key was answered.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np

from beluga._native import step
from beluga.coherence import LINE, BlockState, HeaderTable, Memory, parse_header_table
from beluga.server.allocator import BlockAllocator, overlapping
from beluga.server.collector import gc_paused
from beluga.server.extents import Entry, ExtentKeeping, Pending
from beluga.server.keyindex import KeyWalk
from beluga.server.recovery_state import (
    CENSUS_REGIONS,
    CURSOR_WORD,
    EXTENT_WORD,
    NAMING_ROWS,
    RECOVERY_REGION,
    RECOVERY_SLICE_S,
    RecoveryState,
)

_COLUMNS = ("block", "state", "version", "digest", "length", "writer", "writer_gen")
# named sabotage points (beluga_native.h): recovery's fresh reads of what a gone server stored
_recover_invalidate = step("SERVICE_RECOVER_INVALIDATE", Memory.invalidate)
_recover_mfence = step("SERVICE_RECOVER_MFENCE", Memory.mfence)


def _nonzero_lines(table: bytes) -> np.ndarray:
    """Which 64-byte lines of ``table`` are not all zero (a cleared header is)."""
    words = np.frombuffer(table, "<u8").reshape(-1, LINE // 8)
    acc = words[:, 0].copy()
    for i in range(1, LINE // 8):
        acc |= words[:, i]
    return acc != 0


class Recovery(ExtentKeeping):
    """The metadata service's recovery steps (the module doc): takeover, census, keys,
    buckets, naming.  Not thread-safe, not fork-safe: the service's."""

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

    def _buried(self, headers: HeaderTable, rows: np.ndarray) -> np.ndarray:
        """Which committed values (rows) a grave says are dead: a grave's kept copy must
        not lose to a newer copy the grave buried (a COMMIT landed without its answer,
        older than the grave)."""
        rec = self.rec
        assert rec is not None
        if not rec.graves:
            return np.zeros(rows.size, dtype=bool)
        keys = headers.digest[rows].tolist()
        versions = headers.version[rows].tolist()
        return np.fromiter(
            (k in rec.graves and rec.dead(k, v) for k, v in zip(keys, versions, strict=True)),
            dtype=bool,
            count=rows.size,
        )

    def _name_winners(self, headers: HeaderTable, rows: np.ndarray, won: np.ndarray) -> None:
        """Before the census clears a committed copy that a newer copy of its key beat (the
        newer one's COMMIT landed without its answer): if the pool index names the beaten
        copy, it names the winner first, fenced, so readers never miss the key."""
        if won.all():
            return
        winner: dict[bytes, int] = {}
        for i in rows[won].tolist():
            winner.setdefault(headers.digest[i].tobytes(), i)
        renamed = False
        for i in rows[~won].tolist():
            key = headers.digest[i].tobytes()
            j = winner.get(key)
            if j is None or self.ix.find(key) != (int(headers.block[i]), int(headers.version[i])):
                continue
            renamed |= self.ix.put(key, int(headers.block[j]), int(headers.version[j]))
        if renamed:
            self.mem.sfence()

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
        self.version = self.floor = self.takeover_floor = stored
        n = sb.nblocks
        self.max_extent = self._service_word(EXTENT_WORD)
        self._extent_known = self.max_extent > 0
        # the census starts where the last server allocated (free blocks are likely
        # there), and looks back max_extent blocks for extents reaching into its start
        hint = self._service_word(CURSOR_WORD) if self._extent_known else 0
        origin = hint - hint % region if hint < n else 0
        self.alloc = BlockAllocator(n, frontier=0, origin=origin)
        self.rec = RecoveryState(
            last=self.timer(),
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
        """A word of the service line (recovery_state.py; read fresh by the takeover)."""
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
        with gc_paused():
            while self.rec is not None:
                self._recover_step()

    def recover_some(self, served: int = 0) -> bool:
        """Bounded steps of recovery; whether more remains.

        The server's loop calls it between polls with how many requests its last poll
        served.  An idle server (``served`` 0) takes one step a call: flat out, as the
        loop calls again at once.  A busy one gives recovery ``recovery_share`` of its
        time: each second spent serving earns recovery share / (1 - share) seconds of
        steps, at most ``RECOVERY_SLICE_S`` at a time, and steps run while it has
        some (a step's overrun is paid back by the next).  Idle time earns nothing, so
        a server busy again after an idle spell neither owes recovery nor is owed by
        it.  Until 2026-12-07 a busy loop ran at most one step a poll (the polls, not
        the share, set the pace), and a share of the time since the takeover.
        """
        rec = self.rec
        if rec is None:
            return False
        now = self.timer()
        if served:
            rate = self.recovery_share / (1 - self.recovery_share)
            rec.credit = min(RECOVERY_SLICE_S, rec.credit + rate * max(0.0, now - rec.last))
            if rec.credit <= 0:
                rec.last = now
                return True
        with gc_paused():
            while True:
                self._recover_step()
                then, now = now, self.timer()
                if served:
                    rec.credit -= now - then
                if self.rec is None or not served or rec.credit <= 0:
                    break
        rec.last = now
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
        self._close_graves(rec)

    def _close_graves(self, rec: RecoveryState) -> None:
        """Once every region's keys are scanned (every grave applied, the clears fenced):
        the log of graves goes, so no successor applies a grave this server's later
        decisions outdate."""
        if rec.keys == self.sb.nblocks and (rec.graves or rec.unanswered or self.graves.nblocks):
            self.graves.close()
            rec.graves.clear()
            rec.unanswered.clear()

    def _read_region(self, lo: int, hi: int) -> tuple[HeaderTable, np.ndarray, np.ndarray]:
        """The valid headers of blocks [lo, hi) (absolute block numbers), their commit
        words, and which blocks' header lines are not all zero, read fresh."""
        sb = self.sb
        _recover_invalidate(self.mem, sb.block_header_offset(lo), (hi - lo) * LINE)
        _recover_invalidate(self.mem, sb.block_commit_offset(lo), (hi - lo) * 8)
        _recover_mfence(self.mem)
        table = self.mem.load(sb.block_header_offset(lo), (hi - lo) * LINE)
        headers = parse_header_table(table)
        marked = _nonzero_lines(table)
        committed = np.frombuffer(self.mem.load(sb.block_commit_offset(lo), (hi - lo) * 8), "<u8")
        return replace(headers, block=headers.block + lo), committed, marked

    def _marked(self, lo: int, hi: int) -> np.ndarray:
        """Which of blocks [lo, hi) have a header line not all zero, read fresh."""
        off = self.sb.block_header_offset(lo)
        _recover_invalidate(self.mem, off, (hi - lo) * LINE)
        _recover_mfence(self.mem)
        return _nonzero_lines(self.mem.load(off, (hi - lo) * LINE))

    def _hold_unreadables(self, headers: HeaderTable, marked: np.ndarray, lo: int) -> None:
        """Hold every extent of blocks [lo, ...) whose header line is marked but no header
        (hostile bytes, or a seal read torn): extents.py's rule, after the census decided
        the readable ones."""
        firsts = np.setdiff1d(np.flatnonzero(marked) + lo, headers.block, assume_unique=True)
        for block in firsts.tolist():
            self._hold_unreadable(block, self._marked)

    def _classify(
        self, headers: HeaderTable, committed: np.ndarray, lo: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Masks of a region's headers: live (a write of before the takeover, not decided
        ahead of the scan), committed among them, and stray (a version this server's
        floor says was never handed out: no grant's)."""
        rec = self.rec
        assert rec is not None
        ours = ~rec.adopted[headers.block]
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
        headers, committed, marked = self._read_region(lo, hi)
        live, done, stray = self._classify(headers, committed, lo)
        extents = self._extents(headers)
        # newest first (ties: lower block first), as the one-at-a-time rule reads them
        published = self._newest_first(headers, np.flatnonzero(done))
        dead = self._buried(headers, published)
        won = np.zeros(published.size, dtype=bool)
        won[~dead] = self._reserve_values(headers, published[~dead], extents)
        self._name_winners(headers, published, won)
        unfinished = self._newest_first(headers, np.flatnonzero(live & ~done))
        held = self.alloc.reserve_many(headers.block[unfinished], extents[unfinished])
        rec.hold(headers.block[published[won]], extents[published[won]])
        rec.hold(headers.block[unfinished[held]], extents[unfinished[held]])
        if len(headers) < np.count_nonzero(marked):
            self._hold_unreadables(headers, marked, lo)
        lost = np.concatenate((published[~won], unfinished[~held], np.flatnonzero(stray)))
        for block in headers.block[lost].tolist():
            self._drop_copy(block)
        words = committed != 0  # commit words of nothing kept
        words[headers.block[published[won]] - lo] = False
        words &= ~rec.adopted[lo:hi]
        for block in np.flatnonzero(words).tolist():
            self._set_commit(lo + block, 0)
        if len(headers):
            self._note_extent(int(extents[live].max(initial=0)))
        rec.census += count
        self.alloc.advance(rec.census)
        if rec.census == self.sb.nblocks and not self._extent_known:  # every extent seen
            # (a hold under an unreadable header is at least as long as its write)
            self.max_extent = max(self.max_extent, *self.unreadable.values(), 0)
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
            headers, committed, _ = self._read_region(lo, lo + count)
        else:  # the census's read of the region, just now
            headers, committed, lo, count = read
        live, done, _ = self._classify(headers, committed, lo)
        extents = self._extents(headers)
        # what the census held: a write it did not see (it read the table stale or torn, and
        # may have handed its blocks out since) never joins
        held = (rec.held[headers.block] != 0) & live
        for block in headers.block[live & ~held].tolist():
            if block not in self.unreadable:
                self._drop_copy(block)
                continue
            header, _ = self._read_copy(block)  # sealed since the census read it unreadable
            if header is not None:
                self._readable_again(block, header)
        self._release_lost(lo, count, headers.block[held])
        live &= held
        done &= held
        values = self._newest_first(headers, np.flatnonzero(done))
        known = self.index.known(headers.digest[values])
        if rec.graves:
            graves = rec.graves
            keys = headers.digest[values].tolist()
            known |= np.fromiter((k in graves for k in keys), bool, len(keys))
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

    def _release_lost(self, lo: int, count: int, live: np.ndarray) -> None:
        """Hand the extents the census held in blocks [lo, lo + count) whose header is no
        write now (``live``: the first blocks that are) and that nothing adopted to the
        rule for unreadable headers (extents.py): hostile bytes hit the header since (a
        valid header changes only by a write's seal, which keeps it live, or by a
        decision ahead of the scan, which adopts or unholds it).  The header may have
        been a write's, whose writer still stores: the extent is freed once the writers
        of before are gone.  (Before 2026-12-05 it stayed held until the next takeover;
        then, until 2026-12-06, it was freed at once, under that writer.)"""
        rec = self.rec
        assert rec is not None
        firsts = np.flatnonzero(rec.held[lo : lo + count]) + lo
        lost = firsts[~np.isin(firsts, live)]
        for block in lost.tolist():
            if not rec.adopted[block]:
                self.unreadable[block] = rec.held_extent(block)
                rec.unhold(block)
                self.counters["held_extents_lost"] += 1

    def _index_recovered(self, headers: HeaderTable, rows: np.ndarray, extents: np.ndarray) -> None:
        """Index values of keys met for the first time, as older than everything indexed
        (the LRU order's start), oldest first among themselves: cold keys, no Python
        object each until an operation touches one (keyindex.py)."""
        rows = rows[np.lexsort((headers.block[rows], headers.version[rows]))]
        self.index.add_cold(
            headers.digest[rows],
            headers.block[rows],
            extents[rows],
            headers.version[rows],
            headers.length[rows],
        )
        self.by_block.set_many(headers.block[rows], headers.digest[rows], headers.version[rows])

    def _recover_copy(self, digest: bytes, block: int, version: int, length: int, n: int) -> None:
        """A committed copy of a key the index or a grave knows, found by the scan (its
        extent reserved by the census): kept if it is the newest alive, else dropped.

        Readers keep getting the key throughout: the copy the pool index names (maybe
        newer, not scanned yet: an acknowledged COMMIT of the server before) is settled
        first, and the pool index names the copy kept before the other is cleared.  (It
        may name the older, acknowledged copy when the newer one's COMMIT landed without
        its answer; ``ix.find`` reads the key's two buckets.)
        """
        rec = self.rec
        assert rec is not None
        named = self.ix.find(digest)
        self._settle(digest)  # the copy readers get (maybe newer, not scanned yet) is known
        if named == (block, version):
            return  # this copy, decided by the settling (kept, or dropped for a newer one)
        e = self.index.get(digest)
        if rec.dead(digest, version) or (e is not None and e.version > version):
            if self.ix.find(digest) == (block, version):
                self._name(digest)  # readers get this copy: the kept one (or none) first
                self.mem.sfence()
            self._drop_copy(block, n)
            return
        named = self.ix.find(digest) is not None
        if e is not None:  # an older copy found before (the newer one's commit was in flight)
            del self.index[digest]
        self._index_copy(digest, Entry(block, n, version, length))
        if named:
            self._name(digest)
            self.mem.sfence()
        if e is not None:
            self._retire(e, None)

    def _index_copy(self, digest: bytes, e: Entry) -> None:
        """A value of before the takeover joins the index, at the LRU order's start."""
        self.index[digest] = e
        self.index.move_to_end(digest, last=False)
        self.by_block.set(e.block, digest, e.version)

    def _recover_writes(self, headers: HeaderTable, rows: np.ndarray, extents: np.ndarray) -> None:
        """Writes found in flight: pending again under their writers (the census holds
        their extents); a slot of the pool index naming one names the key's value instead,
        or goes (a server's host died between a COMMIT's stores, which land in any order
        until its fence)."""
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
            if self.ix.find(key) == (block, version):  # its slot landed, its commit word not:
                self._name(key)  # the copy the index holds, if any, as _settle does
        for who in writers & rec.unanswered.keys():  # rings adopted before the scan came
            self.forget_unanswered(*who, rec.unanswered[who])
        self.counters["recovered_writes"] = len(self.pending)

    def _reconcile_step(self) -> None:
        """Make the next buckets of the pool index name exactly what the index holds."""
        rec = self.rec
        assert rec is not None
        lo = rec.buckets
        hi = min(self.ix.nbuckets, lo + rec.region)
        got = self.ix.reconcile(lo, hi, self.by_block.lookup)
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
            rec.naming = KeyWalk([], []) if len(self.ix) == len(self.index) else self.index.walk()
        # the keys no slot names, a region's at most, from NAMING_ROWS looked at in C
        todo = rec.naming.next(NAMING_ROWS, rec.region, self.ix.where.among)
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
