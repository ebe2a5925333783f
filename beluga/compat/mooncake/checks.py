"""Mooncake's arguments as Beluga's: keys, the pool, buffers and checks; failures as codes.

Arguments of the wrong type raise ``TypeError``, as Mooncake's bindings do;
a Beluga failure becomes the Mooncake status code closest to it
(:func:`code_of`).  Key and pool forms are those of the package docstring.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Sequence
from typing import Any

from beluga.compat.mooncake.codes import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    NO_AVAILABLE_HANDLE,
    RPC_FAIL,
)
from beluga.errors import BelugaError, CapacityError, RpcError
from beluga.kv import MAX_KEY_BYTES
from beluga.pool import DEFAULT_POOL, resolve_pool

#: an address argument of ``setup`` that starts with this names a Beluga pool spec
POOL_PREFIX = "beluga:"
_LONG_KEY_TAG = b"\xff"
#: the failures a call turns into a code (:func:`code_of`) instead of raising
FAILURES = (BelugaError, ValueError, OSError)


def beluga_key(key: str | bytes) -> bytes:
    """The Beluga key a Mooncake key is stored under (see the package docstring)."""
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if len(raw) > MAX_KEY_BYTES:
        return _LONG_KEY_TAG + hashlib.sha256(raw).digest()
    return raw


def pool_spec_for(metadata_server: str = "", master_server_addr: str = "") -> str:
    """The pool ``setup`` attaches: a ``beluga:SPEC`` argument, else $BELUGA_POOL, else default."""
    named = (
        address.removeprefix(POOL_PREFIX)
        for address in (master_server_addr, metadata_server)
        if address.startswith(POOL_PREFIX)
    )
    return resolve_pool(
        next(filter(None, named), None),  # a bare "beluga:" names nothing
        setting=f"setup's master_server_addr or metadata_server ({POOL_PREFIX}SPEC)",
        default=DEFAULT_POOL,
    )


def code_of(exc: BaseException) -> int:
    """The Mooncake status code closest to a Beluga failure."""
    if isinstance(exc, CapacityError):
        return NO_AVAILABLE_HANDLE
    if isinstance(exc, ValueError):  # also the server refusing an argument
        return INVALID_PARAMS
    if isinstance(exc, RpcError):
        return RPC_FAIL
    return INTERNAL_ERROR


# -- argument checks (TypeError where Mooncake's bindings raise it) ------------


def check_key(key: object) -> bytes | None:
    """A key's Beluga form; None for the empty key."""
    if not isinstance(key, str | bytes):
        raise TypeError(f"a key is a str, not {type(key).__name__}")
    return beluga_key(key) if key else None


def check_keys(keys: object) -> list[bytes | None]:
    return [check_key(k) for k in check_list(keys, "keys")]


def check_list(items: object, what: str) -> Sequence[Any]:
    if isinstance(items, str | bytes) or not isinstance(items, Sequence):
        raise TypeError(f"{what} is a list, not {type(items).__name__}")
    return items


def check_value(value: object) -> memoryview:
    try:
        view = memoryview(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"a value supports the buffer protocol (bytes, bytearray, numpy), "
            f"not {type(value).__name__}"
        ) from None
    if not view.c_contiguous:
        raise TypeError("a value buffer must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def check_count(n: object, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise TypeError(f"{what} is a non-negative int, not {n!r}")
    return n


def check_ranges(ptrs: object, sizes: object) -> tuple[list[int], list[int]]:
    return (
        [check_count(p, "a buffer pointer") for p in check_list(ptrs, "buffer_ptrs")],
        [check_count(s, "a size") for s in check_list(sizes, "sizes")],
    )


def raw_view(address: int, size: int) -> memoryview:
    """A view of ``size`` bytes at a caller's address (as Mooncake, the caller vouches for it)."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")
