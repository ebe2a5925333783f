"""Tests aimed at the server logic that mutants survived (tests/logic_mutants/ names them).

Each builds the one situation the logic exists for and asserts the promise it
keeps, so a wrong comparison, order, key or position fails here for its own
reason, not by luck:

- a restart after removes and refused writes, versions checked for reuse;
- an extent ending at the pool's last block, surviving a restart, and a free run
  as long as the pool;
- a DROP of an old version at a block reused since;
- an ALLOC batch that skips keys (committed, or in flight elsewhere) among its grants,
  and one that then fails;
- a write in flight at a restart, judged by its writer's id and generation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from beluga.coherence import LINE, BlockState, digest, parse_header
from beluga.kv import protocol as p
from beluga.pool import Pool
from beluga.server.allocator import BlockAllocator
from tests.logic_util import remove_key, value_of
from tests.test_service import GEOMETRY, WRITER, Clock, Harness


@pytest.fixture
def small(shm_path: str) -> Iterator[Pool]:
    pool = Pool.create(shm_path, 12 << 20, geometry=GEOMETRY)
    yield pool
    pool.close()
    Pool.destroy(shm_path)


@pytest.fixture
def h(small: Pool) -> Harness:
    return Harness(small, Clock(), {WRITER}, write_lease_s=1.0, read_lease_s=0.0)


# -- the version floor ------------------------------------------------------------------------


@pytest.mark.leaves("keys", "writes")  # it ends holding grants: WRITING headers
def test_a_restart_after_removes_and_refused_writes_reuses_no_version(h: Harness) -> None:
    handed: list[int] = []
    for i in range(4):
        handed.append(h.put(f"kept{i}", b"k" * 100).version)
    for i in range(3):
        handed.append(h.put(f"gone{i}", b"g" * 100).version)
        remove_key(h, f"gone{i}")
    late = h.alloc("refused", 100)
    handed.append(late.version)
    h.write("refused", late, b"r" * 100)
    h.clock.now += 5  # past its write lease: cancelled, its COMMIT refused
    h.svc.tick()
    assert not h.commit("refused", late)
    aborted = h.alloc("aborted", 100)
    handed.append(aborted.version)
    h.svc.op_abort(
        h.request(
            p.StoreOp.ABORT, p.encode_commit([(digest(b"aborted"), aborted.block, aborted.version)])
        )
    )
    assert len(set(handed)) == len(handed)
    # the newest versions named nothing in the pool: only the floor remembers them
    h.svc = h.start()
    after = [h.alloc(f"new{i}", 100).version for i in range(5)]
    assert min(after) > max(handed), f"versions {sorted(set(after) & set(handed))} repeat"
    h.svc = h.start()  # and once more, with writes in flight at the restart
    again = [h.alloc(f"newer{i}", 100).version for i in range(3)]
    assert min(again) > max(after)


# -- the allocator at the pool's last block -------------------------------------------------


@pytest.mark.leaves("keys")
def test_an_extent_ending_at_the_last_block_survives_a_restart(small: Pool) -> None:
    """The pool is filled to its last block (no watermark eviction): the extent that ends
    there is found free, granted, and recovered."""
    opts = {"write_lease_s": 1.0, "high_watermark": 1.0, "low_watermark": 1.0}
    h = Harness(small, Clock(), {WRITER}, **opts)
    sb = h.pool.superblock
    n, bs = sb.nblocks, sb.block_size
    big = h.put("big", b"B" * ((n - 2) * bs))
    assert big.block == 0
    last = h.put("last", value_of("last", 2 * bs - 100))  # the two blocks left, at the end
    assert last.block + 2 == n, f"extent at {last.block}, not ending at block {n - 1}"
    assert h.lookup("big") is not None, "the pool's free end was not found: 'big' was evicted"
    h.svc = h.start()
    assert h.read("last") == value_of("last", 2 * bs - 100)
    loc = h.lookup("big")
    assert loc is not None and loc.block == 0
    assert h.svc.alloc.nfree == 0


def test_a_run_as_long_as_the_pool_is_found() -> None:
    """The search window is exactly the run: the whole pool, then the last two blocks."""
    alloc = BlockAllocator(8)
    assert alloc.allocate(8) == 0
    alloc.release(0, 8)
    assert alloc.allocate(6) == 0 and alloc.allocate(2) == 6
    assert alloc.nfree == 0 and alloc.allocate(1) is None


@pytest.mark.leaves("keys")
def test_a_drop_of_an_old_version_at_a_reused_block_keeps_the_new_value(h: Harness) -> None:
    """A reader found version 1 corrupt; the key was removed and written again into the
    same block since: its DROP names the old version, so the new value stays."""
    old = h.put("k", b"old" * 100)
    remove_key(h, "k")
    h.svc.alloc._cursor = old.block  # the allocator's next search starts at the freed block
    new = h.put("k", b"new" * 100)
    assert new.block == old.block and new.version != old.version
    drop = p.encode_commit([(digest(b"k"), old.block, old.version)])
    assert p.decode_flags(h.svc.op_drop(h.request(p.StoreOp.DROP, drop))) == [False]
    assert h.read("k") == b"new" * 100


# -- grants of a batch that skips keys ------------------------------------------------------


def _header(pool: Pool, block: int) -> Any:
    sb = pool.superblock
    return parse_header(pool.memory.load(sb.block_header_offset(block), LINE))


def _alloc_skipping(h: Harness, keys: Sequence[str], lengths: Sequence[int]) -> list[p.Grant]:
    """One ALLOC with ALLOC_SKIP_PRESENT, as a save without ``replace`` sends it."""
    items = [(digest(k.encode()), n, len(k)) for k, n in zip(keys, lengths, strict=True)]
    req = h.request(p.StoreOp.ALLOC, p.encode_alloc(items, p.ALLOC_SKIP_PRESENT))
    return p.decode_grants(h.svc.op_alloc(req))


@pytest.mark.leaves("keys")
def test_every_grant_of_a_batch_that_skips_keys_is_written_before_the_answer(h: Harness) -> None:
    """One ALLOC_SKIP_PRESENT batch whose keys are new, committed, in flight on another
    host, and repeated, in that mix: before its writer stores a byte, the header of each
    grant is WRITING with its key, version, length, writer and generation.  The server
    restarts then, the write leases run out, and the writer (alive, stalled) has stored
    nothing: the new server holds every grant, reuses none of their blocks, grants their
    keys again to a new save (a write whose lease ran out never commits), and frees them
    once the writer is seen gone."""
    other = (2, 3)
    h.alive.add(other)
    h.put("committed", b"c" * 100)
    elsewhere = h.alloc("elsewhere", 100, who=other)
    keys = ["n0", "committed", "n1", "elsewhere", "n2", "n2", "n3"]
    lengths = [1000 + 100 * i for i in range(len(keys))]
    grants = _alloc_skipping(h, keys, lengths)
    skipped = {1: p.PRESENT_COMMITTED, 3: p.PRESENT_WRITING, 5: p.PRESENT_WRITING}
    assert [g.present for g in grants] == [skipped.get(i, 0) for i in range(len(keys))]
    granted = {i: g for i, g in enumerate(grants) if not g.present}
    for i, g in granted.items():
        hd = _header(h.pool, g.block)
        assert hd is not None, f"no header for the grant of {keys[i]}"
        assert (hd.state, hd.digest, hd.version, hd.length, hd.key_len) == (
            BlockState.WRITING,
            digest(keys[i].encode()),
            g.version,
            lengths[i],
            len(keys[i]),
        ), keys[i]
        assert (hd.writer, hd.writer_gen) == WRITER, keys[i]
    h.svc = h.start()  # the server dies before the writer's first store
    h.clock.now += 5  # past every write lease; the writers live (stopped)
    h.svc.tick()
    held = {g.block for g in granted.values()} | {elsewhere.block}
    assert set(h.svc.pending) == held, "a grant was lost with its server"
    fresh = h.put("acknowledged", b"v" * 100, who=other)
    assert fresh.block not in held
    # a write whose lease ran out never commits: a save of its key writes it again
    (again,) = _alloc_skipping(h, ["n0"], [1000])
    assert again.present == 0 and again.block not in held
    h.alive.clear()
    h.svc.tick()
    assert not h.svc.pending and h.svc.stats()["blocks_used"] == 2


@pytest.mark.leaves("keys")
def test_a_batch_that_skips_keys_then_fails_gives_every_grant_back_and_says_why(
    h: Harness,
) -> None:
    """A batch that granted some keys and skipped a committed one, then meets a value larger
    than the pool: the value's own error, and no grant held or announced."""
    h.put("committed", b"c" * 100)
    limit = h.pool.superblock.nblocks * h.pool.superblock.block_size
    with pytest.raises(ValueError, match="exceeds the pool"):
        _alloc_skipping(h, ["n0", "committed", "n1", "huge"], [100, 100, 100, limit + 1])
    assert not h.svc.pending and h.svc.stats()["blocks_used"] == 1
    assert [g.present for g in _alloc_skipping(h, ["n0", "committed"], [10, 10])] == [
        0,
        p.PRESENT_COMMITTED,
    ]
    h.alive.clear()
    h.svc.tick()


# -- recovery of a write in flight at a restart ------------------------------------------


@pytest.mark.leaves("keys")
def test_a_write_in_flight_at_a_restart_is_still_its_writers_after_the_new_servers_tick(
    h: Harness,
) -> None:
    """Host 1 in generation 7 (alive) has sealed "a"; a write of "b" by the id's previous
    generation (gone) is in flight too.  The server restarts, and the new server ticks
    within the write lease, judging each recovered writer by the id and generation its
    header names: "a" stays its writer's and commits, "b"'s extent is freed at once."""
    gone = (WRITER[0], WRITER[1] - 1)
    a = h.alloc("a", 10)
    h.write("a", a, b"0123456789")
    h.begin("b", h.alloc("b", 10, who=gone), 10, who=gone)
    h.svc = h.start()
    assert h.svc.stats()["writes_in_flight"] == 2
    h.clock.now += 0.5  # within the write lease of 1 s
    h.svc.tick()
    assert h.svc.stats()["writes_in_flight"] == 1, "a dead generation's write was kept"
    assert h.commit("a", a), "the live writer's recovered write was taken from it"
    assert h.read("a") == b"0123456789"
    assert h.svc.stats()["blocks_used"] == 1
