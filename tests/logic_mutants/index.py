"""Logic mutants of the index writer: cuckoo moves and the scrub (its mirror, in C:
beluga/_native/mirror.c, rebuilt in a scratch tree) and the repair of the pool index after
a restart (beluga/server/index.py).
"""

from __future__ import annotations

from tests.logic_mutants.base import IX, Mutant

# -- cuckoo moves and the scrub of the index writer (beluga/_native/mirror.c)
MOVES: list[Mutant] = [
    Mutant(
        "move-releases-old-bucket-first",
        "cuckoo move",
        "beluga/_native/mirror.c",
        "        write_bucket(m, x, dst / BL_IX_SLOTS);\n        if (BL_STEP(INDEX_MOVE_FENCE))",
        "        clear(x, src);\n        write_bucket(m, x, src / BL_IX_SLOTS);\n"
        "        write_bucket(m, x, dst / BL_IX_SLOTS);\n        if (BL_STEP(INDEX_MOVE_FENCE))",
        (IX + "test_a_move_interrupted_between_its_two_writes_keeps_every_key",),
        "a crash after the old bucket let go and before the new one held it loses the key",
        cheap=True,
    ),
    Mutant(
        "move-chain-first-to-last",
        "cuckoo move",
        "beluga/_native/mirror.c",
        "for (int i = n - 1; i > 0; i--) {\n        uint64_t src = path[i - 1], dst = path[i];",
        "for (int i = 1; i < n; i++) {\n        uint64_t src = path[i - 1], dst = path[i];",
        (IX + "test_a_key_placed_through_a_chain_of_two_moves_keeps_every_key",),
        "moving the first entry first overwrites the next one before it moved: keys are lost",
    ),
    Mutant(
        "move-searches-from-first-bucket-only",
        "cuckoo move",
        "beluga/_native/mirror.c",
        "uint64_t other = b == b1 ? b2 : b1;",
        "uint64_t other = b2;",
        (IX + "test_a_key_placed_through_a_chain_of_two_moves_keeps_every_key",),
        "an entry in its second bucket would be 'moved' into the bucket it is in: keys collide",
    ),
    Mutant(
        "scrub-checks-only-torn-lines",
        "index writer",
        "beluga/_native/mirror.c",
        "if (!bl_ix_bucket_ok(&line) ||\n            memcmp(",
        "if (!bl_ix_bucket_ok(&line) ||\n            0 * memcmp(",
        (IX + "test_the_scrub_rewrites_a_whole_bucket_that_names_the_wrong_slots",),
        "a whole line with the wrong slots would never be rewritten from the mirror",
        cheap=True,
    ),
]


# -- index repair after a restart
REPAIR: list[Mutant] = [
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
]
