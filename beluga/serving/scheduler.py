"""Request routing across engines: by load alone, or by prefix affinity.

A scheduler sees each request as it arrives and names the engine that will
serve it, knowing only the outstanding work of each engine (prompt tokens
routed there and not finished).  It never learns what the cache holds.

``locality-free`` (Beluga's)
    the least outstanding work wins.  On a CXL pool every engine reaches every
    cached block at the same cost, so where a prefix was computed does not
    matter and load alone decides.
``locality-aware`` (the RDMA-era baseline)
    a request whose prefix (its first ``affinity_tokens`` tokens) was routed
    before goes to the same engine, whose local cache holds it; a new prefix
    goes to the least loaded engine.  Hits stay local, at the price of load
    imbalance when some documents are hotter than others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Scheduler(Protocol):
    name: str

    def route(self, token_ids: Sequence[int], outstanding: Sequence[int]) -> int:
        """The engine index for a request, given each engine's outstanding work."""
        ...


def least_loaded(outstanding: Sequence[int], routed: Sequence[int]) -> int:
    """The engine with the least outstanding work; ties go to the one routed to least."""
    if not outstanding:
        raise ValueError("no engines to route to")
    return min(range(len(outstanding)), key=lambda i: (outstanding[i], routed[i], i))


class LocalityFree:
    """Least outstanding work, wherever the prefix was computed."""

    name = "locality-free"

    def __init__(self, engines: int) -> None:
        self.routed = [0] * engines

    def route(self, token_ids: Sequence[int], outstanding: Sequence[int]) -> int:
        engine = least_loaded(outstanding, self.routed)
        self.routed[engine] += 1
        return engine


class LocalityAware:
    """Prefix affinity: a known prefix goes back to its engine; a new one to the least loaded."""

    name = "locality-aware"

    def __init__(self, engines: int, affinity_tokens: int = 64) -> None:
        if affinity_tokens < 1:
            raise ValueError(f"affinity_tokens must be >= 1, not {affinity_tokens}")
        self.routed = [0] * engines
        self.affinity_tokens = affinity_tokens
        self.home: dict[tuple[int, ...], int] = {}

    def route(self, token_ids: Sequence[int], outstanding: Sequence[int]) -> int:
        prefix = tuple(token_ids[: self.affinity_tokens])
        engine = self.home.get(prefix)
        if engine is None:
            engine = self.home[prefix] = least_loaded(outstanding, self.routed)
        self.routed[engine] += 1
        return engine


SCHEDULERS = {s.name: s for s in (LocalityFree, LocalityAware)}


def make_scheduler(name: str, engines: int) -> Scheduler:
    """A fresh scheduler by name (``locality-free`` or ``locality-aware``)."""
    try:
        cls = SCHEDULERS[name]
    except KeyError:
        raise ValueError(f"unknown scheduler {name!r}; choose from {sorted(SCHEDULERS)}") from None
    return cls(engines)
