"""``beluga bench store``: the KV store's operations, beside memcpy and Mooncake Store.

Every operation is timed per call from Python (p50/p99; throughput at the p50):

put, get               a bytes value in, a bytes value out
put_from, get_into     the zero-copy forms, on the caller's buffer
put_batch, get_batch,  64 values of 16 KiB in one call (also per item)
batch_get_into
is_exist               one stored key
lookup_prefix          a chain of 256 stored keys (Beluga only)
lookup_prefix_cold     a chain of 256 keys none of which is stored (a new
                       prompt's first lookup: Beluga only)
invalidate_load        the floor of a read from the pool: invalidate the value's
                       bytes, then load them (Beluga only, the value's own bytes;
                       for the batch, all 64 invalidated behind one fence, then
                       each loaded into its own target)

alignment sweep        get_into, get, batch_get_into and invalidate_load into,
                       and put_from from, caller buffers at each offset from a
                       page boundary (``ALIGN_QUICK``, or ``ALIGN_FULL`` with
                       ``full_sweep``: 0-256 in 16-byte steps, 512, 1024, 2048,
                       4080 and an odd 7); per operation the best and the worst
                       offset's p50 and their ratio.  glibc's malloc puts
                       buffers 16 bytes past a page, so +16 is the common case.

Caller buffers are plain numpy arrays, each allocated on its own, as a user
passes them (so wherever malloc puts them); only Mooncake's run uses one
region, registered once.

memcpy (numpy ``copyto`` between two local buffers) of the same sizes runs in
the same process as the floor: the store cannot move bytes faster than that.

Beluga's metadata server runs in a child process, as ``beluga serve`` would,
and is stopped before Mooncake starts, so the systems never compete for the
CPUs.  With ``baseline="mooncake"`` a private Mooncake Store (see
:mod:`beluga.bench.mooncake`) runs the same operations; its zero-copy forms
work on one region registered once, as an engine registers its KV cache.

Every timed put writes fresh keys: Mooncake keys are write-once, and a Beluga
overwrite would also pay for retiring the old version.  What a round of puts
stored is removed, untimed, before the next round, so neither store evicts
while it is being measured.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from beluga.bench.mooncake import MooncakeBaseline
from beluga.bench.stats import iterations_for, summarize, time_calls
from beluga.child import server_process
from beluga.errors import BackendUnavailableError, BelugaError, RpcError
from beluga.kv import KVStore
from beluga.pool import Pool
from beluga.server import serve
from beluga.units import KiB, MiB, human_bytes

DEFAULT_SIZES = [16 * KiB, 256 * KiB, 2 * MiB]
BATCH = 64
BATCH_VALUE = 16 * KiB
BATCH_LABEL = f"{BATCH}x{human_bytes(BATCH_VALUE)}"
#: Pool bytes a round of timed puts may fill before its keys are removed.
ROUND_BYTES = 32 * MiB
#: Seconds to wait for a server already running on a named pool.
PROBE_S = 1.0
SINGLE_OPS = ("put", "get", "put_from", "get_into")
BATCH_OPS = ("put_batch", "get_batch", "batch_get_into")
METRICS = ("p50_us", "p99_us", "gbps_at_p50", "per_item_us")
PREFIX_CHAIN = 256
PAGE = 4096
#: offsets from a page boundary swept by default, and with ``full_sweep``
ALIGN_QUICK = (0, 16, 48, 144, 1024, 4080, 7)
ALIGN_FULL = (*range(0, 257, 16), 512, 1024, 2048, 4080, 7)
ALIGN_VALUE = 16 * KiB
ALIGN_BATCH = 16
ALIGN_OPS = ("get_into", "get", "batch_get_into", "put_from", "invalidate_load")
#: (name, the figure it reads, what it means, goal, ">=" or "<="): each must reach its goal.
TARGETS = (
    ("get_16KiB_p50_us", "store.beluga.get.16KiB.p50_us", "16 KiB get p50 µs", 4.0, "<="),
    (
        "get_16KiB_vs_mooncake",
        "store.vs_mooncake.get.16KiB",
        "16 KiB get p50, times lower than Mooncake's",
        35.0,
        ">=",
    ),
    (
        "batch_get_into_per_item_us",
        f"store.beluga.batch_get_into.{BATCH_LABEL}.per_item_us",
        f"batch_get_into {BATCH_LABEL}, µs per item",
        1.5,
        "<=",
    ),
    ("is_exist_p50_us", "store.beluga.is_exist.p50_us", "is_exist p50 µs", 1.0, "<="),
    (
        "lookup_prefix_256_p50_us",
        f"store.beluga.lookup_prefix.{PREFIX_CHAIN}.p50_us",
        f"lookup_prefix of {PREFIX_CHAIN} blocks p50 µs",
        20.0,
        "<=",
    ),
    (
        "get_into_2MiB_of_invalidate_load",
        "store.beluga.get_into.2MiB.of_invalidate_load",
        "2 MiB get_into throughput as a fraction of invalidate + load of the same bytes",
        0.8,
        ">=",
    ),
    (
        "get_2MiB_of_memcpy",
        "store.beluga.get.2MiB.of_memcpy",
        "2 MiB get throughput as a fraction of memcpy's",
        0.5,
        ">=",
    ),
)


class Store(Protocol):
    """The operations both systems offer under the same names (KVStore, MooncakeClient)."""

    def put(self, key: str, value: Any, /) -> None: ...
    def get(self, key: str, /) -> bytes | None: ...
    def put_from(self, key: str, value: Any, /) -> None: ...
    def get_into(self, key: str, buffer: Any, /) -> int: ...
    def put_batch(self, keys: Sequence[str], values: Sequence[Any], /) -> None: ...
    def get_batch(self, keys: Sequence[str], /) -> Sequence[bytes | None]: ...
    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any], /) -> Sequence[Any]: ...
    def is_exist(self, key: str, /) -> bool: ...
    def remove(self, key: str, /) -> bool: ...


@dataclass(frozen=True)
class Buffers:
    """Caller memory for every operation, inside one region (Mooncake registers it once)."""

    region: np.ndarray
    source: np.ndarray  # random bytes; every value is a prefix or a slice of it
    target: np.ndarray
    batch_targets: list[np.ndarray]

    @classmethod
    def plain(cls, largest: int) -> Buffers:
        """Separate numpy arrays, each where malloc puts it (what users pass)."""
        span = max(largest, BATCH * BATCH_VALUE)
        source = np.random.default_rng(0).integers(0, 256, span, dtype=np.uint8)
        targets = [np.empty(BATCH_VALUE, dtype=np.uint8) for _ in range(BATCH)]
        return cls(source, source, np.empty(span, dtype=np.uint8), targets)

    @classmethod
    def make(cls, largest: int) -> Buffers:
        """One region holding every buffer (registered once with Mooncake)."""
        span = max(largest, BATCH * BATCH_VALUE)
        region = np.empty(3 * span, dtype=np.uint8)  # source | target | batch targets
        region[:span] = np.random.default_rng(0).integers(0, 256, span, dtype=np.uint8)
        return cls(
            region,
            region[:span],
            region[span : 2 * span],
            [region[2 * span + i * BATCH_VALUE :][:BATCH_VALUE] for i in range(BATCH)],
        )

    def batch_values(self) -> list[np.ndarray]:
        return [self.source[i * BATCH_VALUE :][:BATCH_VALUE] for i in range(BATCH)]


@dataclass(frozen=True)
class Plan:
    """How many calls each point gets: enough to move ``budget`` bytes, at least ``least``."""

    sizes: list[int]
    budget: int
    least: int
    block_bytes: int  # a pool block's; a round of puts is sized by the pool blocks it fills

    def iterations(self, nbytes: int) -> int:
        return iterations_for(nbytes, self.budget, lo=self.least)

    def footprint(self, nbytes: int) -> int:
        return -(-nbytes // self.block_bytes) * self.block_bytes


def data_bytes(sizes: Sequence[int], block_bytes: int = 64 * KiB) -> int:
    """Data-area bytes a run fills: a round of puts and the stored values."""
    plan = Plan(list(sizes), 0, 0, block_bytes)
    stored = sum(plan.footprint(n) for n in sizes) + BATCH * plan.footprint(BATCH_VALUE)
    return ROUND_BYTES + stored


def scratch_bytes(sizes: Sequence[int], block_bytes: int = 64 * KiB) -> int:
    """Data-area bytes of a scratch pool for a run: what it fills, twice over."""
    return 2 * data_bytes(sizes, block_bytes)


def serve_in_child(spec: str, ready: Any) -> None:
    """``beluga serve`` in a child process; its banner would corrupt a JSON document on stdout."""
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        serve(spec, coherence="native", ready=ready)


@contextlib.contextmanager
def beluga_store(pool: Pool, probe: bool) -> Iterator[tuple[KVStore, str]]:
    """A KVStore, and where its server runs: the pool's own, or a child started for the run.

    ``probe`` looks for a server already serving the pool first: a second server
    on the same rings would answer requests twice.
    """
    running = None
    if probe:
        with contextlib.suppress(RpcError):
            running = KVStore(pool, connect_timeout=PROBE_S)
    if running is not None:
        with running:
            yield running, "already running"
        return
    with server_process(serve_in_child, pool.spec), KVStore(pool) as store:
        yield store, "child process"


def _check(ok: bool, system: str, what: str) -> None:
    if not ok:
        raise BelugaError(
            f"{system} {what}: the benchmark measured something other than a working store; "
            "run the store's tests (pytest tests) before trusting any figure"
        )


class Runner:
    """Times every operation of one system; results keyed by (operation, size label)."""

    def __init__(self, system: str, store: Store, buffers: Buffers, plan: Plan) -> None:
        self.system = system
        self.store = store
        self.buffers = buffers
        self.plan = plan
        self.prefix = f"beluga-bench-{uuid.uuid4().hex[:12]}"
        self._names = (f"{self.prefix}-{i}" for i in itertools.count())
        self.results: dict[tuple[str, str], dict[str, float]] = {}

    def run(self) -> dict[tuple[str, str], dict[str, float]]:
        for n in self.plan.sizes:
            self._single(n)
        self._batch()
        self._prefix()
        return self.results

    def _floor(self, key: str, n: int, dst: np.ndarray) -> None:
        """Beluga only: invalidate + load of the value's own bytes, the floor of a read."""
        locate = getattr(self.store, "locate", None)
        if locate is None:
            return
        (ref,) = locate([key], prefix=False)
        mem = self.store.mem  # type: ignore[attr-defined]

        def inv_load() -> None:
            mem.invalidate(ref.payload_offset, n)
            mem.load_into(ref.payload_offset, dst)

        self._record(
            "invalidate_load", human_bytes(n), time_calls(inv_load, self.plan.iterations(n)), n, 1
        )

    def _prefix(self) -> None:
        """Beluga only: lookup_prefix of a stored chain of PREFIX_CHAIN keys."""
        lookup = getattr(self.store, "lookup_prefix", None)
        if lookup is None:
            return
        keys = [next(self._names) for _ in range(PREFIX_CHAIN)]
        self.store.put_batch(keys, [b"v" * 64] * PREFIX_CHAIN)
        _check(lookup(keys) == PREFIX_CHAIN, self.system, "lookup_prefix missed stored keys")
        samples = time_calls(lambda: lookup(keys), self.plan.iterations(BATCH_VALUE))
        self._record("lookup_prefix", str(PREFIX_CHAIN), samples, 0, PREFIX_CHAIN)
        for key in keys:
            self.store.remove(key)
        _check(lookup(keys) == 0, self.system, "lookup_prefix found removed keys")
        samples = time_calls(lambda: lookup(keys), self.plan.iterations(BATCH_VALUE))
        self._record("lookup_prefix_cold", str(PREFIX_CHAIN), samples, 0, PREFIX_CHAIN)

    def _fresh(self, write: Callable[[list[str]], object], keys: int, nbytes: int) -> list[int]:
        """Time ``write(fresh keys)``; each round's keys are removed, untimed, after it."""
        iterations = self.plan.iterations(nbytes)
        per_round = max(1, ROUND_BYTES // (keys * self.plan.footprint(nbytes // keys)))
        samples: list[int] = []
        warmup = min(10, per_round)
        while len(samples) < iterations:
            calls = min(per_round, iterations - len(samples))
            batches = [[next(self._names) for _ in range(keys)] for _ in range(calls + warmup)]
            pending = iter(batches)
            samples += time_calls(lambda it=pending: write(next(it)), calls, warmup)
            for batch in batches:
                for key in batch:
                    self.store.remove(key)
            warmup = 0
        return samples

    def _record(self, op: str, label: str, samples: list[int], nbytes: int, items: int) -> None:
        s = summarize(samples, nbytes)
        if items > 1:
            s["per_item_us"] = s["p50_us"] / items
        self.results[(op, label)] = s

    def _single(self, n: int) -> None:
        store, label, iterations = self.store, human_bytes(n), self.plan.iterations(n)
        src, dst = self.buffers.source[:n], self.buffers.target[:n]
        value = src.tobytes()
        key = next(self._names)
        self._record("put", label, self._fresh(lambda k: store.put(k[0], value), 1, n), n, 1)
        store.put_from(key, src)
        _check(store.get(key) == value, self.system, f"get of {label} returned other bytes")
        self._record("get", label, time_calls(lambda: store.get(key), iterations), n, 1)
        self._record(
            "put_from", label, self._fresh(lambda k: store.put_from(k[0], src), 1, n), n, 1
        )
        dst[:] = 0
        self._record(
            "get_into", label, time_calls(lambda: store.get_into(key, dst), iterations), n, 1
        )
        _check(np.array_equal(dst, src), self.system, f"get_into of {label} wrote other bytes")
        self._floor(key, n, dst)
        store.remove(key)

    def _batch(self) -> None:
        store, total = self.store, BATCH * BATCH_VALUE
        values = [v.tobytes() for v in self.buffers.batch_values()]
        targets = self.buffers.batch_targets
        iterations = self.plan.iterations(total)

        def record(op: str, samples: list[int]) -> None:
            self._record(op, BATCH_LABEL, samples, total, BATCH)

        record("put_batch", self._fresh(lambda k: store.put_batch(k, values), BATCH, total))
        keys = [next(self._names) for _ in range(BATCH)]
        store.put_batch(keys, values)
        _check(store.get_batch(keys) == values, self.system, "get_batch returned other bytes")
        record("get_batch", time_calls(lambda: store.get_batch(keys), iterations))
        for t in targets:
            t[:] = 0
        record(
            "batch_get_into", time_calls(lambda: store.batch_get_into(keys, targets), iterations)
        )
        _check(
            [t.tobytes() for t in targets] == values,
            self.system,
            "batch_get_into wrote other bytes",
        )
        locate = getattr(store, "locate", None)
        if locate is not None:  # the floor: invalidate every value, one fence, load each
            refs = locate(keys, prefix=False)
            mem = store.mem  # type: ignore[attr-defined]

            def inv_load() -> None:
                for r in refs:
                    mem.invalidate(r.payload_offset, BATCH_VALUE)
                mem.mfence()
                for r, t in zip(refs, targets, strict=True):
                    mem.load_into(r.payload_offset, t)

            record("invalidate_load", time_calls(inv_load, iterations))
        _check(store.is_exist(keys[0]), self.system, "is_exist missed a stored key")
        self._record(
            "is_exist",
            "",
            time_calls(lambda: store.is_exist(keys[0]), self.plan.iterations(BATCH_VALUE)),
            0,
            1,
        )
        for key in keys:
            store.remove(key)


def at_offset(n: int, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """A numpy view of n bytes starting ``offset`` bytes past a page boundary, and its owner."""
    owner = np.empty(n + 2 * PAGE, dtype=np.uint8)
    start = -owner.ctypes.data % PAGE + offset
    return owner[start : start + n], owner


def alignment_sweep(
    store: KVStore, offsets: Sequence[int], iterations: int
) -> dict[str, dict[int, dict[str, float]]]:
    """p50/p99 per operation and caller-buffer offset (see the module docstring).

    Each offset's buffers are fresh numpy arrays shifted to that offset from a
    page; values live in pool blocks, which start on a page.  Offsets are
    measured interleaved (one pass over every offset per round, several
    rounds), so a burst of noise lands on all of them alike.
    """
    n, prefix = ALIGN_VALUE, f"beluga-align-{uuid.uuid4().hex[:12]}"
    value = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    keys = [f"{prefix}-{i}" for i in range(ALIGN_BATCH)]
    store.put_batch(keys, [value] * ALIGN_BATCH)
    (ref,) = store.locate([keys[0]], prefix=False)
    mem = store.mem
    samples: dict[str, dict[int, list[int]]] = {op: {o: [] for o in offsets} for op in ALIGN_OPS}
    views = {o: [at_offset(n, o) for _ in range(ALIGN_BATCH)] for o in offsets}
    rounds, fresh = 5, itertools.count()
    try:
        for _ in range(rounds):
            for o in offsets:
                dst = views[o][0][0]
                batch = [v for v, _ in views[o]]
                src, _owner = at_offset(n, o)
                src[:] = value
                puts = (f"{prefix}-put-{i}" for i in fresh)

                def put_from(src: np.ndarray = src, puts: Iterator[str] = puts) -> None:
                    key = next(puts)
                    store.put_from(key, src)
                    store.remove(key)

                def inv_load(dst: np.ndarray = dst) -> None:
                    mem.invalidate(ref.payload_offset, n)
                    mem.load_into(ref.payload_offset, dst)

                calls: dict[str, Callable[[], object]] = {
                    "get_into": lambda dst=dst: store.get_into(keys[0], dst),
                    "get": lambda: store.get(keys[0]),
                    "batch_get_into": lambda batch=batch: store.batch_get_into(keys, batch),
                    "put_from": put_from,
                    "invalidate_load": inv_load,
                }
                for op, fn in calls.items():
                    k = max(5, iterations // rounds // (4 if op == "put_from" else 1))
                    samples[op][o] += time_calls(fn, k, warmup=3)
                _check(np.array_equal(dst, value), "Beluga", f"get_into at +{o} wrote other bytes")
                _check(
                    all(np.array_equal(b, value) for b in batch),
                    "Beluga",
                    f"batch_get_into at +{o} wrote other bytes",
                )
    finally:
        for key in keys:
            store.remove(key)
    return {
        op: {
            o: summarize(s, n * (ALIGN_BATCH if op == "batch_get_into" else 1))
            for o, s in per.items()
        }
        for op, per in samples.items()
    }


def _sweep_rows(sweep: dict[str, dict[int, dict[str, float]]]) -> dict[str, Any]:
    """Per operation: every offset's p50, the best and the worst, and their ratio."""
    rows, figures = [], {}
    for op, per in sweep.items():
        p50 = {o: s["p50_us"] for o, s in per.items()}
        best, worst = min(p50, key=p50.__getitem__), max(p50, key=p50.__getitem__)
        ratio = p50[worst] / p50[best]
        rows.append(
            {
                "op": op,
                "size": human_bytes(ALIGN_VALUE)
                + (f" x{ALIGN_BATCH}" if op == "batch_get_into" else ""),
                "p50_us_by_offset": {str(o): v for o, v in p50.items()},
                "best_offset": best,
                "best_p50_us": p50[best],
                "worst_offset": worst,
                "worst_p50_us": p50[worst],
                "worst_of_best": ratio,
            }
        )
        figures[f"store.align.{op}.worst_of_best"] = ratio
        figures.update({f"store.align.{op}.{o}.p50_us": v for o, v in p50.items()})
    return {"alignment": rows, "figures": figures}


def format_sweep(rows: list[dict[str, Any]]) -> str:
    """The sweep as a table: one column per offset (p50 µs), then best, worst, worst/best."""
    offsets = list(rows[0]["p50_us_by_offset"]) if rows else []
    head = ["op", *[f"+{o}" for o in offsets], "best", "worst", "worst/best"]
    lines = ["  ".join(f"{h:>8}" for h in head)]
    for r in rows:
        cells = [r["op"][:14], *[f"{v:.1f}" for v in r["p50_us_by_offset"].values()]]
        cells += [f"+{r['best_offset']}", f"+{r['worst_offset']}", f"{r['worst_of_best']:.2f}"]
        lines.append("  ".join(f"{c:>8}" for c in cells))
    return "caller-buffer offset from a page, p50 µs:\n" + "\n".join(lines)


def memcpy_floor(plan: Plan, buffers: Buffers) -> dict[str, dict[str, float]]:
    """numpy copyto between two local buffers: what no store can beat."""
    out = {}
    for n in plan.sizes:
        src, dst = buffers.source[:n], buffers.target[:n]
        out[human_bytes(n)] = summarize(
            time_calls(lambda s=src, d=dst: np.copyto(d, s), plan.iterations(n)), n
        )
    return out


def run(
    pool: Pool,
    sizes: Sequence[int] | None = None,
    budget: int = 64 * MiB,
    least: int = 100,
    baseline: str | None = None,
    probe: bool = False,
    full_sweep: bool = False,
) -> dict[str, Any]:
    """Measure Beluga (and a baseline); returns rows, named figures and targets.

    ``probe``: the pool may already have a server (a pool named by the user); use it.
    ``full_sweep``: sweep every offset of ``ALIGN_FULL`` instead of ``ALIGN_QUICK``.
    """
    if baseline not in (None, "mooncake"):
        raise ValueError(f"unknown baseline {baseline!r}; the one baseline is 'mooncake'")
    sb = pool.superblock
    plan = Plan(sorted(sizes or DEFAULT_SIZES), budget, least, sb.block_size)
    need = data_bytes(plan.sizes, sb.block_size)
    if sb.payloads.length < need:
        raise ValueError(
            f"the pool's data area holds {sb.payloads.length} bytes but the benchmark "
            f"needs {need}; use a bigger pool, or omit --pool for a scratch pool"
        )
    buffers = Buffers.plain(max(plan.sizes))
    offsets = ALIGN_FULL if full_sweep else ALIGN_QUICK
    with beluga_store(pool, probe) as (kv, where):
        beluga = Runner("Beluga", kv, buffers, plan).run()
        sweep = _sweep_rows(alignment_sweep(kv, offsets, plan.iterations(ALIGN_VALUE) // 4))
    floor = memcpy_floor(plan, buffers)
    doc: dict[str, Any] = {"server": where, "baseline": None}
    mooncake = None
    if baseline == "mooncake":
        try:
            with MooncakeBaseline() as mc:
                region = Buffers.make(max(plan.sizes))
                mc.client.register_buffer(region.region)
                mooncake = Runner("Mooncake", mc.client, region, plan).run()
                doc["baseline"] = {"system": "mooncake", "version": mc.install.version}
        except BackendUnavailableError as exc:
            doc["baseline"] = {"system": "mooncake", "unavailable": str(exc)}
    table = _tabulate(beluga, floor, mooncake)
    table["figures"].update(sweep["figures"])
    return {**doc, **table, "alignment": sweep["alignment"]}


def _tabulate(
    beluga: dict[tuple[str, str], dict[str, float]],
    floor: dict[str, dict[str, float]],
    mooncake: dict[tuple[str, str], dict[str, float]] | None,
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    figures: dict[str, float] = {}
    for label, s in floor.items():
        rows.append({"op": "memcpy", "size": label, **s})
        figures.update({f"store.memcpy.{label}.{m}": s[m] for m in METRICS if m in s})
    for (op, label), s in beluga.items():
        name = f"{op}.{label}" if label else op
        row: dict[str, Any] = {"op": op, "size": label, **s}
        figures.update({f"store.beluga.{name}.{m}": s[m] for m in METRICS if m in s})
        if op in SINGLE_OPS:
            row["of_memcpy"] = floor[label]["p50_us"] / s["p50_us"]
            figures[f"store.beluga.{name}.of_memcpy"] = row["of_memcpy"]
            inv = beluga.get(("invalidate_load", label))
            if inv is not None:
                row["of_invalidate_load"] = inv["p50_us"] / s["p50_us"]
                figures[f"store.beluga.{name}.of_invalidate_load"] = row["of_invalidate_load"]
        if mooncake is not None and (op, label) in mooncake:
            m = mooncake[(op, label)]
            row.update({f"mc_{k}": v for k, v in m.items()})
            row["vs_mooncake"] = m["p50_us"] / s["p50_us"]
            figures.update({f"store.mooncake.{name}.{k}": m[k] for k in METRICS if k in m})
            figures[f"store.vs_mooncake.{name}"] = row["vs_mooncake"]
        rows.append(row)
    targets = []
    for name, source, what, goal, sense in TARGETS:
        if source in figures:
            value = figures[f"store.target.{name}"] = figures[source]
            met = value >= goal if sense == ">=" else value <= goal
            t = {"name": name, "what": what, "goal": goal, "sense": sense, "value": value}
            targets.append({**t, "met": met})
    return {"rows": rows, "figures": figures, "targets": targets}


def format_targets(targets: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"target: {t['what']}: {t['value']:.2f} (goal {t['sense']} {t['goal']:g}): "
        + ("MET" if t["met"] else "MISSED")
        for t in targets
    )


def columns(with_mooncake: bool) -> list[tuple[str, str]]:
    base = [
        ("op", "op"),
        ("size", "size"),
        ("p50_us", "p50 µs"),
        ("p99_us", "p99 µs"),
        ("gbps_at_p50", "GB/s@p50"),
        ("per_item_us", "µs/item"),
        ("of_memcpy", "of memcpy"),
        ("of_invalidate_load", "of inv+load"),
    ]
    if not with_mooncake:
        return base
    return [
        *base,
        ("mc_p50_us", "Mooncake p50 µs"),
        ("mc_p99_us", "Mooncake p99 µs"),
        ("mc_gbps_at_p50", "Mooncake GB/s"),
        ("mc_per_item_us", "Mooncake µs/item"),
        ("vs_mooncake", "Mooncake/Beluga p50"),
    ]
