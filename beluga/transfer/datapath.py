"""Gather-write, scatter-read and sparse fetch of KV: one C call per batch.

KV moves between an engine's paged cache and pool blocks as one
scatter-gather table of uint64 rows ``(buffer index, buffer offset, pool
offset, length)`` run by one ``Memory.gather_write`` or
``Memory.scatter_read`` call: the C core checks every row before a byte
moves, then writes with non-temporal stores and one SFENCE, or invalidates
every range, fences once and loads.  One call per batch is the point of a
CXL pool: there is no scatter-gather list limit to batch around and no
per-piece call to pay for, so a 16-token engine block of a 28-layer model is
56 pieces in one call, not 56 calls.

The table is built with numpy index arithmetic over whole arrays (no Python
loop per piece), and runs that are adjacent on both sides are merged.

Pool offsets are the payload offsets of pool blocks in the mapping, one per
engine block, as the store's allocator hands them out: line-aligned, each
``block_bytes`` long.  Everything (block ids, offsets, sizes, overlaps) is
checked before the C call, so bad input raises and nothing is written.

``gather_write`` makes the payload reach memory but publishes nothing, and
``scatter_read`` trusts what the pool holds: they are the raw moves.  Values
go through the store's one data-path API, ``KVStore.save(keys, source)``
(reserve, the move with the CRC32C of each block taken from the source as it
is stored, seal, commit) and ``KVStore.load(refs, sink)`` (header, CRC32C of
the bytes as copied, header again), with :class:`EngineBlocks` as the source
or sink: it builds its tables with :func:`block_moves`.

The mover is the pool's ``Memory`` for a KV cache in host memory, or a
:class:`beluga.transfer.gpu.GpuPool` for one on its GPU (copy engines and a
kernel instead of one C call, the CRC32C checked on the GPU; the same table
and the same checks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from beluga.coherence import LINE, Memory
from beluga.errors import KVLayoutError
from beluga.transfer.format import BlockFormat

if TYPE_CHECKING:
    from beluga.transfer.buffers import Place
    from beluga.transfer.layouts import KVLayout


def coalesce(table: np.ndarray) -> np.ndarray:
    """Merge consecutive rows that continue each other in the buffer and in the pool."""
    if len(table) < 2:
        return table
    buf, boff, poff, length = table.T
    joins = (
        (buf[1:] == buf[:-1])
        & (boff[1:] == boff[:-1] + length[:-1])
        & (poff[1:] == poff[:-1] + length[:-1])
    )
    if not joins.any():
        return table
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    merged = table[starts]
    merged[:, 3] = np.add.reduceat(length, starts)
    return merged


def _pool_offsets(
    pool_offsets: object, count: int, fmt: BlockFormat, pool_bytes: int, block_bytes: int
) -> np.ndarray:
    """Pool payload offsets as int64, refused unless each can hold one block of ``fmt``."""
    if block_bytes < fmt.nbytes:
        raise KVLayoutError(
            f"a pool block of {block_bytes} bytes cannot hold one {fmt.order} block of "
            f"{fmt.spec} ({fmt.nbytes} bytes); create the pool with a block size of at least "
            f"{fmt.nbytes} bytes"
        )
    offs = np.asarray(pool_offsets)
    if offs.ndim != 1 or (offs.size and offs.dtype.kind not in "iu"):
        raise ValueError(f"pool offsets must be a 1-D sequence of ints, got {offs!r}")
    if len(offs) != count:
        raise ValueError(f"got {len(offs)} pool offsets for {count} blocks; pass one per block")
    offs = offs.astype(np.int64)
    bad = offs[(offs < 0) | (offs % LINE != 0) | (offs > pool_bytes - fmt.nbytes)]
    if bad.size:
        raise ValueError(
            f"pool offset {int(bad[0])} is not a {LINE}-byte aligned start of a "
            f"{fmt.nbytes}-byte block inside the {pool_bytes}-byte pool"
        )
    return offs


def _check_mover(mover: Any, layout: KVLayout) -> None:
    """Refuse a KV cache on one device moved by the mover of another."""
    device = getattr(mover, "device", None)  # a GpuPool's GPU; a Memory moves host memory
    if device is None and layout.device.type != "cpu":
        raise KVLayoutError(
            f"this {layout.kind} cache is on {layout.device}; the pool's Memory moves host "
            "memory: move it through beluga.transfer.gpu.GpuPool(pool) instead"
        )
    if device is not None and layout.device != device:
        raise KVLayoutError(
            f"this {layout.kind} cache is on {layout.device} but the GpuPool moves KV on "
            f"{device}; make the GpuPool for the cache's device"
        )


def block_table(layout: KVLayout, block_ids: np.ndarray, pool_offsets: np.ndarray) -> np.ndarray:
    """The scatter-gather table that moves whole engine blocks to or from pool blocks."""
    buffer, offset, in_block = layout.block_runs
    table = np.empty((len(block_ids), len(buffer), 4), dtype=np.uint64)
    table[:, :, 0] = buffer
    table[:, :, 1] = layout.block_starts(block_ids)[:, None] + offset
    table[:, :, 2] = pool_offsets[:, None] + in_block
    table[:, :, 3] = layout.run_bytes
    return coalesce(table.reshape(-1, 4))


def block_moves(
    mem: Memory | Any,
    layout: KVLayout,
    block_ids: Sequence[int] | np.ndarray,
    pool_offsets: Sequence[int] | np.ndarray,
    *,
    block_bytes: int,
    write: bool,
) -> tuple[list[Any], np.ndarray]:
    """The buffers and table that move whole engine blocks to (``write``) or from pool blocks.

    Everything is checked first (the mover's device, block ids, offsets, sizes,
    overlaps), so what comes back moves only what was asked.  ``KVStore.save`` /
    ``load`` hand them to ``Memory.write_blocks`` / ``Memory.read_blocks``, which
    checksum each block as it moves; ``gather_write`` / ``scatter_read`` below
    move them unchecked.
    """
    _check_mover(mem, layout)
    ids = layout.check_blocks(block_ids)
    offs = _pool_offsets(pool_offsets, len(ids), layout.format, mem.size, block_bytes)
    if write:
        ordered = np.sort(offs)
        if np.any(np.diff(ordered) < layout.format.nbytes):
            raise ValueError(
                "two pool blocks of this write overlap; each engine block needs its own pool block"
            )
    elif len(np.unique(ids)) != len(ids):
        raise ValueError("an engine block id appears twice; each read needs its own engine block")
    return layout.buffers, block_table(layout, ids, offs)


class EngineBlocks:
    """Whole engine blocks of a paged KV cache: a ``KVStore.save`` source or ``load`` sink.

    Value ``i`` is engine block ``block_ids[i]`` of ``layout``, in the block
    format of :mod:`beluga.transfer.format`.  ``mover``: None for a cache in
    host memory (the pool's ``Memory`` moves it), a ``GpuPool`` for one on
    its GPU.  ``at`` and ``value_bytes`` let a sink fill a part of each value:
    ``layout`` then describes the bytes ``[at, at + layout.format.nbytes)`` of
    values of ``value_bytes`` bytes (a layer-wise load; the whole value is
    still validated).  Stateless beyond its arguments; not thread-safe while
    a transfer runs over its cache (nothing is, the cache's bytes are moving).
    """

    def __init__(
        self,
        layout: KVLayout,
        block_ids: Sequence[int] | np.ndarray,
        *,
        mover: Any = None,
        at: int = 0,
        value_bytes: int | None = None,
    ) -> None:
        self.layout = layout
        self.block_ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        self.mover = mover
        self.at = at
        self.value_bytes = layout.format.nbytes if value_bytes is None else value_bytes
        if at < 0 or at % LINE or at + layout.format.nbytes > self.value_bytes:
            raise ValueError(
                f"bytes [{at}, +{layout.format.nbytes}) are not a {LINE}-byte aligned part of "
                f"a {self.value_bytes}-byte value"
            )

    def lengths(self) -> list[int]:
        return [self.value_bytes] * len(self.block_ids)

    def moves(
        self, mem: Memory, chosen: Sequence[int], places: Sequence[Place], *, write: bool
    ) -> tuple[list[Any], np.ndarray]:
        if write and (self.at or self.value_bytes != self.layout.format.nbytes):
            raise ValueError("a save stores whole values: make EngineBlocks without at/value_bytes")
        mover = self.mover if self.mover is not None else mem
        offs = np.array([p.payload_offset for p in places], dtype=np.int64) + self.at
        room = min((p.capacity for p in places), default=self.value_bytes) - self.at
        return block_moves(
            mover,
            self.layout,
            self.block_ids[np.asarray(chosen, dtype=np.int64)],
            offs,
            block_bytes=room,
            write=write,
        )


def gather_write(
    mem: Memory | Any,
    layout: KVLayout,
    block_ids: Sequence[int] | np.ndarray,
    pool_offsets: Sequence[int] | np.ndarray,
    *,
    block_bytes: int,
) -> int:
    """Copy engine blocks into pool blocks (non-temporal, fenced), unsealed; bytes moved.

    The raw move: a value is written and sealed by ``KVStore.save`` (``Memory.write_blocks``).
    """
    moves = block_moves(mem, layout, block_ids, pool_offsets, block_bytes=block_bytes, write=True)
    return mem.gather_write(*moves)


def scatter_read(
    mem: Memory | Any,
    layout: KVLayout,
    block_ids: Sequence[int] | np.ndarray,
    pool_offsets: Sequence[int] | np.ndarray,
    *,
    block_bytes: int,
) -> int:
    """Copy pool blocks into engine blocks (invalidating first), unchecked; bytes moved.

    The raw move: a value is read, validated, by ``KVStore.load`` (``Memory.read_blocks``).
    """
    moves = block_moves(mem, layout, block_ids, pool_offsets, block_bytes=block_bytes, write=False)
    return mem.scatter_read(*moves)


def sparse_shape(fmt: BlockFormat, positions: np.ndarray) -> tuple[int, int, int, int, int]:
    """Shape of what :func:`sparse_fetch` writes: [layers, 2 (K, V), kv_heads, k, head_dim]."""
    s = fmt.spec
    return (s.num_layers, 2, s.num_kv_heads, positions.shape[-1], s.head_dim)


def sparse_table(fmt: BlockFormat, pool_offsets: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The table that fetches chosen tokens' fragments, laid out as :func:`sparse_shape`."""
    s = fmt.spec
    num_layers, heads, k = positions.shape
    layer = np.arange(num_layers, dtype=np.int64)[:, None, None, None]
    kv = np.arange(2, dtype=np.int64)[None, :, None, None]
    head = np.arange(heads, dtype=np.int64)[None, None, :, None]
    block, token = np.divmod(positions[:, None], s.block_tokens)
    fragment = s.head_dim * s.itemsize
    table = np.empty((num_layers, 2, heads, k, 4), dtype=np.uint64)
    table[..., 0] = 0
    table[..., 1] = (np.arange(table.size // 4, dtype=np.int64) * fragment).reshape(table.shape[:4])
    table[..., 2] = pool_offsets[block] + fmt.fragment_offsets(layer, kv, token, head)
    table[..., 3] = fragment
    return coalesce(table.reshape(-1, 4))


def sparse_fetch(
    mem: Memory,
    fmt: BlockFormat,
    pool_offsets: Sequence[int] | np.ndarray,
    positions: np.ndarray,
    out: object,
    *,
    block_bytes: int,
) -> int:
    """Fetch the K and V of chosen tokens, per layer and KV head, from a sequence's pool blocks.

    ``pool_offsets[i]`` is the payload offset of the pool value holding engine
    block ``i``, tokens ``[i * block_tokens, (i + 1) * block_tokens)``;
    ``positions`` is an int array ``[layers, kv_heads, k]`` of token positions
    (top-k per layer and head); ``out`` is a writable buffer that receives
    ``sparse_shape(fmt, positions)`` elements.  ``mem``: the pool's ``Memory``
    (one C call), or a :class:`~beluga.transfer.gpu.GpuPool` with ``out`` a
    tensor on its GPU: one launch of its copy kernel straight from the pool's
    blocks (the fragments are far below the copy engines' crossover), after
    invalidating what this host may hold stale.  Raw, as on the CPU: the
    caller knows the blocks are published (the paper's top-k reads).
    Returns the bytes moved.
    """
    if not fmt.token_addressable:
        raise KVLayoutError(
            "CPU_ATTN blocks pack each head's tokens for the CPU's ISA; sparse fetch needs "
            "an NHD or HND block format"
        )
    pos = np.asarray(positions)
    s = fmt.spec
    want = (s.num_layers, s.num_kv_heads)
    if pos.ndim != 3 or pos.shape[:2] != want or pos.dtype.kind not in "iu":
        raise ValueError(
            f"positions must be an int array [{s.num_layers}, {s.num_kv_heads}, k] "
            f"(layers, kv heads, tokens), got shape {pos.shape} and dtype {pos.dtype}"
        )
    pos = pos.astype(np.int64)
    offs = np.asarray(pool_offsets)
    offs = _pool_offsets(offs, offs.size, fmt, mem.size, block_bytes)
    limit = len(offs) * s.block_tokens
    if pos.size and (pos.min() < 0 or pos.max() >= limit):
        raise ValueError(
            f"token positions must be in 0..{limit - 1}: the {len(offs)} pool blocks given "
            f"hold {limit} tokens"
        )
    need = int(np.prod(sparse_shape(fmt, pos))) * s.itemsize
    device = getattr(mem, "device", None)
    if device is not None and not isinstance(out, np.ndarray):  # a GpuPool: a tensor there
        if getattr(out, "device", None) != device or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous tensor on {device} (the GpuPool's device), got "
                f"{type(out).__name__} on {getattr(out, 'device', None)}"
            )
        have = out.numel() * out.element_size()
        if have < need:
            raise ValueError(
                f"out must hold at least {need} bytes (a {sparse_shape(fmt, pos)} {s.dtype} "
                f"tensor), got {have} bytes"
            )
        return mem.scatter_read([out], sparse_table(fmt, offs, pos))
    with memoryview(out) as view:
        if view.readonly or not view.c_contiguous or view.nbytes < need:
            raise ValueError(
                f"out must be a writable contiguous buffer of at least {need} bytes "
                f"(a {sparse_shape(fmt, pos)} {s.dtype} array), got {view.nbytes} bytes"
            )
    return mem.scatter_read([out], sparse_table(fmt, offs, pos))
