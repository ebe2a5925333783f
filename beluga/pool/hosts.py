"""The host table: one 64-byte line per host, written only by that host.

A line records who holds a host id (pid, process start time, boot id), a
heartbeat, and a generation that grows with every claim.  Liveness is judged
two ways: on the same boot (same kernel: CI, one machine) by the pid *and* its
start time, so a reused pid is not mistaken for the old process; across hosts
by the age of the heartbeat.

Claiming a free id is claim-then-verify: write the line with a random nonce,
wait, read it back.  Processes of one kernel also serialise claims with an
advisory lock on the pool file, which makes the claim exact there.
"""

from __future__ import annotations

import contextlib
import enum
import os
import struct
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import psutil

from beluga.coherence import LINE, Memory, crc32c, read_line, write_line
from beluga.errors import PoolError
from beluga.pool.layout import Region

HOST_MAGIC = 0x54534F48  # "HOST"
_LINE = struct.Struct("<IIIIQ8sQQQ4x")
_CRC = struct.Struct("<I")
assert _LINE.size + _CRC.size == LINE

DEFAULT_STALE_S = 10.0
CLAIM_SETTLE_S = 0.002


def _boot_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return bytes.fromhex(f.read().strip().decode().replace("-", ""))[:8]
    except OSError:
        return b"\0" * 8


BOOT_ID = _boot_id()


def process_start_ms(pid: int) -> int | None:
    """Start time of a live process in ms since the epoch, or None if it is gone."""
    try:
        return round(psutil.Process(pid).create_time() * 1000)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


class HostState(enum.IntEnum):
    FREE = 0
    ALIVE = 1
    LEFT = 2


@dataclass(frozen=True)
class HostEntry:
    host_id: int
    state: HostState
    pid: int
    start_ms: int
    boot_id: bytes
    heartbeat_ns: int
    generation: int
    nonce: int

    def pack(self) -> bytes:
        body = _LINE.pack(
            HOST_MAGIC,
            self.host_id,
            self.state,
            self.pid,
            self.start_ms,
            self.boot_id,
            self.heartbeat_ns,
            self.generation,
            self.nonce,
        )
        return body + _CRC.pack(crc32c(body))

    @classmethod
    def unpack(cls, line: bytes) -> HostEntry | None:
        """Decode a host line; None for a free, torn or garbage line."""
        body = line[: _LINE.size]
        (crc,) = _CRC.unpack(line[_LINE.size :])
        magic, hid, state, pid, start, boot, beat, gen, nonce = _LINE.unpack(body)
        if magic != HOST_MAGIC or crc != crc32c(body) or state not in HostState._value2member_map_:
            return None
        return cls(hid, HostState(state), pid, start, boot, beat, gen, nonce)


class HostTable:
    """Claims, heartbeats and liveness over the pool's host table region."""

    def __init__(
        self,
        mem: Memory,
        region: Region,
        max_hosts: int,
        lock: Callable[[], AbstractContextManager[None]] | None = None,
    ) -> None:
        self.mem = mem
        self.region = region
        self.max_hosts = max_hosts
        self._lock = lock or contextlib.nullcontext

    def _offset(self, host_id: int) -> int:
        if not 0 <= host_id < self.max_hosts:
            raise ValueError(f"host id must be in 0..{self.max_hosts - 1}, not {host_id}")
        return self.region.offset + host_id * LINE

    def read(self, host_id: int) -> HostEntry | None:
        """The current entry of a host id, or None when the slot is free."""
        entry = HostEntry.unpack(read_line(self.mem, self._offset(host_id)))
        return entry if entry and entry.host_id == host_id else None

    def entries(self) -> list[HostEntry]:
        """Every claimed (alive or not) entry."""
        return [
            e for i in range(self.max_hosts) if (e := self.read(i)) and e.state != HostState.FREE
        ]

    def is_alive(self, entry: HostEntry | None, stale_s: float = DEFAULT_STALE_S) -> bool:
        """Whether the holder of an entry is still running."""
        if entry is None or entry.state != HostState.ALIVE:
            return False
        if entry.boot_id == BOOT_ID:
            return process_start_ms(entry.pid) == entry.start_ms
        return time.time_ns() - entry.heartbeat_ns < stale_s * 1e9

    def _write(self, entry: HostEntry) -> None:
        write_line(self.mem, self._offset(entry.host_id), entry.pack())

    def claim(self, host_id: int | None = None, stale_s: float = DEFAULT_STALE_S) -> HostEntry:
        """Take a host id (the given one, or the first free or dead one) for this process."""
        pid = os.getpid()
        start = process_start_ms(pid) or 0
        candidates = [host_id] if host_id is not None else list(range(self.max_hosts))
        with self._lock():
            for hid in candidates:
                old = self.read(hid)
                if old and self.is_alive(old, stale_s):
                    if host_id is not None:
                        raise PoolError(
                            f"host id {hid} is held by live pid {old.pid}; pick another "
                            "--host-id or let Beluga choose one"
                        )
                    continue
                entry = HostEntry(
                    hid,
                    HostState.ALIVE,
                    pid,
                    start,
                    BOOT_ID,
                    time.time_ns(),
                    (old.generation if old else 0) + 1,
                    int.from_bytes(os.urandom(8), "little"),
                )
                self._write(entry)
                time.sleep(CLAIM_SETTLE_S)
                if self.read(hid) == entry:
                    return entry
        raise PoolError(
            f"all {self.max_hosts} host ids of this pool are held by live processes; "
            "stop one, or create the pool with a larger --max-hosts"
        )

    def heartbeat(self, entry: HostEntry) -> HostEntry:
        """Refresh this host's heartbeat; returns the new entry."""
        fresh = HostEntry(**{**entry.__dict__, "heartbeat_ns": time.time_ns()})
        self._write(fresh)
        return fresh

    def release(self, entry: HostEntry) -> None:
        """Give a host id back (only its holder calls this)."""
        current = self.read(entry.host_id)
        if current and current.nonce == entry.nonce:
            self._write(
                HostEntry(
                    **{**entry.__dict__, "state": HostState.LEFT, "heartbeat_ns": time.time_ns()}
                )
            )
