"""The service's index of committed keys: digest -> Entry, in LRU order, oldest first.

It behaves as the ``OrderedDict[bytes, Entry]`` it replaced (the operations the
service uses: ``get``, ``in``, ``[]``, ``[]=``, ``del``, ``pop``, ``move_to_end``,
``items``, ``values``, iteration, ``len``), with one addition for recovery,
:meth:`KeyIndex.add_cold`, and the same order.

Why: after a takeover, recovery finds every committed value in the pool, and most
are never touched again before they are evicted.  As an ``OrderedDict`` of
``Entry`` objects each cost ~0.8 us and ~300 bytes of Python heap; at the pod's
134 M blocks that was most of recovery.  So a key recovery finds stays *cold*:

- its fields sit in numpy columns (digest, block, extent, version, length), one
  *chunk* for each call of ``add_cold`` (a region of the scan), and a C table
  (``_core.KeyTable``, keytable.c) maps its digest to its row;
- the chunks are older than every other key, newest chunk first (``add_cold``
  puts a region's keys before everything, as recovery orders them), each chunk
  in its rows' order;
- a cold key's ``Entry`` is made the first time anyone asks for it and kept
  (``_made``), so a caller that changes it (a read lease) changes the index's,
  and it keeps its place in the order;
- ``move_to_end`` takes it out of the cold part: to the end of the *warm* part
  (an ``OrderedDict``, newer than every cold key), or, with ``last=False``, to
  the start of a *front group* at the order's start: an ``OrderedDict`` of the
  keys put first since the last chunk was added (recovery puts each value it
  adopts ahead of its scan there).  A group, not a chunk of one key: the order
  is a deque of chunks and groups, and a key put first costs O(1) however many
  regions' chunks there are (a one-key chunk inserted at a list's start cost
  O(chunks): 24-38 us a key at the pod's 32,768 regions, against ~14 at 48,
  in ``bench scale``'s ``index_adopt`` harness);
- ``del`` / ``pop`` mark its row dead; a chunk whose rows are all dead goes.

Recovery's last step (naming) looks at every key for the few no slot of the pool
index names: :meth:`KeyIndex.walk` hands the keys out a batch at a time as digest
columns, so the keys a slot names are left out in C and never become objects.

Eviction takes ``items()``' first entry: the first live row of the oldest
chunk, found from a cursor that only moves forward (dead rows before it stay
dead), so evicting the cold part costs O(1) a key.

tests/test_keyindex.py runs random histories against a plain ``OrderedDict``
and compares every answer and the whole order after each step.

Not thread-safe, not fork-safe: the metadata service's one thread owns it.
"""

from __future__ import annotations

import bisect
import secrets
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from beluga._native import _core
from beluga.server.extents import Entry

_MISSING = object()


@dataclass(slots=True, eq=False)
class _Chunk:
    """One ``add_cold`` call's keys: rows base .. base + len - 1, in LRU order."""

    base: int
    digests: np.ndarray  # V16
    blocks: np.ndarray  # int64
    extents: np.ndarray  # int64
    versions: np.ndarray  # uint64
    lengths: np.ndarray  # int64
    alive: np.ndarray  # bool
    left: int  # live rows
    start: int = 0  # every row before it is dead

    def entry(self, row: int) -> Entry:
        return Entry(
            int(self.blocks[row]),
            int(self.extents[row]),
            int(self.versions[row]),
            int(self.lengths[row]),
        )


class _Front:
    """Keys put first (``move_to_end(last=False)``) since the last chunk was added,
    oldest first; compared by identity (the order's deque removes it by identity)."""

    __slots__ = ("keys",)

    def __init__(self) -> None:
        self.keys: OrderedDict[bytes, Entry] = OrderedDict()


class KeyWalk:
    """The keys a :class:`KeyIndex` held when the walk began (:meth:`KeyIndex.walk`),
    handed out newest first, a batch at a time, each batch oldest first, with no Python
    object for a key a filter leaves out.  Keys indexed since are not in it; keys
    dropped since still are (the caller looks each one up).  Holds a copy of each cold
    chunk's live mask (a byte a key), not of its digests.  Not thread-safe, not
    fork-safe: its index's."""

    def __init__(self, cold: list[tuple[np.ndarray, np.ndarray | None]], warm: list[bytes]) -> None:
        # oldest first, each piece (digests, alive or None: all), and where it ends now:
        # its rows before that end are not handed out yet (the warm keys are the
        # service's 16-byte digests, as every key of the index is)
        self._pieces: list[tuple[np.ndarray, np.ndarray | None]] = [(d, a) for d, a in cold]
        self._ends = [len(d) for d, _ in cold]
        if warm:
            self._pieces.append((np.frombuffer(b"".join(warm), dtype="V16"), None))
            self._ends.append(len(warm))

    def __bool__(self) -> bool:
        return bool(self._pieces)

    def next(
        self, rows: int, keys: int, leave_out: Callable[[np.ndarray], np.ndarray] | None = None
    ) -> list[bytes]:
        """The next keys back from where the walk stands (newest first), in batches of
        at most ``keys`` rows, until ``keys`` are kept or ``rows`` looked at;
        ``leave_out`` (digests -> bool mask) drops some.  The keys kept, oldest first."""
        batches: list[list[bytes]] = []
        kept = seen = 0
        while self._pieces and kept < keys and seen < rows:
            digests, alive = self._pieces[-1]
            end = self._ends[-1]
            lo = max(0, end - keys)
            batch = digests[lo:end] if alive is None else digests[lo:end][alive[lo:end]]
            if leave_out is not None and len(batch):
                batch = batch[~leave_out(batch)]
            batches.append(batch.tolist())
            kept += len(batches[-1])
            seen += end - lo
            self._ends[-1] = lo
            if not lo:
                self._pieces.pop()
                self._ends.pop()
        return [d for batch in reversed(batches) for d in batch]


class KeyIndex:
    """digest -> Entry in LRU order (the module doc).  Not thread-safe, not fork-safe."""

    def __init__(self) -> None:
        self._warm: OrderedDict[bytes, Entry] = OrderedDict()
        self._table = _core.KeyTable(secrets.randbits(64))
        self._order: deque[_Chunk | _Front] = deque()  # oldest first
        self._front: dict[bytes, _Front] = {}  # a key put first -> its group
        self._fronted = 0  # keys put first so far (a change iteration must notice)
        self._by_base: list[_Chunk] = []  # by base (rows are handed out increasing)
        self._bases: list[int] = []
        self._next = 0  # the next row id
        self._made: dict[bytes, Entry] = {}  # cold keys whose Entry was handed out
        self._bytes = 0  # every key's value length, summed (kept as keys come and go)

    # -- the cold part ---------------------------------------------------------------

    def add_cold(
        self,
        digests: np.ndarray,
        blocks: np.ndarray,
        extents: np.ndarray,
        versions: np.ndarray,
        lengths: np.ndarray,
    ) -> None:
        """Index keys none of which is indexed yet (ValueError otherwise, nothing
        changed), as older than every key indexed, in the order given (oldest first)."""
        n = len(digests)
        if not n:
            return
        digests = np.ascontiguousarray(digests, dtype="V16")
        if (self._warm or self._front) and not (
            self._warm.keys().isdisjoint(listed := digests.tolist())
            and self._front.keys().isdisjoint(listed)
        ):
            raise ValueError("add_cold: a key is indexed already; nothing was added")
        self._table.add(digests, self._next)  # refuses keys cold already, changing nothing
        chunk = _Chunk(
            self._next,
            digests,
            np.array(blocks, dtype=np.int64),
            np.array(extents, dtype=np.int64),
            np.array(versions, dtype=np.uint64),
            np.array(lengths, dtype=np.int64),
            np.ones(n, dtype=bool),
            n,
        )
        self._next += n
        self._bytes += int(chunk.lengths.sum())
        self._order.appendleft(chunk)
        self._by_base.append(chunk)
        self._bases.append(chunk.base)

    def known(self, digests: np.ndarray) -> np.ndarray:
        """Whether each of ``digests`` (16-byte void items) is indexed."""
        digests = np.ascontiguousarray(digests, dtype="V16")
        out = np.frombuffer(self._table.contains(digests), dtype=bool).copy()
        if self._warm or self._front:
            out |= np.fromiter(
                (d in self._warm or d in self._front for d in digests.tolist()),
                bool,
                len(digests),
            )
        return out

    @property
    def cold(self) -> int:
        """Keys never touched since ``add_cold`` indexed them."""
        return len(self._table)

    def _row(self, digest: bytes) -> tuple[_Chunk, int] | None:
        if not len(self._table):
            return None
        at = self._table.get(digest)
        return None if at < 0 else self._locate(at)

    def _locate(self, at: int) -> tuple[_Chunk, int]:
        """The chunk and row of row id ``at``."""
        chunk = self._by_base[bisect.bisect_right(self._bases, at) - 1]
        return chunk, at - chunk.base

    def _cold_entry(self, digest: bytes, chunk: _Chunk, row: int) -> Entry:
        e = self._made.get(digest)
        if e is None:
            e = self._made[digest] = chunk.entry(row)
        return e

    def _take_cold(self, digest: bytes) -> Entry | None:
        """Take a cold key out of the cold part: its Entry, or None if it is not cold."""
        at = self._row(digest)
        if at is None:
            return None
        chunk, row = at
        e = self._made.pop(digest, None) or chunk.entry(row)
        self._table.pop(digest)
        chunk.alive[row] = False
        chunk.left -= 1
        if not chunk.left:
            self._order.remove(chunk)
            i = bisect.bisect_left(self._bases, chunk.base)
            del self._bases[i], self._by_base[i]
        elif row == chunk.start:
            while not chunk.alive[chunk.start]:
                chunk.start += 1
        return e

    def _put_first(self, digest: bytes, e: Entry) -> None:
        """``digest`` (indexed nowhere) -> ``e``, older than every key: the start of the
        front group at the order's start (a new group if a chunk is there)."""
        group = self._order[0] if self._order else None
        if not isinstance(group, _Front):
            group = _Front()
            self._order.appendleft(group)
        group.keys[digest] = e
        group.keys.move_to_end(digest, last=False)
        self._front[digest] = group
        self._fronted += 1

    def _take_front(self, digest: bytes) -> Entry | None:
        """Take a key put first out of its group: its Entry, or None if it is in none."""
        group = self._front.pop(digest, None)
        if group is None:
            return None
        e = group.keys.pop(digest)
        if not group.keys:
            self._order.remove(group)  # O(its place): a group is born at the start
        return e

    # -- the mapping -----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._warm) + len(self._front) + len(self._table)

    def __bool__(self) -> bool:
        return bool(self._warm) or bool(self._front) or bool(len(self._table))

    def __contains__(self, digest: object) -> bool:
        if digest in self._warm or digest in self._front:
            return True
        return isinstance(digest, bytes) and len(digest) == 16 and self._row(digest) is not None

    def get(self, digest: bytes, default: Entry | None = None) -> Entry | None:
        e = self._warm.get(digest)
        if e is not None:
            return e
        if self._front:
            group = self._front.get(digest)
            if group is not None:
                return group.keys[digest]
        if not len(self._table) or len(digest) != 16:  # (the first: nothing cold)
            return default
        at = self._table.get(digest)
        return default if at < 0 else self._cold_entry(digest, *self._locate(at))

    def __getitem__(self, digest: bytes) -> Entry:
        e = self.get(digest)
        if e is None:
            raise KeyError(digest)
        return e

    def __setitem__(self, digest: bytes, e: Entry) -> None:
        # (a key is in one part only: warm, a front group or the cold table)
        if self._front:
            group = self._front.get(digest)
            if group is not None:
                self._bytes += e.length - group.keys[digest].length
                group.keys[digest] = e  # a key put first keeps its place
                return
        if len(self._table) and len(digest) == 16 and (at := self._table.get(digest)) >= 0:
            made = self._made.get(digest)
            if made is not None:
                was = made.length
            else:
                chunk, row = self._locate(at)
                was = int(chunk.lengths[row])
            self._made[digest] = e  # a cold key keeps its place
            self._bytes += e.length - was
            return
        warm = self._warm
        old = warm.get(digest)
        warm[digest] = e
        self._bytes += e.length if old is None else e.length - old.length

    def pop(self, digest: bytes, default: object = _MISSING) -> Entry:
        e = self._warm.pop(digest, None)
        if e is None and self._front:
            e = self._take_front(digest)
        if e is None and len(self._table) and len(digest) == 16 and self._table.get(digest) >= 0:
            e = self._take_cold(digest)
        if e is None:
            if default is _MISSING:
                raise KeyError(digest)
            return default  # type: ignore[return-value]
        self._bytes -= e.length
        return e

    def __delitem__(self, digest: bytes) -> None:
        self.pop(digest)

    def move_to_end(self, digest: bytes, last: bool = True) -> None:
        if digest in self._warm:
            if last:
                self._warm.move_to_end(digest)
            else:
                self._put_first(digest, self._warm.pop(digest))
            return
        e = self._take_front(digest) if self._front else None
        if e is None and len(digest) == 16:
            e = self._take_cold(digest)
        if e is None:
            raise KeyError(digest)
        if last:
            self._warm[digest] = e
        else:
            self._put_first(digest, e)

    def items(self) -> Iterator[tuple[bytes, Entry]]:
        """(digest, Entry) oldest first.  As with a dict, changing the index while
        iterating is not allowed (RuntimeError).  Lazy, copying nothing: eviction takes
        the first entry, and a copy of the order (32,768 regions' chunks at the pod) or
        of a front group cost each eviction O(keys)."""
        changes = self._changes()
        for chunk in self._order:  # a change raises below before this moves on
            if isinstance(chunk, _Front):
                for item in chunk.keys.items():
                    yield item
                    if self._changes() != changes:
                        raise RuntimeError("the KeyIndex changed during iteration")
                continue
            for row in range(chunk.start, len(chunk.alive)):
                if chunk.alive[row]:
                    digest = chunk.digests[row].tobytes()
                    yield digest, self._cold_entry(digest, chunk, row)
                    if self._changes() != changes:
                        raise RuntimeError("the KeyIndex changed during iteration")
        for item in self._warm.items():
            yield item
            if self._changes() != changes:
                raise RuntimeError("the KeyIndex changed during iteration")

    def _changes(self) -> tuple[int, int, int, int, int]:
        return self._next, len(self._table), len(self._warm), len(self._front), self._fronted

    def values(self) -> Iterator[Entry]:
        for _, e in self.items():
            yield e

    def __iter__(self) -> Iterator[bytes]:
        """Digests oldest first (without making any cold key's Entry)."""
        changes = self._changes()
        for chunk in self._order:  # a change raises below before this moves on
            if isinstance(chunk, _Front):
                batch = list(chunk.keys)
            else:
                batch = chunk.digests[chunk.start :][chunk.alive[chunk.start :]].tolist()
            for digest in batch:
                yield digest
                if self._changes() != changes:
                    raise RuntimeError("the KeyIndex changed during iteration")
        for digest in self._warm:
            yield digest
            if self._changes() != changes:
                raise RuntimeError("the KeyIndex changed during iteration")

    def walk(self) -> KeyWalk:
        """Every key now, for a walk in batches that outlasts changes (:class:`KeyWalk`):
        the cold chunks' live masks copied, the front groups' and warm keys listed."""
        cold = [
            (np.frombuffer(b"".join(c.keys), dtype="V16"), None)
            if isinstance(c, _Front)
            else (c.digests[c.start :], c.alive[c.start :].copy())
            for c in self._order
        ]
        return KeyWalk(cold, list(self._warm))

    @property
    def made(self) -> int:
        """Cold keys whose ``Entry`` was handed out (and is kept beside the columns)."""
        return len(self._made)

    def value_bytes(self) -> int:
        """The values' lengths, summed: a running sum, O(1) (``stats()`` asks on every
        scrape; a sum over the keys took ~0.3 s a million warm keys, ~19 s at the pod's
        67 M, in the server's one thread).  An ``Entry``'s length never changes once it
        is in the index: a new length is a new ``Entry`` set."""
        return self._bytes
