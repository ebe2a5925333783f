"""Who a process is, and the lines of the host region.

An :class:`Identity` names one process everywhere: its pid and start time on
one boot of one kernel (``$BELUGA_EMULATED_HOST`` makes a process a host of
its own: tests, the chaos tier).  Each line of the host region is one sealed
64-byte record: a holder's own line (:class:`HostEntry`), the server's grant
(:class:`Grant`), a claimant's request (:class:`ClaimRequest`) and the server's
answer (:class:`ClaimAnswer`), and the seat (:class:`Seat`).  Where each line
lives and who writes it: :mod:`beluga.pool.hosts`; the seat's protocol:
:mod:`beluga.pool.seat`.

Thread-safe and fork-safe: frozen values and functions of them;
:func:`emulate_host` changes this process's boot id (tests only).
"""

from __future__ import annotations

import enum
import hashlib
import os
import struct
from dataclasses import dataclass

import psutil

from beluga.coherence import seal_record, unseal_record

HOST_MAGIC = 0x54534F48  # "HOST"
GRANT_MAGIC = 0x544E5247  # "GRNT"
CLAIM_MAGIC = 0x4D49414C  # "LAIM"
ANSWER_MAGIC = 0x52534E41  # "ANSR"
SEAT_MAGIC = 0x54414553  # "SEAT"
_HOST = struct.Struct("<IIIIQ8sQQQ")  # magic, id, state, pid, start, boot, beat, gen, nonce
_GRANT = struct.Struct("<IIIIQ8sQ")  # magic, id, gen, pid, start, boot, nonce
_CLAIM = struct.Struct("<IiIQ8sQ")  # magic, wanted id (-1: any), pid, start, boot, nonce
_ANSWER = struct.Struct("<IiIIQ")  # magic, result, gen, holder pid, nonce
# magic, epoch, pid, start, boot, heartbeat, since, seats taken, takeovers (the last three
# were added later: a seat line written without them reads them as 0)
_SEAT = struct.Struct("<IIIQ8sQQII")

#: set to a name, this process counts as a host of its own (liveness by heartbeat only)
EMULATED_HOST_ENV = "BELUGA_EMULATED_HOST"


def _boot_id() -> bytes:
    """This kernel's boot id (8 bytes), or that of the host named by ``$BELUGA_EMULATED_HOST``.

    The variable emulates another host on one machine (tests, the chaos
    tier): its processes' pids mean nothing to others, so their liveness is
    judged by heartbeat, as across machines.  Never set it in production.
    """
    emulated = os.environ.get(EMULATED_HOST_ENV)
    if emulated:
        return hashlib.blake2b(b"beluga-emulated-host:" + emulated.encode(), digest_size=8).digest()
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return bytes.fromhex(f.read().strip().decode().replace("-", ""))[:8]
    except OSError:
        return b"\0" * 8


BOOT_ID = _boot_id()


def boot_id() -> bytes:
    """This process's host's boot id (:data:`BOOT_ID`, read here so :func:`emulate_host` holds)."""
    return BOOT_ID


def emulate_host(name: str) -> None:
    """Make this process a host of its own named ``name`` from now on (``$BELUGA_EMULATED_HOST``
    for processes forked after the boot id was read: the chaos tier's servers).  Tests only."""
    global BOOT_ID
    os.environ[EMULATED_HOST_ENV] = name
    BOOT_ID = _boot_id()


def process_start_ms(pid: int) -> int | None:
    """Start time of a live process in ms since the epoch, or None if it is gone.

    A zombie is gone: it will never run again, only its parent has not reaped it.
    """
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return round(proc.create_time() * 1000)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _unseal(line: bytes, st: struct.Struct, magic: int) -> tuple | None:
    """The fields of a sealed line of format ``st``; None when torn, foreign or empty."""
    body = unseal_record(line)
    if body is None:
        return None
    fields = st.unpack_from(body)
    return fields[1:] if fields[0] == magic else None


@dataclass(frozen=True)
class Identity:
    """Who a process is, everywhere: pid and start time on one boot of one kernel."""

    pid: int
    start_ms: int
    boot_id: bytes

    @classmethod
    def mine(cls) -> Identity:
        pid = os.getpid()
        return cls(pid, process_start_ms(pid) or 0, boot_id())

    def same_kernel(self) -> bool:
        return self.boot_id == boot_id()

    def running(self) -> bool:
        """On this kernel: whether this exact process still runs (exact, no timing)."""
        return process_start_ms(self.pid) == self.start_ms


class HostState(enum.IntEnum):
    FREE = 0
    ALIVE = 1
    LEFT = 2


@dataclass(frozen=True)
class HostEntry:
    """A host line: written only by the holder of the id."""

    host_id: int
    state: HostState
    pid: int
    start_ms: int
    boot_id: bytes
    heartbeat_ns: int
    generation: int
    nonce: int

    @property
    def identity(self) -> Identity:
        return Identity(self.pid, self.start_ms, self.boot_id)

    def pack(self) -> bytes:
        return seal_record(
            _HOST.pack(
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
        )

    @classmethod
    def unpack(cls, line: bytes) -> HostEntry | None:
        """Decode a host line; None for a free, torn or garbage line."""
        f = _unseal(line, _HOST, HOST_MAGIC)
        if f is None or f[1] not in HostState._value2member_map_:
            return None
        hid, state, *rest = f
        return cls(hid, HostState(state), *rest)


@dataclass(frozen=True)
class Grant:
    """A grant line: written only by the server; who holds an id, in which generation."""

    host_id: int
    generation: int
    identity: Identity
    nonce: int

    def pack(self) -> bytes:
        i = self.identity
        return seal_record(
            _GRANT.pack(
                GRANT_MAGIC,
                self.host_id,
                self.generation,
                i.pid,
                i.start_ms,
                i.boot_id,
                self.nonce,
            )
        )

    @classmethod
    def unpack(cls, line: bytes) -> Grant | None:
        f = _unseal(line, _GRANT, GRANT_MAGIC)
        if f is None:
            return None
        hid, gen, pid, start, boot, nonce = f
        return cls(hid, gen, Identity(pid, start, boot), nonce)


@dataclass(frozen=True)
class ClaimRequest:
    """A lobby line: a claimant's request for an id (any, or a given one)."""

    wanted: int
    identity: Identity
    nonce: int

    def pack(self) -> bytes:
        i = self.identity
        return seal_record(
            _CLAIM.pack(CLAIM_MAGIC, self.wanted, i.pid, i.start_ms, i.boot_id, self.nonce)
        )

    @classmethod
    def unpack(cls, line: bytes) -> ClaimRequest | None:
        f = _unseal(line, _CLAIM, CLAIM_MAGIC)
        if f is None:
            return None
        wanted, pid, start, boot, nonce = f
        return cls(wanted, Identity(pid, start, boot), nonce)


@dataclass(frozen=True)
class ClaimAnswer:
    """An answer line: the server's reply to the request last seen in a lobby line."""

    result: int  # the granted id, or a REFUSED_* code
    generation: int
    holder_pid: int  # for REFUSED_HELD: who holds the wanted id
    nonce: int

    def pack(self) -> bytes:
        return seal_record(
            _ANSWER.pack(ANSWER_MAGIC, self.result, self.generation, self.holder_pid, self.nonce)
        )

    @classmethod
    def unpack(cls, line: bytes) -> ClaimAnswer | None:
        f = _unseal(line, _ANSWER, ANSWER_MAGIC)
        return None if f is None else cls(*f)


@dataclass(frozen=True)
class Seat:
    """The seat line: which server serves the pool (epoch 0: none), since when, how often.

    ``seats`` counts every server that ever took this pool's seat and
    ``takeovers`` those that took it from a server that had not left it (it
    died, or stalled past the staleness bound); each new server carries both
    forward, so they are the pool's history, not one process's.
    """

    epoch: int
    identity: Identity
    heartbeat_ns: int
    since_ns: int = 0  # wall clock when this server took the seat
    seats: int = 0
    takeovers: int = 0

    def pack(self) -> bytes:
        i = self.identity
        return seal_record(
            _SEAT.pack(
                SEAT_MAGIC,
                self.epoch,
                i.pid,
                i.start_ms,
                i.boot_id,
                self.heartbeat_ns,
                self.since_ns,
                self.seats,
                self.takeovers,
            )
        )

    @classmethod
    def unpack(cls, line: bytes) -> Seat | None:
        f = _unseal(line, _SEAT, SEAT_MAGIC)
        if f is None:
            return None
        epoch, pid, start, boot, beat, since, seats, takeovers = f
        return cls(epoch, Identity(pid, start, boot), beat, since, seats, takeovers)
