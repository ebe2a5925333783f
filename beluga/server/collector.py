"""The garbage collector kept from pausing a server for long.

A server holds a few objects per key, and a full collection scans them all;
recovery makes them in bulk.  :func:`gc_paused` keeps collections out of
recovery's steps, and :func:`keep_collections_short` makes a server's full
collections scan only what is new.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while recovery makes its objects (a few per key, no
    cycles among them): a collection every few hundred allocations rescans them all,
    which took 70% of building 32 k entries on 2026-12-03.  After, they go straight to
    the oldest generation (``freeze`` then ``unfreeze``: no scan) instead of being
    scanned by the first young collections (52 ms at 65 k keys); a full collection
    still sees them, so nothing that later becomes garbage is kept.  In a process that
    keeps its collections short (a server's) they stay frozen, as all it built before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if _freeze_survivors not in gc.callbacks:
            gc.unfreeze()
        if enabled:
            gc.enable()


def keep_collections_short() -> None:
    """In a server's own process: full collections scan only what is new since the last.

    A full (oldest-generation) collection scans every object the process holds,
    and the service holds a few per key: 28 s extrapolated to the pod's 67 M
    keys (docs/notes/alignment.md), every RPC waiting.  The objects alive now (what
    recovery built) are frozen out of the collector (``gc.freeze``), and so are
    the survivors of every later full collection, so each scans only what was
    made since the one before.  Frozen objects are still freed by their
    reference counts (the service's entries hold no cycles); what is lost is the
    collection of a cycle that was alive at a full collection and became garbage
    later.  For ``beluga serve`` (server.serve), never for a library's host
    process (it would freeze the caller's objects too).
    """
    gc.freeze()
    if _freeze_survivors not in gc.callbacks:
        gc.callbacks.append(_freeze_survivors)


def _freeze_survivors(phase: str, info: dict[str, int]) -> None:
    """gc callback: after a full collection, its survivors leave the collector."""
    if phase == "stop" and info.get("generation") == 2:
        gc.freeze()
