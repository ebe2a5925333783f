"""The logic mutants of tests/test_logic_mutation.py: one plausible one-line mistake each.

A mutant (``Mutant``, in ``base``) replaces an anchor that must occur exactly
once in one source file by its replacement, and names the pytest nodes that
catch it and why.  The mutants live by area: ``native`` (the C core: the read
record and the index reader), ``index`` (the index writer: cuckoo moves, scrub,
repair), ``server`` (version floor, service, allocator, skip-present grants,
recovery), ``hosts`` (liveness and grants, RPC, standby, seats, restarts) and
``client`` (store batching, tier, data path, identity, vLLM, corrupt values,
RETIRED, ``wait_s``, Mooncake).  ``MUTANTS`` is every one, in the catalogue's
order.

``EQUIVALENT`` lists mutants that were tried and removed because no test can
see them (they change no observable behaviour), each with the reason.
"""

from __future__ import annotations

from tests.logic_mutants import client, hosts, index, native, server
from tests.logic_mutants.base import FRAMEWORK_VENVS, Mutant

__all__ = ["EQUIVALENT", "FRAMEWORK_VENVS", "MUTANTS", "Mutant"]

MUTANTS: list[Mutant] = [
    *native.RECORD,
    *native.READER,
    *index.MOVES,
    *index.REPAIR,
    *server.FLOOR,
    *hosts.LIVENESS,
    *server.SERVICE,
    *server.ALLOCATOR,
    *client.BATCHING,
    *client.TIER,
    *client.DATA_PATH,
    *hosts.RPC,
    *hosts.STANDBY,
    *client.IDENTITY,
    *client.VLLM,
    # == the newest protocol code (issue 37): each area's mistakes, and the tests that hold it
    *server.SKIP_PRESENT,
    *native.FORGED_SLOTS,
    *client.TIER_SOME,
    *client.DROP_CORRUPT,
    *client.RETIRED,
    *client.WAIT,
    *client.MOONCAKE,
    *hosts.SEAT,
    *server.IN_FLIGHT,
    *hosts.RESTARTS,
    *server.RECOVERY,
    *server.DYING_SERVER,
    *native.TORN,
    *server.BLOCK_KEYS,
    *server.PACING,
    *server.COLD_KEYS,
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
