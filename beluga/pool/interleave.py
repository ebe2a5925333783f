"""``interleave:STRIPE:SPEC1,SPEC2,...``: one pool striped across several devices.

Stripe ``k`` of the pool (``STRIPE`` bytes, 2 MiB by default) lives on child
``k % n`` at child offset ``(k // n) * STRIPE``, as the Beluga paper spreads a
pool across CXL memory devices to use all of their bandwidth.  Children are
any backends whose memory comes from a descriptor: shm and numa files, dax
devices and their stand-in files.

Design: stitched mappings.  We reserve one contiguous, 2 MiB-aligned virtual
range and map every stripe into it with ``mmap(MAP_SHARED | MAP_FIXED)`` from
its child.  The result is one buffer with one address space, so everything
above the backend (superblock, host table, RPC rings, allocator, coherence,
gather/scatter tables) keeps speaking in plain pool offsets and runs
unchanged; the page tables do the striping at no cost per access.  Striping
in the allocator instead (one mapping per device, blocks placed across them)
would make every layer carry (device, offset) pairs.

The limit is the mapping count: each stripe is one kernel mapping, and
``vm.max_map_count`` (65530 by default) caps a process, so 2 MiB stripes reach
only about 120 GiB.  A multi-TB pool needs larger stripes (1 GiB stripes take
1024 mappings per TiB), a raised sysctl, or allocator-level striping; we
check the count before mapping anything and say which.  Where the hardware
can interleave (a CXL region built with several targets), prefer that and
map the region as one dax device.

The reserved range is a Python ``mmap`` made with MAP_NORESERVE, so it costs
no memory, its ``close()`` unmaps the whole stitched range exactly once, and
it refuses (BufferError) while any view of the pool is still alive instead of
leaving a dangling pointer.
"""

from __future__ import annotations

import functools
import mmap
import os
from collections.abc import Sequence
from typing import Any

from beluga.errors import BackendUnavailableError, BelugaError
from beluga.pool._libc import address_of, map_fixed
from beluga.pool.backends import HUGE_ALIGN, Backend, Mapping, parse_spec, register_backend

DEFAULT_STRIPE = HUGE_ALIGN
MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"
#: Mappings left for everything else the process maps later (libraries, malloc arenas, torch).
MAPS_KEPT_FREE = 4096
_MAP_NORESERVE = 0x4000  # x86-64 and AArch64


def _mapping_room() -> tuple[int, int]:
    """(vm.max_map_count, mappings this process holds now)."""
    with open(MAX_MAP_COUNT) as f:
        limit = int(f.read())
    with open("/proc/self/maps") as f:
        used = sum(1 for _ in f)
    return limit, used


def _check_map_count(total: int, stripe: int) -> None:
    """Refuse a stitch that would run the process out of mappings, and say what to change."""
    needed = total // stripe
    limit, used = _mapping_room()
    room = limit - used - MAPS_KEPT_FREE
    if needed <= room:
        return
    advice = ""
    if room > 0:
        bigger = stripe
        while total // bigger > room:
            bigger *= 2
        advice = f"use a stripe of at least {bigger} bytes (interleave:{bigger}:...) or "
    raise BackendUnavailableError(
        f"a {total}-byte interleaved pool in {stripe}-byte stripes needs {needed} memory "
        f"mappings, but this process may add only {max(room, 0)} (vm.max_map_count={limit}, "
        f"{used} in use, {MAPS_KEPT_FREE} kept free); {advice}raise the limit with "
        f"'sysctl -w vm.max_map_count={used + MAPS_KEPT_FREE + needed}'"
    )


def _stitch(
    children: Sequence[Backend], parts: Sequence[Mapping], stripe: int, total: int
) -> Mapping:
    """Map ``total`` bytes of the children's mappings, striped, into one range.

    The children's own mappings stay the caller's to close: the stitched one
    keeps duplicates of their descriptors.
    """
    for child, part in zip(children, parts, strict=True):
        if part.fd < 0:
            raise BackendUnavailableError(
                f"{child.spec} cannot be interleaved: its memory does not come from a file "
                "or device"
            )
    _check_map_count(total, stripe)
    n = len(parts)
    fds: list[int] = []
    reserved: mmap.mmap | None = None
    try:
        fds.extend(os.dup(part.fd) for part in parts)
        try:
            reserved = mmap.mmap(-1, total + HUGE_ALIGN, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE)
        except OSError as e:
            raise BackendUnavailableError(
                f"cannot reserve {total} bytes of address space for the interleaved pool: "
                f"{e.strerror}; check ulimit -v and vm.overcommit_memory"
            ) from e
        start = -address_of(reserved) % HUGE_ALIGN  # device-DAX needs 2 MiB-aligned addresses
        base = address_of(reserved) + start
        for k in range(total // stripe):
            child = k % n
            try:
                map_fixed(
                    base + k * stripe, stripe, fds[child], parts[child].offset + k // n * stripe
                )
            except OSError as e:
                raise BackendUnavailableError(
                    f"cannot map stripe {k} of the interleaved pool from {children[child].spec}: "
                    f"{e.strerror}"
                ) from e
        view = memoryview(reserved)[start : start + total]
    except BaseException:
        if reserved is not None:
            reserved.close()
        for fd in fds:
            os.close(fd)
        raise
    closers: list[Any] = [functools.partial(os.close, fd) for fd in fds]
    closers += [reserved.close, view.release]
    return Mapping(buffer=view, size=total, fd=fds[0], _closers=closers)


@register_backend
class InterleaveBackend(Backend):
    """Several fd-backed backends striped into one pool (see the module docstring)."""

    scheme = "interleave"

    def __init__(self, children: Sequence[Backend], stripe: int = DEFAULT_STRIPE) -> None:
        if stripe <= 0 or stripe % HUGE_ALIGN:
            raise ValueError(
                f"an interleave stripe must be a positive multiple of 2 MiB ({HUGE_ALIGN}), "
                f"not {stripe}"
            )
        if len(children) < 2:
            raise ValueError(
                "interleave needs at least two children, e.g. "
                "interleave:2097152:dax:/dev/dax0.0,dax:/dev/dax1.0; for one device use its "
                "own spec"
            )
        specs = [child.spec for child in children]
        for child, spec in zip(children, specs, strict=True):
            if isinstance(child, InterleaveBackend) or "," in spec:
                raise ValueError(f"{spec!r} cannot be an interleave child (nested, or has a comma)")
        if len(set(specs)) != len(specs):
            raise ValueError(f"an interleave child appears twice in {specs}; each must be distinct")
        self.children = list(children)
        self.stripe = stripe
        # Pool.create must clear old bytes if any child is a device that keeps them.
        self.creates_storage = all(child.creates_storage for child in children)

    @classmethod
    def from_spec(cls, rest: str) -> InterleaveBackend:
        head, sep, tail = rest.partition(":")
        stripe, listed = (int(head), tail) if sep and head.isdigit() else (DEFAULT_STRIPE, rest)
        pieces = listed.split(",")
        if not all(pieces):
            raise ValueError(
                f"an interleave spec is interleave:STRIPE:SPEC1,SPEC2,... with no empty child, "
                f"not 'interleave:{rest}'"
            )
        return cls([parse_spec(piece) for piece in pieces], stripe)

    @property
    def spec(self) -> str:
        return f"interleave:{self.stripe}:{','.join(child.spec for child in self.children)}"

    def exists(self) -> bool:
        return all(child.exists() for child in self.children)

    def create(self, size: int) -> Mapping:
        """Create every child big enough for its share of stripes, then stitch them."""
        if size <= 0 or size % self.stripe:
            raise ValueError(
                f"an interleaved pool's size must be a positive multiple of its stripe "
                f"({self.stripe}), not {size}"
            )
        n = len(self.children)
        share = (size // self.stripe + n - 1) // n * self.stripe
        parts: list[Mapping] = []
        try:
            for child in self.children:
                parts.append(child.create(share))
            return _stitch(self.children, parts, self.stripe, size)
        except BaseException:
            self.abort()
            raise
        finally:
            for part in parts:
                part.close()

    def open(self) -> Mapping:
        """Stitch the children; unequal children contribute as much as the smallest."""
        parts: list[Mapping] = []
        try:
            for child in self.children:
                parts.append(child.open())
            share = min(part.size for part in parts) // self.stripe * self.stripe
            if not share:
                raise BackendUnavailableError(
                    f"the smallest child of {self.spec} holds less than one {self.stripe}-byte "
                    "stripe; use bigger children or a smaller stripe"
                )
            return _stitch(self.children, parts, self.stripe, share * len(parts))
        finally:
            for part in parts:
                part.close()

    def commit(self) -> None:
        for child in self.children:
            child.commit()

    def abort(self) -> None:
        for child in self.children:
            child.abort()

    def unlink(self) -> None:
        """Unlink every child, even after one fails; then report the first failure."""
        failures: list[BaseException] = []
        for child in self.children:
            try:
                child.unlink()
            except (BelugaError, OSError) as e:
                failures.append(e)
        if failures:
            raise failures[0]

    def info(self) -> dict[str, Any]:
        out = super().info()
        out["stripe"] = self.stripe
        out["children"] = [child.info() for child in self.children]
        return out
