"""The two things about mappings that Python's ``mmap`` module cannot do.

NUMA calls need the address of a mapping, and stitching several files into
one range needs ``mmap(MAP_FIXED)``.  Both go through ctypes here so that
the backends that need them share one careful copy.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10  # the same value on every Linux architecture


def address_of(buffer: Any) -> int:
    """The address of a writable buffer's first byte.

    The ctypes view that reveals it dies with this expression, so the buffer
    (an ``mmap``) can still be closed afterwards.
    """
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def map_fixed(address: int, length: int, fd: int, offset: int) -> None:
    """Map ``length`` bytes of ``fd`` from ``offset`` shared and writable, exactly at ``address``.

    ``address`` must lie in a range this process reserved itself: MAP_FIXED
    silently replaces whatever was mapped there.
    """
    got = _mmap(
        address,
        length,
        mmap.PROT_READ | mmap.PROT_WRITE,
        mmap.MAP_SHARED | _MAP_FIXED,
        fd,
        offset,
    )
    if got == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of fd {fd} at offset {offset} failed: {os.strerror(err)}")
