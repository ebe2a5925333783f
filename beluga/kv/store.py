"""KVStore: the client API, shaped after Mooncake Store's.

Writes go allocate (one RPC per batch) -> copy into the pool and publish the
header (no server involved) -> commit (one RPC per batch).  Reads need no
server at all: each is one call into the C core (``_core.Index``, index.c)
that digests the key, probes the pool-resident index with loads, confirms
the entry against the block header, copies the payload with its checksum
fused into the copy, and checks the header again.  A read that fails
validation (the key was just replaced or evicted) is retried once with a
fresh probe, then reported as a miss: never as data.  Reads keep working
while the metadata server is down or restarting.

Values are any buffer: bytes, bytearray, memoryview, numpy arrays, CPU torch
tensors (any dtype, contiguous), or a raw ``(address, size)`` pair.  Keys are
``str`` or ``bytes`` of at most 256 bytes; the pool stores their 16-byte
BLAKE2b digests.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from beluga._native import _core
from beluga.coherence import digest
from beluga.errors import BelugaError, WriteLeaseLost
from beluga.kv import protocol as p
from beluga.kv.tier import MooncakeTier, TierConfig, make_tier
from beluga.pool import Pool
from beluga.rpc import RpcClient

log = logging.getLogger("beluga.store")

MAX_KEY_BYTES = 256
Key = str | bytes


def key_bytes(key: Key) -> bytes:
    """A key as bytes, checked against the size limit."""
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if not raw or len(raw) > MAX_KEY_BYTES:
        raise ValueError(
            f"a key is 1..{MAX_KEY_BYTES} bytes, not {len(raw)}; hash longer keys "
            "(e.g. hashlib.sha256(key).digest())"
        )
    return raw


def as_buffer(obj: Any, writable: bool = False) -> memoryview:
    """A flat byte view of a value without copying it."""
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(x, int) for x in obj):
        address, size = obj
        if address <= 0 or size < 0:
            raise ValueError(f"a raw buffer is (address > 0, size >= 0), not {obj}")
        return memoryview((ctypes.c_char * size).from_address(address)).cast("B")
    if type(obj).__module__.startswith("torch"):
        if obj.device.type != "cpu" or not obj.is_contiguous():
            raise ValueError("a torch tensor value must be a contiguous CPU tensor")
        import torch

        obj = obj.reshape(-1).view(torch.uint8).numpy()
    try:
        view = memoryview(obj)
    except TypeError:
        raise ValueError(
            f"a value must support the buffer protocol, not {type(obj).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError("a value buffer must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("get_into needs a writable buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


@dataclass(frozen=True)
class BlockRef:
    """A value's place in the pool, for callers that move its payload themselves."""

    digest: bytes
    block: int
    version: int
    length: int
    header_offset: int
    payload_offset: int
    capacity: int  # bytes of the extent


class BlockWrite:
    """Extents reserved for one batch of in-place writes: the one write API of the
    block protocol (:meth:`KVStore.writing`).

    ``refs`` say where each payload goes; :meth:`fill` moves the bytes through
    one scatter-gather table (any mover), seals every block with the CRC of
    what was moved and commits them.  Leaving the ``with`` block without a
    fill, or with an exception, gives the extents back.  Not thread-safe (one
    writer fills one batch); not fork-safe (as its store).
    """

    def __init__(self, store: KVStore, refs: list[BlockRef]) -> None:
        self.store = store
        self.refs = refs
        self.done = False

    @property
    def payload_offsets(self) -> list[int]:
        return [r.payload_offset for r in self.refs]

    def fill(self, buffers: Sequence[Any], table: Any, mover: Any = None) -> None:
        """Move, seal and commit (see :meth:`KVStore.write_blocks`); at most once."""
        if self.done:
            raise ValueError("this BlockWrite was already filled; reserve a new one")
        self.done = True  # write_blocks aborts on its own failure: never abort twice
        self.store.write_blocks(self.refs, buffers, table, mover=mover)
        tier = self.store.tier
        if tier is not None and tier.config.write_through:
            for r in self.refs:  # the committed bytes, read back from the pool
                value = self.store.mem.read_bytes(
                    r.header_offset, r.payload_offset, r.capacity, r.digest, r.version
                )
                if isinstance(value, bytes):
                    tier.submit(r.digest, value, "write-through")


class KVStore:
    """A connection to a pool's metadata server, and direct access to its blocks.

    Thread-safe: threads may share one store.  Its RPC client serialises
    calls with a lock; reads and writes of the pool itself need none (each
    block has one writer, and reads validate); the read path's hit counters
    change only under the GIL.  Not fork-safe: the store is
    one host of the pool, so a forked child opens its own (writes through the
    parent's raise ``RpcError``; its reads, which need no server, still return
    only committed bytes but record no hits; closing it in the child leaves
    the parent connected).
    """

    def __init__(
        self,
        pool: Pool | str,
        *,
        coherence: str | None = None,
        depth: int = 32,
        host_id: int | None = None,
        timeout: float = 30.0,
        connect_timeout: float = 10.0,
        tier: MooncakeTier | TierConfig | str | None = None,
    ) -> None:
        """``tier``: the cross-pod tier (:mod:`beluga.kv.tier`); default ``BELUGA_TIER``."""
        self._owns_pool = not isinstance(pool, Pool)
        self.pool = Pool.attach(pool, coherence=coherence) if self._owns_pool else pool
        try:
            self.rpc = RpcClient(
                self.pool,
                depth=depth,
                host_id=host_id,
                timeout=timeout,
                connect_timeout=connect_timeout,
            )
        except BaseException:
            if self._owns_pool:
                self.pool.close()
            raise
        self.mem = self.pool.memory
        self.sb = self.pool.superblock
        sb = self.sb
        #: one-sided reads through the pool index; hits are recorded in this host's hint lines
        self.index = _core.Index(
            self.mem,
            sb.index.offset,
            sb.nbuckets,
            sb.headers.offset,
            sb.payloads.offset,
            sb.block_size,
            sb.nblocks,
            hint_off=sb.hint_offset(self.rpc.host_id),
            owner=self.rpc.entry.generation,
        )
        #: the tier beyond this pod (None: the pool alone); misses are looked up there
        self.tier = make_tier(tier)
        self._owns_tier = self.tier is not None and not isinstance(tier, MooncakeTier)

    # -- the tier beyond the pod -----------------------------------------------

    def _from_tier(self, keys: Sequence[Key]) -> list[bytes | None]:
        """Values of keys the pool missed, from the tier; found ones are promoted into the
        pool (best effort: a full pool or an absent server still returns the value)."""
        assert self.tier is not None
        values = self.tier.fetch(_core.key_digests(keys))
        found = [(k, v) for k, v in zip(keys, values, strict=True) if v is not None]
        promoted = 0
        if found:
            try:
                self.batch_put_from([k for k, _ in found], [v for _, v in found], tier=False)
                promoted = len(found)
            except (BelugaError, OSError) as exc:
                log.debug("promotion of %d values from the tier failed: %s", len(found), exc)
        self.index.count_tier(len(found), promoted)
        return values

    def _to_tier(self, digests: Sequence[bytes], values: Sequence[Any]) -> None:
        """Queue committed values for the tier (write-through)."""
        assert self.tier is not None
        for d, v in zip(digests, values, strict=True):
            self.tier.submit(d, bytes(v), "write-through")

    # -- plumbing ------------------------------------------------------------

    def _batches(self, op: p.StoreOp, n: int) -> Iterator[slice]:
        per = max(1, (self.rpc.max_payload - p.HEADER_BYTES) // p.RECORD_BYTES[op])
        for start in range(0, n, per):
            yield slice(start, min(n, start + per))

    def _extent_bytes(self, length: int) -> int:
        return max(1, -(-length // self.sb.block_size)) * self.sb.block_size

    def _ref(self, d: bytes, block: int, version: int, length: int) -> BlockRef:
        return BlockRef(
            d,
            block,
            version,
            length,
            self.sb.block_header_offset(block),
            self.sb.block_payload_offset(block),
            self._extent_bytes(length),
        )

    def _alloc(
        self, digests: list[bytes], lengths: list[int], key_lens: list[int]
    ) -> list[BlockRef]:
        items = list(zip(digests, lengths, key_lens, strict=True))
        grants = p.decode_grants(self.rpc.call(p.StoreOp.ALLOC, p.encode_alloc(items)))
        return [
            self._ref(d, g.block, g.version, n) for (d, n, _), g in zip(items, grants, strict=True)
        ]

    def _commit(self, refs: Sequence[BlockRef]) -> list[int]:
        """Commit ``refs`` (one COMMIT per RPC batch); the positions the server refused."""
        lost: list[int] = []
        for s in self._batches(p.StoreOp.COMMIT, len(refs)):
            done = p.decode_flags(
                self.rpc.call(
                    p.StoreOp.COMMIT,
                    p.encode_commit([(r.digest, r.block, r.version) for r in refs[s]]),
                )
            )
            lost += [s.start + i for i, ok in enumerate(done) if not ok]
        return lost

    def _commit_all(self, refs: Sequence[BlockRef]) -> None:
        """Commit ``refs``; WriteLeaseLost names those the server refused (the rest are in)."""
        lost = self._commit(refs)
        if lost:
            raise WriteLeaseLost(lost, len(refs))

    def abort(self, refs: Sequence[BlockRef]) -> None:
        """Give back extents reserved by :meth:`reserve` that will not be sealed."""
        for s in self._batches(p.StoreOp.ABORT, len(refs)):
            self.rpc.call(
                p.StoreOp.ABORT, p.encode_commit([(r.digest, r.block, r.version) for r in refs[s]])
            )

    # -- writes --------------------------------------------------------------

    def batch_put_from(self, keys: Sequence[Key], values: Sequence[Any], tier: bool = True) -> None:
        """Store many values; one ALLOC and one COMMIT RPC per batch.

        With a write-through tier the values are queued for it too (``tier``:
        False for values that came from it)."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        raw = [key_bytes(k) for k in keys]
        views = [as_buffer(v) for v in values]
        digests = [digest(k) for k in raw]
        lost: list[int] = []
        for s in self._batches(p.StoreOp.ALLOC, len(raw)):
            refs = self._alloc(digests[s], [len(v) for v in views[s]], [len(k) for k in raw[s]])
            try:
                for r, view, k in zip(refs, views[s], raw[s], strict=True):
                    self.mem.publish(
                        r.header_offset,
                        r.payload_offset,
                        r.digest,
                        r.version,
                        view,
                        key_len=len(k),
                        writer=self.rpc.host_id,
                        writer_gen=self.rpc.entry.generation,
                    )
            except BaseException:
                self.abort(refs)
                raise
            refused = set(self._commit(refs))
            lost += sorted(s.start + i for i in refused)
            if tier and self.tier is not None and self.tier.config.write_through:
                kept = [i for i in range(len(refs)) if i not in refused]
                self._to_tier([digests[s][i] for i in kept], [views[s][i] for i in kept])
        if lost:
            raise WriteLeaseLost(lost, len(raw))

    # -- in-place writes and reads (the KV data path) ------------------------

    @contextlib.contextmanager
    def writing(self, keys: Sequence[Key], lengths: Sequence[int]) -> Iterator[BlockWrite]:
        """Reserve extents for ``keys``; the caller fills them (``w.fill(buffers, table)``).

        Usage::

            with store.writing(keys, lengths) as w:
                buffers, table = block_moves(..., w.payload_offsets, ...)
                w.fill(buffers, table)

        Whatever goes wrong before the fill (building the table, a bad
        argument) gives the extents back; the fill itself seals and commits,
        or aborts and raises.
        """
        w = BlockWrite(self, self.reserve(keys, lengths))
        try:
            yield w
        finally:
            if not w.done:
                w.done = True
                self.abort(w.refs)

    def reserve(self, keys: Sequence[Key], lengths: Sequence[int]) -> list[BlockRef]:
        """Reserve extents and mark them WRITING; fill the payloads, then :meth:`seal`."""
        raw = [key_bytes(k) for k in keys]
        digests = [digest(k) for k in raw]
        refs: list[BlockRef] = []
        for s in self._batches(p.StoreOp.ALLOC, len(raw)):
            refs += self._alloc(digests[s], list(lengths[s]), [len(k) for k in raw[s]])
        for r, k in zip(refs, raw, strict=True):
            self.mem.begin_write(
                r.header_offset,
                r.payload_offset,
                r.digest,
                r.version,
                r.length,
                key_len=len(k),
                writer=self.rpc.host_id,
                writer_gen=self.rpc.entry.generation,
            )
        return refs

    def seal(self, refs: Sequence[BlockRef]) -> None:
        """Checksum payloads written in place, publish their headers, and commit them."""
        for r in refs:
            self.mem.seal(
                r.header_offset,
                r.payload_offset,
                r.digest,
                r.version,
                r.length,
                writer=self.rpc.host_id,
                writer_gen=self.rpc.entry.generation,
            )
        self._commit_all(refs)

    def locate(self, keys: Sequence[Key], prefix: bool = True) -> list[BlockRef | None]:
        """Where keys live, from the pool index (no RPC); with ``prefix``, up to and
        including the first miss.  Read them with :meth:`read_blocks`, which checks
        every block again: a block replaced since is a miss, never other bytes."""
        found = self.index.locate(keys, prefix=prefix)
        if self.tier is not None and None in found:
            # misses of the pool: promote what the tier holds, then look again
            first = found.index(None)
            missing = (
                list(keys[first:])
                if prefix
                else [keys[i] for i, f in enumerate(found) if f is None]
            )
            got = self._from_tier(missing)
            if any(v is not None for v in got):
                found = self.index.locate(keys, prefix=prefix)
        return [None if loc is None else self._ref(*loc) for loc in found]

    def write_blocks(
        self, refs: Sequence[BlockRef], buffers: Sequence[Any], table: Any, mover: Any = None
    ) -> None:
        """Fill reserved blocks through one scatter-gather table, seal them, commit them.

        The one write call of the block protocol for payloads moved in place:
        ``refs`` from :meth:`reserve`, ``table`` rows of (buffer index, buffer
        offset, pool offset, length) covering each block's payload, e.g. from
        ``beluga.transfer.block_moves``.  Each block's CRC32C is taken from the
        source bytes as they are stored, so bytes in an extent that this
        writer did not put there can never be sealed in.  ``mover``: a
        ``GpuPool`` for a KV cache on its GPU (its kernel moves the bytes and
        the checksum is taken from the pool afterwards).  Raises
        ``WriteLeaseLost`` naming the blocks whose write lease ran out first
        (the others are committed): put those values again.
        """
        host, gen = self.rpc.host_id, self.rpc.entry.generation
        try:
            if mover is not None and mover is not self.mem:
                mover.gather_write(buffers, table)
                for r in refs:
                    self.mem.seal(
                        r.header_offset,
                        r.payload_offset,
                        r.digest,
                        r.version,
                        r.length,
                        writer=host,
                        writer_gen=gen,
                    )
            else:
                blocks = [
                    (r.header_offset, r.payload_offset, r.digest, r.version, r.length, 0, host, gen)
                    for r in refs
                ]
                self.mem.write_blocks(buffers, table, blocks)
        except BaseException:
            self.abort(refs)  # nothing was sealed: give the extents back
            raise
        self._commit_all(refs)

    def read_blocks(
        self, refs: Sequence[BlockRef], buffers: Sequence[Any], table: Any, mover: Any = None
    ) -> list[bool]:
        """Copy whole blocks out of the pool through one table, each one validated.

        The one read call of the block protocol for payloads moved in place:
        ``refs`` from :meth:`locate`, ``table`` as for :meth:`write_blocks`.
        Per block: its header is checked (this key, this version, published),
        the CRC32C of its bytes *as copied* must be the header's, and the
        header must not have changed meanwhile.  True where the destination
        holds the committed value; False where the block was replaced,
        evicted, torn or corrupted: those destination bytes are garbage.
        ``mover``: a ``GpuPool`` for a KV cache on its GPU; its kernel copies,
        then the pool's bytes are checksummed by the CPU (one more read).

        ``refs`` may name one pool block twice (two requests of one batch that
        share a prefix block): the block is validated once for all its rows,
        and a ref of another version than the first is a miss.
        """
        first: dict[int, int] = {}
        unique: list[BlockRef] = []
        for r in refs:
            if r.block not in first:
                first[r.block] = len(unique)
                unique.append(r)
        blocks = [
            (r.header_offset, r.payload_offset, r.capacity, r.digest, r.version) for r in unique
        ]
        if mover is None or mover is self.mem:
            got = self.mem.read_blocks(buffers, table, blocks)
        else:
            before = self.check(unique)
            mover.scatter_read(buffers, table)
            whole = bytearray(sum(r.length for r in unique))
            rows, at = [], 0
            for r in unique:
                rows.append((0, at, r.payload_offset, r.length))
                at += r.length
            got = self.mem.read_blocks([whole], np.array(rows, dtype=np.uint64), blocks)
            got = [g if ok else -1 for g, ok in zip(got, before, strict=True)]
        valid = [g == r.length for g, r in zip(got, unique, strict=True)]
        return [valid[first[r.block]] and unique[first[r.block]] == r for r in refs]

    def check(self, refs: Sequence[BlockRef]) -> list[bool]:
        """Whether each block is still the published version (call before and after a copy)."""
        return [
            self.mem.check_header(
                r.header_offset, r.payload_offset, r.capacity, r.digest, r.version
            )
            == r.length
            for r in refs
        ]

    def put_from(self, key: Key, value: Any) -> None:
        self.batch_put_from([key], [value])

    def put(self, key: Key, value: Any) -> None:
        self.batch_put_from([key], [value])

    def put_batch(self, keys: Sequence[Key], values: Sequence[Any]) -> None:
        self.batch_put_from(keys, values)

    def remove(self, key: Key) -> bool:
        """Delete a key; False if it was not there."""
        (found,) = p.decode_flags(
            self.rpc.call(p.StoreOp.REMOVE, p.encode_digests([digest(key_bytes(key))]))
        )
        return found

    # -- reads ---------------------------------------------------------------

    def get_batch(self, keys: Sequence[Key]) -> list[bytes | None]:
        """Values of many keys (None for a miss); no RPC."""
        out = self.index.get_many(keys)
        if self.tier is not None and None in out:
            misses = [i for i, v in enumerate(out) if v is None]
            for i, v in zip(misses, self._from_tier([keys[i] for i in misses]), strict=True):
                out[i] = v
        return out

    def get(self, key: Key) -> bytes | None:
        """A key's value, or None on a miss; no RPC (one call into the C core)."""
        value = self.index.get(key)
        if value is None and self.tier is not None:
            return self._from_tier([key])[0]
        return value

    def _into(self, value: bytes, buffer: Any) -> int:
        """A value from the tier into a caller's buffer (the checks of get_into)."""
        view = as_buffer(buffer, writable=True)
        if len(view) < len(value):
            raise ValueError(
                f"the buffer holds {len(view)} bytes but the value is {len(value)} bytes; "
                "pass a buffer of at least that size"
            )
        view[: len(value)] = value
        return len(value)

    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[int]:
        """Read many values into caller buffers; each result is the length, or -1 for a miss.

        One call into the C core for the whole batch, no RPC.
        """
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        out = self.index.get_many_into(keys, [as_buffer(b, writable=True) for b in buffers])
        if self.tier is not None and -1 in out:
            misses = [i for i, n in enumerate(out) if n < 0]
            for i, v in zip(misses, self._from_tier([keys[i] for i in misses]), strict=True):
                if v is not None:
                    out[i] = self._into(v, buffers[i])
        return out

    def get_into(self, key: Key, buffer: Any) -> int:
        """Read a value into ``buffer``: its length, or -1 for a miss; no RPC."""
        try:
            n = self.index.get_into(key, buffer)
        except (TypeError, BufferError):  # a torch tensor, a raw (address, size) pair
            n = self.index.get_into(key, as_buffer(buffer, writable=True))
        if n < 0 and self.tier is not None:
            value = self._from_tier([key])[0]
            if value is not None:
                return self._into(value, buffer)
        return n

    def batch_is_exist(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each key is stored (in the pool, or else in the tier)."""
        out = self.index.exists(keys)
        if self.tier is not None and not all(out):
            misses = [i for i, there in enumerate(out) if not there]
            digests = _core.key_digests([keys[i] for i in misses])
            for i, there in zip(misses, self.tier.exists(digests), strict=True):
                out[i] = there
        return out

    def is_exist(self, key: Key) -> bool:
        if self.index.exists_one(key):
            return True
        return self.tier is not None and self.tier.exists(_core.key_digests([key]))[0]

    def lookup_prefix(self, keys: Sequence[Key]) -> int:
        """How many leading keys of a chain are stored (one call, no RPC; then the tier
        for the rest of the chain, whose values a later read promotes)."""
        n = sum(self.index.exists(keys, prefix=True))
        if n < len(keys) and self.tier is not None:
            there = self.tier.exists(_core.key_digests(keys[n:]))
            n += next((i for i, t in enumerate(there) if not t), len(there))
        return n

    def stats(self) -> dict[str, Any]:
        """The server's counters (capacity, use, hits, misses, evictions, leases).

        This store's hits and misses are stored first, so they are in the answer.
        """
        self.index.flush_hints()
        stats = json.loads(self.rpc.call(p.StoreOp.STATS))
        if self.tier is not None:
            stats["client_tier"] = self.tier.stats()
        return stats

    # -- life cycle ----------------------------------------------------------

    def close(self) -> None:
        if not self.mem.released:
            with contextlib.suppress(Exception):  # closing: hints are only hints
                self.index.flush_hints()
        if self.tier is not None and self._owns_tier:
            self.tier.close()
        self.rpc.close()
        if self._owns_pool:
            self.pool.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
