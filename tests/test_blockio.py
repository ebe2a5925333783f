"""Whole blocks through one table, checksummed as they move (``read_blocks`` / ``write_blocks``).

These are the calls behind every in-place read and write of KV: a corrupted,
replaced, torn or foreign payload is a miss for that block alone, whatever
order the table lists its pieces in.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from beluga.coherence import Memory, Miss, attach, crc32c, digest
from beluga.errors import CoherenceError
from beluga.pool import Geometry, Pool

#: blocks are sealed through Memory with no metadata server, so no commit word ever
#: names them: to the pool's tables they stay writes in flight (tests/conftest.py)
pytestmark = pytest.mark.leaves("writes")
GEOMETRY = Geometry(max_hosts=4, rpc_bytes_per_host=64 << 10, block_size=16 << 10)
PIECE = 1024  # bytes per row in the tables below


@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_crc_combine_is_the_crc_of_the_concatenation(a: bytes, b: bytes) -> None:
    from beluga._native import _core

    assert _core.crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


@pytest.fixture
def pool(shm_path: str) -> Iterator[Pool]:
    p = Pool.create(shm_path, 16 << 20, geometry=GEOMETRY)
    yield p
    p.close()
    Pool.destroy(shm_path)


def blocks_of(pool: Pool, first: int, count: int, length: int) -> list[dict]:
    sb = pool.superblock
    return [
        {
            "hdr": sb.block_header_offset(first + i),
            "payload": sb.block_payload_offset(first + i),
            "digest": digest(f"key-{first + i}".encode()),
            "version": 100 + first + i,
            "length": length,
        }
        for i in range(count)
    ]


def table_for(blocks: list[dict], shuffle: random.Random | None = None) -> np.ndarray:
    """Rows moving block i's payload to/from buffer 0 at i * length, PIECE bytes a row."""
    rows = [
        (0, i * b["length"] + off, b["payload"] + off, min(PIECE, b["length"] - off))
        for i, b in enumerate(blocks)
        for off in range(0, b["length"], PIECE)
    ]
    if shuffle:
        shuffle.shuffle(rows)
    return np.array(rows, dtype=np.uint64).reshape(-1, 4)


def write(mem: Memory, blocks: list[dict], data: np.ndarray, table: np.ndarray) -> None:
    for b in blocks:
        mem.begin_write(b["hdr"], b["payload"], b["digest"], b["version"], b["length"])
    mem.write_blocks(
        [data],
        table,
        [(b["hdr"], b["payload"], b["digest"], b["version"], b["length"], 3, 1, 2) for b in blocks],
    )


def read(mem: Memory, blocks: list[dict], table: np.ndarray, cap: int) -> tuple[list, np.ndarray]:
    out = np.zeros(sum(b["length"] for b in blocks), dtype=np.uint8)
    res = mem.read_blocks(
        [out],
        table,
        [(b["hdr"], b["payload"], b.get("cap", cap), b["digest"], b["version"]) for b in blocks],
    )
    return res, out


@pytest.mark.parametrize("order", ["in order", "shuffled"])
@pytest.mark.parametrize("mode", ["native", "model"])
def test_round_trip_with_pieces_in_any_order(pool: Pool, order: str, mode: str) -> None:
    rng = random.Random(7)
    blocks = blocks_of(pool, 3, 5, 10_000)
    data = np.frombuffer(rng.randbytes(50_000), dtype=np.uint8)
    with (
        Pool.attach(pool.spec, coherence=mode) as writer,
        Pool.attach(pool.spec, coherence=mode) as reader,
    ):
        write(writer.memory, blocks, data, table_for(blocks, rng if order == "shuffled" else None))
        for b in blocks:  # sealed: the header's CRC is the payload's
            raw = reader.memory.read_bytes(b["hdr"], b["payload"], 16 << 10, b["digest"], 0)
            assert isinstance(raw, bytes) and len(raw) == b["length"]
        shuffle = rng if order == "shuffled" else None
        res, out = read(reader.memory, blocks, table_for(blocks, shuffle), 16 << 10)
    assert res == [10_000] * 5
    assert out.tobytes() == data.tobytes()


def test_rows_that_run_across_adjacent_blocks(pool: Pool) -> None:
    """A block that fills its whole extent, next to another: one row covers both."""
    block_bytes = pool.superblock.block_size
    blocks = blocks_of(pool, 0, 2, block_bytes)
    data = np.frombuffer(random.Random(1).randbytes(2 * block_bytes), dtype=np.uint8)
    one_row = np.array([[0, 0, blocks[0]["payload"], 2 * block_bytes]], dtype=np.uint64)
    write(pool.memory, blocks, data, one_row)
    res, out = read(pool.memory, blocks, one_row, block_bytes)
    assert res == [block_bytes, block_bytes] and out.tobytes() == data.tobytes()


def test_a_corrupted_payload_is_a_miss_for_its_block_alone(pool: Pool) -> None:
    blocks = blocks_of(pool, 0, 3, 5000)
    data = np.frombuffer(random.Random(2).randbytes(15_000), dtype=np.uint8)
    table = table_for(blocks)
    write(pool.memory, blocks, data, table)
    hostile = attach(pool.mapping.buffer, "native")
    try:
        hostile.nt_store(blocks[1]["payload"] + 4321, b"\xff\x00")
        hostile.sfence()
    finally:
        hostile.release()
    res, out = read(pool.memory, blocks, table, 16 << 10)
    assert res == [5000, Miss.CHECKSUM, 5000]
    assert out[:5000].tobytes() == data[:5000].tobytes()
    assert out[10000:].tobytes() == data[10000:].tobytes()


def test_another_key_version_or_state_is_a_miss(pool: Pool) -> None:
    blocks = blocks_of(pool, 0, 4, 3000)
    data = np.zeros(12_000, dtype=np.uint8)
    write(pool.memory, blocks[:3], data[:9000], table_for(blocks[:3]))  # block 3: never written
    asked = [dict(b) for b in blocks]
    asked[0]["digest"] = digest(b"another key")
    asked[1]["version"] += 1
    res, _ = read(pool.memory, asked, table_for(asked), 16 << 10)
    assert res == [Miss.KEY, Miss.VERSION, 3000, Miss.MAGIC]


def test_a_partial_read_is_checked_against_the_whole_payload(pool: Pool) -> None:
    blocks = blocks_of(pool, 0, 1, 8000)
    data = np.frombuffer(random.Random(3).randbytes(8000), dtype=np.uint8)
    write(pool.memory, blocks, data, table_for(blocks))
    part = np.array([[0, 0, blocks[0]["payload"] + 100, 50]], dtype=np.uint64)
    res, out = read(pool.memory, blocks, part, 16 << 10)
    assert res == [8000] and out[:50].tobytes() == data[100:150].tobytes()


def test_reading_past_a_blocks_length_is_a_miss_for_it(pool: Pool) -> None:
    blocks = blocks_of(pool, 0, 2, 4000)
    write(pool.memory, blocks, np.zeros(8000, dtype=np.uint8), table_for(blocks))
    longer = [dict(blocks[0], length=6000), blocks[1]]
    res, _ = read(pool.memory, longer, table_for(longer), 16 << 10)
    assert res == [Miss.LENGTH, 4000]


def test_rows_outside_the_blocks_are_refused_before_anything_moves(pool: Pool) -> None:
    blocks = blocks_of(pool, 0, 1, 4000)
    write(pool.memory, blocks, np.zeros(4000, dtype=np.uint8), table_for(blocks))
    stray = np.array([[0, 0, pool.superblock.block_payload_offset(5), 64]], dtype=np.uint64)
    out = np.full(4000, 7, dtype=np.uint8)
    spec = [(blocks[0]["hdr"], blocks[0]["payload"], 16 << 10, blocks[0]["digest"], 100)]
    with pytest.raises(CoherenceError, match="outside every block"):
        pool.memory.read_blocks([out], stray, spec)
    assert (out == 7).all()
    with pytest.raises(CoherenceError, match="overlap"):
        pool.memory.read_blocks([out], table_for(blocks), spec * 2)
    with pytest.raises(CoherenceError, match="outside every block's payload"):
        pool.memory.write_blocks(
            [out],
            stray,
            [(blocks[0]["hdr"], blocks[0]["payload"], blocks[0]["digest"], 101, 4000, 0, 0, 0)],
        )
    with pytest.raises(CoherenceError, match="digest is 16 bytes"):
        pool.memory.read_blocks([out], table_for(blocks), [(0, 0, 10, b"short", 1)])


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 9000),
    st.integers(0, 2**32),
    st.floats(0, 1, exclude_max=True),
    st.binary(min_size=1, max_size=64),
)
def test_foreign_bytes_in_the_extent_are_never_sealed_in(
    length: int, seed: int, where: float, stray: bytes
) -> None:
    """What a stalled writer (or anyone) left in the extent is not what this writer meant:
    the seal's CRC is of the writer's source bytes, so the block reads as a miss, whatever
    the value's length and wherever in it foreign bytes land, however many."""
    import mmap

    data = np.frombuffer(random.Random(seed).randbytes(length), dtype=np.uint8)
    at = int(where * length)
    stray = stray[: length - at]
    if stray == data[at : at + len(stray)].tobytes():  # not foreign: make the first byte so
        stray = bytes([stray[0] ^ 0xFF]) + stray[1:]
    cap = (length + 4095) // 4096 * 4096
    b = {"hdr": 4096, "payload": 1 << 20, "digest": digest(b"k"), "version": 1, "length": length}
    buf = mmap.mmap(-1, 4 << 20)
    mem = Memory(buf)
    try:
        table = table_for([b])
        mem.begin_write(b["hdr"], b["payload"], b["digest"], b["version"], length)
        mem.write_blocks(
            [data], table, [(b["hdr"], b["payload"], b["digest"], b["version"], length, 0, 0, 0)]
        )
        mem.nt_store(b["payload"] + at, stray)  # a late stray store
        mem.sfence()
        res, _ = read(mem, [b], table, cap)
        assert res == [Miss.CHECKSUM]
    finally:
        mem.release()
        buf.close()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 9000), min_size=1, max_size=6), st.integers(0, 2**32))
def test_any_layout_of_pieces_round_trips(lengths: list[int], seed: int) -> None:
    import mmap

    buf = mmap.mmap(-1, 8 << 20)
    mem = Memory(buf)
    try:
        rng = random.Random(seed)
        blocks, off = [], 1 << 20
        for i, n in enumerate(lengths):
            blocks.append(
                {
                    "hdr": 4096 + 64 * i,
                    "payload": off,
                    "digest": digest(bytes([i])),
                    "version": i + 1,
                    "length": n,
                    "cap": (n + 4095) // 4096 * 4096,
                }
            )
            off += (n + 4095) // 4096 * 4096
        data = np.frombuffer(rng.randbytes(sum(lengths)), dtype=np.uint8)
        rows, pos = [], 0
        for b in blocks:  # random cut points within each block
            cuts = sorted({0, b["length"], *(rng.randrange(b["length"]) for _ in range(3))})
            rows += [(0, pos + a, b["payload"] + a, z - a) for a, z in itertools.pairwise(cuts)]
            pos += b["length"]
        rng.shuffle(rows)
        table = np.array(rows, dtype=np.uint64).reshape(-1, 4)
        write(mem, blocks, data, table)
        res, out = read(mem, blocks, table, 1 << 20)
        assert res == lengths and out.tobytes() == data.tobytes()
    finally:
        mem.release()
        buf.close()
