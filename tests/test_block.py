"""publish / read_validated: a miss is always a miss, never wrong data."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from beluga.coherence import (
    LINE,
    BlockState,
    Memory,
    Miss,
    digest,
    parse_header,
    parse_header_table,
    parse_headers,
)
from beluga.errors import CoherenceError

KEY = digest(b"key")
HDR, PAYLOAD, CAP = 0, 4096, 8192


@pytest.fixture(params=["native", "model"])
def hosts(request: pytest.FixtureRequest) -> tuple[bytearray, Memory, Memory]:
    shared = bytearray(1 << 16)
    return shared, Memory(shared, request.param, seed=1), Memory(shared, request.param, seed=2)


def test_round_trip_and_header_fields(hosts: tuple[bytearray, Memory, Memory]) -> None:
    shared, w, r = hosts
    data = os.urandom(5000)
    w.publish(HDR, PAYLOAD, KEY, 9, data, key_len=3, writer=4, stamp=77)
    out = bytearray(CAP)
    assert r.read_validated(HDR, PAYLOAD, CAP, KEY, 9, out) == 5000
    assert bytes(out[:5000]) == data
    assert r.read_validated(HDR, PAYLOAD, CAP, KEY, 0, out) == 5000  # 0: any version
    h = parse_header(bytes(shared[HDR : HDR + LINE]))
    assert h is not None
    assert (h.state, h.version, h.digest, h.length, h.key_len, h.writer, h.stamp) == (
        BlockState.PUBLISHED,
        9,
        KEY,
        5000,
        3,
        4,
        77,
    )


def test_each_kind_of_miss(hosts: tuple[bytearray, Memory, Memory]) -> None:
    shared, w, r = hosts
    out = bytearray(CAP)
    assert r.read_validated(HDR, PAYLOAD, CAP, KEY, 1, out) == Miss.MAGIC
    w.publish(HDR, PAYLOAD, KEY, 1, b"abc" * 100)
    assert r.read_validated(HDR, PAYLOAD, CAP, digest(b"other"), 1, out) == Miss.KEY
    assert r.read_validated(HDR, PAYLOAD, CAP, KEY, 2, out) == Miss.VERSION
    assert r.read_validated(HDR, PAYLOAD, 100, KEY, 1, out) == Miss.LENGTH
    shared[PAYLOAD + 5] ^= 0xFF  # corrupt the payload behind everyone's back
    assert r.read_validated(HDR, PAYLOAD, CAP, KEY, 1, out) == Miss.CHECKSUM


def test_buffer_too_small_is_an_error_that_names_the_size(
    hosts: tuple[bytearray, Memory, Memory],
) -> None:
    _, w, r = hosts
    w.publish(HDR, PAYLOAD, KEY, 1, bytes(300))
    with pytest.raises(CoherenceError, match="300 bytes"):
        r.read_validated(HDR, PAYLOAD, CAP, KEY, 1, bytearray(10))


def test_republish_is_seen_as_a_new_version(hosts: tuple[bytearray, Memory, Memory]) -> None:
    _, w, r = hosts
    out = bytearray(CAP)
    w.publish(HDR, PAYLOAD, KEY, 1, b"one")
    assert r.read_validated(HDR, PAYLOAD, CAP, KEY, 1, out) == 3
    w.publish(HDR, PAYLOAD, KEY, 2, b"two!")
    assert r.read_validated(HDR, PAYLOAD, CAP, KEY, 1, out) == Miss.VERSION
    assert r.read_validated(HDR, PAYLOAD, CAP, KEY, 2, out) == 4 and bytes(out[:4]) == b"two!"


def test_a_reader_without_invalidation_would_be_stale_but_protocol_is_not() -> None:
    shared = bytearray(1 << 16)
    w, r = Memory(shared, "model", seed=1), Memory(shared, "model", seed=2)
    out = bytearray(CAP)
    w.publish(HDR, PAYLOAD, KEY, 1, b"A" * 1000)
    assert r.read_validated(HDR, PAYLOAD, CAP, KEY, 1, out) == 1000  # r now caches lines
    w.publish(HDR, PAYLOAD, KEY, 2, b"B" * 1000)
    assert r.load(PAYLOAD, 4) == b"AAAA"  # a plain load is stale ...
    assert r.read_validated(HDR, PAYLOAD, CAP, KEY, 2, out) == 1000
    assert bytes(out[:1000]) == b"B" * 1000  # ... the protocol is not


def test_a_payload_written_in_place_is_sealed_and_read_whole(
    hosts: tuple[bytearray, Memory, Memory],
) -> None:
    _, w, r = hosts
    out = bytearray(CAP)
    data = os.urandom(3000)
    w.begin_write(HDR, PAYLOAD, KEY, 3, len(data))
    assert r.read_validated(HDR, PAYLOAD, CAP, KEY, 3, out) == Miss.STATE
    w.nt_store(PAYLOAD, data[:1000])  # the caller's own stores, in pieces, unfenced
    w.nt_store(PAYLOAD + 1000, data[1000:])
    w.seal(HDR, PAYLOAD, KEY, 3, len(data))  # fences them, checksums the pool's bytes
    assert r.read_validated(HDR, PAYLOAD, CAP, KEY, 3, out) == 3000
    assert bytes(out[:3000]) == data


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=LINE, max_size=LINE))
def test_header_parser_rejects_garbage(line: bytes) -> None:
    assert parse_header(line) is None


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=LINE, max_size=LINE), st.binary(max_size=512))
def test_garbage_in_a_block_is_a_miss_never_data(header: bytes, payload: bytes) -> None:
    shared = bytearray(1 << 14)
    shared[HDR : HDR + LINE] = header
    shared[PAYLOAD : PAYLOAD + len(payload)] = payload
    mem = Memory(shared)
    assert mem.read_validated(HDR, PAYLOAD, 4096, KEY, 0, bytearray(4096)) < 0


@settings(max_examples=200, deadline=None)
@given(st.integers(0, LINE - 1), st.integers(1, 255))
def test_any_flipped_header_byte_turns_a_hit_into_a_miss(pos: int, flip: int) -> None:
    shared = bytearray(1 << 14)
    mem = Memory(shared)
    mem.publish(HDR, PAYLOAD, KEY, 5, b"payload")
    shared[HDR + pos] ^= flip
    assert mem.read_validated(HDR, PAYLOAD, 4096, KEY, 5, bytearray(4096)) < 0
    assert parse_header(bytes(shared[HDR : HDR + LINE])) is None


def test_a_header_table_scan_finds_exactly_the_valid_headers() -> None:
    """parse_headers: what recovery and the chaos tools scan, one pass in C."""
    nblocks, block = 16, 1024
    shared = bytearray(nblocks * LINE + nblocks * block)
    mem = Memory(shared)
    table = {3: (digest(b"a"), 7), 4: (digest(b"b"), 8), 15: (digest(b"c"), 9)}
    for b, (d, version) in table.items():
        mem.publish(b * LINE, nblocks * LINE + b * block, d, version, os.urandom(100))
    mem.begin_write(9 * LINE, nblocks * LINE + 9 * block, digest(b"w"), 10, 50)
    shared[4 * LINE + 20] ^= 1  # torn: its own checksum fails
    shared[6 * LINE : 7 * LINE] = os.urandom(LINE)  # garbage
    found = parse_headers(bytes(shared[: nblocks * LINE]))
    assert [b for b, _ in found] == [3, 9, 15]
    assert [(h.state, h.digest, h.version) for _, h in found] == [
        (BlockState.PUBLISHED, digest(b"a"), 7),
        (BlockState.WRITING, digest(b"w"), 10),
        (BlockState.PUBLISHED, digest(b"c"), 9),
    ]
    assert [h for _, h in found] == [
        parse_header(bytes(shared[b * LINE : (b + 1) * LINE])) for b in (3, 9, 15)
    ]
    assert parse_headers(b"") == []
    with pytest.raises(CoherenceError, match="whole 64-byte lines"):
        parse_headers(bytes(LINE + 1))
    columns = parse_header_table(bytes(shared[: nblocks * LINE]))
    assert columns.block.tolist() == [b for b, _ in found]
    assert [
        (BlockState(s), v, d, n, w, g)
        for s, v, d, n, w, g in zip(
            columns.state.tolist(),
            columns.version.tolist(),
            columns.digest.tolist(),
            columns.length.tolist(),
            columns.writer.tolist(),
            columns.writer_gen.tolist(),
            strict=True,
        )
    ] == [(h.state, h.version, h.digest, h.length, h.writer, h.writer_gen) for _, h in found]
    assert len(parse_header_table(b"")) == 0
    with pytest.raises(CoherenceError, match="whole 64-byte lines"):
        parse_header_table(bytes(LINE + 1))
