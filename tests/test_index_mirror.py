"""The pool index writer against its oracle, operation by operation.

``beluga.server.index.PoolIndex`` (the implementation under test) and
``tests.index_oracle.PoolIndex`` (today's pure-Python writer, kept frozen) run
the same operations, each over its own pool with the same contents, and must
agree after every step:

- each operation's answer, its type included (put, find, crowd, drop, scrub,
  reconcile and repair's counts);
- the pool's bucket lines: whether each is whole, and its slots' tag, block and
  version.  Not the sequence or the CRC: the implementation may bump sequences
  in another order.  Its own lines are held to what readers need instead: a
  bucket whose slots changed between two steps has a new sequence;
- the mirror: ``len``, ``where`` (membership, slot numbers, iteration),
  ``loaded``, and the counters ``moves``, ``failed``, ``scrubbed`` and
  ``unconfirmed``.

The pool is small (32 buckets, 23 blocks) and most keys' two buckets lie among
five, so cuckoo moves, chains of them, keys that fit nowhere and keys replaced
in place are common.  Histories mix puts of new keys and of placed ones, drops,
finds, crowds, scrubs, fresh servers (a lazy mirror that resolves slots against
block headers and commit words, written from another host: confirming, of
another key or version, uncommitted, cleared), stray bytes in bucket lines
(torn, whole but wrong, with junk in untagged slots), reconcile over random
ranges, the whole index reconciled and ``loaded_all``, and ``repair``; with the
native memory and with the model (the same memops table).

Seeded histories must together reach every path (``REACHED``); a history drawn
by hypothesis shrinks to a short failing one.  ``BELUGA_STRESS=full`` runs many
more of both.
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

#: block headers are left published (some committed) in the pools on purpose
pytestmark = pytest.mark.leaves("keys", "writes")

FULL = os.environ.get("BELUGA_STRESS") == "full"
SEEDS = range(400) if FULL else range(16)
STEPS = 300 if FULL else 200
DRAWN_EXAMPLES = 500 if FULL else 30
MODES = ["native", "model"]

GEOMETRY = Geometry(max_hosts=1, rpc_bytes_per_host=4096, block_size=256 << 10)
SIZE = 16 << 20
NBUCKETS, NBLOCKS = plan(SIZE, GEOMETRY).nbuckets, plan(SIZE, GEOMETRY).nblocks
SLOTS = _core.IX_SLOTS
CROWD = 6  # buckets 0..5, in a row: where most keys' two buckets lie
FAR_BLOCKS = (NBLOCKS, NBLOCKS + 1, (1 << 31) + 3, (1 << 32) - 1)  # past the pool's last
#: the paths every run of the seeded histories must reach (counted on the oracle)
REACHED = (
    "moves",
    "chain",
    "failed",
    "in place",
    "replaced",
    "scrubbed",
    "unconfirmed",
    "salvaged",
    "fresh",
    "reconcile kept",
    "reconcile dropped",
    "loaded_all",
    "repair inserted",
    "repair dropped",
)
_COLUMNS = ("u1", "=u8", "=u4", "=u4", "=u8")  # _core.ix_columns: whole, seq, tag, block, version


def _keys() -> list[bytes]:
    """20 keys whose two buckets are neighbours in the crowd (more than its 18 slots hold,
    most at its start, so that a put moves entries down the row), 4 keys with one bucket
    in the crowd, 4 with none."""
    rng = random.Random(20261207)
    row = {(0, 1): 6, (1, 2): 4, (2, 3): 4, (3, 4): 3, (4, 5): 3, "half": 4, "none": 4}
    got: dict[object, list[bytes]] = {k: [] for k in row}
    while any(len(got[k]) < n for k, n in row.items()):
        d = rng.randbytes(16)
        _, b1, b2 = _core.ix_hash(d, NBUCKETS)
        inside = (b1 < CROWD) + (b2 < CROWD)
        pair = (min(b1, b2), max(b1, b2))
        k = pair if inside == 2 else ("none", "half")[inside] if inside < 2 else None
        if k in row and len(got[k]) < row[k]:
            got[k].append(d)
    return [d for k in row for d in got[k]]


KEYS = _keys()
HOME = {d: i % NBLOCKS for i, d in enumerate(KEYS)}  # the last key shares the first's block


def tag_of(d: bytes) -> int:
    return int(_core.ix_hash(d, NBUCKETS)[0])


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


#: a bucket line as compared: whole or not, and (tag, block, version) per slot
Bucket = tuple[bool, tuple[tuple[int, int, int], ...]]


@dataclass
class Lines:
    buckets: list[Bucket]
    seqs: list[int]


def mirror_state(ix: Any) -> dict[str, object]:
    """What a writer's mirror shows through the API both writers share."""
    where = ix.where
    listed = list(where)
    loaded = ix.loaded
    if loaded is not None:
        assert isinstance(loaded, np.ndarray) and loaded.dtype == np.bool_
        assert loaded.shape == (NBUCKETS,)
    return {
        "len": len(ix),
        "len(where)": len(where),
        "iter(where)": len(listed),
        "where": {d: where[d] for d in listed},
        "in where": [d in where for d in KEYS],
        "loaded": None if loaded is None else loaded.tolist(),
        "moves": ix.moves,
        "failed": ix.failed,
        "scrubbed": ix.scrubbed,
        "unconfirmed": ix.unconfirmed,
    }


# -- the two writers over their pools ----------------------------------------------------


@dataclass
class Side:
    name: str
    pool: Pool  # the server's attachment
    other: Pool  # another host's: block headers, commit words, stray bytes
    cls: Any
    ix: Any = None

    def fresh(self) -> None:
        self.ix = self.cls(self.pool.memory, self.pool.superblock)


class Twin:
    """The writer under test and the oracle, run step by step and compared after each."""

    def __init__(self, impl: Side, ref: Side) -> None:
        self.impl, self.ref = impl, ref
        self.sides = (impl, ref)
        #: what the service would know: each key's entry, as last put or repaired
        self.values: dict[bytes, tuple[int, int]] = {}
        self.reconciled = np.zeros(NBUCKETS, dtype=bool)  # since the last fresh server
        self.version = 0
        self.log: list[str] = []
        self.reached: Counter[str] = Counter()
        self.last: Lines | None = None
        self.fresh()

    # -- running and comparing

    def say(self, msg: str) -> str:
        tail = "\n  ".join(self.log[-12:])
        return f"{msg}\nthe last steps (impl: {self.impl.cls.__module__}):\n  {tail}"

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
        if after["moves"] - before["moves"] > 1:
            self.reached["chain"] += 1
        return got[1][1]

    def _counters(self) -> dict[str, int]:
        ix = self.ref.ix
        return {n: getattr(ix, n) for n in ("moves", "failed", "scrubbed", "unconfirmed")}

    def lines(self, side: Side) -> Lines:
        mem, base = side.pool.memory, side.pool.superblock.index.offset
        mem.invalidate(base, NBUCKETS * LINE)
        mem.mfence()
        whole, seq, tags, blocks, versions = (
            np.frombuffer(c, t).tolist()
            for c, t in zip(
                _core.ix_columns(mem.load(base, NBUCKETS * LINE)), _COLUMNS, strict=True
            )
        )
        slots = list(zip(tags, blocks, versions, strict=True))
        return Lines(
            [(bool(whole[b]), tuple(slots[b * SLOTS : (b + 1) * SLOTS])) for b in range(NBUCKETS)],
            seq,
        )

    def check(self, what: str, *, stray: bool = False) -> None:
        """The pools' lines (but their sequences) and the mirrors agree; a line the writer
        under test changed has a new sequence (not after ``stray`` bytes the test stored)."""
        mine, want = self.lines(self.impl), self.lines(self.ref)
        differ = [b for b in range(NBUCKETS) if mine.buckets[b] != want.buckets[b]]
        assert not differ, self.say(
            f"after {what}, bucket lines differ (whole, [(tag, block, version)]):\n"
            + "\n".join(
                f"  bucket {b}: impl {mine.buckets[b]}\n  {'':>{len(str(b)) + 7}} "
                f"oracle {want.buckets[b]}"
                for b in differ
            )
        )
        if self.last is not None and not stray:
            unbumped = [
                b
                for b in range(NBUCKETS)
                if mine.buckets[b] != self.last.buckets[b] and mine.seqs[b] == self.last.seqs[b]
            ]
            assert not unbumped, self.say(
                f"after {what}, the implementation rewrote buckets {unbumped} "
                "with their sequence unchanged: a reader would not see the rewrite"
            )
        if self.last is not None and not stray:
            self.reached["salvaged"] += sum(
                not old[0] and new[0]
                for old, new in zip(self.last.buckets, want.buckets, strict=True)
            )
        self.last = mine
        states = [mirror_state(s.ix) for s in self.sides]
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
        if block >= NBLOCKS:
            return

        def store(side: Side) -> None:
            sb, mem = side.pool.superblock, side.other.memory
            hdr, payload = sb.block_header_offset(block), sb.block_payload_offset(block)
            mem.publish(hdr, payload, d, version, b"v%d" % version, writer=1, writer_gen=1)
            word = version if commit else 0
            mem.nt_store(sb.block_commit_offset(block), word.to_bytes(8, "little"))

        self._other(store)

    def clear_header(self, block: int) -> None:
        def store(side: Side) -> None:
            side.other.memory.nt_store(side.pool.superblock.block_header_offset(block), bytes(LINE))

        self._other(store)

    def stray(self, bucket: int, line: bytes) -> None:
        """Stray or hostile bytes over one bucket line, from another host."""
        self.log.append(f"stray bytes over bucket {bucket}: {line.hex()}")

        def store(side: Side) -> None:
            side.other.memory.nt_store(side.pool.superblock.index.offset + bucket * LINE, line)

        self._other(store)
        self.check(f"stray bytes over bucket {bucket}", stray=True)

    # -- the writers' operations

    def next_version(self, big: bool = False) -> int:
        self.version += 1
        return (1 << 64) - self.version if big else self.version

    def fresh(self) -> None:
        """A new server over the pools: a lazy mirror, nothing loaded."""
        self.log.append("a fresh server")
        for side in self.sides:
            side.fresh()
            assert side.ix.nbuckets == NBUCKETS
            assert side.ix.base == side.pool.superblock.index.offset
        self.reconciled[:] = False
        self.reached["fresh"] += 1
        self.check("a fresh server")

    def put(self, d: bytes, block: int, version: int, *, commit: bool = True) -> bool:
        """COMMIT's steps: the value's header and commit word (``commit``), then the slot."""
        if commit:
            self.publish(block, d, version)
        was = self.ref.ix.where.get(d)  # the oracle's: a dict
        ok = bool(
            self.both(
                f"put {d.hex()} -> ({block}, {version})", lambda ix: ix.put(d, block, version)
            )
        )
        if ok:
            now = self.ref.ix.where[d]
            if was is not None and self.values.get(d) != (block, version):
                self.reached["in place" if now == was else "replaced"] += 1
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
        digests = [d for d, _, _ in entries]

        def op(ix: Any) -> dict[str, int]:
            blocks = np.array([b for _, b, _ in entries], dtype=np.int64)
            versions = np.array([v for _, _, v in entries], dtype=np.uint64)
            got: dict[str, int] = ix.repair(list(digests), blocks, versions)
            return got

        got: dict[str, int] = self.both(f"repair {len(entries)} entries", op)
        self.values = {d: (b, v) for d, b, v in entries}
        self.reconciled[:] = True
        self.reached["repair inserted"] += got["inserted"]
        self.reached["repair dropped"] += got["dropped"]
        return got


@contextmanager
def twin(path: str, mode: str, seed: int, impl: Any = None) -> Iterator[Twin]:
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
            pool = Pool.create(p, SIZE, geometry=GEOMETRY, coherence=mode, model=model(2 * seed))
            stack.callback(pool.close)
            other = Pool.attach(p, coherence=mode, model=model(2 * seed + 1))
            stack.callback(other.close)
            sides.append(Side(name, pool, other, cls))
        assert pool.superblock.nbuckets == NBUCKETS and pool.superblock.nblocks == NBLOCKS
        yield Twin(*sides)


# -- histories -----------------------------------------------------------------------------


class Draw(Protocol):
    def int(self, lo: int, hi: int) -> int:
        """lo..hi, both included."""
        ...

    def bytes(self, n: int) -> bytes: ...


class Seeded:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def bytes(self, n: int) -> bytes:
        return self.rng.randbytes(n)


class Drawn:
    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def bytes(self, n: int) -> bytes:
        return self.data.draw(st.binary(min_size=n, max_size=n))


def pick(draw: Draw, seq: Sequence[Any]) -> Any:
    return seq[draw.int(0, len(seq) - 1)]


def chance(draw: Draw, percent: int) -> bool:
    return draw.int(0, 99) < percent


def a_block(draw: Draw, d: bytes) -> int:
    r = draw.int(0, 9)
    if r < 6:
        return HOME[d]
    return draw.int(0, NBLOCKS - 1) if r < 9 else int(pick(draw, FAR_BLOCKS))


def op_put(tw: Twin, draw: Draw) -> None:
    new = [d for d in KEYS if d not in tw.values]
    if tw.values and (not new or chance(draw, 30)):  # a placed key again
        d = pick(draw, sorted(tw.values))
        if chance(draw, 15):
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
    tw.scrub(pick(draw, (1, 3, 8, 16, 64, NBUCKETS + 5)))


def op_header(tw: Twin, draw: Draw) -> None:
    """Block headers and commit words that confirm a slot, or no longer do."""
    placed = sorted(d for d, (b, _) in tw.values.items() if b < NBLOCKS)
    d = pick(draw, placed) if placed and chance(draw, 80) else pick(draw, KEYS)
    block, version = tw.values.get(d, (HOME[d], tw.next_version()))
    if block >= NBLOCKS:
        return
    kind = draw.int(0, 4)
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
    tw.log.append(f"header op {kind} at block {block} ({d.hex()}, {version})")


def a_slot(tw: Twin, draw: Draw) -> tuple[int, int, int]:
    r = draw.int(0, 5)
    if r == 0:
        return (0, 0, 0)
    if r == 1 and tw.values:  # a placed key's (maybe outside its buckets, or a second slot)
        d = pick(draw, sorted(tw.values))
        return (tag_of(d), *tw.values[d])
    if r <= 2:
        d = pick(draw, KEYS)
        return (tag_of(d), HOME[d], draw.int(1, max(1, tw.version)))
    if r == 3:  # untagged, junk in the other fields
        return (0, draw.int(0, (1 << 32) - 1), draw.int(0, (1 << 64) - 1))
    return (draw.int(1, (1 << 32) - 1), draw.int(0, NBLOCKS + 2), draw.int(0, (1 << 64) - 1))


def op_stray(tw: Twin, draw: Draw) -> None:
    bucket = draw.int(0, CROWD + 1) if chance(draw, 75) else draw.int(0, NBUCKETS - 1)
    kind = draw.int(0, 3)
    if kind == 0:
        line = draw.bytes(LINE)
    elif kind == 3:
        line = bytes(LINE)
    else:
        slots = [a_slot(tw, draw) for _ in range(SLOTS)]
        line = _core.ix_pack(draw.int(0, 1 << 62), slots)
        if kind == 1:  # torn: its fields plausible, its CRC not
            torn = bytearray(line)
            torn[LINE - 4 + draw.int(0, 3)] ^= 1 << draw.int(0, 7)
            line = bytes(torn)
    tw.stray(bucket, line)


def entries_of(tw: Twin, draw: Draw) -> BlockKeys:
    """Recovered entries, as a BlockKeys: most of the keys put, some with another version,
    some keys named twice, some others."""
    keys = BlockKeys(NBLOCKS)
    for d, (block, version) in sorted(tw.values.items()):
        if block < NBLOCKS and chance(draw, 90):
            keys.set(block, d, version if chance(draw, 90) else version + 1)
    for _ in range(draw.int(0, 3)):
        d = pick(draw, KEYS)
        version = tw.values.get(d, (0, tw.next_version()))[1]
        keys.set(draw.int(0, NBLOCKS - 1), d, version)
    return keys


def op_reconcile(tw: Twin, draw: Draw) -> None:
    lo = draw.int(0, NBUCKETS)
    tw.reconcile(lo, draw.int(lo, min(NBUCKETS, lo + draw.int(0, 12))), entries_of(tw, draw))


def op_recover(tw: Twin, draw: Draw) -> None:
    """Every bucket reconciled, a region at a time, then loaded_all (the service's order)."""
    entries, region = entries_of(tw, draw), draw.int(1, NBUCKETS)
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
    for _ in range(draw.int(0, 4)):  # keys the index lost
        d, block = pick(draw, KEYS), draw.int(0, NBLOCKS - 1)
        if block not in blocks and d not in {e[0] for e in out}:
            out.append((d, block, tw.next_version()))
            blocks.add(block)
    for i in range(len(out) - 1, 0, -1):  # in any order
        j = draw.int(0, i)
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
    (5, op_stray),
    (3, op_fresh),
    (5, op_reconcile),
    (2, op_recover),
    (1, op_repair),
]
_WEIGHTS = list(itertools.accumulate(w for w, _ in OPS))


def history(tw: Twin, draw: Draw, steps: int) -> None:
    for _ in range(steps):
        r = draw.int(0, _WEIGHTS[-1] - 1)
        OPS[next(i for i, w in enumerate(_WEIGHTS) if r < w)][1](tw, draw)


# -- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_crowded_keys_move_fail_and_are_replaced_in_place_alike(shm_path: str, mode: str) -> None:
    """Every crowded key put (moves, chains, a key that fits nowhere), each put again with a
    new entry (both buckets full: in place), some dropped and the others put again."""
    crowded = KEYS[:20][::-1]  # the row's far end first: later keys push entries down it
    with twin(shm_path, mode, 1) as tw:
        placed = [d for d in crowded if tw.put(d, HOME[d], tw.next_version())]
        assert tw.ref.ix.moves > 0 and tw.ref.ix.failed > 0, "no move, or no key failed"
        assert tw.reached["chain"] > 0, "no put moved two entries"
        assert len(placed) < len(crowded) and len(tw.ref.ix) == len(placed)
        for d in placed:
            assert tw.put(d, HOME[d], tw.next_version(big=d == placed[0]))
        assert tw.reached["in place"] > 0, "no key was replaced in place"
        for d in placed[::3]:
            tw.drop(d)
        for d in crowded:
            tw.put(d, HOME[d], tw.next_version())
        assert tw.reached["replaced"] > 0, "no key was replaced into a free slot"
        for d in KEYS:
            tw.crowd(d)
            tw.find(d)
        assert tw.ref.ix.moves == tw.reached["moves"] and tw.ref.ix.failed == tw.reached["failed"]


@pytest.mark.parametrize("mode", MODES)
def test_a_fresh_server_resolves_slots_alike(shm_path: str, mode: str) -> None:
    """A new server's lazy mirror: slots that headers and commit words confirm, and slots
    they do not (another key, another version, no commit word, no header, a block past the
    last), a torn line and one whole but wrong, resolved by finds, puts, moves and crowds."""
    with twin(shm_path, mode, 2) as tw:
        for d in KEYS[:20][::-1]:  # the row full (18 slots), as in the test above
            tw.put(d, HOME[d], tw.next_version())
        for d, block in ((KEYS[20], FAR_BLOCKS[0]), (KEYS[24], FAR_BLOCKS[3])):
            assert tw.put(d, block, tw.next_version())
        placed = [d for d in KEYS[:20] if d in tw.values]
        tw.publish(HOME[placed[0]], KEYS[27], tw.next_version())  # another key's header
        tw.publish(HOME[placed[1]], placed[1], tw.values[placed[1]][1] + 1)  # another version
        tw.publish(HOME[placed[2]], placed[2], tw.values[placed[2]][1], commit=False)  # in flight
        tw.clear_header(HOME[placed[3]])
        # a torn line and a whole wrong one over the buckets of a key: its slot a second time
        # (in each of its buckets), slots naming the wrong block, junk in an untagged slot
        d = placed[5]
        _, b1, b2 = _core.ix_hash(d, NBUCKETS)
        wrong = [(tag_of(d), *tw.values[d]), (tag_of(placed[6]), 7, 7), (0, 9, 9)]
        torn = bytearray(_core.ix_pack(1 << 40, wrong))
        torn[-1] ^= 0x10
        tw.stray(b1, bytes(torn))
        tw.stray(b2, _core.ix_pack(5, [*wrong[:2], (tag_of(placed[7]), *tw.values[placed[7]])]))
        tw.fresh()
        for d in KEYS:
            tw.find(d)
        assert tw.ref.ix.unconfirmed >= 6, "slots the headers do not confirm were kept"
        assert tw.reached["salvaged"] > 0, "the torn line was not salvaged"
        tw.fresh()  # again, over the lines the last one left: puts resolve by their searches
        for d in KEYS[:20]:
            tw.put(d, HOME[d], tw.next_version())
        for d in KEYS:
            tw.crowd(d)
        tw.scrub(NBUCKETS)


@pytest.mark.parametrize("mode", MODES)
def test_seeded_histories_agree_and_reach_every_path(shm_path: str, mode: str) -> None:
    reached: Counter[str] = Counter()
    for seed in SEEDS:
        with twin(f"{shm_path}-{seed}", mode, seed) as tw:
            tw.log.append(f"(seed {seed}, {mode})")
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
    draw = Drawn(data)
    with twin(f"{shm_path}-{next(_examples)}", mode, draw.int(0, 1 << 16)) as tw:
        history(tw, draw, draw.int(1, 60))


def test_refusals_agree(shm_path: str) -> None:
    """Ranges and repairs both writers refuse, with the same exception."""
    with twin(shm_path, "native", 3) as tw:
        keys = BlockKeys(NBLOCKS)
        for lo, hi in ((-1, 2), (3, 2), (0, NBUCKETS + 1)):
            got = tw.both(
                f"reconcile [{lo}, {hi})",
                lambda ix, lo=lo, hi=hi: ix.reconcile(lo, hi, keys.lookup),
                raises=True,
            )
            assert got is ValueError
        for digests, blocks, versions in (
            ([KEYS[0]], [1, 2], [1, 1]),  # a block more than digests
            ([KEYS[0]], [NBLOCKS], [1]),  # past the last block
            ([b"short"], [1], [1]),  # not a digest
        ):
            got = tw.both(
                f"repair {digests}, {blocks}",
                lambda ix, d=digests, b=blocks, v=versions: ix.repair(
                    d, np.array(b), np.array(v, np.uint64)
                ),
                raises=True,
            )
            assert got is ValueError
