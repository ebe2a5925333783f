"""KVStore: the client API, shaped after Mooncake Store's, and the one data path.

Every write goes through ``save(keys, source)`` (``put`` and
``batch_put_from`` are saves that replace), with the source a
:class:`beluga.transfer.Values` that says where the caller's bytes are.
Reads come two ways, both validated the same way in C:

- ``locate(keys)`` then ``load(refs, sink)``, for callers that move values
  into places of their own (the serving engine's, the vLLM worker's, SGLang's
  and LMCache's KV blocks, the Mooncake drop-in's ranges): the refs say where
  each value lies, the sink where it goes;
- ``get``, ``get_batch``, ``get_into`` and ``batch_get_into`` read by key.
  They are their own C path (``_core.Index``, index.c) because a read by key
  needs nothing of Python between the lookup and the copy: one call digests
  the keys, probes the pool-resident index with loads, confirms each entry
  against its block header, copies the payload with its checksum fused into
  the copy, and checks the header again, for the whole batch, with no ref
  made per value.

The store runs the protocol inside, and nobody else repeats its steps.
Writes go allocate (one RPC per batch) -> copy into the pool and seal the
headers (no server involved) -> commit (one RPC per batch).  Reads need no
server at all.  A read by key that fails validation (the key was just
replaced or evicted) is retried once with a fresh probe, then reported as a
miss; a load reports it as a miss: never as data.  Reads keep working while
the metadata server is down or restarting.

Values are any buffer: bytes, bytearray, memoryview, numpy arrays, CPU torch
tensors (any dtype, contiguous), or a raw ``(address, size)`` pair.  Keys are
``str`` or ``bytes`` of at most 256 bytes; the pool stores the first 16 bytes
of their BLAKE3 digests (layout 4 on; :func:`beluga.coherence.digest`).

A store given a tier, or with ``BELUGA_TIER`` set, holds a
:class:`~beluga.kv.tiered.StoreTier` that its reads hand their pool misses to
(:meth:`KVStore.__init__`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from beluga._native import _core
from beluga.coherence import Miss, digest
from beluga.errors import RpcError, WriteLeaseLost
from beluga.kv import protocol as p
from beluga.kv.tier import MooncakeTier, TierConfig
from beluga.kv.tiered import StoreTier
from beluga.pool import Pool
from beluga.rpc import RpcClient
from beluga.transfer.buffers import Buffers, Values, as_buffer

log = logging.getLogger("beluga.store")

MAX_KEY_BYTES = _core.MAX_KEY_BYTES  # the C core owns the limit
Key = str | bytes
#: a save waiting for another write of its keys asks the server again this often (seconds)
RECHECK_S = 0.05
#: what a read finds when a value itself is bad (not replaced or evicted): its payload fails
#: its checksum, or its header is not one, or claims an impossible length
_CORRUPT = frozenset(int(m) for m in (Miss.CHECKSUM, Miss.MAGIC, Miss.LENGTH))
#: buffers the C core reads into as they are (the buffer protocol); others go through as_buffer
_PLAIN_BUFFERS = frozenset((np.ndarray, bytearray, memoryview))


def key_bytes(key: Key) -> bytes:
    """A key as bytes, checked against the size limit."""
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if not raw or len(raw) > MAX_KEY_BYTES:
        raise ValueError(
            f"a key is 1..{MAX_KEY_BYTES} bytes, not {len(raw)}; hash longer keys "
            "(e.g. hashlib.sha256(key).digest())"
        )
    return raw


@dataclass
class _Outcome:
    """What the rounds of one save did so far."""

    stored: list[int] = field(default_factory=list)
    present: list[int] = field(default_factory=list)
    writing: list[int] = field(default_factory=list)
    refs: list[BlockRef] = field(default_factory=list)  # of the stored ones


@dataclass(frozen=True)
class Saved:
    """What one :meth:`KVStore.save` did with each of its keys (positions, ascending)."""

    stored: list[int]  # committed by this call
    present: list[int]  # skipped: committed already (by anyone), now in the pool
    lost: list[int]  # every attempt's write lease ran out: not stored (save them again)
    in_flight: list[int] = field(default_factory=list)  # another write was still storing
    # them when the wait for it ended: not in the pool yet (it commits them, or they are missing)


@dataclass(frozen=True)
class Retired:
    """What :meth:`KVStore.retired` found: the digests (:func:`beluga.coherence.digest`) of
    the keys that left the pool, oldest first, and the cursor to ask from next."""

    digests: list[bytes]
    cursor: tuple[int, int]  # (the server's life, the next number)
    gap: bool  # some may be missing: the server restarted, or more left than it keeps


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
        """Attach to ``pool`` (a Pool, or a spec to attach by) and connect to its server.

        ``tier``: the cross-pod tier (:mod:`beluga.kv.tier`: a MooncakeTier, a
        TierConfig or a spec string); None: ``BELUGA_TIER``, if set.  With one,
        the store holds a :class:`~beluga.kv.tiered.StoreTier` (``self.tier``),
        which its reads hand their pool misses to and its saves their commits
        (write-through); without one, ``self.tier`` is None and the store is
        the pool alone.  A tier the store made from a config or spec is closed
        with it; a MooncakeTier given stays the caller's.
        """
        #: the tier beyond this pod, or None (the pool alone)
        self.tier = StoreTier.make(tier)
        self._owns_pool = not isinstance(pool, Pool)
        try:
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
        except BaseException:
            if self.tier is not None:
                self.tier.close()
            raise
        self.mem = self.pool.memory
        self.sb = self.pool.superblock
        sb = self.sb
        #: one-sided reads through the pool index; hits are recorded in this host's hint lines
        self.index = self.pool.index_reader(
            self.mem, hint_off=sb.hint_offset(self.rpc.host_id), owner=self.rpc.entry.generation
        )

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

    def _reserve(
        self,
        chosen: Sequence[int],
        raw: Sequence[bytes],
        digests: Sequence[bytes],
        lengths: Sequence[int],
        skip: bool,
    ) -> tuple[list[BlockRef], list[int], list[int], list[int]]:
        """Reserve extents for keys ``chosen`` (one ALLOC per batch) and mark them WRITING.

        Returns the refs, the positions they were granted for, and the positions
        skipped (with ``skip``) because the key is committed, and because
        another write of it is in flight.
        """
        refs: list[BlockRef] = []
        granted: list[int] = []
        present: list[int] = []
        writing: list[int] = []
        flags = p.ALLOC_SKIP_PRESENT if skip else 0
        for s in self._batches(p.StoreOp.ALLOC, len(chosen)):
            batch = chosen[s]
            items = [(digests[i], lengths[i], len(raw[i])) for i in batch]
            reply = self.rpc.call(p.StoreOp.ALLOC, p.encode_alloc(items, flags))
            for i, g in zip(batch, p.decode_grants(reply), strict=True):
                if g.present == p.PRESENT_COMMITTED:
                    present.append(i)
                elif g.present == p.PRESENT_WRITING:
                    writing.append(i)
                else:
                    refs.append(self._ref(digests[i], g.block, g.version, lengths[i]))
                    granted.append(i)
        try:
            for r, i in zip(refs, granted, strict=True):
                self.mem.begin_write(
                    r.header_offset,
                    r.payload_offset,
                    r.digest,
                    r.version,
                    r.length,
                    key_len=len(raw[i]),
                    writer=self.rpc.host_id,
                    writer_gen=self.rpc.entry.generation,
                )
        except BaseException:
            self._abort(refs)
            raise
        return refs, granted, present, writing

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

    def _abort(self, refs: Sequence[BlockRef]) -> None:
        """Give back reserved extents that will not be sealed."""
        for s in self._batches(p.StoreOp.ABORT, len(refs)):
            self.rpc.call(
                p.StoreOp.ABORT, p.encode_commit([(r.digest, r.block, r.version) for r in refs[s]])
            )

    def _fill(self, refs: list[BlockRef], granted: list[int], source: Values) -> list[int]:
        """Move the source's values ``granted`` into their extents, seal and commit them;
        the positions (of ``refs``) whose commit was refused.  Anything that fails before
        the seal gives every extent back and raises."""
        if not refs:
            return []
        try:
            buffers, table = source.moves(self.mem, granted, refs, write=True)
            self._move_and_seal(refs, buffers, table, source.mover)
        except BaseException:
            self._abort(refs)  # nothing was committed: give the extents back
            raise
        return self._commit(refs)

    def _move_and_seal(
        self, refs: Sequence[BlockRef], buffers: Sequence[Any], table: Any, mover: Any
    ) -> None:
        """Fill reserved blocks through one scatter-gather table and seal their headers.

        Each block's CRC32C is taken from the source bytes as they are stored,
        so bytes in an extent that this writer did not put there can never be
        sealed in.  ``mover``: None (the pool's ``Memory``), or a ``GpuPool`` for
        a KV cache on its GPU, which takes the same arguments and computes each
        block's CRC on the GPU from its source bytes.
        """
        host, gen = self.rpc.host_id, self.rpc.entry.generation
        blocks = [
            (r.header_offset, r.payload_offset, r.digest, r.version, r.length, 0, host, gen)
            for r in refs
        ]
        (self.mem if mover is None else mover).write_blocks(buffers, table, blocks)

    def _read_blocks(
        self, refs: Sequence[BlockRef], buffers: Sequence[Any], table: Any, mover: Any
    ) -> list[int]:
        """Copy whole blocks out of the pool through one table, each one validated.

        Per block: its header is checked (this key, this version, published),
        the CRC32C of its bytes *as copied* must be the header's, and the
        header must not have changed meanwhile.  Each ref's value length where
        the destination holds the committed value, else a negative miss code
        (``beluga.coherence.Miss``).  ``mover``: None (the pool's ``Memory``,
        one C call), or a ``GpuPool`` for a KV cache on its GPU, which takes the
        same arguments: the CPU checks the headers, the GPU the CRC of the bytes
        where they landed (no CPU read of a payload).  ``refs`` may name one pool
        block twice (two requests of one batch that share a prefix block): the
        block is validated once for all its rows, and a ref of another version
        than the first is a miss.
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
        got = list((self.mem if mover is None else mover).read_blocks(buffers, table, blocks))
        return [
            got[first[r.block]] if unique[first[r.block]] == r else int(Miss.VERSION) for r in refs
        ]

    # -- the data path: save and load ----------------------------------------

    def save(
        self,
        keys: Sequence[Key],
        source: Values,
        *,
        replace: bool = False,
        attempts: int = 1,
        wait_s: float = 2.0,
    ) -> Saved:
        """Store one value per key from ``source``: the one write call of the data path.

        Reserve (one ALLOC RPC per batch, each extent marked WRITING), move
        every value through one scatter-gather table (non-temporal stores,
        the CRC32C of each block taken from the bytes as they are stored),
        seal each header, commit (one COMMIT RPC per batch).  Nobody can see a
        value before its commit.  ``source``: a :class:`beluga.transfer.Values`
        (:class:`~beluga.transfer.Buffers`, :class:`~beluga.transfer.Pieces`,
        :class:`~beluga.transfer.EngineBlocks`).

        Unless ``replace``, a key that is committed already is granted
        nothing and skipped (``Saved.present``): duplicate work costs no pool
        capacity and never evicts a committed value.  A key that another
        write (any host's) is storing under a live lease is skipped too, and
        waited for, up to ``wait_s``, with one-sided lookups: once that write
        commits it is ``present``; if its writer gives up, this call writes
        it; if it is still being written then, it is ``in_flight`` (with
        ``wait_s`` 0: at once).  The server counts every ALLOC answer that
        skipped a key (``duplicate_writes_skipped``), so a save that waits and
        asks again counts a key more than once.  With ``replace`` the
        new value replaces the old one (``put``).  A write whose lease ran out
        is refused at its commit and tried again, ``attempts`` times in all,
        then reported in ``Saved.lost``.  Anything that fails before the
        seal gives every reserved extent back and raises (nothing is stored
        for that attempt).
        """
        lengths = list(source.lengths())
        if len(lengths) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(lengths)} values")
        if attempts < 1:
            raise ValueError(f"attempts is at least 1, not {attempts}")
        raw = [key_bytes(k) for k in keys]
        digests = [digest(k) for k in raw]
        out = _Outcome()
        todo = list(range(len(raw)))
        for _ in range(attempts):
            if not todo:
                break
            todo = self._save_round(out, todo, raw, digests, lengths, source, not replace)
        deadline = time.monotonic() + wait_s
        while out.writing and wait_s > 0:  # others are storing duplicates: wait, bounded
            waiting, out.writing = out.writing, []
            until = min(deadline, time.monotonic() + RECHECK_S)
            landed, rest = self._await_others(waiting, raw, until)
            out.present += landed
            if not rest:
                break
            # ask again: what a writer gave up is ours to write; the rest stays in flight
            todo += self._save_round(out, rest, raw, digests, lengths, source, True)
            if time.monotonic() >= deadline:
                break
        if self.tier is not None:  # write-through, if the tier asks for it
            self.tier.committed(self, out.refs)
        return Saved(sorted(out.stored), sorted(out.present), sorted(todo), sorted(out.writing))

    def _save_round(
        self,
        out: _Outcome,
        todo: list[int],
        raw: Sequence[bytes],
        digests: Sequence[bytes],
        lengths: Sequence[int],
        source: Values,
        skip: bool,
    ) -> list[int]:
        """One reserve, move, seal and commit of keys ``todo``, added to ``out``; the keys
        whose commit was refused (a lost write lease)."""
        refs, granted, present, writing = self._reserve(todo, raw, digests, lengths, skip)
        out.present += present
        out.writing += writing
        refused = set(self._fill(refs, granted, source))
        out.stored += [i for j, i in enumerate(granted) if j not in refused]
        out.refs += [r for j, r in enumerate(refs) if j not in refused]
        return sorted(granted[j] for j in refused)

    def _await_others(
        self, chosen: list[int], raw: Sequence[bytes], deadline: float
    ) -> tuple[list[int], list[int]]:
        """Wait (with one-sided lookups, no RPC) until ``deadline`` (``time.monotonic``) for
        keys others are writing; the keys committed meanwhile, and the rest."""
        nap = 0.0005
        while True:
            there = self.index.exists([raw[i] for i in chosen])
            landed = [i for i, t in zip(chosen, there, strict=True) if t]
            rest = [i for i, t in zip(chosen, there, strict=True) if not t]
            if not rest or time.monotonic() >= deadline:
                return landed, rest
            time.sleep(min(nap, max(0.0, deadline - time.monotonic())))
            nap = min(nap * 2, 0.02)

    def load(
        self, refs: Sequence[BlockRef | None], sink: Values, *, drop_corrupt: bool = False
    ) -> list[bool]:
        """Copy values out of the pool into ``sink``, each one validated: the one read call
        of the data path.

        ``refs[i]`` (from :meth:`locate`; None for a miss) fills the sink's
        value ``i``.  One C call moves them all through one scatter-gather
        table; per block the header is checked (this key, this version,
        published), the CRC32C of the bytes *as copied* must be the
        header's, and the header must not have changed meanwhile.  True where
        the sink holds the committed value; False for a miss, a value whose
        length is not the sink's, and a block replaced, evicted, torn or
        corrupted since it was located (those destination bytes are garbage).

        ``drop_corrupt``: a value found corrupt (its payload fails its
        checksum, or its header is not one) is removed from the pool, if the
        index still holds that very version, so no later lookup offers it
        again and its recomputation can be saved (one RPC, only then; best
        effort while the server is away).  For caches, whose values can be
        computed again: KV blocks.
        """
        lengths = list(sink.lengths())
        if len(lengths) != len(refs):
            raise ValueError(f"{len(refs)} refs but {len(lengths)} values to fill")
        out = [False] * len(refs)
        found = [(i, r) for i, r in enumerate(refs) if r is not None and r.length == lengths[i]]
        if not found:
            return out
        chosen = [i for i, _ in found]
        picked = [r for _, r in found]
        buffers, table = sink.moves(self.mem, chosen, picked, write=False)
        got = self._read_blocks(picked, buffers, table, sink.mover)
        for i, r, n in zip(chosen, picked, got, strict=True):
            out[i] = n == r.length
        if drop_corrupt:
            bad = {r for r, n in zip(picked, got, strict=True) if n in _CORRUPT}
            if bad:
                self._drop(sorted(bad, key=lambda r: r.block))
        return out

    def _drop(self, refs: Sequence[BlockRef]) -> None:
        """Remove values found corrupt, each if it is still that version (best effort)."""
        try:
            for s in self._batches(p.StoreOp.DROP, len(refs)):
                self.rpc.call(
                    p.StoreOp.DROP,
                    p.encode_commit([(r.digest, r.block, r.version) for r in refs[s]]),
                )
        except RpcError as e:  # the server is away: the next reader that finds it drops it
            log.debug("could not drop %d corrupt values: %s", len(refs), e)

    def locate(self, keys: Sequence[Key], prefix: bool = True) -> list[BlockRef | None]:
        """Where keys live, from the pool index (no RPC); with ``prefix``, up to and
        including the first miss.  Read them with :meth:`load`, which checks every
        block again: a block replaced since is a miss, never other bytes.  With a tier,
        what it holds of the keys missed is promoted into the pool first."""
        found = self._locate(keys, prefix)
        tier = self.tier
        if tier is not None and None in found and tier.promote_missing(self, keys, found, prefix):
            found = self._locate(keys, prefix)  # look again: the promoted keys are there
        return found

    def _locate(self, keys: Sequence[Key], prefix: bool) -> list[BlockRef | None]:
        return [None if loc is None else self._ref(*loc) for loc in self.index.locate(keys, prefix)]

    def peek(self, refs: Sequence[BlockRef], nbytes: int) -> list[bytes]:
        """The first ``nbytes`` of each located value as the pool holds them now, unchecked.

        No header and no checksum is looked at, so what comes back may be
        another writer's bytes: only a hint, such as a value's own header that
        sizes the buffers of a :meth:`load` (which checks every byte it
        returns, and lets the caller compare the header again).  One C call
        for the batch, no RPC.
        """
        if nbytes < 1 or any(nbytes > r.length for r in refs):
            raise ValueError(f"peek at 1 to a value's length bytes, not {nbytes}")
        out = np.zeros(len(refs) * nbytes, dtype=np.uint8)
        if refs:
            rows = [(0, j * nbytes, r.payload_offset, nbytes) for j, r in enumerate(refs)]
            self.mem.scatter_read([out], np.array(rows, dtype=np.uint64))
        return [out[j * nbytes : (j + 1) * nbytes].tobytes() for j in range(len(refs))]

    # -- values --------------------------------------------------------------

    def batch_put_from(self, keys: Sequence[Key], values: Sequence[Any]) -> None:
        """Store many values, replacing what the keys held; one ALLOC and one COMMIT RPC per
        batch (:meth:`save` with ``replace``).

        Raises ``WriteLeaseLost`` naming the values whose write lease ran out
        (the others are committed).
        """
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        saved = self.save(keys, Buffers(values), replace=True)
        if saved.lost:
            raise WriteLeaseLost(saved.lost, len(keys))

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
        if self.tier is not None:
            self.tier.fill(self, keys, out)
        return out

    def get(self, key: Key) -> bytes | None:
        """A key's value, or None on a miss; no RPC (one call into the C core)."""
        value = self.index.get(key)
        if value is None and self.tier is not None:
            return self.tier.fetch(self, [key])[0]
        return value

    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[int]:
        """Read many values into caller buffers; each result is the length, or -1 for a miss.

        One call into the C core for the whole batch, no RPC.
        """
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        if all(type(b) in _PLAIN_BUFFERS for b in buffers):  # the C core takes them as they are
            out = self.index.get_many_into(keys, buffers)
        else:
            out = self.index.get_many_into(keys, [as_buffer(b, writable=True) for b in buffers])
        if self.tier is not None:
            self.tier.fill_into(self, keys, buffers, out)
        return out

    def get_into(self, key: Key, buffer: Any) -> int:
        """Read a value into ``buffer``: its length, or -1 for a miss; no RPC."""
        try:
            n = self.index.get_into(key, buffer)
        except (TypeError, BufferError):  # a torch tensor, a raw (address, size) pair
            n = self.index.get_into(key, as_buffer(buffer, writable=True))
        if n < 0 and self.tier is not None:
            return self.tier.get_into(self, key, buffer)
        return n

    def batch_is_exist(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each key is stored."""
        out = self.index.exists(keys)
        if self.tier is not None:
            self.tier.fill_exists(keys, out)
        return out

    def is_exist(self, key: Key) -> bool:
        return self.index.exists_one(key) or (self.tier is not None and self.tier.exists(key))

    def lookup_prefix(self, keys: Sequence[Key]) -> int:
        """How many leading keys of a chain are stored (one call, no RPC)."""
        n = self.index.prefix(keys)
        if self.tier is not None and n < len(keys):
            n += self.tier.prefix(keys[n:])
        return n

    def retired(self, since: tuple[int, int] | None = None) -> Retired:
        """The keys that left the pool (evicted, removed, dropped as corrupt) since the
        cursor ``since`` of an earlier answer; None: from now on (nothing yet).

        The server keeps the last ``RETIRED_KEEP`` of them; an answer's ``gap``
        says some may be missing (the server restarted since the cursor, or
        more keys left than it keeps).  One RPC per slot-buffer's worth.
        Raises RpcError while the server is away.
        """
        epoch, cursor = since or (0, 0)
        most = (self.rpc.max_payload - p.RETIRED_HEADER_BYTES) // p.RECORD_BYTES[p.StoreOp.RETIRED]
        digests: list[bytes] = []
        gap = False
        while True:
            r = p.decode_retirements(
                self.rpc.call(p.StoreOp.RETIRED, p.encode_retired_request(epoch, cursor, most))
            )
            gap |= since is not None and (r.epoch != epoch or r.first > cursor)
            digests += r.digests
            epoch, cursor = r.epoch, r.next
            if len(r.digests) < most:
                return Retired(digests, (epoch, cursor), gap)

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
        if self.tier is not None:
            self.tier.close()
        if not self.mem.released:
            with contextlib.suppress(Exception):  # closing: hints are only hints
                self.index.flush_hints()
        self.rpc.close()
        if self._owns_pool:
            self.pool.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
