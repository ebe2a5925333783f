"""What one litmus observation saw, and how a run's observations are counted."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Seen(enum.IntFlag):
    """What one observation found."""

    NOTHING = 0
    WRONG = 1  # a stale, lost or foreign value: the violation a bug pattern must show
    RIGHT = 2  # a value observed and correct
    RACED = 4  # the writer was caught mid-way (a reader refusing a torn block, two flags crossing)


def judge(correct: bool) -> Seen:
    """A value observed: RIGHT when it was the expected one, else WRONG."""
    return Seen.RIGHT if correct else Seen.WRONG


@dataclass(frozen=True)
class LitmusResult:
    """The outcome of one pattern's run, or of one crash sweep."""

    pattern: str
    trials: int
    violations: int
    first_violation: int | None
    confirmed: int = 0  # observations that saw a value and found it right
    raced: int = 0  # observations that caught the writer mid-way (the racy window occurred)

    @property
    def caught(self) -> bool:
        return self.violations > 0


class Tally:
    """Counts observations as a LitmusResult.

    Not thread-safe (one role's loop owns it); fork-safe (plain counters).
    """

    def __init__(self, pattern: str) -> None:
        self.pattern, self.looks, self.violations, self.confirmed, self.raced = pattern, 0, 0, 0, 0
        self.first: int | None = None

    def add(self, seen: Seen) -> bool:
        """Count one observation; True when it was a violation."""
        self.confirmed += bool(seen & Seen.RIGHT)
        self.raced += bool(seen & Seen.RACED)
        wrong = bool(seen & Seen.WRONG)
        if wrong:
            self.violations += 1
            self.first = self.looks if self.first is None else self.first
        self.looks += 1
        return wrong

    def result(self) -> LitmusResult:
        return LitmusResult(
            self.pattern, self.looks, self.violations, self.first, self.confirmed, self.raced
        )
