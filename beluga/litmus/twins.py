"""Equal-CRC ("twin") payloads and the one litmus block that holds them.

Two twins differ only inside one cache line and share one CRC32C, so any
mixture of the two that a reader could copy is one of them and its checksum
matches: there only the seqlock of the block header stands between a reader
and another version's bytes.  Version v of the block carries twin v % 2.
"""

from __future__ import annotations

import random
import struct

from beluga.coherence import LINE, crc32c, digest
from beluga.litmus.area import BLOCK_BYTES, BLOCK_HDR, BLOCK_PAYLOAD


def crc_twins(size: int = BLOCK_BYTES) -> tuple[bytes, bytes]:
    """Two ``size``-byte payloads with the same CRC32C that differ in one cache line only.

    Each is a common head, then LINE - 4 bytes of its own followed by the
    CRC32C of everything before them (little-endian), then a common tail.  A
    CRC register that has just taken in a message and its own CRC holds a
    constant, whatever the message, so the common tail ends both at the same
    checksum.
    """
    rng = random.Random(0xB1061A)
    line = size // LINE // 2
    head, tail = rng.randbytes(line * LINE), rng.randbytes(size - (line + 1) * LINE)

    def twin() -> bytes:
        body = head + rng.randbytes(LINE - 4)
        return body + struct.pack("<I", crc32c(body)) + tail

    return twin(), twin()


TWINS = crc_twins()
#: the key every twin block is published under
TWIN_KEY = digest(b"litmus twins")


def twin_of(version: int) -> bytes:
    """The whole-block twin that version ``version`` carries."""
    return TWINS[version % 2]


def twin_block(base: int) -> tuple[int, int]:
    """The twin block's header and payload offsets in the area at ``base``."""
    return base + BLOCK_HDR, base + BLOCK_PAYLOAD
