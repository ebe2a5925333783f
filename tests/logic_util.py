"""Helpers the logic-area tests share (tests/test_logic_index.py, test_logic_server.py,
test_logic_client.py).

value_of (tests/test_store.py's) and reader (tests/test_index.py's) are repeated here:
importing those modules costs torch's import, and the cheap logic mutants run these
tests in fresh processes on every pytest run.
"""

from __future__ import annotations

import hashlib
import random

from beluga.coherence import digest
from beluga.kv import protocol as p
from beluga.pool import Pool
from tests.test_service import Harness


def value_of(key: str, size: int) -> bytes:
    """The bytes every test writes under a key: checkable by any reader."""
    return random.Random(hashlib.sha256(key.encode()).digest()).randbytes(size)


def remove_key(h: Harness, key: str) -> None:
    """REMOVE one key through the harness's service; it must have been there."""
    raw = h.svc.op_remove(h.request(p.StoreOp.REMOVE, p.encode_digests([digest(key.encode())])))
    assert p.decode_flags(raw) == [True]


def reader(pool: Pool) -> object:
    """A one-sided reader with no hint lines."""
    return pool.index_reader()
