"""Logic mutants of the C core (beluga/_native): each one rebuilds the core in a scratch tree.

The read record a GPU load invalidates, the index reader's confirmation of a slot
against its block header and its bucket search, and its bounds on a slot naming a
block past the pool's last.
"""

from __future__ import annotations

from tests.logic_mutants.base import DYING, GPU, IX, Mutant

# -- the read record (C): what a GPU load invalidates (beluga/_native/record.c)
RECORD: list[Mutant] = [
    Mutant(
        "record-marks-all-but-the-last-granule",
        "read record",
        "beluga/_native/record.c",
        "g <= last && g < m->rec_count; g++)",
        "g < last && g < m->rec_count; g++)",
        (GPU + "test_a_gpu_load_invalidates_what_this_host_cached_and_nothing_else",),
        "the last granule a CPU read touched stays CLEAN: the GPU copies its stale lines",
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
]


# -- index reader (C): confirmation of a slot against the block header, bucket search
READER: list[Mutant] = [
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
    ),
    Mutant(
        "reader-prefix-stops-after-one-round",
        "index reader",
        "beluga/_native/index.c",
        "if (prefix && missed) {",
        "if (prefix) {",
        (IX + "test_a_prefix_settles_its_open_keys_round_by_round_up_to_its_first_miss",),
        "a prefix whose first round of open keys all hit would end there, shorter than stored",
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
]


# -- index slots naming a block past the pool's last (hostile or stray bytes)
FORGED_SLOTS: list[Mutant] = [
    Mutant(
        "reader-trusts-a-block-past-the-pool",
        "forged index slots",
        "beluga/_native/index.c",
        "if (e->tag != tag || e->block >= ix->nblocks || e->version == 0)",
        "if (e->tag != tag || e->version == 0)",
        (IX + "test_a_slot_naming_a_block_past_the_pools_last_is_a_miss_on_every_read_path",),
        "get and every key a batch settles alone would load a header past the mapping: the "
        "reading process dies",
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
]


# -- a bucket line a dying server tore (2026-12-06)
TORN: list[Mutant] = [
    Mutant(
        "reader-counts-a-torn-bucket-as-empty",
        "index reader",
        "beluga/_native/index.c",
        "        if (bl_ix_bucket_ok(&out[0]) && bl_ix_bucket_ok(&out[1]))\n            return;\n"
        "    }\n",
        "        if (bl_ix_bucket_ok(&out[0]) && bl_ix_bucket_ok(&out[1]))\n            return;\n"
        "    }\n    if (!bl_ix_bucket_ok(&out[0]))\n        memset(&out[0], 0, sizeof(out[0]));\n"
        "    if (!bl_ix_bucket_ok(&out[1]))\n        memset(&out[1], 0, sizeof(out[1]));\n",
        (DYING + "test_a_bucket_line_a_dying_server_tore_still_names_its_keys",),
        "a bucket line a dying server tore reads as empty: every key it names is a miss "
        "until a server rewrites the line",
    ),
]
