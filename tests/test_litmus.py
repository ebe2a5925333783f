"""Coherence litmus tests across processes under the non-coherent model.

Each process attaches the pool on its own (one emulated host, one private
cache).  Bugs must be caught within a bounded number of seeded trials; the
correct recipes must never be caught, over thousands of randomized trials.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from beluga.coherence import litmus
from beluga.pool import Pool

BUGS = [name for name, p in litmus.PATTERNS.items() if p.is_bug]
CORRECT = [name for name, p in litmus.PATTERNS.items() if not p.is_bug]
BUG_TRIAL_BOUND = 200


@pytest.fixture
def area(pool: Pool) -> Iterator[tuple[str, int]]:
    yield pool.spec, pool.superblock.payloads.offset


@pytest.mark.parametrize("pattern", BUGS)
@pytest.mark.parametrize("seed", [1, 2])
def test_each_bug_is_caught_under_the_model(area: tuple[str, int], pattern: str, seed: int) -> None:
    spec, base = area
    result = litmus.run_local(spec, base, pattern, BUG_TRIAL_BOUND, mode="model", seed=seed)
    assert result.caught, f"{pattern} was not caught in {BUG_TRIAL_BOUND} trials"


@pytest.mark.parametrize("pattern", [p for p in CORRECT if p != "publish"])
def test_correct_recipes_are_never_caught(area: tuple[str, int], pattern: str) -> None:
    spec, base = area
    result = litmus.run_local(spec, base, pattern, 300, mode="model", seed=3)
    assert not result.caught, f"{pattern} saw a stale value at trial {result.first_violation}"
    assert result.confirmed == 300


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_publish_and_read_validated_never_return_wrong_data(
    area: tuple[str, int], seed: int
) -> None:
    spec, base = area
    result = litmus.run_local(spec, base, "publish", 3000, mode="model", seed=seed)
    assert not result.caught, f"wrong data returned at observation {result.first_violation}"
    assert result.confirmed > 100  # the reader really read data, not only misses


def test_native_mode_on_a_coherent_host_cannot_catch_the_bug(area: tuple[str, int]) -> None:
    """Why CI needs the model: the same missing flush goes unseen natively."""
    spec, base = area
    assert not litmus.run_local(spec, base, "no_flush", 100, mode="native").caught


def test_bad_arguments(pool: Pool) -> None:
    with pytest.raises(ValueError, match="unknown litmus pattern"):
        litmus.run_role(pool.memory, pool.superblock.payloads.offset, "nope", "writer", 1)
    with pytest.raises(ValueError, match="line-aligned"):
        litmus.run_role(pool.memory, 3, "flush", "writer", 1)
    with pytest.raises(ValueError, match="role"):
        litmus.run_role(pool.memory, pool.superblock.payloads.offset, "flush", "writer_b", 1)
