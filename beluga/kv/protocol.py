"""The store's RPC operations, each with a symmetric encode / decode pair.

Every request and response is a little-endian count followed by fixed-size
records, so a batch of N keys is one message and decoding is one
``iter_unpack``.  Keys travel as their 16-byte digests (the identity kept in
block headers); the server never sees key bytes.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from beluga.rpc import FIRST_SERVICE_OP


class StoreOp(enum.IntEnum):
    ALLOC = FIRST_SERVICE_OP  # reserve extents for writing, under a write lease
    COMMIT = FIRST_SERVICE_OP + 1  # make written extents visible in the index
    ABORT = FIRST_SERVICE_OP + 2  # give reserved extents back (a put that failed)
    LOOKUP = FIRST_SERVICE_OP + 3  # where keys live (optionally leasing them)
    REMOVE = FIRST_SERVICE_OP + 4
    STATS = FIRST_SERVICE_OP + 5
    DROP = FIRST_SERVICE_OP + 6  # remove values a reader found corrupt, if still those versions
    RETIRED = FIRST_SERVICE_OP + 7  # the keys that left the index since a cursor


NO_BLOCK = 0xFFFFFFFF
LOOKUP_LEASE = 1  # take a read lease on every hit
LOOKUP_PREFIX = 2  # stop at the first miss
#: ALLOC flag: grant nothing for a key that is committed or being written (not cancelled)
#: already; its grant is NO_BLOCK with the reason in place of a version
ALLOC_SKIP_PRESENT = 1
PRESENT_COMMITTED = 1  # the key has a committed value
PRESENT_WRITING = 2  # another write of the key is in flight (it commits, or its lease ends)

_COUNT = struct.Struct("<I")
_ALLOC_REQ = struct.Struct("<16sQH")  # digest, length, key length
_GRANT = struct.Struct("<IQ")  # block, version
_COMMIT_REQ = struct.Struct("<16sIQ")  # digest, block, version
_FLAG = struct.Struct("<B")
_FLAGS = struct.Struct("<B")  # a request's flags, before its records (LOOKUP, ALLOC)
_LOCATION = struct.Struct("<IQQ")  # block, version, length
_DIGEST = struct.Struct("<16s")
_RETIRED_REQ = struct.Struct("<QQI")  # server epoch (0: none yet), cursor, most digests wanted
_RETIRED_HEAD = struct.Struct("<QQQ")  # server epoch, sequence of the first digest, the next


@dataclass(frozen=True)
class Grant:
    """An extent to write (``block``, ``version``), or NO_BLOCK and why nothing was granted."""

    block: int
    version: int

    @property
    def present(self) -> int:
        """0 for a grant; PRESENT_COMMITTED or PRESENT_WRITING for a key skipped."""
        return self.version if self.block == NO_BLOCK else 0


@dataclass(frozen=True)
class Location:
    block: int
    version: int
    length: int


def _records(st: struct.Struct, items: list[tuple]) -> bytes:
    return _COUNT.pack(len(items)) + b"".join(st.pack(*i) for i in items)


def _unrecords(st: struct.Struct, data: bytes, offset: int = 0) -> list[tuple]:
    (n,) = _COUNT.unpack_from(data, offset)
    body = data[offset + _COUNT.size :]
    if len(body) != n * st.size:
        raise ValueError(
            f"malformed message: {n} records of {st.size} bytes expected, {len(body)} bytes present"
        )
    return list(st.iter_unpack(body))


def encode_alloc(items: list[tuple[bytes, int, int]], flags: int = 0) -> bytes:
    return _FLAGS.pack(flags) + _records(_ALLOC_REQ, items)


def decode_alloc(data: bytes) -> tuple[int, list[tuple[bytes, int, int]]]:
    (flags,) = _FLAGS.unpack_from(data)
    return flags, _unrecords(_ALLOC_REQ, data, _FLAGS.size)


def encode_grants(grants: list[Grant]) -> bytes:
    return _records(_GRANT, [(g.block, g.version) for g in grants])


def decode_grants(data: bytes) -> list[Grant]:
    return [Grant(*r) for r in _unrecords(_GRANT, data)]


def encode_commit(items: list[tuple[bytes, int, int]]) -> bytes:
    return _records(_COMMIT_REQ, items)


def decode_commit(data: bytes) -> list[tuple[bytes, int, int]]:
    return _unrecords(_COMMIT_REQ, data)


def encode_flags(flags: list[bool]) -> bytes:
    return _records(_FLAG, [(int(f),) for f in flags])


def decode_flags(data: bytes) -> list[bool]:
    return [bool(f) for (f,) in _unrecords(_FLAG, data)]


def encode_digests(digests: list[bytes], flags: int = 0) -> bytes:
    return _FLAGS.pack(flags) + _COUNT.pack(len(digests)) + b"".join(digests)


def decode_digests(data: bytes) -> tuple[int, list[bytes]]:
    (flags,) = _FLAGS.unpack_from(data)
    return flags, [d for (d,) in _unrecords(_DIGEST, data, _FLAGS.size)]


def encode_locations(locations: list[Location | None]) -> bytes:
    return _records(
        _LOCATION,
        [(loc.block, loc.version, loc.length) if loc else (NO_BLOCK, 0, 0) for loc in locations],
    )


def decode_locations(data: bytes) -> list[Location | None]:
    return [None if b == NO_BLOCK else Location(b, v, n) for b, v, n in _unrecords(_LOCATION, data)]


@dataclass(frozen=True)
class Retirements:
    """A RETIRED answer: the digests of keys that left the index, numbered ``first`` on,
    by the server whose life ``epoch`` names; ask again from ``next``."""

    epoch: int
    first: int
    next: int
    digests: list[bytes]


def encode_retired_request(epoch: int, cursor: int, most: int) -> bytes:
    return _RETIRED_REQ.pack(epoch, cursor, most)


def decode_retired_request(data: bytes) -> tuple[int, int, int]:
    if len(data) != _RETIRED_REQ.size:
        raise ValueError(f"malformed message: {_RETIRED_REQ.size} bytes expected, {len(data)}")
    epoch, cursor, most = _RETIRED_REQ.unpack(data)
    return epoch, cursor, most


def encode_retirements(r: Retirements) -> bytes:
    return _RETIRED_HEAD.pack(r.epoch, r.first, r.next) + _records(
        _DIGEST, [(d,) for d in r.digests]
    )


def decode_retirements(data: bytes) -> Retirements:
    epoch, first, nxt = _RETIRED_HEAD.unpack_from(data)
    return Retirements(
        epoch, first, nxt, [d for (d,) in _unrecords(_DIGEST, data, _RETIRED_HEAD.size)]
    )


#: bytes per record, for sizing batches to the RPC slot buffers
RECORD_BYTES = {
    # a batch that is allocated together is committed together: size it for both
    StoreOp.ALLOC: max(_ALLOC_REQ.size, _GRANT.size, _COMMIT_REQ.size),
    StoreOp.COMMIT: max(_COMMIT_REQ.size, _FLAG.size),
    StoreOp.ABORT: _COMMIT_REQ.size,
    StoreOp.LOOKUP: max(16, _LOCATION.size),
    StoreOp.REMOVE: 16,
    StoreOp.DROP: max(_COMMIT_REQ.size, _FLAG.size),
    StoreOp.RETIRED: _DIGEST.size,
}
HEADER_BYTES = _COUNT.size + _FLAGS.size
#: bytes of a RETIRED answer before its digests
RETIRED_HEADER_BYTES = _RETIRED_HEAD.size + _COUNT.size
