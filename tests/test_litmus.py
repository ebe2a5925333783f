"""Coherence litmus tests across processes under the non-coherent model.

Each process attaches the pool on its own (one emulated host, one private
cache).  Bugs must be caught within a bounded number of seeded trials; the
correct recipes must never be caught, over hundreds of randomized trials in
which the racy window is seen to occur, with the model's eviction off and on.
Crash sweeps look inside one write call: every state it passes through.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import pytest

from beluga import litmus
from beluga.coherence import LINE, ModelConfig, crc32c
from beluga.pool import Pool

BUGS = [name for name, p in litmus.PATTERNS.items() if p.is_bug]
CORRECT = [name for name, p in litmus.PATTERNS.items() if not p.is_bug]
STEPPED_CORRECT = [n for n in CORRECT if not litmus.PATTERNS[n].concurrent]
BUG_TRIAL_BOUND = 200
#: free races are retried, each round a fresh seed, until one hits its window; past this, fail
RACE_ROUNDS = 20


def model(**kw: float) -> ModelConfig:
    """The default model the bounds below assume, with the environment's eviction rate.

    (The ``model_eviction`` fixture runs the correct recipes with eviction on
    and off; the reordering rates stay the defaults, since a drain or refill
    rate of 0 or 1 removes the reordering a pattern is there to catch.)
    """
    return dataclasses.replace(ModelConfig(evict_rate=ModelConfig.from_env().evict_rate), **kw)


@pytest.fixture
def area(pool: Pool) -> Iterator[tuple[str, int]]:
    yield pool.spec, pool.superblock.payloads.offset


def race_until_hit(
    run: Callable[[int], litmus.LitmusResult], hit: Callable[[litmus.LitmusResult], bool]
) -> litmus.LitmusResult:
    """Run seeded rounds of a free race, each of which must be clean, until one hits its
    window (``hit``); the one that did.

    Whether hosts that race freely meet inside a window is the scheduler's to
    decide, so one round's count proves nothing either way; a round that did
    meet proves the recipe held there.  Fails, saying so, if none of
    RACE_ROUNDS does.
    """
    seen = []
    for round_ in range(RACE_ROUNDS):
        result = run(round_)
        assert not result.caught, f"round {round_}: caught at observation {result.first_violation}"
        if hit(result):
            return result
        seen.append((result.confirmed, result.raced))
    raise AssertionError(
        f"the racy window was never hit in {RACE_ROUNDS} rounds ((confirmed, raced) per round: "
        f"{seen}): the recipe was never tested against a write in flight"
    )


@pytest.mark.parametrize("pattern", BUGS)
@pytest.mark.parametrize("seed", [1, 2])
def test_each_bug_is_caught_under_the_model(area: tuple[str, int], pattern: str, seed: int) -> None:
    spec, base = area
    result = litmus.run_local(spec, base, pattern, BUG_TRIAL_BOUND, seed=seed, model=model())
    assert result.caught, f"{pattern} was not caught in {BUG_TRIAL_BOUND} trials"


@pytest.mark.parametrize("pattern", STEPPED_CORRECT)
@pytest.mark.usefixtures("model_eviction")
def test_correct_recipes_are_never_caught(area: tuple[str, int], pattern: str) -> None:
    spec, base = area
    result = litmus.run_local(spec, base, pattern, 300, seed=3, model=model())
    assert not result.caught, f"{pattern} saw a stale value at trial {result.first_violation}"
    assert result.confirmed == 300


def test_dekker_with_mfence_holds_even_when_both_flags_cross(area: tuple[str, int]) -> None:
    spec, base = area
    race_until_hit(  # raced: trials in which both raised their flags before either looked
        lambda r: litmus.run_local(spec, base, "dekker", 200, seed=4 + 100 * r, model=model()),
        lambda result: result.raced > 0,
    )


def test_a_polled_line_stays_stale_however_often_eviction_runs(area: tuple[str, int]) -> None:
    """Eviction spares a hot line: polling without invalidating never sees the flag."""
    spec, base = area
    evicting = model(evict_rate=1.0)  # an eviction attempt after every line touched
    bug = litmus.run_local(spec, base, "poll_no_invalidate", 20, seed=5, model=evicting)
    assert bug.caught
    right = litmus.run_local(spec, base, "poll_invalidate", 100, seed=5, model=evicting)
    assert not right.caught and right.confirmed == 100


@pytest.mark.parametrize("seed", [4, 5, 6])
@pytest.mark.usefixtures("model_eviction")
def test_publish_and_read_validated_never_return_wrong_data(
    area: tuple[str, int], seed: int
) -> None:
    spec, base = area
    race_until_hit(  # the reader really read data, and some of its reads met a write in flight
        lambda r: litmus.run_local(spec, base, "publish", 3000, seed=seed + 100 * r, model=model()),
        lambda result: result.confirmed > 100 and result.raced > 0,
    )


def test_the_twins_share_a_crc_and_differ_in_one_line_only() -> None:
    a, b = litmus.TWINS
    assert len(a) == len(b) == litmus.BLOCK_BYTES and a != b
    assert crc32c(a) == crc32c(b)
    differing = {i // LINE for i in range(len(a)) if a[i] != b[i]}
    assert len(differing) == 1  # so any line-wise mixture of the two is one of them


@pytest.mark.parametrize("pattern", ["crc_twins", "twins_recheck"])
@pytest.mark.usefixtures("model_eviction")
def test_the_seqlock_alone_keeps_equal_crc_versions_apart(
    area: tuple[str, int], pattern: str
) -> None:
    """Every trial holds the writer (or the reader) inside the window, so each is a race.

    crc_twins: the writer holds WRITING, then PUBLISHED, for a whole look of the
    reader each.  twins_recheck: each version after the first is written while
    the reader waits between its check and its copy, and the looks between
    windows see a settled block.  So the counts are certain, not likely.
    """
    spec, base = area
    trials = 300
    result = litmus.run_local(spec, base, pattern, trials, seed=7, model=model())
    assert not result.caught, f"another version's bytes at observation {result.first_violation}"
    assert result.confirmed >= trials - 1 and result.raced >= trials - 1, result


@pytest.mark.parametrize("sweep", list(litmus.SWEEPS))
@pytest.mark.usefixtures("model_eviction")
def test_every_state_inside_a_block_write_reads_as_a_miss_or_a_whole_version(sweep: str) -> None:
    """A crash sweep: the writer's host dies after each of its writes in turn, and another
    host reads equal-CRC twins: only the seqlock keeps the versions apart."""
    result = litmus.run_sweep(sweep, model(), seeds=range(8))
    assert not result.caught, f"another version's bytes in crash state {result.first_violation}"
    assert result.raced > 50 and result.confirmed >= 16  # misses mid-write, whole versions


def test_the_sweep_twins_share_a_crc_and_fit_the_write_combining_queue() -> None:
    a, b = litmus.SWEEP_TWINS
    assert len(a) == len(b) == 1024 and a != b and crc32c(a) == crc32c(b)


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
