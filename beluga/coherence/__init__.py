"""The coherence layer: the only way protocol code reaches shared memory.

A :class:`Memory` is one host's view of a shared mapping.  Its mode is chosen
once, when it is attached, and never tested again on a hot path:

``native``
    real instructions (CLFLUSHOPT/CLFLUSH, CLWB, non-temporal stores,
    SFENCE/MFENCE), picked once per process from CPUID.
``model``
    a seeded, deterministic, simulated non-coherent host per attachment in
    front of the real mapping (``beluga/_native/model.c`` states each rule
    and the hardware behaviour behind it): stores stay private until flushed
    and fenced; non-temporal stores wait in write-combining buffers and
    reach memory in any order until a fence; flushes complete at the next
    fence; loads see stale lines until invalidated *and* MFENCEd, and an
    invalidated line may come back before that MFENCE; only MFENCE orders
    loads after earlier stores; eviction spares recently used lines; lines
    are written back whole.  Protocol code runs unchanged.

Device reads (a GPU's DMA) go through this host's root complex, which snoops
its CPU caches: a line a CPU path of this host cached is what the GPU copies,
even after another host rewrote the block.  Every attachment therefore keeps a
*read record* (``beluga/_native/record.c`` argues the rule in full): one state
per granule, set TOUCHED by every CPU load, store, prefetch, flush and
invalidate, and ``Memory.invalidate_stale`` invalidates before a device read
only the granules that may hold a stale line (a granule a CPU path touched,
or one last read as another version; lines refilled at that invalidation hold
the version read then, which is published and immutable, so a later read of
the same version needs nothing).  A GPU load of a block this host's CPUs never
touched invalidates nothing; the writer's side is unchanged (single writer,
sealed header last), and another host's rewrite of an extent shows as another
version, whose first device read here invalidates.  The GPU path checks every
block's CRC32C on the GPU and reads a failing block once more with all its
ranges invalidated, so what the record cannot see on real hardware (other
processes of the same machine share its caches) costs a second read, not
bytes.  ``dma_read`` / ``dma_write`` let a CPU stand-in of a GPU see what a
device sees, so the model proves the rule (tests/sabotage_checks/blocks.py).

The chicken bit ``BELUGA_COHERENCE=native|model`` forces the mode for every
attach that does not name one; ``BELUGA_MODEL_SEED``, ``BELUGA_MODEL_LINES``,
``BELUGA_MODEL_EVICT``, ``BELUGA_MODEL_DRAIN`` and ``BELUGA_MODEL_REFILL``
tune the model.

Memory methods (all offsets are bytes from the start of the mapping; misuse
raises :class:`~beluga.errors.CoherenceError`):

- ``load(off, n)``, ``load_into(off, buf)``, ``load_u64(off)``: plain loads
- ``store(off, data)``, ``store_u64(off, v)``: plain stores (stay in cache)
- ``nt_store(off, data)``: non-temporal stores (go to memory)
- ``flush(off, n)``, ``writeback(off, n)``, ``invalidate(off, n)``
- ``sfence()``, ``mfence()``
- ``publish(hdr_off, payload_off, digest, version, data, key_len=0, writer=0, stamp=0,
  writer_gen=0)``: a whole value, header last
- ``begin_write(hdr_off, payload_off, digest, version, length, ...)`` (the header
  WRITING, fenced, before any payload store) and ``seal(..., crc=None)`` (the
  same fields: the header PUBLISHED with the payload's CRC32C, taken from the
  pool or given by the writer), for a payload moved in between
- ``write_blocks(buffers, table, blocks)`` / ``read_blocks(buffers, table,
  blocks)``: whole values through one scatter-gather table, each sealed with the
  CRC32C of what was written, or validated (header, CRC32C of the bytes as
  copied, header again) into a length or a :class:`Miss` per block: the moves of
  ``KVStore.save`` / ``load``
- ``read_bytes(hdr_off, payload_off, block_cap, digest, version)`` → the payload
  as ``bytes``, validated, or a negative :class:`Miss` code;
  ``check_header(...)`` → the header's answer alone
- ``read_validated(hdr_off, payload_off, block_cap, digest, version, out)`` →
  payload length, or a negative :class:`Miss` code
- ``gather_write(buffers, table)`` / ``scatter_read(buffers, table)``: one call
  for a whole scatter-gather list of ``(buffer index, buffer offset, pool
  offset, length)`` uint64 rows, checked before any byte moves
- ``check_headers(blocks)``: read_blocks' header steps alone (a GPU moves the payload)
- ``invalidate_stale(ranges)``, ``record_state(off)``, ``dma_read(off, buf)``,
  ``dma_write(off, data)``: the read record and a device's view (above)
- ``discard()``, ``crash_after(lines)``, ``model_stats()``, ``release()``
- attributes ``mode``, ``size``, ``released``, ``busy``, ``record_granule``
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from beluga._native import _core, step

Memory = _core.Memory
LINE = _core.LINE
crc32c = _core.crc32c
MODES = ("native", "model")


@dataclass(frozen=True)
class ModelConfig:
    """Parameters of the simulated non-coherent host (each rate is a probability).

    ``evict_rate``: per line touched, that a cold line is evicted;
    ``drain_rate``: per line queued for memory (non-temporal store or
    write-back), that a random queued line drains before the next fence;
    ``refill_rate``: per invalidation completed at MFENCE, that the line is
    speculatively refilled at once.

    These are the one set of defaults: ``attach`` always passes every field to
    C, whose constructor defaults serve only its own unit tests.
    """

    cache_lines: int = 4096
    evict_rate: float = 0.002
    drain_rate: float = 0.25
    refill_rate: float = 0.5
    seed: int = 0

    @classmethod
    def from_env(cls, seed: int | None = None) -> ModelConfig:
        """Defaults overridden by BELUGA_MODEL_* variables (and an explicit seed)."""
        env = os.environ
        return cls(
            cache_lines=int(env.get("BELUGA_MODEL_LINES", cls.cache_lines)),
            evict_rate=float(env.get("BELUGA_MODEL_EVICT", cls.evict_rate)),
            drain_rate=float(env.get("BELUGA_MODEL_DRAIN", cls.drain_rate)),
            refill_rate=float(env.get("BELUGA_MODEL_REFILL", cls.refill_rate)),
            seed=seed if seed is not None else int(env.get("BELUGA_MODEL_SEED", cls.seed)),
        )


def resolve_mode(mode: str | None) -> str:
    """The mode to use: the argument, else BELUGA_COHERENCE, else native."""
    chosen = mode or os.environ.get("BELUGA_COHERENCE") or "native"
    if chosen not in MODES:
        raise ValueError(
            f"coherence mode must be one of {MODES}, not {chosen!r} "
            "(check the mode argument or BELUGA_COHERENCE)"
        )
    return chosen


def attach(buffer: object, mode: str | None = None, model: ModelConfig | None = None) -> Memory:
    """A new host view of ``buffer`` in the given (or environment's) mode."""
    chosen = resolve_mode(mode)
    if chosen == "native":
        return Memory(buffer, "native")
    cfg = model or ModelConfig.from_env()
    return Memory(
        buffer,
        "model",
        cache_lines=cfg.cache_lines,
        evict_rate=cfg.evict_rate,
        drain_rate=cfg.drain_rate,
        refill_rate=cfg.refill_rate,
        seed=cfg.seed,
    )


def read_line(mem: Memory, off: int) -> bytes:
    """Load one line that another host writes: invalidate, fence, load."""
    mem.invalidate(off, LINE)
    mem.mfence()
    return mem.load(off, LINE)


def write_line(mem: Memory, off: int, data: bytes) -> None:
    """Make one whole line this host owns visible to every host."""
    if len(data) != LINE or off % LINE:
        raise ValueError(f"write_line takes one aligned {LINE}-byte line")
    mem.nt_store(off, data)
    mem.sfence()


def line_reader(invalidate_point: str, mfence_point: str) -> Callable[[Memory, int], bytes]:
    """``read_line``, its two steps named after sabotage points (``beluga._native.step``).

    It is ``read_line`` itself unless a mutation run armed one of the points.
    """
    invalidate = step(invalidate_point, Memory.invalidate)
    mfence = step(mfence_point, Memory.mfence)
    if invalidate is Memory.invalidate and mfence is Memory.mfence:
        return read_line

    def read(mem: Memory, off: int) -> bytes:
        invalidate(mem, off, LINE)
        mfence(mem)
        return mem.load(off, LINE)

    return read


def line_writer(sfence_point: str) -> Callable[[Memory, int, bytes], None]:
    """``write_line``, its SFENCE named after a sabotage point (``write_line`` itself but there)."""
    sfence = step(sfence_point, Memory.sfence)
    if sfence is Memory.sfence:
        return write_line

    def write(mem: Memory, off: int, data: bytes) -> None:
        if len(data) != LINE or off % LINE:
            raise ValueError(f"write_line takes one aligned {LINE}-byte line")
        mem.nt_store(off, data)
        sfence(mem)

    return write


def seal_record(body: bytes, size: int = LINE) -> bytes:
    """``body`` zero-padded to ``size - 4`` bytes, then their CRC32C (little-endian).

    The sealed record of every format in the pool that has no richer check
    (host-table lines, ring control and status lines, the superblock); the C
    core seals its own lines (block headers, index buckets, RPC messages) the
    same way.  ValueError when ``body`` does not fit.
    """
    return _core.seal_record(body, size)


def unseal_record(record: bytes) -> bytes | None:
    """The bytes of a sealed record before its checksum; None when they do not match it."""
    return _core.unseal_record(record)


def digest(key: bytes) -> bytes:
    """The 16-byte identity of a key as stored in block headers.

    BLAKE3's first 16 bytes (``blake3.blake3(key).digest(16)``), computed by the
    C core (blake3.c): the same code that digests keys on the read path
    (``_core.Index``, ``_core.key_digests``), so writers and readers cannot
    disagree.  ValueError for a key that is not 1..256 bytes.
    """
    return _core.key_digest(key)


# The C core owns both lists (BL_BLOCK_STATES, BL_MISS_CODES in beluga/_native/beluga_native.h).
BlockState = enum.IntEnum("BlockState", _core.BLOCK_STATES, module=__name__)
BlockState.__doc__ = "A block header's state, as the C core numbers it."
Miss = enum.IntEnum("Miss", [(name, code) for name, code, _ in _core.MISS_CODES], module=__name__)
Miss.__doc__ = (
    "Why read_validated returned no data.  Every one of these is a cache miss:\n\n"
    + "\n".join(f"- ``{name}``: {why}" for name, _, why in _core.MISS_CODES)
)


@dataclass(frozen=True)
class BlockHeader:
    state: BlockState
    version: int
    digest: bytes
    length: int
    payload_crc: int
    key_len: int
    writer: int  # host id of the writer
    stamp: int
    writer_gen: int  # generation of that host id when it wrote


def _header(fields: tuple) -> BlockHeader | None:
    """A header from the C core's fields; None for a state this Beluga does not know."""
    state, *rest = fields
    try:
        return BlockHeader(BlockState(state), *rest)
    except ValueError:
        return None


def parse_header(line: bytes) -> BlockHeader | None:
    """Decode a block header line; None when it is not a valid header."""
    fields = _core.parse_header(line)
    return None if fields is None else _header(fields)


def parse_headers(table: bytes) -> list[tuple[int, BlockHeader]]:
    """Every valid header of a table of header lines, with its line number (the block).

    One pass in C over the magic and checksum of each line, as ``parse_header``.
    """
    found = ((block, _header(fields)) for block, fields in _core.parse_headers(table))
    return [(block, h) for block, h in found if h is not None]


_COLUMN_TYPES = ("<i8", "<u2", "<u8", "V16", "<u8", "<u4", "<u4")  # as header_columns packs them


@dataclass(frozen=True)
class HeaderTable:
    """The valid headers of a header table as numpy columns, one row a header, in block order.

    ``digest`` is 16-byte void items (``.tolist()`` gives bytes).  Thread-safe and
    fork-safe: immutable, its arrays read-only views of the C core's output.
    """

    block: np.ndarray
    state: np.ndarray
    version: np.ndarray
    digest: np.ndarray
    length: np.ndarray
    writer: np.ndarray
    writer_gen: np.ndarray

    def __len__(self) -> int:
        return len(self.block)


def parse_header_table(table: bytes) -> HeaderTable:
    """``parse_headers`` without an object per block: the same headers (valid magic and
    checksum, a state this Beluga knows) as columns, for recovery's scan of a whole pool."""
    cols = [
        np.frombuffer(c, t) for c, t in zip(_core.header_columns(table), _COLUMN_TYPES, strict=True)
    ]
    known = np.isin(cols[1], [s.value for s in BlockState])
    if not known.all():
        cols = [c[known] for c in cols]
        for c in cols:
            c.flags.writeable = False
    return HeaderTable(*cols)


__all__ = [
    "LINE",
    "MODES",
    "BlockHeader",
    "BlockState",
    "HeaderTable",
    "Memory",
    "Miss",
    "ModelConfig",
    "attach",
    "crc32c",
    "digest",
    "line_reader",
    "line_writer",
    "parse_header",
    "parse_header_table",
    "parse_headers",
    "read_line",
    "resolve_mode",
    "seal_record",
    "unseal_record",
    "write_line",
]
