"""The RPC's shared-memory formats: ring geometry, control lines, messages, statuses.

Per client host h, a ring lives at ``rpc.offset + h * rpc_bytes_per_host``
(the C core, ``beluga/_native/rpc.c``, defines and documents the slot layout;
every offset here comes from it).  Its head is four lines:

- ``CONTROL_LINE``, ring control, written only by the client: who, which
  generation of the host id (from the host table), how many slots;
- ``STATUS_LINE``, server status, written only by the server: its epoch (new
  at every start), the ring generation it has acknowledged, its pid and
  heartbeat, and how long it has seen the id's holder's heartbeat stand still
  (a successor inherits that: beluga.pool.hosts, Liveness);
- two wake lines (client's, server's) that only the C core touches.

Wake lines, and the server's doorbell at ``DOORBELL`` in region 0, are
same-kernel hints for sleeping waiters (futex); nothing depends on them.
Each end uses them only when the other end runs on the same kernel (same
boot id): see :func:`wake_ups`.  ``BELUGA_RPC_WAKE=0`` turns them off, so
waits fall back to spinning, yielding and timed naps, as across hosts.

A server runs only requests sent to it.  The requests a new server (a restart,
a standby's takeover) finds in a ring when it adopts it were sent to the one
that is gone; it answers each ``RESTARTED`` without running it, and a caller
still waiting sends it again (``RpcClient``), while one that gave up drops the
answer.  So a request pending when its server died runs again exactly when
its caller still wants the answer, and never for nobody.
"""

from __future__ import annotations

import enum
import os
import struct
from dataclasses import dataclass

from beluga._native import _core
from beluga.coherence import seal_record, unseal_record
from beluga.errors import BelugaError, CapacityError, RpcError
from beluga.pool.host_records import boot_id
from beluga.pool.hosts import Watch
from beluga.pool.layout import Superblock

RING_MAGIC = 0x474E4952  # "RING"
SERVER_MAGIC = 0x52565253  # "SRVR"
INLINE = _core.RPC_INLINE
MAX_DEPTH = _core.RPC_MAX_DEPTH
CONTROL_LINE = _core.RPC_CONTROL  # offsets inside a ring
STATUS_LINE = _core.RPC_STATUS
DOORBELL = _core.RPC_DOORBELL  # offset in the pool (region 0, after the superblock)

_RING = struct.Struct("<IIIIIIQ")
# magic, epoch, acked gen, host id, pid, start, boot, heartbeat; then the server's watch of
# the id's holder (generation, heartbeat value, ms it stood still: beluga.pool.hosts Watch),
# added later: a line written without it reads it as 0, nothing watched
_SERVER = struct.Struct("<IIIIIQ8sQIQI")


class Op(enum.IntEnum):
    """Operations every server understands; services add theirs from 16 on."""

    PING = 0
    ECHO = 1


FIRST_SERVICE_OP = 16


class Status(enum.IntEnum):
    OK = 0
    UNKNOWN_OP = 1
    BAD_REQUEST = 2  # the handler refused the arguments (ValueError, BelugaError)
    CAPACITY = 3  # the handler raised CapacityError
    FAILED = 4  # the handler raised anything else
    BAD_LENGTH = _core.ST_BAD_LENGTH  # transport: impossible length for the ring
    CORRUPT = _core.ST_CORRUPT  # transport: torn or garbage line / payload
    RESTARTED = _core.ST_RESTARTED  # sent to a server that is gone: not run, send it again


def ring_offset(sb: Superblock, host_id: int) -> int:
    return sb.rpc.offset + host_id * sb.rpc_bytes_per_host


def buf_size(sb: Superblock, depth: int) -> int:
    """Largest payload one slot carries for a ring of ``depth`` slots."""
    return _core.rpc_buf_size(sb.rpc_bytes_per_host, depth)


@dataclass(frozen=True)
class RingControl:
    host_id: int
    gen: int
    depth: int
    pid: int
    first_seq: int
    created_ns: int

    def pack(self) -> bytes:
        return seal_record(
            _RING.pack(
                RING_MAGIC,
                self.host_id,
                self.gen,
                self.depth,
                self.pid,
                self.first_seq,
                self.created_ns,
            )
        )

    @classmethod
    def unpack(cls, line: bytes) -> RingControl | None:
        body = unseal_record(line)
        if body is None:
            return None
        magic, host, gen, depth, pid, first, created = _RING.unpack_from(body)
        if magic != RING_MAGIC or not 1 <= depth <= MAX_DEPTH:
            return None
        return cls(host, gen, depth, pid, first, created)


@dataclass(frozen=True)
class ServerStatus:
    epoch: int  # 0: no server (stopped cleanly)
    acked_gen: int
    host_id: int
    pid: int
    start_ms: int
    boot_id: bytes
    heartbeat_ns: int
    watch: Watch | None = None  # how the server saw the id's holder, for its successor

    def pack(self) -> bytes:
        w = self.watch or Watch(0, 0, 0.0)
        return seal_record(
            _SERVER.pack(
                SERVER_MAGIC,
                self.epoch,
                self.acked_gen,
                self.host_id,
                self.pid,
                self.start_ms,
                self.boot_id,
                self.heartbeat_ns,
                w.generation,
                w.beat,
                min(round(w.still_s * 1000), 0xFFFFFFFF),
            )
        )

    @classmethod
    def unpack(cls, line: bytes) -> ServerStatus | None:
        body = unseal_record(line)
        if body is None:
            return None
        magic, *fields, watch_gen, beat, still_ms = _SERVER.unpack_from(body)
        if magic != SERVER_MAGIC:
            return None
        return cls(*fields, Watch(watch_gen, beat, still_ms / 1000) if watch_gen else None)


@dataclass(frozen=True)
class Message:
    """One request or response line; the C core owns the format (``rpc_line`` in rpc.c).

    The server and client never parse lines in Python; this is for tests and
    tools that forge or inspect one.
    """

    seq: int
    code: int
    flags: int
    length: int
    gen: int
    inline: bytes
    payload_crc: int

    def pack(self) -> bytes:
        return _core.rpc_pack_line(
            self.seq, self.code, self.flags, self.length, self.gen, self.inline, self.payload_crc
        )

    @classmethod
    def unpack(cls, line: bytes) -> Message | None:
        fields = _core.rpc_parse_line(line)
        return None if fields is None else cls(*fields)


def request_line(depth: int, slot: int) -> int:
    """Offset of a slot's request line inside its ring."""
    return _core.rpc_slot_lines(depth, slot)[0]


def response_line(depth: int, slot: int) -> int:
    """Offset of a slot's response line inside its ring."""
    return _core.rpc_slot_lines(depth, slot)[1]


def request_buffer(sb: Superblock, depth: int, slot: int) -> int:
    """Offset of a slot's request payload buffer inside its ring (out-of-line payloads)."""
    return _core.rpc_slot_buffers(sb.rpc_bytes_per_host, depth, slot)[0]


def response_buffer(sb: Superblock, depth: int, slot: int) -> int:
    """Offset of a slot's response payload buffer inside its ring (out-of-line payloads)."""
    return _core.rpc_slot_buffers(sb.rpc_bytes_per_host, depth, slot)[1]


def wake_ups(peer_boot_id: bytes) -> bool:
    """Whether to use the wake lines with a peer: same kernel, and not turned off."""
    return peer_boot_id == boot_id() and os.environ.get("BELUGA_RPC_WAKE", "1") != "0"


_ERRORS: dict[int, type[BelugaError]] = {Status.CAPACITY: CapacityError}


def error_for(status: int, payload: bytes, op: int) -> BelugaError:
    """The exception a client raises for a non-OK status."""
    text = payload.decode(errors="replace")
    try:
        name = Status(status).name.lower()
    except ValueError:
        name = f"status {status}"
    cls = _ERRORS.get(status, RpcError)
    if status == Status.BAD_REQUEST:
        return RemoteValueError(f"server refused op {op}: {text}")
    return cls(f"op {op} failed on the server ({name}): {text}")


class RemoteValueError(RpcError, ValueError):
    """The server refused a request's arguments."""
