"""What one GPU move does: copy-engine runs, kernel rows and CRC segments, from one table.

The data path hands the GPU path the same checked scatter-gather table as the
CPU path (rows of buffer index, buffer offset, pool offset, length; adjacent
runs already merged by :func:`beluga.transfer.datapath.coalesce`).
:func:`plan_moves` turns it into a :class:`Plan`, with numpy over whole
arrays (no Python loop per row or per block):

- rows of at least ``crossover`` bytes go to the copy engines (one batched
  submission), shorter ones to the SM copy kernel: one descriptor per piece
  costs a DMA engine more than a small piece is worth;
- with ``blocks`` (each block's payload offset, length and the CRC its
  header carries), the rows are cut at block boundaries and each block's
  bytes become CRC segments in GPU memory: for a load, where they land (bytes
  the table does not bring, a partial load's, are checksummed where they are
  in the pool, so the whole value is still validated; rows that overlap count
  once); for a save, where they come from, which must tile the block exactly
  once, else the block is marked untiled and its seal takes the CRC from the
  pool as before.

Everything is plain data: the CUDA runtime uploads it, the stand-in runtime
of the tests runs it on the CPU.  Pure functions: thread-safe and fork-safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from beluga.transfer.gpu.kernels import BLOCK_DTYPE, LANES, ROW_DTYPE, SEG_DTYPE, init_terms

#: rows at least this long go to the copy engines, shorter ones to the SM kernel.  A guess
#: from vLLM's finding (its kernel won below ~28 KiB pieces on its GPUs): MEASURE it on the
#: machine (``beluga bench gpu`` prints the crossover sweep) and pass it to GpuPool.
CROSSOVER = 32 << 10
#: bytes per lane of the CRC kernel (a warp checksums up to LANES of them per segment)
CRC_CHUNK = 256


@dataclass
class Plan:
    """One move, as data: copy-engine runs, kernel rows, CRC segments and blocks."""

    ce_src: np.ndarray
    ce_dst: np.ndarray
    ce_len: np.ndarray
    rows: np.ndarray  # ROW_DTYPE
    segs: np.ndarray = field(default_factory=lambda: np.zeros(0, SEG_DTYPE))
    blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, BLOCK_DTYPE))
    chunk: int = CRC_CHUNK
    #: per block: True where the rows tile it exactly once (a save can seal it with its CRC)
    tiled: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    #: per block: True where a row reads past its length (a load's LENGTH miss)
    too_long: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))

    @property
    def copy_bytes(self) -> int:
        return int(self.ce_len.sum()) + int(self.rows["len"].sum())


def _addresses(
    table: np.ndarray, bases: np.ndarray, pool_device: int, *, to_pool: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(source, destination) device addresses of each row."""
    engine = bases[table[:, 0].astype(np.int64)] + table[:, 1]
    pool = np.uint64(pool_device) + table[:, 2]
    return (engine, pool) if to_pool else (pool, engine)


def split_copies(
    table: np.ndarray, bases: np.ndarray, pool_device: int, *, to_pool: bool, crossover: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Copy-engine (src, dst, len) arrays and kernel rows of a table, split at ``crossover``."""
    src, dst = _addresses(table, bases, pool_device, to_pool=to_pool)
    n = table[:, 3]
    big = n >= np.uint64(crossover)
    rows = np.zeros(int((~big).sum()), ROW_DTYPE)
    rows["src"], rows["dst"], rows["len"] = src[~big], dst[~big], n[~big]
    return (
        np.ascontiguousarray(src[big]),
        np.ascontiguousarray(dst[big]),
        np.ascontiguousarray(n[big]),
        rows,
    )


def cut_at_blocks(
    table: np.ndarray, starts: np.ndarray, caps: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Rows cut where they cross from one block's extent into the next: (pieces, block index).

    ``starts``/``caps``: the blocks' payload offsets and extent bytes, sorted by offset.
    ValueError if a byte lies outside every extent (the caller's table is wrong).
    """
    pieces = table.astype(np.uint64, copy=True)
    out_rows, out_blocks = [], []
    while len(pieces):
        p = pieces[:, 2].astype(np.int64)
        k = np.searchsorted(starts, p, side="right") - 1
        if np.any(k < 0):
            raise ValueError("a row reads or writes pool bytes outside every block of the call")
        end_extent = starts[k] + caps[k]
        if np.any(p >= end_extent):
            raise ValueError("a row reads or writes pool bytes outside every block of the call")
        n = pieces[:, 3].astype(np.int64)
        over = p + n > end_extent
        head = pieces.copy()
        head[over, 3] = (end_extent[over] - p[over]).astype(np.uint64)
        out_rows.append(head)
        out_blocks.append(k)
        rest = pieces[over].copy()
        took = head[over, 3]
        rest[:, 1] += took
        rest[:, 2] += took
        rest[:, 3] -= took
        pieces = rest
    if not out_rows:
        return np.zeros((0, 4), np.uint64), np.zeros(0, np.int64)
    return np.concatenate(out_rows), np.concatenate(out_blocks)


def _segments(
    addr: np.ndarray, length: np.ndarray, after: np.ndarray, block: np.ndarray, chunk: int
) -> np.ndarray:
    """CRC pieces cut into warp segments of at most LANES * chunk bytes."""
    span = LANES * chunk
    count = np.maximum((length + span - 1) // span, 0).astype(np.int64)
    total = int(count.sum())
    segs = np.zeros(total, SEG_DTYPE)
    if not total:
        return segs
    which = np.repeat(np.arange(len(length)), count)
    first = np.concatenate(([0], np.cumsum(count)[:-1]))
    k = (np.arange(total) - first[which]).astype(np.uint64)
    start = k * np.uint64(span)
    n = np.minimum(np.uint64(span), length[which] - start)
    segs["addr"] = addr[which] + start
    segs["len"] = n
    segs["after"] = after[which] + (length[which] - start - n)
    segs["block"] = block[which]
    return segs


def crc_segments(
    pieces: np.ndarray,
    piece_block: np.ndarray,
    bases: np.ndarray,
    pool_device: int,
    starts: np.ndarray,
    lengths: np.ndarray,
    *,
    chunk: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CRC segments of every block (sorted by offset) from its cut pieces: (segs, tiled, too_long).

    Each piece's bytes are taken where they are on the engine's side (a load's
    destination, a save's source); bytes no piece covers are taken from the
    pool (``pool_device`` + offset); bytes two pieces cover count once; bytes
    past a block's length count not at all and mark it ``too_long``.
    ``tiled``: the pieces cover the block exactly once, nothing past its length.
    """
    nblocks = len(starts)
    order = np.argsort(pieces[:, 2], kind="stable")
    pieces, piece_block = pieces[order], piece_block[order]
    p = pieces[:, 2].astype(np.int64)
    e = p + pieces[:, 3].astype(np.int64)
    bstart = starts[piece_block]
    bend = bstart + lengths[piece_block]
    too_long = np.zeros(nblocks, bool)
    np.logical_or.at(too_long, piece_block, e > bend)
    e_clip = np.minimum(e, bend)
    reach = np.maximum.accumulate(e_clip) if len(e_clip) else e_clip
    prev = np.concatenate(([np.iinfo(np.int64).min], reach[:-1])) if len(reach) else reach
    prev = np.maximum(prev, bstart)
    eff = np.maximum(p, prev)
    keep = eff < e_clip
    engine = bases[pieces[:, 0].astype(np.int64)] + pieces[:, 1]
    # pieces' own bytes
    addr = [engine[keep] + (eff[keep] - p[keep]).astype(np.uint64)]
    off = [eff[keep]]
    ln = [e_clip[keep] - eff[keep]]
    blk = [piece_block[keep]]
    # gaps before a piece (inside its block), then after each block's last piece
    gap = p > prev
    gap_start = prev[gap]
    gap_end = np.minimum(p[gap], bend[gap])
    ok_gap = gap_end > gap_start
    gs, ge, gb = gap_start[ok_gap], gap_end[ok_gap], piece_block[gap][ok_gap]
    last = np.full(nblocks, -1, np.int64)
    if len(reach):
        np.maximum.at(last, piece_block, reach)
    last = np.maximum(last, starts)
    tail_end = starts + lengths
    tail = last < tail_end
    gs = np.concatenate((gs, last[tail]))
    ge = np.concatenate((ge, tail_end[tail]))
    gb = np.concatenate((gb, np.flatnonzero(tail)))
    addr.append(np.uint64(pool_device) + gs.astype(np.uint64))
    off.append(gs)
    ln.append(ge - gs)
    blk.append(gb)
    addr_a, off_a = np.concatenate(addr), np.concatenate(off)
    len_a, blk_a = np.concatenate(ln), np.concatenate(blk).astype(np.int64)
    after = (starts[blk_a] + lengths[blk_a] - off_a - len_a).astype(np.uint64)
    overlapped = np.zeros(nblocks, bool)
    np.logical_or.at(overlapped, piece_block, eff > p)
    gapped = np.zeros(nblocks, bool)
    gapped[gb] = True
    tiled = ~(overlapped | gapped | too_long)
    segs = _segments(addr_a, len_a.astype(np.uint64), after, blk_a.astype(np.uint64), chunk)
    return segs, tiled, too_long


def plan_moves(
    table: np.ndarray,
    bases: np.ndarray,
    pool_device: int,
    *,
    to_pool: bool,
    crossover: int = CROSSOVER,
    blocks: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
    chunk: int = CRC_CHUNK,
) -> Plan:
    """The plan of one move; ``blocks``: (payload offsets, lengths, extent bytes, expected
    CRCs), in any order, to checksum whole blocks (plan.blocks follows that order)."""
    table = np.asarray(table, dtype=np.uint64).reshape(-1, 4)
    bases = np.asarray(bases, dtype=np.uint64)
    ce_src, ce_dst, ce_len, rows = split_copies(
        table, bases, pool_device, to_pool=to_pool, crossover=crossover
    )
    plan = Plan(ce_src, ce_dst, ce_len, rows, chunk=chunk)
    if blocks is None:
        return plan
    offs, lengths, caps, expect = (np.asarray(a, dtype=np.int64) for a in blocks)
    order = np.argsort(offs, kind="stable")
    starts, lens_s, caps_s = offs[order], lengths[order], caps[order]
    if len(starts) > 1 and np.any(starts[1:] < starts[:-1] + caps_s[:-1]):
        raise ValueError("two blocks of one call overlap in the pool; give each block once")
    pieces, k = cut_at_blocks(table, starts, caps_s)
    segs, tiled_s, long_s = crc_segments(pieces, k, bases, pool_device, starts, lens_s, chunk=chunk)
    # segments name blocks in sorted order: renumber to the caller's order
    segs["block"] = order[segs["block"].astype(np.int64)].astype(np.uint64)
    nblocks = len(offs)
    plan.segs = segs
    plan.blocks = np.zeros(nblocks, BLOCK_DTYPE)
    plan.blocks["init"] = init_terms(lengths)
    plan.blocks["total"] = lengths.astype(np.uint64)
    plan.blocks["expect"] = expect.astype(np.uint64)
    plan.tiled = np.empty(nblocks, bool)
    plan.tiled[order] = tiled_s
    plan.too_long = np.empty(nblocks, bool)
    plan.too_long[order] = long_s
    return plan
