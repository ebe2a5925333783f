# THEORY OF OPERATION
#
# Assumed: the configured memory (BELUGA_HW_DAX and/or BELUGA_HW_NUMA, see
# conftest.py) is reachable from this host with ordinary loads and stores.
#
# Checked, on this one host, each litmus role in its own process, with the
# real instructions (native mode): every correct recipe (store + flush before
# the flag, invalidate before the load, one writer per line, the block
# protocol's publish / read_validated) never observes a stale value or wrong
# data on this memory.  The block protocol must also really deliver data
# (not only misses).
#
# Not checked here: coherence *between* hosts, which needs two of them. Run
# 'beluga certify --role observer' on one host and '--role writer' on the
# other, both naming the same device; the observer's report holds the verdicts.
"""The correct coherence recipes on the device (see the THEORY OF OPERATION above)."""

from __future__ import annotations

import pytest

from beluga import litmus
from beluga.bench.certify import LITMUS_STRIDE, certify_pool
from beluga.pool import parse_spec

pytestmark = pytest.mark.hw

CORRECT = [name for name, p in litmus.PATTERNS.items() if not p.is_bug]
TRIALS = 300


@pytest.mark.parametrize("pattern", CORRECT)
def test_correct_recipe_holds_on_the_device(hw_target: str, pattern: str) -> None:
    with certify_pool(parse_spec(hw_target), LITMUS_STRIDE, force=True) as pool:
        result = litmus.run_local(
            pool.spec, pool.superblock.payloads.offset, pattern, TRIALS, mode="native"
        )
    assert not result.caught, (
        f"{pattern} saw a stale value or wrong data at trial {result.first_violation}: "
        "Beluga's coherence recipe does not hold on this memory"
    )
    assert result.confirmed > 0, f"{pattern} never observed a value it could judge"
