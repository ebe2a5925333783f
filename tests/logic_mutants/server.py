"""Logic mutants of the metadata server: the version floor, the service, the allocator,
the grants of a batch that skips keys, and recovery (of a write in flight at a restart,
and while serving after a takeover).
"""

from __future__ import annotations

from tests.logic_mutants.base import BLOCKS, DYING, REC, RECI, SVC, SX, Mutant

# -- version floor
FLOOR: list[Mutant] = [
    Mutant(
        "floor-persists-the-version-not-the-floor",
        "version floor",
        "beluga/server/extents.py",
        'self.mem.nt_store(self.sb.service_offset, self.floor.to_bytes(8, "little"))',
        'self.mem.nt_store(self.sb.service_offset, self.version.to_bytes(8, "little"))',
        (SX + "test_a_restart_after_removes_and_refused_writes_reuses_no_version",),
        "versions handed out after the floor's write, then removed or refused, repeat",
        cheap=True,
    ),
    Mutant(
        "recover-ignores-the-floor",
        "version floor",
        "beluga/server/recovery.py",
        'stored = int.from_bytes(self.mem.load(sb.service_offset, 8), "little")',
        "stored = 0",
        (SX + "test_a_restart_after_removes_and_refused_writes_reuses_no_version",),
        "a restarted server counts from the headers alone: removed writes' versions repeat",
    ),
]


# -- service
SERVICE: list[Mutant] = [
    Mutant(
        "late-commit-accepted",
        "service",
        "beluga/server/service.py",
        "            elif pend.cancelled:  # too late",
        "            elif False:  # too late",
        (SVC + "test_an_expired_lease_cancels_the_write_but_quarantines_its_extent",),
        "a write whose lease ran out would be committed although its extent may be reused",
        cheap=True,
    ),
    Mutant(
        "dead-writer-waits-for-its-lease",
        "service",
        "beluga/server/service.py",
        "                gone = not alive[who]",
        "                gone = pend.cancelled and not alive[who]",
        (SVC + "test_a_dead_writer_within_its_lease_is_reclaimed_at_once",),
        "a dead writer's extent would stay reserved until its lease ran out",
    ),
    Mutant(
        "client-gone-frees-the-others",
        "service",
        "beluga/server/service.py",
        "            if pend.host == host_id:",
        "            if pend.host != host_id:",
        (SVC + "test_a_client_gone_frees_its_writes_only",),
        "a host leaving would free the writes of every other host",
    ),
    Mutant(
        "recover-trusts-a-sealed-header",
        "service",
        "beluga/server/recovery.py",
        "committed[rel] == headers.version",
        "headers.version == headers.version",
        (SVC + "test_a_late_seal_is_not_a_committed_value_after_a_restart",),
        "a value sealed after its lease ran out would come back as committed after a restart",
    ),
    Mutant(
        "retire-frees-leased-extents",
        "service",
        "beluga/server/extents.py",
        "        if e.lease_until > self.clock():",
        "        if e.lease_until < self.clock():",
        (SVC + "test_retired_extents_wait_out_their_read_leases",),
        "a removed value's extent would be reused while a read lease still covers it",
    ),
    Mutant(
        "evict-ignores-read-leases",
        "service",
        "beluga/server/extents.py",
        "            if e.lease_until <= now:\n                del self.index[digest]",
        "            if True:\n                del self.index[digest]",
        (SVC + "test_eviction_is_lru_and_waits_for_read_leases",),
        "eviction would take a leased value first",
    ),
    Mutant(
        "drop-ignores-the-version",
        "service",
        "beluga/server/service.py",
        "hit = e is not None and e.block == block and e.version == version",
        "hit = e is not None and e.block == block",
        (
            BLOCKS + "test_a_value_replaced_meanwhile_is_a_miss_and_is_not_dropped",
            SX + "test_a_drop_of_an_old_version_at_a_reused_block_keeps_the_new_value",
        ),
        "a reader's DROP of a corrupt old version would remove the good value replacing it",
    ),
    Mutant(
        "skip-present-ignores-writes-in-flight",
        "service",
        "beluga/server/service.py",
        "if skip and (digest in self.index or digest in writing):",
        "if skip and digest in self.index:",
        (BLOCKS + "test_a_key_another_writer_is_writing_is_in_flight_when_not_waited_for",),
        "a key another host is writing would be granted and written twice",
    ),
]


# -- allocator at the pool's last block
ALLOCATOR: list[Mutant] = [
    Mutant(
        "reserve-refuses-the-last-block",
        "allocator",
        "beluga/server/allocator.py",
        "(firsts <= self.nblocks - counts)",
        "(firsts < self.nblocks - counts)",
        (SX + "test_an_extent_ending_at_the_last_block_survives_a_restart",),
        "recovery would refuse an extent ending at the last block: a committed value is lost",
    ),
    Mutant(
        "reserve-many-ignores-overlaps",
        "allocator",
        "beluga/server/allocator.py",
        "tangled[ok] = overlapping(firsts[ok], counts[ok])",
        "tangled[ok] = False",
        (SVC + "test_reserve_many_decides_as_reserve_one_at_a_time",),
        "two recovered extents sharing a block would both be reserved: two values, one block",
        cheap=True,
    ),
    Mutant(
        "recover-ignores-copies-of-a-key",
        "service",
        "beluga/server/recovery.py",
        "if len(set(keys)) == len(keys):",
        "if True:",
        (SVC + "test_recovery_decides_as_one_header_at_a_time",),
        "after a crash during an overwrite both copies of a key would be kept, the older "
        "one's extent never freed",
    ),
    Mutant(
        "find-misses-a-run-at-the-end",
        "allocator",
        "beluga/server/allocator.py",
        "elif window.size >= count:",
        "elif window.size > count:",
        (SX + "test_a_run_as_long_as_the_pool_is_found",),
        "a free run exactly as long as the search window (the whole pool) is never found",
    ),
    Mutant(
        "find-takes-a-run-one-block-short",
        "allocator",
        "beluga/server/allocator.py",
        "long = np.flatnonzero(ends - starts >= count)",
        "long = np.flatnonzero(ends - starts >= count - 1)",
        (SVC + "test_a_search_finds_the_first_free_run_from_the_cursor",),
        "an extent would be granted over a run one block too short: its last block is "
        "another value's",
        cheap=True,
    ),
    Mutant(
        "allocate-refuses-the-last-free-blocks",
        "allocator",
        "beluga/server/allocator.py",
        "        if count > self.nfree:\n            return None",
        "        if count >= self.nfree:\n            return None",
        (SX + "test_an_extent_ending_at_the_last_block_survives_a_restart",),
        "an allocation of exactly the free blocks left would be refused",
    ),
]


# -- grants of an ALLOC batch that skips keys (committed, or in flight elsewhere)
SKIP_PRESENT: list[Mutant] = [
    Mutant(
        "announce-stops-at-the-first-skipped-key",
        "skip-present grants",
        "beluga/server/service.py",
        "                continue\n            self.mem.begin_write(",
        "                break\n            self.mem.begin_write(",
        (SX + "test_every_grant_of_a_batch_that_skips_keys_is_written_before_the_answer",),
        "the grants after a skipped key get no WRITING header: a server restarted before "
        "their writers' first store loses them and grants their blocks again",
        cheap=True,
    ),
    Mutant(
        "announce-without-the-writers-generation",
        "skip-present grants",
        "beluga/server/service.py",
        "                writer_gen=req.generation,",
        "                writer_gen=0,",
        (SX + "test_every_grant_of_a_batch_that_skips_keys_is_written_before_the_answer",),
        "a recovered grant of a stalled writer names no generation, so its lease alone "
        "decides: its blocks are freed (and reused) while the writer lives",
    ),
    Mutant(
        "skip-present-waits-for-cancelled-writes",
        "skip-present grants",
        "beluga/server/service.py",
        "return {pend.digest for pend in self.pending.values() if not pend.cancelled}",
        "return {pend.digest for pend in self.pending.values()}",
        (SX + "test_every_grant_of_a_batch_that_skips_keys_is_written_before_the_answer",),
        "a key whose write lost its lease (it never commits) is reported in flight to "
        "every save, until its stalled writer is seen gone",
    ),
    Mutant(
        "alloc-rollback-frees-skipped-grants",
        "skip-present grants",
        "beluga/server/service.py",
        "if g.block != p.NO_BLOCK:",
        "if True:",
        (SX + "test_a_batch_that_skips_keys_then_fails_gives_every_grant_back_and_says_why",),
        "a batch that skipped a key and then failed raises KeyError, not its own error, "
        "and keeps the grants after the skipped key",
    ),
]


# -- recovery of a write in flight at a restart: its writer's id, generation and lease
IN_FLIGHT: list[Mutant] = [
    Mutant(
        "recover-swaps-writer-and-generation",
        "recovery of a write in flight",
        "beluga/server/recovery.py",
        "                int(headers.writer[i]),\n                int(headers.writer_gen[i]),",
        "                int(headers.writer_gen[i]),\n                int(headers.writer[i]),",
        (
            SX + "test_a_write_in_flight_at_a_restart_is_still_its_writers_after_the_new_servers_"
            "tick",
        ),
        "a recovered write is judged by a writer that does not exist: freed at the new "
        "server's first tick, its live writer's COMMIT refused (an acknowledged-looking write "
        "lost; before, only process restarts and chaos rounds saw it, in tens of seconds)",
        cheap=True,
    ),
    Mutant(
        "recover-forgets-the-writers-generation",
        "recovery of a write in flight",
        "beluga/server/recovery.py",
        "                int(headers.writer_gen[i]),",
        "                0,",
        (
            SX + "test_a_write_in_flight_at_a_restart_is_still_its_writers_after_the_new_servers_"
            "tick",
        ),
        "a recovered write whose writer's generation is gone stays held for a whole lease "
        "(writer unknown), and one whose writer lives is freed once its lease runs out",
    ),
    Mutant(
        "recover-gives-no-write-lease",
        "recovery of a write in flight",
        "beluga/server/recovery.py",
        "expires=self.clock() + self.write_lease_s,",
        "expires=self.clock(),",
        (
            SX + "test_a_write_in_flight_at_a_restart_is_still_its_writers_after_the_new_servers_"
            "tick",
        ),
        "every recovered write is cancelled at the new server's first tick: a writer that "
        "sealed before the restart has its COMMIT refused",
    ),
]


# -- recovery while serving: writes resume at once after a takeover (issue 36)
RECOVERY: list[Mutant] = [
    Mutant(
        "claim-trusts-the-census-frontier",
        "recovery while serving",
        "beluga/server/settling.py",
        "return bool(rec.censused(block) and rec.held[block])",
        "return bool(rec.censused(block))",
        (REC + "test_a_write_met_on_blocks_the_census_freed_is_reserved_before_it_is_adopted",),
        "a commit of a write on blocks the census freed is acknowledged with its blocks "
        "free, and the next grant overwrites it",
    ),
    Mutant(
        "settle-ignores-the-slot-readers-see",
        "recovery while serving",
        "beluga/server/settling.py",
        "named = self.ix.find(digest)",
        "named = None",
        (REC + "test_an_overwrite_retires_the_old_copy_wherever_the_scan_is",),
        "an overwrite before the scan leaves the key's old copy readable by its block, and "
        "in the pool for a successor's recovery",
    ),
    Mutant(
        "graves-kept-only-in-memory",
        "recovery while serving",
        "beluga/server/settling.py",
        "self.graves.append(digest, rec.first, keep)",
        "rec.graves.get(digest)",
        (REC + "test_a_remove_survives_a_second_takeover_in_the_middle_of_recovery",),
        "a server taken over before its scan reached a removed key's copy dies with the "
        "grave: the next one brings the key back",
        cheap=True,
    ),
    Mutant(
        "grave-spares-no-copy",
        "recovery while serving",
        "beluga/server/recovery_state.py",
        "version < grave[0] and version != grave[1]",
        "version < grave[0]",
        (REC + "test_a_write_committed_during_recovery_outlives_a_second_takeover",),
        "a write committed during a recovery is dropped by the next server as one of the "
        "key's older copies",
    ),
    Mutant(
        "allocation-reaches-past-the-frontier",
        "recovery while serving",
        "beluga/server/allocator.py",
        "end = self.origin + (self.frontier if frontier is None else frontier)",
        "end = self.origin + (self.nblocks if frontier is None else frontier)",
        (REC + "test_the_allocator_allocates_below_its_frontier_and_reserves_beyond",),
        "a run is taken in blocks no scan has seen: they may hold a value or a write",
    ),
    Mutant(
        "commit-before-the-scan-refused",
        "recovery while serving",
        "beluga/server/service.py",
        "            if pend is None and scanning:  # granted before the takeover, not scanned "
        "yet?\n                pend = self._adopt_write(digest, block, version)",
        "            if pend is None and scanning:  # granted before the takeover, not scanned "
        "yet?\n                pend = None",
        (REC + "test_writes_in_flight_at_the_takeover_are_their_writers_before_the_scan",),
        "a write granted before the takeover is refused until the scan reaches its block",
    ),
    Mutant(
        "remove-of-an-unnamed-key-buries-nothing",
        "recovery while serving",
        "beluga/server/service.py",
        "            elif scanning:  # a copy the scan has not reached must not come back either",
        "            elif False:  # a copy the scan has not reached must not come back either",
        (REC + "test_a_remove_of_a_key_no_slot_names_keeps_its_copy_gone",),
        "a key whose only copy no slot names comes back once the scan finds it, after its "
        "REMOVE was answered",
    ),
    Mutant(
        "scan-keeps-the-older-copy",
        "recovery while serving",
        "beluga/server/recovery.py",
        "e.version > version):\n            if self.ix.find(digest) == (block, version):",
        "e.version < version):\n            if self.ix.find(digest) == (block, version):",
        (REC + "test_copies_of_a_key_found_apart_leave_the_newest",),
        "copies of a key found regions apart: the newer one (its commit landed) is dropped",
    ),
    Mutant(
        "census-frees-writes-in-flight",
        "recovery while serving",
        "beluga/server/recovery.py",
        "held = self.alloc.reserve_many(headers.block[unfinished], extents[unfinished])",
        "held = np.zeros(unfinished.size, dtype=bool)",
        (REC + "test_a_write_in_flight_the_scan_passed_is_still_its_writers",),
        "a write in flight at the takeover loses its extent to the census: its writer's "
        "stores land on whatever is granted there next",
    ),
    Mutant(
        "recovery-names-nothing-missing",
        "recovery while serving",
        "beluga/server/recovery.py",
        "            if e is None or d in self.ix.where:",
        "            if True:",
        (REC + "test_a_value_whose_slot_never_landed_is_named_once_recovery_ends",),
        "a value no slot named (its commit's slot never landed) stays unreadable for good",
    ),
    Mutant(
        "pool-index-writes-a-bucket-it-never-read",
        "recovery while serving",
        "beluga/_native/mirror.c",
        "    load(m, x, b, 2);\n    if (!x->all_loaded)",
        "    if (!x->all_loaded)",
        (REC + "test_the_pool_index_loads_a_bucket_only_when_touched_and_keeps_its_other_slots",),
        "a new server's first put rewrites its buckets from an empty mirror: the other keys "
        "there go unreadable",
    ),
    Mutant(
        "claim-trusts-blocks-past-the-census",
        "recovery while serving",
        "beluga/server/settling.py",
        "return bool(rec.censused(block) and rec.held[block]) or self.alloc.reserve(block, n)",
        "return True",
        (REC + "test_writes_in_flight_at_the_takeover_are_their_writers_before_the_scan",),
        "a write adopted ahead of the census holds no blocks: they are free once it passes",
    ),
    Mutant(
        "census-does-not-look-back",
        "recovery while serving",
        "beluga/server/recovery.py",
        "        if rec.census == 0 and rec.origin:\n            self._look_back()",
        "        if False:\n            self._look_back()",
        (REC + "test_the_census_starts_where_allocation_was_and_holds_what_reaches_into_it",),
        "a value begun before the census's first block loses its last blocks to new writes",
    ),
    Mutant(
        "unanswered-grant-above-the-floor-kept",
        "recovery while serving",
        "beluga/server/recovery.py",
        "before = headers.version < rec.first",
        "before = headers.version >= 0",
        (REC + "test_a_header_at_or_above_the_floor_is_a_grant_never_answered",),
        "a grant nobody learned of (announced as the floor's raise was lost) is held forever",
    ),
    Mutant(
        "census-lets-a-buried-copy-win",
        "recovery while serving",
        "beluga/server/recovery.py",
        "dead = self._buried(headers, published)",
        "dead = np.zeros(published.size, dtype=bool)",
        (RECI + "test_a_graves_kept_copy_beats_a_newer_copy_the_grave_buried",),
        "a grave's kept copy (a COMMIT acknowledged during a recovery) loses to a newer "
        "copy whose COMMIT landed unanswered: the acknowledged write is gone",
    ),
    Mutant(
        "census-clears-the-copy-readers-get",
        "recovery while serving",
        "beluga/server/recovery.py",
        "        self._name_winners(headers, published, won)\n",
        "",
        (RECI + "test_a_landed_commit_beside_its_acknowledged_copy_never_hides_the_key",),
        "the census clears the acknowledged copy the pool index names before naming the "
        "newer one: readers miss the key until recovery ends",
    ),
    Mutant(
        "scan-names-an-older-copy-over-a-newer-one",
        "recovery while serving",
        "beluga/server/recovery.py",
        "        self._settle(digest)  # the copy readers get (maybe newer, not scanned yet)",
        "        pass  # the copy readers get (maybe newer, not scanned yet)",
        (RECI + "test_random_histories_across_takeovers_read_the_last_acknowledged_value",),
        "the scan puts a key's older copy into the slot of a newer one it has not reached: "
        "readers get the older value after the newer write was acknowledged",
    ),
    Mutant(
        "look-back-drops-the-slot-readers-use",
        "recovery while serving",
        "beluga/server/settling.py",
        "                self._settle(header.digest)  # the copy readers get first",
        "                pass  # the copy readers get first",
        (RECI + "test_random_histories_across_takeovers_read_the_last_acknowledged_value[481]",),
        "the census's look-back decides a copy without the one the pool index names and "
        "drops the key's slot: an acknowledged value goes unreadable",
    ),
    Mutant(
        "a-full-pool-refuses-before-scanning-keys",
        "recovery while serving",
        "beluga/server/extents.py",
        "            if self.rec is not None and self.rec.keys < self.sb.nblocks:\n"
        "                self.heartbeat()\n"
        "                self._keys_step()",
        "            if False:\n"
        "                self.heartbeat()\n"
        "                self._keys_step()",
        (RECI + "test_random_histories_in_a_full_pool_evict_and_remove_while_recovering",),
        "a full pool refuses grants while recovering although values it has not scanned "
        "yet could be evicted",
    ),
    Mutant(
        "a-grave-without-room-fails-the-remove",
        "recovery while serving",
        "beluga/server/settling.py",
        "            self._finish_keys()  # and the log goes",
        "            raise  # and the log goes",
        (RECI + "test_random_histories_in_a_full_pool_evict_and_remove_while_recovering",),
        "a REMOVE in a full pool while recovering fails after taking the key out of the "
        "index, its grave nowhere a successor would read it",
    ),
    Mutant(
        "a-new-write-gets-no-grave",
        "recovery while serving",
        "beluga/server/settling.py",
        "self._bury(digest, version if version < rec.first else 0)",
        "version < rec.first and self._bury(digest, version)",
        (RECI + "test_hostile_bytes_in_a_new_copys_header_bring_back_no_older_copy",),
        "hostile bytes in the header of a write acknowledged while recovering let a "
        "successor bring back the older copy it replaced: a stale read",
        cheap=True,
    ),
    Mutant(
        "a-held-extent-whose-header-is-lost-stays-held",
        "recovery while serving",
        "beluga/server/recovery.py",
        "        self._release_lost(lo, count, headers.block[held])\n",
        "",
        (RECI + "test_hostile_bytes_in_a_held_extents_header_hold_it_until_its_writers_are_gone",),
        "an extent the census held keeps its blocks after hostile bytes took its header: "
        "capacity leaks until the next takeover",
        cheap=True,
    ),
    Mutant(
        "a-held-extent-whose-header-is-lost-is-freed-at-once",
        "recovery while serving",
        "beluga/server/recovery.py",
        "                self.unreadable[block] = rec.held_extent(block)",
        "                self.alloc.release(block, rec.held_extent(block))",
        (RECI + "test_hostile_bytes_in_a_held_extents_header_hold_it_until_its_writers_are_gone",),
        "an extent the census held is freed when hostile bytes take its header, though the "
        "header may have been a live writer's, whose late stores then hit a new value",
        cheap=True,
    ),
    Mutant(
        "an-unreadable-header-is-taken-for-free",
        "recovery",
        "beluga/server/recovery.py",
        "            self._hold_unreadables(headers, marked, lo)",
        "            pass",
        (RECI + "test_hostile_bytes_in_a_writes_header_keep_its_blocks_from_a_new_grant",),
        "the census frees the blocks under a header nobody can read: a write in flight whose "
        "header took hostile bytes is granted again, and its writer overwrites the new value",
        cheap=True,
    ),
    Mutant(
        "the-look-back-takes-an-unreadable-header-for-free",
        "recovery while serving",
        "beluga/server/settling.py",
        "                self._hold_unreadable(last, self._marked, start=rec.origin)",
        "                pass",
        (RECI + "test_an_unreadable_write_reaching_past_the_census_start_is_held",),
        "a write in flight reaching into the census's start, its header unreadable, is not "
        "held by the look-back: its blocks there are granted again before the census wraps",
        cheap=True,
    ),
    Mutant(
        "unreadable-extents-freed-while-their-writers-may-live",
        "recovery",
        "beluga/server/extents.py",
        "        if any(self.writer_alive(host, gen) for host, gen in self._writers_before):",
        "        if False:",
        (RECI + "test_hostile_bytes_in_a_writes_header_keep_its_blocks_from_a_new_grant",),
        "blocks under an unreadable header are freed at the next tick, while the writer "
        "whose header it was may still store there",
        cheap=True,
    ),
    Mutant(
        "a-sealed-write-under-an-unreadable-header-is-refused",
        "recovery",
        "beluga/server/service.py",
        "            if pend is None and block in self.unreadable:  # its header reads again?",
        "            if False:  # its header reads again?",
        (RECI + "test_hostile_bytes_in_a_writes_header_keep_its_blocks_from_a_new_grant",),
        "a write whose WRITING header took hostile bytes before its writer sealed it is "
        "refused at COMMIT, though the seal made the header whole again",
        cheap=True,
    ),
    Mutant(
        "a-copy-freed-ahead-of-the-scan-is-freed-again",
        "recovery while serving",
        "beluga/server/settling.py",
        "                rec.unhold(block)  # freed now",
        "                pass  # freed now",
        (RECI + "test_a_held_copy_dropped_ahead_of_the_scan_is_not_freed_twice",),
        "a copy freed ahead of the scan is freed again by the scan of keys: blocks "
        "handed out since are freed under their new value",
        cheap=True,
    ),
    Mutant(
        "the-look-back-keeps-a-grant-nobody-learned-of",
        "recovery while serving",
        "beluga/server/settling.py",
        "            self.forget_unanswered(pend.host, pend.generation, ask)",
        "            pass",
        (RECI + "test_a_grant_nobody_learned_of_is_freed_when_the_look_back_meets_it",),
        "a grant whose answer never went out, met by the look-back after its writer's ring "
        "was adopted, stays pending (its blocks quarantined) until its writer leaves",
        cheap=True,
    ),
]


# -- a server whose host dies inside an operation (tests/test_dying_servers.py, 2026-12-06)
_SWEEP = DYING + "test_a_server_dying_inside_an_overwrite_while_recovering_keeps_the_key_readable"
DYING_SERVER: list[Mutant] = [
    Mutant(
        "a-torn-bucket-is-rewritten-empty",
        "a dying server",
        "beluga/_native/mirror.c",
        "            if (line.slot[j].tag) {",
        "            if (line.slot[j].tag && bl_ix_bucket_ok(&line)) {",
        (DYING + "test_a_bucket_line_a_dying_server_tore_still_names_its_keys",),
        "the next server to touch a bucket a dying server tore rewrites it empty: every key "
        "it named is a miss until recovery's last step",
        cheap=True,
    ),
    Mutant(
        "a-placed-key-is-rewritten-in-place",
        "a dying server",
        "beluga/_native/mirror.c",
        "    int64_t free = free_slot(x, b[0]);\n"
        "    if (free < 0)\n        free = free_slot(x, b[1]);",
        "    int64_t free = -1;",
        (_SWEEP + "[0]", _SWEEP + "[1]", _SWEEP + "[2]", _SWEEP + "[3]"),
        "a server that dies while it rewrites a key's slot in place can leave it torn: the "
        "slot names neither value, and the key is a miss",
    ),
    Mutant(
        "the-grave-lands-before-the-slot",
        "a dying server",
        "beluga/server/service.py",
        "            if scanning:\n                self._settle(digest)\n            new = Entry(",
        "            if scanning:\n                self._settle(digest)\n"
        "                self._bury_commit(digest, version)\n            new = Entry(",
        (_SWEEP + "[0]", _SWEEP + "[1]", _SWEEP + "[2]", _SWEEP + "[3]"),
        "a COMMIT's grave lands before its slot: a successor's census clears the copy "
        "readers get (dead by the grave) while the new one is named nowhere",
    ),
    Mutant(
        "a-key-is-found-at-its-first-slot",
        "a dying server",
        "beluga/_native/mirror.c",
        "if (x->state[at] == UNRESOLVED && x->slot[at].tag == *tag)",
        "if (x->state[at] == UNRESOLVED && x->slot[at].tag == *tag &&\n"
        "                    bl_ixm_slot_of(x, digest) < 0)",
        (DYING + "test_a_second_slot_a_dying_replacement_left_neither_hides_nor_outlives_the_key",),
        "a second slot of a key, left by a replacement that died half done, outlives the "
        "key's next acknowledged write: readers get the value before it",
        cheap=True,
    ),
    Mutant(
        "a-slot-is-confirmed-without-its-commit-word",
        "a dying server",
        "beluga/_native/mirror.c",
        "h.version == s.version &&\n            committed == s.version) {",
        "h.version == s.version) {",
        (DYING + "test_a_second_slot_a_dying_replacement_left_neither_hides_nor_outlives_the_key",),
        "a slot naming a write whose commit word never landed is taken for the key's value; "
        "the slot of the committed copy goes, and a LOOKUP leaves the key named nowhere",
        cheap=True,
    ),
    Mutant(
        "a-commit-sent-again-is-not-named",
        "a dying server",
        "beluga/server/service.py",
        "                    self._name(digest)  # a scan may have indexed it",
        "                    pass  # a scan may have indexed it",
        (DYING + "test_a_commit_sent_again_names_the_copy_a_scan_indexed_unnamed",),
        "a COMMIT sent again is acknowledged while its copy, indexed by the scan, is named "
        "nowhere: readers miss an acknowledged value until recovery's last step",
        cheap=True,
    ),
    Mutant(
        "a-commit-sent-again-leaves-no-grave",
        "a dying server",
        "beluga/server/service.py",
        "                    if scanning:\n"
        "                        self._bury_commit(digest, version)",
        "                    if False:\n                        self._bury_commit(digest, version)",
        (DYING + "test_a_commit_sent_again_while_recovering_buries_the_older_copies",),
        "a COMMIT sent again and acknowledged while recovering leaves no grave: hostile bytes "
        "in its header then let a successor bring back the value it replaced",
        cheap=True,
    ),
    Mutant(
        "a-named-copy-is-dropped-before-the-newer-is-named",
        "a dying server",
        "beluga/server/settling.py",
        "            self._name_first(digest)\n"
        "            held = rec.censused(block) and rec.held[block]\n"
        "            self._drop_copy(block, n if held else 0)\n",
        "            held = rec.censused(block) and rec.held[block]\n"
        "            self._drop_copy(block, n if held else 0)\n"
        "            self._name_first(digest)\n",
        (
            DYING + "test_a_server_dying_as_its_scan_drops_a_named_copy_keeps_the_key_readable[0]",
            DYING + "test_a_server_dying_as_its_scan_drops_a_named_copy_keeps_the_key_readable[1]",
            DYING + "test_a_server_dying_as_its_scan_drops_a_named_copy_keeps_the_key_readable[2]",
        ),
        "a scan drops the copy readers get before it names the newer one it indexed: a "
        "server that dies between them leaves the key named nowhere",
        cheap=True,
    ),
    Mutant(
        "a-grave-with-no-room-leaves-the-log",
        "a dying server",
        "beluga/server/settling.py",
        "        self.mem.sfence()\n        self._close_graves(rec)",
        "        self.mem.sfence()",
        (DYING + "test_a_grave_with_no_room_closes_the_log_so_no_older_grave_outlives_it",),
        "a grave that found no room for the log finishes the scan but leaves the log: a "
        "successor applies the key's older grave over an acknowledged copy",
        cheap=True,
    ),
    Mutant(
        "an-unknown-longest-extent-holds-one-block",
        "a dying server",
        "beluga/server/extents.py",
        "longest = max(1, self.max_extent) if self._extent_known else self.sb.nblocks",
        "longest = max(1, self.max_extent)",
        (
            DYING + "test_a_write_hostile_bytes_hit_keeps_its_blocks_while_no_server_knows_"
            "the_longest_extent",
        ),
        "while no server knew the longest extent, a hold under an unreadable header is one "
        "block: a grant takes the rest of a live write's blocks",
        cheap=True,
    ),
]

# -- the block -> key map as columns (BlockKeys, 2026-12-07): readers' hints fold through it
_HINTS = SVC + "test_readers_hints_reorder_the_lru_and_hints_naming_nothing_are_ignored"
BLOCK_KEYS: list[Mutant] = [
    Mutant(
        "a-hint-outside-the-pool-is-looked-up",
        "block keys",
        "beluga/server/service.py",
        "inside = np.flatnonzero(blocks < self.sb.nblocks)",
        "inside = np.arange(blocks.size)",
        (_HINTS,),
        "a hint ring is anyone's bytes: a hint naming a block past the pool's end is looked "
        "up, and the server's tick dies of an IndexError",
        cheap=True,
    ),
    Mutant(
        "a-hint-of-another-version-moves-the-key",
        "block keys",
        "beluga/server/service.py",
        "hit = has & ((versions & 0xFFFFFFFF) == vlows[inside])",
        "hit = has",
        (_HINTS,),
        "a hint of an older value at the same block (or stray bytes) makes the key there "
        "the most recently used, and eviction keeps the wrong keys",
        cheap=True,
    ),
]

# -- recovery's pace (2026-12-07): a busy server gives recovery its share, idle time earns
# none, and an operation that recovers keeps the seat's heartbeat
_PACE = REC + "test_a_busy_server_gives_recovery_its_share_and_an_idle_one_everything"
PACING: list[Mutant] = [
    Mutant(
        "a-busy-loop-takes-one-recovery-step-a-poll",
        "recovery pace",
        "beluga/server/recovery.py",
        "if self.rec is None or not served or rec.credit <= 0:",
        "if True:",
        (_PACE,),
        "the polls set recovery's pace, not its share: a busy server with long polls gives "
        "recovery a step each, and writes stay slow for minutes longer at the pod",
        cheap=True,
    ),
    Mutant(
        "idle-time-earns-recovery-credit",
        "recovery pace",
        "beluga/server/recovery.py",
        "if served:\n            rate = ",
        "if True:\n            rate = ",
        (_PACE,),
        "an idle spell banks a slice of steps that the first busy poll pays out, and a busy "
        "server's requests wait behind it",
        cheap=True,
    ),
    Mutant(
        "the-scan-finished-inside-a-commit-skips-the-heartbeat",
        "recovery pace",
        "beluga/server/settling.py",
        "self.heartbeat()  # minutes at the pod, inside one operation",
        "pass",
        (REC + "test_an_operation_that_recovers_heartbeats_before_each_step",),
        "a COMMIT that finishes the scan at once keeps no heartbeat for minutes at the pod: "
        "a standby fences the healthy server, and its successor may do the same again",
        cheap=True,
    ),
]


# -- the key index's cold part (KeyIndex, 2026-12-07): recovery's keys, no Entry each
_COLD = REC + "test_recovered_keys_stay_cold_and_go_first_but_a_key_looked_up_since_stays"
COLD_KEYS: list[Mutant] = [
    Mutant(
        "a-cold-key-looked-up-goes-to-the-start",
        "cold keys",
        "beluga/server/keyindex.py",
        "        if last:\n            self._warm[digest] = e",
        "        if not last:\n            self._warm[digest] = e",
        (_COLD,),
        "a key read since the takeover is moved before every key instead of after them: "
        "eviction takes the one key in use first",
        cheap=True,
    ),
    Mutant(
        "a-region-found-later-is-newer",
        "cold keys",
        "beluga/server/keyindex.py",
        "self._order.appendleft(chunk)",
        "self._order.append(chunk)",
        ("tests/test_keyindex.py::test_random_histories_agree_with_an_ordered_dict",),
        "a region's keys land after the keys indexed before them (warm ones' chunks "
        "included): eviction's order is no longer the one recovery gives",
        cheap=True,
    ),
    Mutant(
        "a-key-put-first-joins-its-group-last",
        "cold keys",
        "beluga/server/keyindex.py",
        "        group.keys.move_to_end(digest, last=False)\n",
        "",
        ("tests/test_keyindex.py::test_random_histories_agree_with_an_ordered_dict",),
        "keys recovery adopts ahead of its scan one after another keep the order they "
        "came in, not newest first: eviction no longer takes what recovery's order says",
        cheap=True,
    ),
    Mutant(
        "a-cold-value-replaced-keeps-its-old-length",
        "cold keys",
        "beluga/server/keyindex.py",
        "                was = int(chunk.lengths[row])\n",
        "                was = e.length\n",
        ("tests/test_keyindex.py::test_random_histories_agree_with_an_ordered_dict",),
        "the running sum of value bytes (stats' value_bytes) drifts each time a key "
        "recovery found is written again before anyone looked it up",
        cheap=True,
    ),
    Mutant(
        "the-naming-walk-skips-keys-moved-since",
        "cold keys",
        "beluga/server/keyindex.py",
        "else (c.digests[c.start :], c.alive[c.start :].copy())",
        "else (c.digests[c.start :], c.alive[c.start :])",
        (REC + "test_naming_makes_no_entry_for_keys_named_and_names_a_key_looked_up_meanwhile",),
        "recovery's naming step reads the cold part's live masks as they are now, not as "
        "they were when it began: a key a lookup took out of the cold part meanwhile is "
        "never named, and readers miss a key the index holds",
        cheap=True,
    ),
    Mutant(
        "the-naming-walk-drops-a-batch-edge",
        "cold keys",
        "beluga/server/keyindex.py",
        "            self._ends[-1] = lo\n",
        "            self._ends[-1] = lo - (lo > 0)\n",
        ("tests/test_keyindex.py::test_random_histories_agree_with_an_ordered_dict",),
        "the walk steps one key too far back after each batch: the key at every batch's "
        "edge is never looked at",
        cheap=True,
    ),
]
