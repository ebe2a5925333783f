"""``beluga certify``: measure a pool's memory and check that Beluga's recipes hold on it.

The suite formats its own pool on the target (a device, a NUMA node, or a
file standing in for one), runs each section on it, and destroys the pool
afterwards.  Sections:

``latency``      the coherence recipes by access size, 64 B to 4 MiB
                 (:mod:`beluga.bench.memops`: load, flush+load, non-temporal
                 store, store+flush, beside plain memcpy)
``gpu``          pool <-> GPU copies through ``torch.cuda``, where a GPU exists
``copy_engine``  a DMA copy engine (Intel DSA), which Beluga does not drive yet
``bandwidth``    aggregate GB/s against thread count: the threads split one
                 working set (four times the last-level cache, so that reads
                 reach memory) into regions of their own, and copy in chunks big
                 enough for the C core to drop the GIL
``interleave``   one device alone against all of them striped every 2 MiB
``rpc``          an echo server in a child process (its own host), the client's
                 transport rate at queue depths 1..128, and ``call`` round trips
``litmus``       every coherence litmus pattern with its roles in separate local
                 processes, native mode: a smoke check of the harness and of the
                 correct recipes on this memory

Nothing here judges speed.  The verdict fails only on wrong behaviour: a
correct litmus recipe caught, or a section that broke (an RPC server that
stopped answering, a device that refused a mapping).  The figures go to the
report (:mod:`beluga.bench.report`), beside the paper's.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from beluga import __version__, litmus
from beluga.bench import memops
from beluga.bench.stats import machine, summarize, time_calls
from beluga.child import stop_process
from beluga.errors import BelugaError, RpcError
from beluga.pool import Geometry, Pool, parse_spec
from beluga.pool.backends import Backend
from beluga.pool.interleave import InterleaveBackend
from beluga.pool.layout import REGION_ALIGN, align_up, blocks_holding, pool_size_for
from beluga.rpc import Op, RpcClient, RpcServer
from beluga.rpc.protocol import INLINE, MAX_DEPTH
from beluga.units import human_bytes, parse_size

SECTIONS = ("latency", "gpu", "copy_engine", "bandwidth", "interleave", "rpc", "litmus")
LABEL = "beluga-certify"
GEOMETRY = Geometry(max_hosts=4, rpc_bytes_per_host=1 << 20, block_size=REGION_ALIGN)
RPC_DEPTHS = (1, 8, 32, 128)
#: each bandwidth copy is this big: well above the C core's GIL threshold (256 KiB)
CHUNK = 1 << 20
#: one litmus area per pattern, page-aligned so that no two patterns share a line
LITMUS_STRIDE = align_up(litmus.AREA_BYTES, 4096)
GPU_SIZES = (64, 16 << 10, 256 << 10, 4 << 20)
#: device nodes of a GPU driver (NVIDIA, AMD); without one, importing torch is wasted time
GPU_NODES = ("/dev/nvidiactl", "/dev/kfd")

Log = Callable[[str], None]


@dataclass(frozen=True)
class Settings:
    """How much to measure: ``quick`` for CI and smoke checks, else a full run."""

    quick: bool
    sizes: tuple[int, ...]
    latency_budget: int
    max_threads: int
    working_set: int
    bandwidth_s: float
    rpc_s: float
    rpc_calls: int
    litmus_trials: int

    @classmethod
    def make(cls, quick: bool, max_threads: int | None = None) -> Settings:
        if max_threads is not None and max_threads < 1:
            raise ValueError(f"--threads must be at least 1, not {max_threads}")
        threads = max_threads or os.cpu_count() or 1
        if quick:
            return cls(
                quick=True,
                sizes=(64, 1 << 10, 16 << 10, 256 << 10),
                latency_budget=2 << 20,
                max_threads=threads,
                working_set=8 << 20,
                bandwidth_s=0.1,
                rpc_s=0.1,
                rpc_calls=500,
                litmus_trials=20,
            )
        return cls(
            quick=False,
            sizes=tuple(memops.DEFAULT_SIZES),
            latency_budget=128 << 20,
            max_threads=threads,
            working_set=max(256 << 20, 4 * last_level_cache_bytes()),
            bandwidth_s=1.0,
            rpc_s=1.0,
            rpc_calls=20000,
            litmus_trials=500,
        )

    def thread_counts(self) -> list[int]:
        """1, 2, 4, ... up to the maximum, and the maximum itself."""
        counts = [1 << k for k in range(self.max_threads.bit_length()) if 1 << k < self.max_threads]
        return [*counts, self.max_threads]

    def payload_bytes(self) -> int:
        """Data-area bytes the sections need (they run one after another, from its start)."""
        return max(
            2 * max(self.sizes),
            max(GPU_SIZES),
            self.working_set,
            self.max_threads * CHUNK,
            len(litmus.PATTERNS) * LITMUS_STRIDE,
        )


def pool_bytes(payload: int, align: int = REGION_ALIGN) -> int:
    """A pool size (a multiple of ``align``) whose data area holds ``payload`` bytes."""
    return pool_size_for(blocks_holding(payload, GEOMETRY), GEOMETRY, align)


@contextlib.contextmanager
def certify_pool(backend: Backend, payload: int, force: bool) -> Iterator[Pool]:
    """A fresh pool on ``backend`` for the run; destroyed afterwards, whatever happens."""
    align = backend.stripe if isinstance(backend, InterleaveBackend) else REGION_ALIGN
    pool = Pool.create(
        backend,
        pool_bytes(payload, align),
        geometry=GEOMETRY,
        label=LABEL,
        force=force,
        coherence="native",
    )
    try:
        yield pool
    finally:
        try:
            pool.close()
        finally:
            Pool.destroy(backend)


def last_level_cache_bytes() -> int:
    """Size of this CPU's largest cache, from sysfs (0 where it is not reported)."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    sizes = [0]
    with contextlib.suppress(OSError):
        for index in os.listdir(root):
            with contextlib.suppress(OSError, ValueError), open(f"{root}/{index}/size") as f:
                sizes.append(parse_size(f.read()))
    return max(sizes)


def skipped(reason: str) -> dict[str, Any]:
    return {"status": "skipped", "reason": reason}


# -- sections on one pool --------------------------------------------------------


def latency(pool: Pool, s: Settings) -> dict[str, Any]:
    """The memops recipes by size (their own module measures; we only choose sizes)."""
    return {"status": "ok", **memops.run(pool, list(s.sizes), memops.METHODS, s.latency_budget)}


def gpu(pool: Pool, s: Settings) -> dict[str, Any]:
    """Pool -> GPU and GPU -> pool copies with the pool region pinned, where CUDA exists."""
    if not any(os.path.exists(node) for node in GPU_NODES):
        return skipped(f"no GPU on this host (none of {', '.join(GPU_NODES)} exists)")
    try:
        import torch
    except ImportError:
        return skipped("torch is not installed, so no GPU copy can be measured")
    if not torch.cuda.is_available():
        return skipped("no CUDA device (torch.cuda.is_available() is False)")
    view = np.frombuffer(
        pool.mapping.buffer, np.uint8, max(GPU_SIZES), offset=pool.superblock.payloads.offset
    )
    # the view (an export of the mapping) dies with this frame, before the pool closes
    return {"status": "ok", **_gpu_copies(torch, torch.from_numpy(view), 50 if s.quick else 2000)}


def _gpu_copies(torch: Any, host: Any, iters: int) -> dict[str, Any]:
    cudart = torch.cuda.cudart()
    # cudaHostRegisterMapped (2) is the flag that works for DAX; the call returns a code.
    pinned = int(cudart.cudaHostRegister(host.data_ptr(), host.numel(), 2)) == 0
    try:
        dev = torch.empty(host.numel(), dtype=torch.uint8, device="cuda")
        rows = []
        for n in GPU_SIZES:
            for direction, dst, src in (("pool_to_gpu", dev, host), ("gpu_to_pool", host, dev)):

                def copy(dst: Any = dst, src: Any = src, n: int = n) -> None:
                    dst[:n].copy_(src[:n], non_blocking=True)
                    torch.cuda.synchronize()

                samples = time_calls(copy, iters)
                rows.append(
                    {
                        "size": human_bytes(n),
                        "bytes": n,
                        "direction": direction,
                        **summarize(samples, n),
                    }
                )
    finally:
        if pinned:
            cudart.cudaHostUnregister(host.data_ptr())
    return {"device": torch.cuda.get_device_name(), "pinned": pinned, "rows": rows}


def copy_engine(pool: Pool, s: Settings) -> dict[str, Any]:
    """Report whether a DMA copy engine is there; Beluga's copies are CPU copies today."""
    queues = sorted(os.listdir("/dev/dsa")) if os.path.isdir("/dev/dsa") else []
    if not queues:
        return skipped("no Intel DSA work queue on this host (/dev/dsa is absent or empty)")
    return skipped(
        f"Intel DSA work queues are present ({', '.join(queues)}) but Beluga's C core copies "
        "with the CPU; the paper's DSA figures cannot be compared here"
    )


def _copy_loop(
    mem: Any,
    offset: int,
    region: int,
    write: bool,
    start: threading.Barrier,
    stop: threading.Event,
    out: list[tuple[int, float]],
) -> None:
    """One thread: copy its own region chunk by chunk until told to stop."""
    buf = np.full(CHUNK, 0x5A, dtype=np.uint8)
    moved = 0
    start.wait()
    begin = time.perf_counter()
    while not stop.is_set():
        for off in range(offset, offset + region, CHUNK):
            if write:
                mem.nt_store(off, buf)
            else:
                mem.load_into(off, buf)
            moved += CHUNK
        if write:
            mem.sfence()
    out.append((moved, time.perf_counter() - begin))


def copy_bandwidth(
    pool: Pool, threads: int, working_set: int, write: bool, seconds: float
) -> float:
    """Aggregate GB/s of ``threads`` threads, each copying its own share of ``working_set``."""
    base = pool.superblock.payloads.offset
    region = max(CHUNK, working_set // threads // CHUNK * CHUNK)
    if threads * region > pool.superblock.payloads.length:
        raise ValueError(f"{threads} regions of {region} bytes do not fit the pool's data area")
    start, stop = threading.Barrier(threads + 1, timeout=30), threading.Event()
    out: list[tuple[int, float]] = []
    workers = [
        threading.Thread(
            target=_copy_loop,
            args=(pool.memory, base + i * region, region, write, start, stop, out),
            daemon=True,
        )
        for i in range(threads)
    ]
    for w in workers:
        w.start()
    try:
        start.wait()
        time.sleep(seconds)
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    if len(out) != threads:
        raise BelugaError(f"{threads - len(out)} of {threads} copy threads did not finish")
    return sum(moved for moved, _ in out) / max(t for _, t in out) / 1e9


def bandwidth(pool: Pool, s: Settings) -> dict[str, Any]:
    rows = [
        {
            "direction": name,
            "threads": n,
            "gbps": copy_bandwidth(pool, n, s.working_set, write, s.bandwidth_s),
        }
        for name, write in (("write", True), ("read", False))
        for n in s.thread_counts()
    ]
    return {"status": "ok", "working_set_bytes": s.working_set, "chunk_bytes": CHUNK, "rows": rows}


def _echo_server(spec: str, limit_s: float, stop: Any, errors: Any) -> None:
    """Child process: one server thread answering echoes in C until stopped."""
    try:
        with Pool.attach(spec, coherence="native") as pool, RpcServer.open(pool) as server:
            deadline = time.monotonic() + limit_s
            while not stop.is_set() and time.monotonic() < deadline:
                server.serve_echo(0.2)
    except BaseException as e:  # report to the parent rather than die silently
        errors.put(f"{type(e).__name__}: {e}")


def rpc(pool: Pool, s: Settings) -> dict[str, Any]:
    """Transport rate by queue depth (C pump) and round trips through the Python client."""
    ctx = mp.get_context("fork")
    stop, errors = ctx.Event(), ctx.Queue()
    limit = 60 + len(RPC_DEPTHS) * s.rpc_s + s.rpc_calls * 1e-3
    server = ctx.Process(target=_echo_server, args=(pool.spec, limit, stop, errors), daemon=True)
    server.start()
    payload = bytes(range(INLINE))
    try:
        with RpcClient(pool, depth=MAX_DEPTH, connect_timeout=30) as client:
            depths = []
            for depth in RPC_DEPTHS:
                begin = time.perf_counter()
                done = client.ring.pump(Op.ECHO, payload, depth, s.rpc_s)
                elapsed = time.perf_counter() - begin
                depths.append(
                    {
                        "depth": depth,
                        "requests": done,
                        "mops": done / elapsed / 1e6,
                        "us_per_request": elapsed / max(done, 1) * 1e6,
                    }
                )
            if client.call(Op.ECHO, payload) != payload:
                raise RpcError("the echo server returned a different payload than it was sent")
            calls = summarize(time_calls(lambda: client.call(Op.ECHO, payload), s.rpc_calls))
    except RpcError as e:
        try:
            said = errors.get(timeout=1)
        except queue.Empty:
            said = None
        if said is None:
            raise
        raise RpcError(f"{e} (the server process said: {said})") from e
    finally:
        stop.set()
        stop_process(server, 10, terminate=False)
        errors.close()
        errors.join_thread()
    return {"status": "ok", "payload_bytes": len(payload), "depths": depths, "call": calls}


def litmus_local(pool: Pool, s: Settings) -> dict[str, Any]:
    """Every pattern, roles in local processes, native mode.

    On one host the caches are coherent, so a bug pattern is not expected to
    be caught here; a *correct* pattern caught means the memory or the
    instructions are broken, and fails the verdict.
    """
    base = pool.superblock.payloads.offset
    rows = []
    for i, (name, pattern) in enumerate(litmus.PATTERNS.items()):
        r = litmus.run_local(
            pool.spec, base + i * LITMUS_STRIDE, name, s.litmus_trials, mode="native", timeout=60
        )
        rows.append(litmus_row(r, pattern.is_bug))
    return {"status": "ok", "mode": "native", "hosts": "one (local processes)", "rows": rows}


def litmus_row(r: litmus.LitmusResult, is_bug: bool) -> dict[str, Any]:
    if not is_bug:
        verdict = "FAIL: a correct recipe saw a stale value" if r.caught else "ok"
    else:
        verdict = "caught (not coherent)" if r.caught else "not caught (coherent)"
    return {**asdict(r), "is_bug": is_bug, "verdict": verdict}


ON_POOL: dict[str, Callable[[Pool, Settings], dict[str, Any]]] = {
    "latency": latency,
    "gpu": gpu,
    "copy_engine": copy_engine,
    "bandwidth": bandwidth,
    "rpc": rpc,
    "litmus": litmus_local,
}


# -- the suite --------------------------------------------------------------------


def _guarded(name: str, fn: Callable[[], dict[str, Any]], log: Log) -> dict[str, Any]:
    """Run a section; a BelugaError fails that section (and the verdict), not the run."""
    log(f"{name} ...")
    begin = time.monotonic()
    try:
        out = fn()
    except BelugaError as e:
        out = {"status": "failed", "error": str(e)}
    out["seconds"] = round(time.monotonic() - begin, 3)
    log(f"{name}: {out['status']} ({out['seconds']:.1f} s)")
    return out


def interleave(
    backend: Backend, s: Settings, force: bool, striped: dict[str, Any]
) -> dict[str, Any]:
    """Bandwidth of the first device alone, beside the striped pool's (already measured)."""
    if not isinstance(backend, InterleaveBackend):
        return skipped("one device: give several --dax devices to measure 2 MiB interleaving")
    if striped.get("status") != "ok":
        return skipped("the striped pool's bandwidth was not measured")
    first = backend.children[0]
    with certify_pool(first, max(s.working_set, s.max_threads * CHUNK), force) as pool:
        single = bandwidth(pool, s)
    return {
        "status": "ok",
        "stripe": backend.stripe,
        "devices": [c.spec for c in backend.children],
        "single_device": first.spec,
        "rows": [
            {**one, "interleaved_gbps": all_["gbps"], "gain": all_["gbps"] / one["gbps"]}
            for one, all_ in zip(single["rows"], striped["rows"], strict=True)
        ],
    }


def problems(sections: dict[str, dict[str, Any]]) -> list[str]:
    """What makes the verdict fail: broken sections and correct recipes caught."""
    out = [f"{name}: {sec['error']}" for name, sec in sections.items() if sec["status"] == "failed"]
    for name in ("litmus", "litmus_cross_host"):
        for row in sections.get(name, {}).get("rows", []):
            if row.get("is_bug") is False and row["violations"]:
                out.append(
                    f"{name}: the correct recipe {row['pattern']!r} saw a stale value at trial "
                    f"{row['first_violation']}; Beluga's coherence is not safe on this memory"
                )
    return out


def document(
    spec: str, target: dict[str, Any], s: Settings, sections: dict[str, Any], began: float
) -> dict[str, Any]:
    """The report's JSON document (``report.comparisons`` adds the paper's figures)."""
    found = problems(sections)
    return {
        "suite": "beluga certify",
        "version": __version__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(began)),
        "seconds": round(time.time() - began, 1),
        "quick": s.quick,
        "settings": asdict(s),
        "machine": machine(),
        "target": {"spec": spec, **target},
        "sections": sections,
        "verdict": {"ok": not found, "problems": found},
    }


def run_suite(
    spec: str,
    settings: Settings,
    sections: Sequence[str] = SECTIONS,
    *,
    force: bool = False,
    log: Log = lambda line: None,
) -> dict[str, Any]:
    """Create a pool on ``spec``, run the chosen sections on it, destroy it; the document."""
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown certify sections {sorted(unknown)}; choose from {SECTIONS}")
    began = time.time()
    backend = parse_spec(spec)
    wanted = set(sections) | ({"bandwidth"} if "interleave" in sections else set())
    out: dict[str, Any] = {}
    with certify_pool(backend, settings.payload_bytes(), force) as pool:
        target = {**backend.info(), "pool_bytes": pool.superblock.pool_size}
        for name, fn in ON_POOL.items():
            if name in wanted:
                out[name] = _guarded(name, lambda fn=fn: fn(pool, settings), log)
    if "interleave" in wanted:
        out["interleave"] = _guarded(
            "interleave", lambda: interleave(backend, settings, force, out["bandwidth"]), log
        )
    return document(backend.spec, target, settings, out, began)
