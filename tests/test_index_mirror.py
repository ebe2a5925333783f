"""The pool index writer against its oracle, operation by operation.

``beluga.server.index.PoolIndex`` (the implementation under test) and
``tests.index_oracle.PoolIndex`` (today's pure-Python writer, kept frozen) run
the same operations, each over its own pool with the same contents, and must
agree after every step:

- each operation's answer, its type included (put, find, crowd, drop, scrub,
  reconcile's and repair's counts), or the same exception;
- the pool's bucket lines, as another host reads them: whether each is whole,
  and its slots' tag, block and version.  Not the sequence or the CRC: the
  implementation may bump sequences in another order.  Its own lines are held
  to what readers need instead: a bucket whose slots changed between two steps
  has a new sequence;
- the mirror: ``len``, ``where`` (its length, iteration, membership and slot
  numbers), ``loaded``, and the counters ``moves``, ``failed``, ``scrubbed``
  and ``unconfirmed``.

The pool is small (32 buckets, 23 blocks) and most keys' two buckets are
neighbours in a row of eight (more keys than its 24 slots), so cuckoo moves,
chains of up to MAX_PATH of them, keys that fit nowhere and keys replaced in
place are common.  Histories mix puts of new keys and of placed ones, drops,
finds, crowds, scrubs, fresh servers (a lazy mirror that resolves slots against
block headers and commit words that another host wrote: confirming, another
key's or version's, uncommitted, cleared), stray bytes over bucket lines (torn,
whole but wrong, junk in untagged slots, a key's slot in its other bucket as a
server that died in the middle of a move leaves it), reconcile over random
ranges, the whole index reconciled and ``loaded_all``, and ``repair``.  They
run with the native memory and with the model, where the server's host keeps
stale lines until it invalidates them (the same memops table serves both), as
do two scripted tests: the row's moves, failures and replacements, and a fresh
server's resolutions.  A nearly full 512-bucket index tells searches that visit
one bucket more or fewer apart.

Seeded histories must together reach every path (``REACHED``); histories drawn
by hypothesis shrink to a short failing one.  ``BELUGA_STRESS=full`` runs many
more of both.  The last test checks the comparison itself against oracles given
a bug each.  To point the comparison at another implementation, pass its class
as ``twin(..., impl=...)``.
"""

from __future__ import annotations

import itertools
import os
import random
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from beluga._native import _core
from beluga.coherence import LINE, ModelConfig
from beluga.pool import Geometry, Pool
from beluga.pool.layout import plan
from beluga.server import index as under_test
from beluga.server.extents import BlockKeys
from tests import index_oracle as oracle

#: block headers are left published (some committed, some not) in the pools on purpose
pytestmark = pytest.mark.leaves("keys", "writes")

FULL = os.environ.get("BELUGA_STRESS") == "full"
SEEDS = range(400) if FULL else range(16)
STEPS = 300 if FULL else 200
DRAWN_EXAMPLES = 500 if FULL else 30
MODES = ["native", "model"]

GEOMETRY = Geometry(max_hosts=1, rpc_bytes_per_host=4096, block_size=256 << 10)
SIZE = 16 << 20
NBUCKETS, NBLOCKS = plan(SIZE, GEOMETRY).nbuckets, plan(SIZE, GEOMETRY).nblocks  # 32, 23
SLOTS = _core.IX_SLOTS
ROW = 8  # buckets 0..7: most keys' two buckets are neighbours there
FAR_BLOCKS = (NBLOCKS, NBLOCKS + 1, (1 << 31) + 3, (1 << 32) - 1)  # past the pool's last
#: the paths the seeded histories must reach together (counted on the oracle)
REACHED = (
    "moves",
    "chain",
    "failed",
    "in place",
    "replaced",
    "scrubbed",
    "unconfirmed",
    "salvaged",
    "second slot",
    "fresh",
    "reconcile kept",
    "reconcile dropped",
    "loaded_all",
    "repair inserted",
    "repair dropped",
)
_COLUMNS = ("u1", "=u8", "=u4", "=u4", "=u8")  # _core.ix_columns: whole, seq, tag, block, version


def _keys() -> list[bytes]:
    """25 keys whose two buckets are neighbours in the row (its 24 slots cannot hold them,
    and more of them at its start, so that puts push entries down it), 4 keys with one
    bucket in the row, 4 with none."""
    rng = random.Random(20261207)
    want: dict[object, int] = {(i, i + 1): n for i, n in enumerate((6, 3, 3, 3, 3, 3, 4))}
    want |= {1: 4, 0: 4}
    got: dict[object, list[bytes]] = {k: [] for k in want}
    while any(len(got[k]) < n for k, n in want.items()):
        d = rng.randbytes(16)
        _, b1, b2 = _core.ix_hash(d, NBUCKETS)
        inside = (b1 < ROW) + (b2 < ROW)
        k = (min(b1, b2), max(b1, b2)) if inside == 2 else inside
        if k in want and len(got[k]) < want[k]:
            got[k].append(d)
    return [d for k in want for d in got[k]]


KEYS = _keys()
ROW_KEYS, HALF_KEYS, OTHER_KEYS = KEYS[:25], KEYS[25:29], KEYS[29:]
HOME = {d: i % NBLOCKS for i, d in enumerate(KEYS)}  # so some keys share a block


def buckets_of(d: bytes, nbuckets: int = NBUCKETS) -> tuple[int, int]:
    _, b1, b2 = _core.ix_hash(d, nbuckets)
    return int(b1), int(b2)


def tag_of(d: bytes, nbuckets: int = NBUCKETS) -> int:
    return int(_core.ix_hash(d, nbuckets)[0])


# -- comparing ---------------------------------------------------------------------------


def same(a: object, b: object) -> bool:
    """Equal, and of the same types all the way down (True is not 1, a list not a tuple)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        assert isinstance(b, list | tuple)
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@dataclass
class Lines:
    """A pool's bucket lines as read: whole or not, sequence, (tag, block, version) a slot."""

    whole: np.ndarray  # (nbuckets,) bool
    seqs: np.ndarray  # (nbuckets,) uint64
    slots: np.ndarray  # (nbuckets, SLOTS, 3) uint64

    def bucket(self, b: int) -> tuple[bool, list[tuple[int, ...]]]:
        return bool(self.whole[b]), [tuple(s) for s in self.slots[b].tolist()]

    def differ(self, other: Lines) -> list[int]:
        """Buckets whose wholeness or slots differ (sequences aside)."""
        changed = (self.whole != other.whole) | (self.slots != other.slots).any(axis=(1, 2))
        return np.flatnonzero(changed).tolist()


def with_slot(now: Lines, bucket: int, slot: tuple[int, int, int], bump: int = 1) -> bytes:
    """``bucket``'s line as ``now`` holds it with ``slot`` in its first empty slot, its
    sequence ``bump``ed."""
    slots = [tuple(s) for s in now.slots[bucket].tolist()]
    slots[next(i for i, s in enumerate(slots) if s[0] == 0)] = slot
    return bytes(_core.ix_pack(int(now.seqs[bucket]) + bump, slots))


def mirror_state(ix: Any, nbuckets: int, probe: Sequence[bytes], deep: bool) -> dict[str, object]:
    """What a writer's mirror shows through the API both writers share (``where`` in full
    only when ``deep``)."""
    where = ix.where
    loaded = ix.loaded
    if loaded is not None:
        assert isinstance(loaded, np.ndarray) and loaded.dtype == np.bool_
        assert loaded.shape == (nbuckets,)
    state: dict[str, object] = {
        "len": len(ix),
        "len(where)": len(where),
        "in where": [d in where for d in probe],
        "where[d]": [where[d] for d in probe if d in where],  # (only in, [], iter and len)
        "loaded": None if loaded is None else loaded.tolist(),
        "moves": ix.moves,
        "failed": ix.failed,
        "scrubbed": ix.scrubbed,
        "unconfirmed": ix.unconfirmed,
    }
    if hasattr(where, "among"):  # the mirror's batch membership (recovery's naming step)
        among = where.among(np.array(probe, dtype="V16")).tolist() if probe else []
        assert among == state["in where"]
    if deep:
        listed = list(where)
        state["iter(where)"] = len(listed)
        state["where"] = {d: where[d] for d in listed}
    return state


# -- the two writers over their pools ----------------------------------------------------


@dataclass
class Side:
    name: str
    pool: Pool  # the server's attachment (its host)
    other: Pool  # another host's: block headers, commit words, stray bytes, and the reader
    cls: Any
    ix: Any = None

    def fresh(self) -> None:
        self.ix = self.cls(self.pool.memory, self.pool.superblock)


class Twin:
    """The writer under test and the oracle, run step by step and compared after each."""

    def __init__(self, impl: Side, ref: Side, deep_every: int = 1) -> None:
        self.impl, self.ref = impl, ref
        self.sides = (impl, ref)
        sb = ref.pool.superblock
        self.nbuckets, self.nblocks, self.base = sb.nbuckets, sb.nblocks, sb.index.offset
        self.deep_every = deep_every  # steps between comparisons of all of where
        #: what the service would know: each key's entry, as last put or repaired
        self.values: dict[bytes, tuple[int, int]] = {}
        self.reconciled = np.zeros(self.nbuckets, dtype=bool)  # since the last fresh server
        self.version = 0
        self.log: list[str] = []
        self.label = ""  # which history, for the failure messages
        self.reached: Counter[str] = Counter()
        self.longest = 0  # moves of one put
        self.last: Lines | None = None
        self.strayed: set[int] = set()  # buckets whose line stray bytes wrote last
        self.fresh()

    # -- running and comparing

    def say(self, msg: str) -> str:
        tail = "\n  ".join(self.log[-14:])
        impl = f"{self.impl.cls.__module__}.{self.impl.cls.__qualname__}"
        return f"{msg}\nthe last steps of {self.label or 'the test'} (impl {impl}):\n  {tail}"

    def both(self, what: str, op: Callable[[Any], Any], *, raises: bool = False) -> Any:
        """Run ``op`` on each writer, fence as the service does, compare answers and state."""
        self.log.append(what)
        before = self._counters()
        got: list[tuple[str, object]] = []
        errors: list[BaseException] = []
        for side in self.sides:
            try:
                got.append(("answered", op(side.ix)))
            except Exception as e:
                errors.append(e)
                got.append(("raised", type(e)))
            side.pool.memory.sfence()
        assert same(got[0], got[1]), self.say(
            f"{what}: the implementation {got[0]!r}, the oracle {got[1]!r} ({errors!r})"
        )
        if got[1][0] == "raised" and not raises:
            raise errors[-1]
        self.check(what)
        after = self._counters()
        for name in ("moves", "failed", "scrubbed", "unconfirmed"):
            self.reached[name] += after[name] - before[name]
        moved = after["moves"] - before["moves"]
        self.reached["chain"] += moved > 1
        self.longest = max(self.longest, moved)
        return got[1][1]

    def _counters(self) -> dict[str, int]:
        ix = self.ref.ix
        return {n: getattr(ix, n) for n in ("moves", "failed", "scrubbed", "unconfirmed")}

    def lines(self, side: Side) -> Lines:
        """The bucket lines as another host reads them (not through the server's cache)."""
        mem = side.other.memory
        mem.invalidate(self.base, self.nbuckets * LINE)
        mem.mfence()
        raw = _core.ix_columns(mem.load(self.base, self.nbuckets * LINE))
        whole, seqs, tags, blocks, versions = (
            np.frombuffer(c, t) for c, t in zip(raw, _COLUMNS, strict=True)
        )
        slots = np.stack([tags, blocks, versions], axis=1).astype(np.uint64)
        return Lines(whole != 0, seqs.copy(), slots.reshape(self.nbuckets, SLOTS, 3))

    def check(self, what: str, *, stray: bool = False, deep: bool = False) -> None:
        """The pools' lines (but their sequences) and the mirrors agree (all of ``where``
        every ``deep_every`` steps, or when ``deep``); a line the writer under test changed
        has a new sequence (not after ``stray`` bytes the test stored)."""
        mine, want = self.lines(self.impl), self.lines(self.ref)
        differ = mine.differ(want)
        assert not differ, self.say(
            f"after {what}, bucket lines differ (whole, [(tag, block, version)]):\n"
            + "\n".join(
                f"  bucket {b}: impl   {mine.bucket(b)}\n  bucket {b}: oracle {want.bucket(b)}"
                for b in differ
            )
        )
        if self.last is not None and not stray:
            changed = self.last.differ(mine)
            # a line stray bytes wrote last may hold the sequence the writer writes next
            # (the oracle too): only a rewrite of its own line must change the sequence
            unbumped = [
                b for b in changed if mine.seqs[b] == self.last.seqs[b] and b not in self.strayed
            ]
            assert not unbumped, self.say(
                f"after {what}, the implementation rewrote buckets {unbumped} with their "
                "sequence unchanged: a reader that probed across the rewrite would not know"
            )
            self.strayed.difference_update(changed)
            self.reached["salvaged"] += sum(
                not self.last.whole[b] and bool(want.whole[b]) for b in changed
            )
        self.last = mine
        deep = deep or len(self.log) % self.deep_every == 0
        probe = KEYS + sorted(self.values) if deep else KEYS
        states = [mirror_state(s.ix, self.nbuckets, probe, deep) for s in self.sides]
        for field in states[1]:
            a, b = states[0][field], states[1][field]
            if not same(a, b) and isinstance(a, dict) and isinstance(b, dict):  # where: the keys
                a, b = (
                    {d.hex(): v for d, v in x.items() if not same(v, y.get(d))}
                    for x, y in ((a, b), (b, a))
                )
            assert same(a, b), self.say(f"after {what}, the mirrors' {field}: impl {a}, oracle {b}")

    # -- writes of other hosts (the same bytes into both pools)

    def _other(self, store: Callable[[Side], None]) -> None:
        for side in self.sides:
            store(side)
            side.other.memory.sfence()

    def publish(self, block: int, d: bytes, version: int, *, commit: bool = True) -> None:
        """A value's header at ``block`` (PUBLISHED), and its commit word (or 0)."""
        if block >= self.nblocks:
            return
        self.log.append(f"header at block {block}: {d.hex()} v{version}, committed {commit}")

        def store(side: Side) -> None:
            sb, mem = side.pool.superblock, side.other.memory
            hdr, payload = sb.block_header_offset(block), sb.block_payload_offset(block)
            mem.publish(hdr, payload, d, version, b"v%d" % version, writer=1, writer_gen=1)
            word = version if commit else 0
            mem.nt_store(sb.block_commit_offset(block), word.to_bytes(8, "little"))

        self._other(store)

    def clear_header(self, block: int) -> None:
        self.log.append(f"header at block {block} cleared")

        def store(side: Side) -> None:
            side.other.memory.nt_store(side.pool.superblock.block_header_offset(block), bytes(LINE))

        self._other(store)

    def stray(self, bucket: int, line: bytes) -> None:
        """Stray or hostile bytes over one bucket line, from another host."""
        self.log.append(f"stray bytes over bucket {bucket}: {line.hex()}")

        def store(side: Side) -> None:
            side.other.memory.nt_store(self.base + bucket * LINE, line)

        self._other(store)
        self.strayed.add(bucket)
        self.check(f"stray bytes over bucket {bucket}", stray=True)

    def copy_slot(self, d: bytes) -> None:
        """``d``'s slot in its other bucket too, as a server that died between the two
        writes of a move leaves it (the oracle's mirror names the slot)."""
        at = self.ref.ix.where[d]
        b1, b2 = buckets_of(d, self.nbuckets)
        src, dst = at // SLOTS, b2 if at // SLOTS == b1 else b1
        now = self.lines(self.ref)
        slots = [tuple(s) for s in now.slots[dst].tolist()]
        free = next((i for i, s in enumerate(slots) if s[0] == 0), at % SLOTS)
        slots[free] = tuple(now.slots[src, at % SLOTS].tolist())
        self.reached["second slot"] += 1
        self.stray(dst, _core.ix_pack(int(now.seqs[dst]) + 1, slots))

    # -- the writers' operations

    def next_version(self, big: bool = False) -> int:
        self.version += 1
        return (1 << 64) - 2 - self.version if big else self.version  # + 1 still fits

    def fresh(self) -> None:
        """A new server over the pools, on the same host: a lazy mirror, nothing loaded."""
        self.log.append("a fresh server")
        for side in self.sides:
            side.fresh()
            assert side.ix.nbuckets == self.nbuckets
            assert side.ix.base == self.base
        self.reconciled[:] = False
        self.reached["fresh"] += 1
        self.check("a fresh server")

    def put(self, d: bytes, block: int, version: int, *, commit: bool = True) -> bool:
        """COMMIT's steps: the value's header and commit word (``commit``), then the slot."""
        if commit:
            self.publish(block, d, version)
        was = self.ref.ix.where.get(d)  # the oracle's: a dict
        ok: bool = self.both(
            f"put {d.hex()} -> ({block}, {version})", lambda ix: ix.put(d, block, version)
        )
        if ok:
            if was is not None and self.values.get(d) != (block, version):
                self.reached["in place" if self.ref.ix.where[d] == was else "replaced"] += 1
            self.values[d] = (block, version)
        return ok

    def drop(self, d: bytes) -> None:
        self.both(f"drop {d.hex()}", lambda ix: ix.drop(d))
        self.values.pop(d, None)

    def find(self, d: bytes) -> tuple[int, int] | None:
        got: tuple[int, int] | None = self.both(f"find {d.hex()}", lambda ix: ix.find(d))
        return got

    def crowd(self, d: bytes) -> list[bytes]:
        got: list[bytes] = self.both(f"crowd {d.hex()}", lambda ix: ix.crowd(d))
        return got

    def scrub(self, n: int) -> int:
        got: int = self.both(f"scrub {n}", lambda ix: ix.scrub(n))
        return got

    def reconcile(self, lo: int, hi: int, entries: BlockKeys) -> dict[str, int]:
        got: dict[str, int] = self.both(
            f"reconcile [{lo}, {hi})", lambda ix: ix.reconcile(lo, hi, entries.lookup)
        )
        self.reconciled[lo:hi] = True
        self.reached["reconcile kept"] += got["kept"]
        self.reached["reconcile dropped"] += got["dropped"]
        return got

    def loaded_all(self) -> None:
        assert self.reconciled.all(), "loaded_all only once every bucket is reconciled"
        self.both("loaded_all", lambda ix: ix.loaded_all())
        self.reached["loaded_all"] += 1

    def repair(self, entries: Sequence[tuple[bytes, int, int]]) -> dict[str, int]:
        def op(ix: Any) -> dict[str, int]:
            digests = [d for d, _, _ in entries]
            blocks = np.array([b for _, b, _ in entries], dtype=np.int64)
            versions = np.array([v for _, _, v in entries], dtype=np.uint64)
            got: dict[str, int] = ix.repair(digests, blocks, versions)
            return got

        got: dict[str, int] = self.both(f"repair {len(entries)} entries", op)
        self.values = {d: (b, v) for d, b, v in entries}
        self.reconciled[:] = True
        self.reached["repair inserted"] += got["inserted"]
        self.reached["repair dropped"] += got["dropped"]
        return got


@contextmanager
def twin(
    path: str,
    mode: str,
    seed: int,
    impl: Any = None,
    size: int = SIZE,
    geometry: Geometry = GEOMETRY,
    deep_every: int = 1,
) -> Iterator[Twin]:
    """Two pools with the same contents (``path``-impl and ``path``-oracle), a writer over
    each, destroyed after; in the model, each host seeded alike on both sides."""

    def model(n: int) -> ModelConfig | None:
        return ModelConfig(seed=n) if mode == "model" else None

    def destroy(p: str) -> None:
        if os.path.exists(p):
            Pool.destroy(p)

    with ExitStack() as stack:
        sides = []
        for name, cls in (("impl", impl or under_test.PoolIndex), ("oracle", oracle.PoolIndex)):
            p = f"{path}-{name}"
            stack.callback(destroy, p)
            pool = Pool.create(p, size, geometry=geometry, coherence=mode, model=model(2 * seed))
            stack.callback(pool.close)
            other = Pool.attach(p, coherence=mode, model=model(2 * seed + 1))
            stack.callback(other.close)
            sides.append(Side(name, pool, other, cls))
        yield Twin(sides[0], sides[1], deep_every=deep_every)


# -- histories -----------------------------------------------------------------------------


class Draw(Protocol):
    def number(self, lo: int, hi: int) -> int:
        """lo..hi, both included."""
        ...

    def raw(self, n: int) -> bytes: ...


class Seeded:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def number(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def raw(self, n: int) -> bytes:
        return self.rng.randbytes(n)


class Drawn:
    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def number(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def raw(self, n: int) -> bytes:
        return self.data.draw(st.binary(min_size=n, max_size=n))


def pick(draw: Draw, seq: Sequence[Any]) -> Any:
    return seq[draw.number(0, len(seq) - 1)]


def chance(draw: Draw, percent: int) -> bool:
    return draw.number(0, 99) < percent


def a_block(draw: Draw, d: bytes) -> int:
    r = draw.number(0, 9)
    if r < 6:
        return HOME[d]
    return draw.number(0, NBLOCKS - 1) if r < 9 else int(pick(draw, FAR_BLOCKS))


def op_put(tw: Twin, draw: Draw) -> None:
    new = [d for d in KEYS if d not in tw.values]
    if tw.values and (not new or chance(draw, 30)):  # a placed key again
        d = pick(draw, sorted(tw.values))
        if chance(draw, 15):  # the same entry
            tw.put(d, *tw.values[d])
            return
    else:
        d = pick(draw, new if chance(draw, 90) else KEYS)
    tw.put(d, a_block(draw, d), tw.next_version(big=chance(draw, 5)), commit=chance(draw, 85))


def op_drop(tw: Twin, draw: Draw) -> None:
    tw.drop(pick(draw, sorted(tw.values)) if tw.values and chance(draw, 70) else pick(draw, KEYS))


def op_find(tw: Twin, draw: Draw) -> None:
    tw.find(pick(draw, KEYS))


def op_crowd(tw: Twin, draw: Draw) -> None:
    tw.crowd(pick(draw, KEYS))


def op_scrub(tw: Twin, draw: Draw) -> None:
    tw.scrub(pick(draw, (0, 1, 3, 8, 16, 64, NBUCKETS + 5)))


def op_header(tw: Twin, draw: Draw) -> None:
    """Block headers and commit words that confirm a slot, or no longer do."""
    placed = sorted(d for d, (b, _) in tw.values.items() if b < NBLOCKS)
    d = pick(draw, placed) if placed and chance(draw, 80) else pick(draw, KEYS)
    block, version = tw.values.get(d, (HOME[d], tw.next_version()))
    if block >= NBLOCKS:
        return
    kind = draw.number(0, 4)
    if kind == 0:  # confirms it (again)
        tw.publish(block, d, version)
    elif kind == 1:  # another key's, committed
        tw.publish(block, pick(draw, KEYS), tw.next_version())
    elif kind == 2:  # another version of it, committed
        tw.publish(block, d, version + 1)
    elif kind == 3:  # its, not committed (a COMMIT whose commit word did not land)
        tw.publish(block, d, version, commit=False)
    else:
        tw.clear_header(block)


def a_slot(tw: Twin, draw: Draw) -> tuple[int, int, int]:
    r = draw.number(0, 5)
    if r == 0:
        return (0, 0, 0)
    if r == 1 and tw.values:  # a placed key's (maybe outside its buckets, or a second slot)
        d = pick(draw, sorted(tw.values))
        return (tag_of(d), *tw.values[d])
    if r <= 2:
        d = pick(draw, KEYS)
        return (tag_of(d), HOME[d], draw.number(1, max(1, tw.version)))
    if r == 3:  # untagged, junk in the other fields
        return (0, draw.number(0, (1 << 32) - 1), draw.number(0, (1 << 64) - 1))
    return (
        draw.number(1, (1 << 32) - 1),
        draw.number(0, NBLOCKS + 2),
        draw.number(0, (1 << 64) - 1),
    )


def op_stray(tw: Twin, draw: Draw) -> None:
    bucket = draw.number(0, ROW) if chance(draw, 75) else draw.number(0, NBUCKETS - 1)
    kind = draw.number(0, 4)
    if kind == 4:  # a move or replacement that died between its two writes
        resolved = sorted(tw.ref.ix.where)
        if resolved:
            tw.copy_slot(pick(draw, resolved))
        return
    if kind == 0:
        line = draw.raw(LINE)
    elif kind == 3:
        line = bytes(LINE)
    else:
        slots = [a_slot(tw, draw) for _ in range(SLOTS)]
        line = _core.ix_pack(draw.number(0, 1 << 62), slots)
        if kind == 1:  # torn: its fields plausible, its CRC not
            torn = bytearray(line)
            torn[LINE - 4 + draw.number(0, 3)] ^= 1 << draw.number(0, 7)
            line = bytes(torn)
    tw.stray(bucket, line)


def entries_of(tw: Twin, draw: Draw) -> BlockKeys:
    """Recovered entries, as a BlockKeys: most of the keys put, some with another version,
    some keys named at a second block, some others."""
    keys = BlockKeys(NBLOCKS)
    for d, (block, version) in sorted(tw.values.items()):
        if block < NBLOCKS and chance(draw, 90):
            keys.set(block, d, version if chance(draw, 90) else version + 1)
    for _ in range(draw.number(0, 3)):
        d = pick(draw, KEYS)
        version = tw.values.get(d, (0, tw.next_version()))[1]
        keys.set(draw.number(0, NBLOCKS - 1), d, version)
    return keys


def op_reconcile(tw: Twin, draw: Draw) -> None:
    lo = draw.number(0, NBUCKETS)
    tw.reconcile(lo, draw.number(lo, min(NBUCKETS, lo + draw.number(0, 12))), entries_of(tw, draw))


def op_recover(tw: Twin, draw: Draw) -> None:
    """Every bucket reconciled, a region at a time, then loaded_all (the service's order)."""
    entries, region = entries_of(tw, draw), draw.number(1, NBUCKETS)
    for lo in range(0, NBUCKETS, region):
        tw.reconcile(lo, min(NBUCKETS, lo + region), entries)
    if tw.ref.ix.loaded is not None:
        tw.loaded_all()


def op_repair(tw: Twin, draw: Draw) -> None:
    out: list[tuple[bytes, int, int]] = []
    blocks: set[int] = set()
    for d, (block, version) in sorted(tw.values.items()):
        if block < NBLOCKS and block not in blocks and chance(draw, 90):
            out.append((d, block, version))
            blocks.add(block)
    for _ in range(draw.number(0, 4)):  # keys the index lost
        d, block = pick(draw, KEYS), draw.number(0, NBLOCKS - 1)
        if block not in blocks and d not in {e[0] for e in out}:
            out.append((d, block, tw.next_version()))
            blocks.add(block)
    for i in range(len(out) - 1, 0, -1):  # in any order
        j = draw.number(0, i)
        out[i], out[j] = out[j], out[i]
    tw.repair(out)


def op_fresh(tw: Twin, draw: Draw) -> None:
    tw.fresh()


OPS: list[tuple[int, Callable[[Twin, Draw], None]]] = [
    (40, op_put),
    (4, op_drop),
    (6, op_find),
    (5, op_crowd),
    (6, op_scrub),
    (6, op_header),
    (6, op_stray),
    (3, op_fresh),
    (5, op_reconcile),
    (2, op_recover),
    (1, op_repair),
]
_WEIGHTS = list(itertools.accumulate(w for w, _ in OPS))


def history(tw: Twin, draw: Draw, steps: int) -> None:
    for _ in range(steps):
        r = draw.number(0, _WEIGHTS[-1] - 1)
        OPS[next(i for i, w in enumerate(_WEIGHTS) if r < w)][1](tw, draw)


# -- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_crowded_keys_move_fail_and_are_replaced_in_place_alike(shm_path: str, mode: str) -> None:
    """The row filled twice: its far end first (a key fails that a sixth move would have
    placed), then in an order that needs a chain of MAX_PATH moves; each key put again with
    a new entry (both buckets full: in place), some dropped and the others put again."""
    shuffled = ROW_KEYS[::-1]
    random.Random(2).shuffle(shuffled)
    with twin(shm_path, mode, 1) as tw:
        for d in ROW_KEYS[::-1]:
            tw.put(d, HOME[d], tw.next_version())
        assert tw.ref.ix.moves > 0 and tw.ref.ix.failed > 1, "no move, or no key failed"
        assert tw.reached["chain"] > 0, "no put moved two entries"
        for d in list(tw.values):
            tw.drop(d)
        for d in shuffled:
            tw.put(d, HOME[d], tw.next_version())
        assert tw.longest == oracle.MAX_PATH, f"the longest chain was {tw.longest} moves"
        placed = [d for d in ROW_KEYS if d in tw.values]
        assert len(placed) == len(ROW_KEYS) - 1 == len(tw.ref.ix)
        for d in placed:
            assert tw.put(d, HOME[d], tw.next_version(big=d == placed[0]))
        assert tw.reached["in place"] == len(placed), "a key in full buckets not in place"
        for d in placed[::3]:
            tw.drop(d)
        for d in ROW_KEYS:
            tw.put(d, HOME[d], tw.next_version())
        assert tw.reached["replaced"] > 0, "no key was replaced into a free slot"
        for d in KEYS:
            tw.crowd(d)
            tw.find(d)


@pytest.mark.parametrize("mode", MODES)
def test_a_fresh_server_resolves_slots_alike(shm_path: str, mode: str) -> None:
    """A new server's lazy mirror: slots that headers and commit words confirm, and slots
    they do not (another key, another version, no commit word, no header, a block past the
    last, a bucket not the key's, a key's second slot), torn lines and whole wrong ones,
    resolved by finds, crowds, puts and their moves; then recovery over lines a server left
    with keys in both their buckets."""
    with twin(shm_path, mode, 2) as tw:
        for d in ROW_KEYS[::-1]:
            tw.put(d, HOME[d], tw.next_version())
        for d, block in ((HALF_KEYS[0], FAR_BLOCKS[0]), (OTHER_KEYS[0], FAR_BLOCKS[3])):
            assert tw.put(d, block, tw.next_version())
        placed = [d for d in ROW_KEYS[10:23] if d in tw.values]  # each alone at its block
        tw.publish(HOME[placed[0]], OTHER_KEYS[3], tw.next_version())  # another key's header
        tw.publish(HOME[placed[1]], placed[1], tw.values[placed[1]][1] + 1)  # another version
        tw.publish(HOME[placed[2]], placed[2], tw.values[placed[2]][1], commit=False)
        tw.clear_header(HOME[placed[3]])
        # over a key's two buckets (not those of the keys above), a torn line and a whole
        # wrong one: its slot in each, a slot naming another key's block, junk in an untagged
        # slot, and a second slot of a key that lies in its other bucket
        d = placed[9]
        b1, b2 = buckets_of(d)
        assert not {b1, b2} & {tw.ref.ix.where[k] // SLOTS for k in placed[:4]}
        wrong = [(tag_of(d), *tw.values[d]), (tag_of(placed[5]), 7, 7), (0, 9, 9)]
        torn = bytearray(_core.ix_pack(1 << 40, wrong))
        torn[-1] ^= 0x10
        tw.stray(b1, bytes(torn))
        tw.stray(b2, _core.ix_pack(5, [*wrong[:2], (tag_of(placed[11]), *tw.values[placed[11]])]))
        # a key's slot, confirmed by its header, in a bucket not its own (beside the row)
        d, k = placed[7], HALF_KEYS[1]
        away = max(buckets_of(k))
        assert away >= ROW and away not in buckets_of(d)
        tw.stray(away, with_slot(tw.lines(tw.ref), away, (tag_of(d), *tw.values[d])))
        # a torn line that the first look at it salvages, with no slot to resolve
        lone = OTHER_KEYS[1]
        spot = buckets_of(lone)[0]
        assert spot != away
        torn = bytearray(_core.ix_pack(3, [(tag_of(OTHER_KEYS[2]), 3, 3), (0, 0, 0), (0, 0, 0)]))
        torn[-2] ^= 1
        tw.stray(spot, bytes(torn))
        tw.fresh()
        tw.find(lone)
        assert tw.reached["salvaged"] == 1
        tw.crowd(k)  # resolves the slot in ``away`` before d is looked for
        for d in KEYS:
            tw.find(d)
        assert tw.ref.ix.unconfirmed >= 7, "slots the headers do not confirm were kept"
        assert tw.reached["salvaged"] == 2, "a torn line was not salvaged"
        tw.fresh()  # again, over the lines the last one left: puts resolve by their searches
        for d in ROW_KEYS:
            tw.put(d, HOME[d], tw.next_version())
        for d in KEYS:
            tw.crowd(d)
        tw.scrub(NBUCKETS)
        # a server that died in the middle of moves: keys in both their buckets, recovered
        for d in sorted(tw.ref.ix.where)[:6]:
            tw.copy_slot(d)
        tw.fresh()
        entries = BlockKeys(NBLOCKS)
        for d, (block, version) in tw.values.items():
            if block < NBLOCKS:
                entries.set(block, d, version)
        got = tw.reconcile(0, NBUCKETS, entries)
        assert got["dropped"] > 0
        tw.loaded_all()
        for d in KEYS:
            tw.put(d, HOME[d], tw.next_version())
        # a whole line with the mirror's slots but junk in an untagged one: the scrub's
        b = ROW + 1
        tw.stray(b, with_slot(tw.lines(tw.ref), b, (0, 5, 5), bump=0))
        assert tw.scrub(NBUCKETS) == 1


BIG_GEOMETRY = Geometry(max_hosts=1, rpc_bytes_per_host=4096, block_size=16 << 10)


def test_searches_give_up_alike_in_a_nearly_full_index(shm_path: str) -> None:
    """512 buckets filled past what two-choice placement holds: searches that visit up to
    MAX_VISIT buckets, and keys that fit nowhere (seed 11 tells a search that stops one
    bucket sooner or later from the oracle's)."""
    rng = random.Random(11)
    with twin(shm_path, "native", 4, size=16 << 20, geometry=BIG_GEOMETRY, deep_every=128) as tw:
        assert tw.nbuckets == 512
        for i in range(3 * tw.nbuckets):
            tw.put(rng.randbytes(16), i % tw.nblocks, i + 1, commit=False)
        assert tw.ref.ix.failed > 0 and tw.longest > 2
        tw.check("the last put", deep=True)


@pytest.mark.parametrize("mode", MODES)
def test_seeded_histories_agree_and_reach_every_path(shm_path: str, mode: str) -> None:
    """Each history from its own seed (a failure names it); together they reach every path
    of ``REACHED``, so a history generator that drifted cannot pass vacuously."""
    reached: Counter[str] = Counter()
    for seed in SEEDS:
        with twin(f"{shm_path}-{seed}", mode, seed) as tw:
            tw.label = f"the history of seed {seed} ({mode})"
            history(tw, Seeded(seed), STEPS)
            reached += tw.reached
    missed = [path for path in REACHED if not reached[path]]
    assert not missed, f"the seeded histories never reached {missed} ({dict(reached)})"


_examples = itertools.count()


@pytest.mark.parametrize("mode", MODES)
@settings(
    max_examples=DRAWN_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_drawn_histories_agree(shm_path: str, mode: str, data: st.DataObject) -> None:
    """Histories drawn by hypothesis: a failure shrinks to a short history (its draws)."""
    draw = Drawn(data)
    with twin(f"{shm_path}-{next(_examples)}", mode, draw.number(0, 1 << 16)) as tw:
        history(tw, draw, draw.number(1, 60))


def test_refusals_agree(shm_path: str) -> None:
    """Ranges and repairs both writers refuse, with the same exception."""
    with twin(shm_path, "native", 3) as tw:
        keys = BlockKeys(NBLOCKS)
        for lo, hi in ((-1, 2), (3, 2), (0, NBUCKETS + 1)):

            def bad_range(ix: Any, lo: int = lo, hi: int = hi) -> object:
                return ix.reconcile(lo, hi, keys.lookup)

            assert tw.both(f"reconcile [{lo}, {hi})", bad_range, raises=True) is ValueError
        for digests, blocks, versions in (
            ([KEYS[0]], [1, 2], [1, 1]),  # a block more than digests
            ([KEYS[0]], [NBLOCKS], [1]),  # past the last block
            ([b"short"], [1], [1]),  # not a digest
        ):

            def bad_repair(
                ix: Any, d: list[bytes] = digests, b: list[int] = blocks, v: list[int] = versions
            ) -> object:
                return ix.repair(d, np.array(b), np.array(v, np.uint64))

            assert tw.both(f"repair {digests}, {blocks}", bad_repair, raises=True) is ValueError


# -- the comparison itself -------------------------------------------------------------------


class _SameSequence(oracle.PoolIndex):
    """Rewrites a bucket with the sequence it had."""

    def _write(self, bucket: int) -> None:
        get, at = self.slots.get, bucket * SLOTS
        slots = [(s[1], s[2], s[3]) if (s := get(i)) else (0, 0, 0) for i in range(at, at + SLOTS)]
        self.mem.nt_store(self.base + bucket * LINE, _core.ix_pack(int(self.seq[bucket]), slots))


class _CrowdReversed(oracle.PoolIndex):
    def crowd(self, digest: bytes) -> list[bytes]:
        return super().crowd(digest)[::-1]


class _ScrubSeesNothing(oracle.PoolIndex):
    def scrub(self, n: int = 64) -> int:
        self._scrub_at = (self._scrub_at + min(n, self.nbuckets)) % self.nbuckets
        return 0


class _DropLeavesTheLine(oracle.PoolIndex):
    def drop(self, digest: bytes) -> None:
        at = self._find(digest)
        if at is not None:
            del self.slots[at]
            del self.where[digest]


@pytest.mark.parametrize(
    ("bug", "says"),
    [
        (_SameSequence, "sequence unchanged"),
        (_CrowdReversed, "crowd .* the implementation"),
        (_ScrubSeesNothing, "scrub .* the implementation"),
        (_DropLeavesTheLine, "bucket lines differ"),
    ],
)
def test_the_comparison_catches_a_writer_that_deviates(
    shm_path: str, bug: type[oracle.PoolIndex], says: str
) -> None:
    """The comparison itself: oracles with a bug each, as the implementation under test."""
    with pytest.raises(AssertionError, match=says):
        for seed in range(4):
            with twin(f"{shm_path}-{seed}", "native", seed, impl=bug) as tw:
                history(tw, Seeded(seed), STEPS)
