"""Native instructions (memops.c): the choices the model replaces and so cannot see."""

from __future__ import annotations

from beluga._native import _core
from beluga.coherence import ModelConfig
from tests.sabotage_checks.base import Violation


def memops_selfcheck(model: ModelConfig) -> None:
    """The native table flushes what plain stores wrote and never invalidates with CLWB."""
    problems = _core.memops_selfcheck()
    if problems:
        raise Violation("; ".join(problems))
    if _core.selected()["invalidate"] == "clwb":
        raise Violation("invalidate is CLWB, which keeps a stale line")
