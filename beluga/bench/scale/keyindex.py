"""The key index at the pod's size, measured rather than fitted: what an operation on a
key recovery adopted ahead of its scan costs the index, with as many cold chunks as the
pod has recovery regions.  A cost that grows with the chunks is invisible to a fit over
this machine's pools, which have a few dozen (it was: keyindex.py's front groups,
2026-12-08)."""

from __future__ import annotations

import time

import numpy as np

from beluga.server.extents import Entry
from beluga.server.keyindex import KeyIndex


def _with_chunks(regions: int, rng: np.random.Generator) -> KeyIndex:
    """A key index holding ``regions`` cold chunks of one key each, as recovery adds a
    region's keys in one call."""
    index = KeyIndex()
    one = np.ones(1, dtype=np.int64)
    for r in range(regions):
        digest = np.frombuffer(rng.bytes(16), dtype="V16")
        index.add_cold(digest, np.array([r]), one, np.ones(1, dtype=np.uint64), one)
    return index


def adopt_us(regions: int, keys: int = 20_000, seed: int = 0) -> float:
    """Microseconds a key for what an operation on a key adopted ahead of the scan does
    to the index (recovery.py's ``_index_copy``: indexed, then put before every key;
    then the operation's move to the end), with ``regions`` cold chunks in the index.
    The pod's chunks hold thousands of keys each; one key each here, as the order's
    structure pays for their count, not their size."""
    if regions < 0 or keys < 1:
        raise ValueError("adopt_us takes regions >= 0 and keys >= 1")
    rng = np.random.default_rng(seed)
    index = _with_chunks(regions, rng)
    digests = [rng.bytes(16) for _ in range(keys)]
    start = time.perf_counter()
    for i, d in enumerate(digests):
        index[d] = Entry(regions + i, 1, 1, 1)
        index.move_to_end(d, last=False)
        index.move_to_end(d)
    took = time.perf_counter() - start
    assert len(index) == regions + keys  # every key indexed once, none lost
    return 1e6 * took / keys


def evict_us(regions: int, keys: int = 2_000, seed: int = 0) -> float:
    """Microseconds an eviction spends in the index (``_evict_one``: the first entry,
    taken out), with ``regions`` cold chunks and ``keys`` keys adopted ahead of the scan
    before them (a front group: what eviction meets first)."""
    if regions < 1 or keys < 1:
        raise ValueError("evict_us takes regions >= 1 and keys >= 1")
    rng = np.random.default_rng(seed)
    index = _with_chunks(regions, rng)
    for i in range(keys):
        d = rng.bytes(16)
        index[d] = Entry(regions + i, 1, 1, 1)
        index.move_to_end(d, last=False)
    start = time.perf_counter()
    for _ in range(keys):
        digest, _e = next(iter(index.items()))
        del index[digest]
    took = time.perf_counter() - start
    assert len(index) == regions  # the adopted keys went, oldest first, and nothing else
    return 1e6 * took / keys
