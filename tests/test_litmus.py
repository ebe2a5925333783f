"""Coherence litmus tests across processes under the non-coherent model.

Each process attaches the pool on its own (one emulated host, one private
cache).  Bugs must be caught within a bounded number of seeded trials; the
correct recipes must never be caught, over hundreds of randomized trials in
which the racy window is seen to occur, with the model's eviction off and on.
Where hosts race freely, the scheduler decides whether they meet in a round,
so such tests run seeded rounds until one does (:func:`rounds_until`).
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
#: rounds of a free race (each with a fresh seed) before a window that never came fails it
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


def rounds_until(
    run: Callable[[int], litmus.LitmusResult],
    hit: Callable[[litmus.LitmusResult], bool],
    never: str,
) -> litmus.LitmusResult:
    """Seeded rounds (``run(round)``) of hosts that race freely, until one shows ``hit``.

    Whether such hosts meet inside a window is the scheduler's to decide (a
    loaded machine may run one host's trials before the other's begin), so
    one round proves nothing either way, and a round that met proves what
    it met.  Fails with ``never`` and what each round saw when none of
    RACE_ROUNDS does.
    """
    seen = []
    for round_ in range(RACE_ROUNDS):
        result = run(round_)
        if hit(result):
            return result
        seen.append((result.violations, result.confirmed, result.raced))
    raise AssertionError(
        f"{never} in {RACE_ROUNDS} rounds ((violations, confirmed, raced) each: {seen})"
    )


def clean(result: litmus.LitmusResult) -> litmus.LitmusResult:
    """A round of a correct recipe, which must never be caught."""
    assert not result.caught, f"{result.pattern} caught at observation {result.first_violation}"
    return result


@pytest.mark.parametrize("pattern", BUGS)
@pytest.mark.parametrize("seed", [1, 2])
def test_each_bug_is_caught_under_the_model(area: tuple[str, int], pattern: str, seed: int) -> None:
    spec, base = area
    rounds_until(
        lambda r: litmus.run_local(
            spec, base, pattern, BUG_TRIAL_BOUND, seed=seed + 100 * r, model=model()
        ),
        lambda result: result.caught,
        f"{pattern} was never caught in {BUG_TRIAL_BOUND} trials",
    )


@pytest.mark.parametrize("pattern", STEPPED_CORRECT)
@pytest.mark.usefixtures("model_eviction")
def test_correct_recipes_are_never_caught(area: tuple[str, int], pattern: str) -> None:
    spec, base = area
    result = litmus.run_local(spec, base, pattern, 300, seed=3, model=model())
    assert not result.caught, f"{pattern} saw a stale value at trial {result.first_violation}"
    assert result.confirmed == 300


def test_dekker_with_mfence_holds_even_when_both_flags_cross(area: tuple[str, int]) -> None:
    spec, base = area
    rounds_until(  # raced: trials in which both raised their flags before either looked
        lambda r: clean(
            litmus.run_local(spec, base, "dekker", 200, seed=4 + 100 * r, model=model())
        ),
        lambda result: result.raced > 0,
        "the two hosts' flags never crossed",
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
    rounds_until(
        lambda r: clean(
            litmus.run_local(spec, base, "publish", 3000, seed=seed + 100 * r, model=model())
        ),
        lambda result: result.confirmed > 100 and result.raced > 0,
        "the reader never both read data and met a write in flight",
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
