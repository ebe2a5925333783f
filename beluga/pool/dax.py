"""``dax:PATH[@OFFSET]``: a device-DAX character device mapped MAP_SHARED.

This is how a host reaches CXL memory that is not onlined as RAM: a QEMU
CXL Type-3 device or a real switch, exposed as ``/dev/daxX.Y``.  The device
exists before the pool and outlives it, so ``creates_storage`` is False:
``create`` claims the device (Pool.create clears the regions it uses and
writes the superblock magic last) and ``unlink`` only wipes the superblock.

Device-DAX maps only whole, aligned huge pages, so the data offset and every
mapping length are multiples of 2 MiB; ``open`` maps from the offset to the
last whole 2 MiB of the device, since only the superblock knows how big the
pool is and a backend never reads it.  The size of a real device comes from
sysfs (``/sys/dev/char/MAJ:MIN/size``).

A regular file at PATH stands in for a device, with the same alignment
rules: that is how CI exercises this backend (``truncate -s 64M FILE``).
"""

from __future__ import annotations

import os
import stat
from typing import Any

from beluga.coherence import Memory
from beluga.errors import BackendUnavailableError
from beluga.pool.backends import (
    HUGE_ALIGN,
    Backend,
    Mapping,
    _map_fd,
    _mapping_of,
    register_backend,
    same_object,
)
from beluga.pool.layout import SUPERBLOCK_BYTES

SYS_CHAR_DEVICES = "/sys/dev/char"

_HOW_TO_MAKE = (
    "make a device-DAX device with 'ndctl create-namespace -m devdax -a 2M' (pmem) or "
    "'cxl create-region' then 'ndctl create-namespace -m devdax' (CXL), boot the QEMU CXL "
    "sandbox in emulation/, or for a test stand-in create a file: 'truncate -s 64M PATH'"
)


def device_size(st: os.stat_result, path: str) -> int:
    """Bytes a device-DAX device (or a stand-in regular file) holds, or why it is no such thing."""
    if stat.S_ISREG(st.st_mode):
        return st.st_size
    if stat.S_ISCHR(st.st_mode):
        node = os.path.join(SYS_CHAR_DEVICES, f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
        subsystem = os.path.basename(os.path.realpath(os.path.join(node, "subsystem")))
        if subsystem == "dax":
            with open(os.path.join(node, "size")) as f:
                return int(f.read())
        kind = f"a character device of the {subsystem or 'unknown'} subsystem"
    else:
        kind = "neither a file nor a character device"
    raise BackendUnavailableError(
        f"{path} is not a device-DAX device (it is {kind}); dax: needs /dev/daxX.Y "
        "('daxctl list' shows them) or a regular file standing in for one"
    )


@register_backend
class DaxBackend(Backend):
    """A device-DAX device (or a stand-in file) from a 2 MiB-aligned data offset."""

    scheme = "dax"
    creates_storage = False

    def __init__(self, path: str, offset: int = 0) -> None:
        if not path:
            raise ValueError("the dax backend needs a device, e.g. dax:/dev/dax0.0")
        if offset < 0 or offset % HUGE_ALIGN:
            raise ValueError(
                f"a dax data offset must be a non-negative multiple of 2 MiB ({HUGE_ALIGN}), "
                f"not {offset}: device-DAX maps only whole huge pages"
            )
        self.path = os.path.abspath(path)
        self.offset = offset

    @classmethod
    def from_spec(cls, rest: str) -> DaxBackend:
        path, sep, offset = rest.rpartition("@")
        if not sep:
            return cls(rest)
        if not offset.isdigit():
            raise ValueError(
                f"a dax spec is dax:PATH[@OFFSET] with OFFSET in bytes (e.g. "
                f"dax:/dev/dax0.0@{HUGE_ALIGN}), not 'dax:{rest}'"
            )
        return cls(path, int(offset))

    @property
    def spec(self) -> str:
        return f"dax:{self.path}@{self.offset}" if self.offset else f"dax:{self.path}"

    def exists(self) -> bool:
        return os.path.exists(self.path)

    def _open_device(self) -> tuple[int, int]:
        """An O_RDWR descriptor and the bytes usable after the offset; closes it on failure."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError as e:
            raise BackendUnavailableError(f"no device at {self.path}; {_HOW_TO_MAKE}") from e
        except PermissionError as e:
            raise BackendUnavailableError(
                f"cannot open {self.path}: permission denied; run as a member of its group "
                "or add a udev rule that grants your group read-write access"
            ) from e
        except IsADirectoryError as e:
            raise BackendUnavailableError(
                f"{self.path} is a directory, not a device-DAX device; {_HOW_TO_MAKE}"
            ) from e
        try:
            return fd, max(0, device_size(os.fstat(fd), self.path) - self.offset)
        except BaseException:
            os.close(fd)
            raise

    def _map(self, fd: int, length: int) -> Mapping:
        try:
            return _mapping_of(fd, length, self.offset)
        except OSError as e:
            raise BackendUnavailableError(
                f"cannot map {length} bytes of {self.path} at offset {self.offset}: {e.strerror}"
            ) from e

    def create(self, size: int) -> Mapping:
        """Claim ``size`` bytes from the offset; the device must already hold them."""
        if size <= 0 or size % HUGE_ALIGN:
            raise ValueError(f"a dax pool size must be a positive multiple of 2 MiB, not {size}")
        fd, room = self._open_device()
        if room < size:
            os.close(fd)
            raise BackendUnavailableError(
                f"device smaller than asked: has {room}, need {size} bytes "
                f"({self.path} after offset {self.offset}); pick a smaller --size or offset"
            )
        return self._map(fd, size)

    def open(self) -> Mapping:
        """Map from the offset to the last whole 2 MiB of the device."""
        fd, room = self._open_device()
        length = room // HUGE_ALIGN * HUGE_ALIGN
        if not length:
            os.close(fd)
            raise BackendUnavailableError(
                f"{self.path} has {room} bytes after offset {self.offset}, less than the "
                f"2 MiB a pool needs at the least; check the device or the offset"
            )
        return self._map(fd, length)

    def names(self, mapping: Mapping) -> bool:
        return same_object(self.path, mapping)

    def unlink(self) -> None:
        """Zero the superblock with stores that reach the device, so no host sees a pool."""
        fd, room = self._open_device()
        try:
            if room < HUGE_ALIGN:
                return  # too small to have held a pool
            with _map_fd(fd, HUGE_ALIGN, self.offset) as mm:
                memory = Memory(mm, "native")
                try:
                    memory.nt_store(0, bytes(SUPERBLOCK_BYTES))
                    memory.sfence()
                finally:
                    memory.release()
        finally:
            os.close(fd)

    def info(self) -> dict[str, Any]:
        out = super().info()
        out["path"] = self.path
        out["offset"] = self.offset
        try:
            st = os.stat(self.path)
            out["device_size"] = device_size(st, self.path)
            out["stand_in_file"] = stat.S_ISREG(st.st_mode)
        except (OSError, BackendUnavailableError):
            out["device_size"] = None
        return out
