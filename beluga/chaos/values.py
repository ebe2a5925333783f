"""Self-describing values: whatever bytes a read returns can be judged on their own.

A chaos value of ``n`` bytes (``n >= HEADER_BYTES``) is::

    offset  0   magic b"BCV1"
            4   the key's 16-byte digest (as the store keeps it)
           20   writer slot (u32)
           24   serial (u64): incarnation << 32 | counter, growing per key
           32   length n (u64)
           40   CRC32C of bytes 0..40 (u32), then 4 zero bytes
           48   a PRNG stream seeded by (digest, writer, serial), n - 48 bytes

So a reader that asked for key ``k`` can tell, without knowing what was
written, whether it got a value of ``k`` (which writer, which serial) or
other bytes: another key's value (digest), a value cut or padded (length),
a torn value or a mixture of two extents (the stream, which depends on the
position of every byte), or garbage (magic, CRC).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np

from beluga.coherence import crc32c

MAGIC = b"BCV1"
HEADER_BYTES = 48
_HEAD = struct.Struct("<4s16sIQQ")
_CRC = struct.Struct("<I")
assert _HEAD.size == 40


def _stream(key_digest: bytes, writer: int, serial: int, n: int) -> bytes:
    seed = hashlib.blake2b(key_digest + struct.pack("<IQ", writer, serial), digest_size=16).digest()
    return np.random.Generator(np.random.Philox(int.from_bytes(seed, "little"))).bytes(n)


def make_value(key_digest: bytes, writer: int, serial: int, n: int) -> bytes:
    """The value a writer stores: ``n`` bytes that say whose they are."""
    if n < HEADER_BYTES:
        raise ValueError(f"a chaos value is at least {HEADER_BYTES} bytes, not {n}")
    if len(key_digest) != 16:
        raise ValueError("key_digest is the store's 16-byte digest of the key")
    head = _HEAD.pack(MAGIC, key_digest, writer, serial, n)
    return head + _CRC.pack(crc32c(head)) + bytes(4) + _stream(key_digest, writer, serial, n - 48)


@dataclass(frozen=True)
class Verdict:
    """What a returned value is: a value of the key asked for, or why it is not.

    Immutable: thread-safe and fork-safe.
    """

    ok: bool
    writer: int = -1
    serial: int = -1
    reason: str = ""  # empty when ok
    detail: str = ""


def _wrong(reason: str, detail: str = "", writer: int = -1, serial: int = -1) -> Verdict:
    return Verdict(False, writer, serial, reason, detail)


def verify(key_digest: bytes, data: bytes | bytearray | memoryview) -> Verdict:
    """Judge the bytes a read of the key with digest ``key_digest`` returned."""
    raw = memoryview(data).cast("B")
    n = len(raw)
    if n < HEADER_BYTES:
        return _wrong("short", f"{n} bytes, less than a {HEADER_BYTES}-byte value header")
    head = bytes(raw[:40])
    magic, digest, writer, serial, length = _HEAD.unpack(head)
    if magic != MAGIC or _CRC.unpack_from(raw, 40)[0] != crc32c(head) or any(raw[44:48]):
        return _wrong("garbage", f"no intact value header: first bytes {bytes(raw[:16]).hex()}")
    if digest != key_digest:
        return _wrong(
            "other-key",
            f"a value of digest {digest.hex()} (writer {writer}, serial {serial:#x})",
            writer,
            serial,
        )
    if length != n:
        return _wrong("length", f"the value says {length} bytes, {n} came back", writer, serial)
    want = np.frombuffer(_stream(digest, writer, serial, n - 48), dtype=np.uint8)
    got = np.frombuffer(raw[48:], dtype=np.uint8)
    bad = np.flatnonzero(want != got)
    if bad.size:
        first = int(bad[0]) + HEADER_BYTES
        return _wrong(
            "torn",
            f"{bad.size} of {n} bytes differ from the value its header names, "
            f"first at offset {first}",
            writer,
            serial,
        )
    return Verdict(True, writer, serial)
