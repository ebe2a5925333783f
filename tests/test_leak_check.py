"""The leak check of tests/conftest.py: what it reads in a pool, and when it reads it."""

from __future__ import annotations

from typing import Any

import pytest

from beluga import KVStore
from beluga.chaos.roles import Midway
from beluga.pool import Pool

from . import conftest
from .conftest import SMALL, PoolContents, pool_contents
from .test_store import server


def test_a_pool_reads_as_its_committed_keys_and_its_writes_in_flight(shm_path: str) -> None:
    pool = Pool.create(shm_path, 32 << 20, geometry=SMALL)
    spec = pool.spec
    try:
        with server(spec), KVStore(pool) as store:
            assert pool_contents(spec) == PoolContents(spec, keys=0, writes=0)
            store.put("a", b"x" * 100_000)  # an extent of two blocks is one key
            store.put("b", b"y")
            store.put("b", b"z")  # the new version replaces the old one

            class Abandoned(Exception):
                pass

            def look_while_writing(mem: Any, places: Any) -> None:  # "c" WRITING, uncommitted
                assert pool_contents(spec) == PoolContents(spec, keys=2, writes=1)
                raise Abandoned  # the save gives its extent back

            with pytest.raises(Abandoned):
                store.save(["c"], Midway([b"c" * 10], look_while_writing))
            assert store.remove("a") and store.remove("b")
            assert pool_contents(spec) == PoolContents(spec, keys=0, writes=0)
    finally:
        pool.close()
        Pool.destroy(spec)
    assert pool_contents(spec) is None  # no pool there any more


@pytest.mark.leaves("keys")  # the key this test leaves is the one it looks for
def test_a_destroyed_pool_is_read_before_it_goes(shm_path: str) -> None:
    pool = Pool.create(shm_path, 32 << 20, geometry=SMALL)
    spec = pool.spec
    with server(spec), KVStore(pool) as store:
        store.put("kept", b"v")
    pool.close()
    Pool.destroy(spec)  # the leak check's own Pool.destroy while a test runs
    assert conftest._let_go == [PoolContents(spec, keys=1, writes=0)]
