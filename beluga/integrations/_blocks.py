"""The store's validated block read, for batches that may name one pool block twice.

``KVStore.read_blocks`` takes each pool block once (blocks of one call must
not overlap), but an engine can read one pool block into several places in
one batch: two vLLM requests of one step whose prefixes share a block, or a
framework batch that repeats a key.  :func:`read_blocks` hands the store each
block once, with every row of the table (rows that cover a block more than
once make the store checksum that block from the pool, as for a partial read).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from beluga.kv import BlockRef, KVStore


def read_blocks(
    store: KVStore, refs: Sequence[BlockRef], buffers: Sequence[Any], table: Any
) -> list[bool]:
    """``store.read_blocks`` where ``refs`` may repeat a block: True where a copy is valid.

    A block named by two refs of different versions (located at different
    times) is read as the first; the other ref is a miss.
    """
    first: dict[int, int] = {}
    unique: list[BlockRef] = []
    for ref in refs:
        if ref.block not in first:
            first[ref.block] = len(unique)
            unique.append(ref)
    valid = store.read_blocks(unique, buffers, table)
    if len(unique) == len(refs):
        return valid
    return [valid[first[r.block]] and unique[first[r.block]] == r for r in refs]
