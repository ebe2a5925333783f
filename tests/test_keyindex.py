"""The service's key index (beluga/server/keyindex.py) against a plain OrderedDict.

``KeyIndex`` replaced the service's ``OrderedDict[bytes, Entry]``: keys recovery
finds stay cold (numpy columns and a C table) until an operation touches them.  It
must answer every operation as the ``OrderedDict`` would and keep the same LRU
order, because eviction takes the order's first entry and recovery's rules put
whole regions before everything.  So random histories run the same operations on
both, as the service uses them (recovery's ``add_cold`` done on the oracle as the
old code did it: insert, then move each key to the start), and compare every
answer, the digests in order after every step, and the entries in order (which
makes every cold key's ``Entry``) now and then and at the end.

``BELUGA_STRESS=full`` runs many more and longer histories.
"""

from __future__ import annotations

import os
import random
from collections import Counter, OrderedDict

import numpy as np
import pytest

from beluga._native import _core
from beluga.server.extents import Entry
from beluga.server.keyindex import KeyIndex, KeyWalk, _Front

FULL = os.environ.get("BELUGA_STRESS") == "full"
SEEDS = 400 if FULL else 40
STEPS = 1500 if FULL else 300


def _digest(i: int) -> bytes:
    return i.to_bytes(16, "little")


class _Oracle:
    """The OrderedDict the service used, and recovery's way of adding a region to it."""

    def __init__(self) -> None:
        self.od: OrderedDict[bytes, Entry] = OrderedDict()

    def add_cold(self, rows: list[tuple[bytes, int, int, int, int]]) -> None:
        self.od.update((d, Entry(b, n, v, length)) for d, b, n, v, length in rows)
        for d, *_ in reversed(rows):
            self.od.move_to_end(d, last=False)


def _add_cold(ki: KeyIndex, rows: list[tuple[bytes, int, int, int, int]]) -> None:
    ki.add_cold(
        np.array([r[0] for r in rows], dtype="V16"),
        np.array([r[1] for r in rows], dtype=np.int64),
        np.array([r[2] for r in rows], dtype=np.int64),
        np.array([r[3] for r in rows], dtype=np.uint64),
        np.array([r[4] for r in rows], dtype=np.int64),
    )


def _part(ki: KeyIndex, d: bytes, op: str) -> str:
    """Which part of ``ki`` holds ``d``, for the paths a history took."""
    return f"{op}_{'warm' if d in ki._warm else 'front' if d in ki._front else 'cold'}"


def _history(seed: int, steps: int, make: type[KeyIndex] = KeyIndex) -> Counter[str]:
    """Run one random history on both; assert they agree throughout.  Returns the paths
    taken (so a test can check the histories reach them all)."""
    rnd = random.Random(seed)
    ki, oracle = make(), _Oracle()
    od = oracle.od
    paths: Counter[str] = Counter()
    universe = rnd.choice([8, 40, 300])  # few keys: many hits; many: mostly new keys
    next_block = 0

    def some_key() -> bytes:
        if od and rnd.random() < 0.8:
            return rnd.choice(list(od))
        return _digest(rnd.randrange(universe))

    def fresh_rows(n: int) -> list[tuple[bytes, int, int, int, int]]:
        nonlocal next_block
        keys = [d for d in {_digest(rnd.randrange(universe)) for _ in range(n)} if d not in od]
        rnd.shuffle(keys)
        rows = []
        for d in keys:
            rows.append(
                (d, next_block, rnd.randint(1, 4), rnd.randrange(1 << 40), rnd.randrange(1 << 20))
            )
            next_block += 8
        return rows

    walk: KeyWalk | None = None  # recovery's naming step walks the keys while they change
    walked: list[bytes] = []  # what the walk must hand out, the keys left out removed
    left_out: set[bytes] = set()

    def walk_next() -> None:
        nonlocal walk
        assert walk is not None
        made, keys = ki.made, rnd.choice([1, 2, 5, 50])
        got = walk.next(
            rnd.choice([1, 3, 100]),
            keys,
            lambda ds: np.array([d in left_out for d in ds.tolist()], dtype=bool),
        )
        assert ki.made == made  # no cold key's Entry made
        assert len(got) < 2 * keys
        assert got == walked[len(walked) - len(got) :]  # the next keys back, oldest first
        del walked[len(walked) - len(got) :]
        if not walk:
            assert not walked
            walk = None

    for step in range(steps):
        op = rnd.choices(
            [
                "add_cold",
                "set",
                "get",
                "getitem",
                "contains",
                "pop",
                "del",
                "move",
                "lease",
                "evict",
                "known",
                "refuse",
                "walk",
            ],
            [6, 8, 10, 4, 6, 6, 3, 10, 4, 5, 3, 1, 4],
        )[0]
        paths[op] += 1
        if op == "add_cold":
            rows = fresh_rows(rnd.choice([1, 3, 20]))
            _add_cold(ki, rows)
            oracle.add_cold(rows)
        elif op == "set":
            d = some_key()
            e = Entry(next_block, 1, rnd.randrange(1 << 40), rnd.randrange(100))
            next_block += 8
            paths[_part(ki, d, "set") if d in ki else "set_new"] += 1
            ki[d] = e
            od[d] = Entry(e.block, e.nblocks, e.version, e.length)
        elif op == "get":
            d = some_key()
            assert ki.get(d) == od.get(d)
        elif op == "getitem":
            d = some_key()
            if d in od:
                assert ki[d] == od[d]
            else:
                with pytest.raises(KeyError):
                    ki[d]
        elif op == "contains":
            d = some_key()
            assert (d in ki) == (d in od)
        elif op == "pop":
            d = some_key()
            if rnd.random() < 0.5:
                assert ki.pop(d, None) == od.pop(d, None)
            elif d in od:
                assert ki.pop(d) == od.pop(d)
            else:
                with pytest.raises(KeyError):
                    ki.pop(d)
        elif op == "del":
            d = some_key()
            if d in od:
                paths[_part(ki, d, "del")] += 1
                del ki[d]
                del od[d]
            else:
                with pytest.raises(KeyError):
                    del ki[d]
        elif op == "move":
            d, last = some_key(), rnd.random() < 0.7
            if d in od:
                paths[f"{_part(ki, d, 'move')}_{last}"] += 1
                ki.move_to_end(d, last=last)
                od.move_to_end(d, last=last)
                front = ki._order[0] if ki._order else None
                if not last and isinstance(front, _Front) and len(front.keys) > 1:
                    paths["front_grew"] += 1
            else:
                with pytest.raises(KeyError):
                    ki.move_to_end(d, last=last)
        elif op == "lease":  # a caller changes the Entry it got: the index's own
            d = some_key()
            if d in od:
                t = float(rnd.randrange(1, 100))
                ki[d].lease_until = t
                od[d].lease_until = t
        elif op == "evict":  # _evict_one: the first entry whose lease ran out goes
            now = float(rnd.randrange(0, 100))
            want = next((d for d, e in od.items() if e.lease_until <= now), None)
            got = next((d for d, e in ki.items() if e.lease_until <= now), None)
            assert got == want
            if want is not None:
                paths["evicted"] += 1
                assert ki.pop(got) == od.pop(want)
        elif op == "known":
            ds = [some_key() for _ in range(rnd.randrange(0, 6))]
            got = ki.known(np.array(ds, dtype="V16")).tolist()
            assert got == [d in od for d in ds]
        elif op == "refuse" and od:  # a key indexed already: nothing changes
            rows = [*fresh_rows(3), (rnd.choice(list(od)), 0, 1, 1, 1)]
            with pytest.raises(ValueError):
                _add_cold(ki, rows)
            paths["refused"] += 1
        elif op == "walk" and walk is None:
            walk = ki.walk()
            left_out = {d for d in od if rnd.random() < 0.6}
            walked = [d for d in od if d not in left_out]
            paths["walk"] += 1
        elif op == "walk":
            walk_next()
            paths["walk_done" if walk is None else "walk_next"] += 1
        assert len(ki) == len(od)
        assert bool(ki) == bool(od)
        assert list(ki) == list(od)
        if rnd.random() < 0.05 or step == steps - 1:
            assert list(ki.items()) == list(od.items())
            assert list(ki.values()) == list(od.values())
        assert ki.value_bytes() == sum(e.length for e in od.values())
    for _ in range(len(walked) + 1000):  # each call looks at a row at least
        if walk is None:
            break
        walk_next()
    assert walk is None
    paths["cold_left"] += ki.cold
    return paths


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_histories_agree_with_an_ordered_dict(seed: int) -> None:
    _history(seed, STEPS)


def test_the_histories_reach_every_path() -> None:
    """Without this, the comparison could pass by never touching a cold key."""
    paths: Counter[str] = Counter()
    for seed in range(SEEDS):
        paths += _history(seed, STEPS)
    for path in (
        "add_cold",
        "set_cold",
        "set_warm",
        "set_new",
        "del_cold",
        "del_warm",
        "del_front",
        "set_front",
        "front_grew",
        "move_front_True",
        "move_front_False",
        "evicted",
        "refused",
        "move_warm_True",
        "move_warm_False",
        "move_cold_True",
        "move_cold_False",
        "cold_left",
        "walk",
        "walk_next",
        "walk_done",
    ):
        assert paths[path] > 0, path


class _NoCursor(KeyIndex):
    """A deliberate bug: a row taken at the cursor leaves the cursor where it was, and
    the cursor is trusted to be live."""

    def items(self):  # type: ignore[no-untyped-def]
        for chunk in list(self._order):
            if isinstance(chunk, _Front):
                yield from chunk.keys.items()
                continue
            digest = chunk.digests[chunk.start].tobytes()
            yield digest, self._cold_entry(digest, chunk, chunk.start)
        yield from self._warm.items()


class _FirstIsLast(KeyIndex):
    """A deliberate bug: move_to_end(last=False) of a warm key keeps it warm (at the warm
    part's start, after every cold key) -- the order the plan first proposed."""

    def move_to_end(self, digest: bytes, last: bool = True) -> None:
        if digest in self._warm and not last:
            self._warm.move_to_end(digest, last=False)
            return
        super().move_to_end(digest, last)


class _ColumnsWin(KeyIndex):
    """A deliberate bug: a cold key's replaced Entry is forgotten for its columns."""

    def __setitem__(self, digest: bytes, e: Entry) -> None:
        if digest not in self._warm and self._row(digest) is not None:
            return
        self._warm[digest] = e


class _GroupInOrder(KeyIndex):
    """A deliberate bug: a key put first joins its front group at the group's end, so
    keys put first one after another keep the order they came in (not newest first)."""

    def _put_first(self, digest: bytes, e: Entry) -> None:
        group = self._order[0] if self._order else None
        if not isinstance(group, _Front):
            group = _Front()
            self._order.appendleft(group)
        group.keys[digest] = e
        self._front[digest] = group
        self._fronted += 1


@pytest.mark.parametrize("bug", [_NoCursor, _FirstIsLast, _ColumnsWin, _GroupInOrder])
def test_the_comparison_catches_an_index_that_deviates(bug: type[KeyIndex]) -> None:
    with pytest.raises(AssertionError):
        for seed in range(SEEDS):
            _history(seed, STEPS, bug)


def test_the_table_refuses_misuse_with_an_error_never_a_crash() -> None:
    t = _core.KeyTable(7)
    with pytest.raises(ValueError, match="16-byte records"):
        t.add(b"x" * 17, 0)
    with pytest.raises(ValueError, match="16 bytes"):
        t.get(b"short")
    with pytest.raises(ValueError, match="below 2"):
        t.add(b"x" * 16, -1)
    t.add(b"a" * 16 + b"b" * 16, 5)
    with pytest.raises(ValueError, match="already"):  # the second repeats the first
        t.add(b"c" * 16 + b"a" * 16, 9)
    assert len(t) == 2 and t.get(b"c" * 16) == -1 and t.get(b"b" * 16) == 6
    with pytest.raises(ValueError, match="twice"):
        t.add(b"d" * 32, 9)
    assert len(t) == 2 and t.get(b"d" * 16) == -1
    assert t.pop(b"a" * 16) == 5 and t.pop(b"a" * 16) == -1 and len(t) == 1
    bare = _core.KeyTable.__new__(_core.KeyTable)
    with pytest.raises(ValueError, match="not initialised"):
        bare.get(b"a" * 16)
    assert len(bare) == 0


def test_the_table_holds_many_keys_through_growth_and_removals() -> None:
    """Growth rebuilds the array and drops tombstones; every key stays findable."""
    t = _core.KeyTable(11)
    rnd = np.random.default_rng(3)
    keys = rnd.bytes(16 * 50_000)
    t.add(keys, 0)
    ds = np.frombuffer(keys, dtype="V16")
    gone = rnd.choice(len(ds), 20_000, replace=False)
    for i in gone.tolist():
        assert t.pop(ds[i].tobytes()) == i
    more = rnd.bytes(16 * 50_000)
    t.add(more, 50_000)
    held = np.frombuffer(t.contains(keys), dtype=bool)
    assert held.sum() == 30_000 and not held[gone].any()
    assert np.frombuffer(t.contains(more), dtype=bool).all()
    assert len(t) == 80_000
    assert t.get(np.frombuffer(more, dtype="V16")[123].tobytes()) == 50_123


def test_keys_put_first_one_after_another_share_one_segment_of_the_order() -> None:
    """What keeps a key adopted ahead of the scan O(1) at the pod's 32,768 regions: keys
    put first in a row join one front group at the order's start, not a chunk each (a
    chunk each made the order's length, and each insertion's cost, grow with them)."""
    ki = KeyIndex()
    regions = [[_digest(1000 + 10 * r + i) for i in range(3)] for r in range(100)]
    for keys in regions:
        _add_cold(ki, [(d, 8 * n, 1, 1, 1) for n, d in enumerate(keys)])
    first = [_digest(i) for i in range(50)]
    for n, d in enumerate(first):
        ki[d] = Entry(10_000 + n, 1, 1, 1)
        ki.move_to_end(d, last=False)
    assert len(ki._order) == len(regions) + 1  # one group for the 50 keys
    assert list(ki)[:50] == first[::-1]  # each put before the one before it
    assert list(ki)[50:] == [d for keys in reversed(regions) for d in keys]
    del ki[first[10]]
    ki.move_to_end(first[20])  # to the warm part's end
    assert len(ki._order) == len(regions) + 1
    for d in first:
        if d in ki._front:
            ki.move_to_end(d)
    assert len(ki._order) == len(regions)  # an emptied group leaves the order
    assert list(ki)[-49:] == [first[20], *(d for d in first if d not in (first[10], first[20]))]


@pytest.mark.parametrize("part", ["cold", "front", "warm"])
@pytest.mark.parametrize("change", ["del", "set", "add_cold", "first", "last"])
def test_iterating_while_the_index_changes_raises_in_every_part(part: str, change: str) -> None:
    """items() and iteration copy nothing (eviction takes the first entry, at any size),
    so a change between two steps must be noticed, as a dict notices it."""
    for how in ("items", "iter"):
        ki = KeyIndex()
        _add_cold(ki, [(_digest(i), 8 * i, 1, 1, 1) for i in range(3)])
        for i in range(3, 6):
            ki[_digest(i)] = Entry(8 * i, 1, 1, 1)
            ki.move_to_end(_digest(i), last=False)  # a front group, before the chunk
        for i in range(6, 9):
            ki[_digest(i)] = Entry(8 * i, 1, 1, 1)  # warm
        keys = list(ki)
        at = {"front": 0, "cold": 3, "warm": 6}[part]
        it = iter(ki.items()) if how == "items" else iter(ki)
        for _ in range(at + 1):
            next(it)  # stands in this part, one key of it handed out
        other = keys[at + 1]
        if change == "del":
            del ki[other]
        elif change == "set":
            ki[_digest(100)] = Entry(800, 1, 1, 1)
        elif change == "add_cold":
            _add_cold(ki, [(_digest(101), 808, 1, 1, 1)])
        elif change == "first":
            ki.move_to_end(other, last=False)
        else:
            ki.move_to_end(other)
        with pytest.raises(RuntimeError):
            next(it)
