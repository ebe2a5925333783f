"""``beluga bench gpu``: the GPU data path beside its floors, from one run on one GPU.

Rows (each pool->GPU "load" and GPU->pool "save", with and without the
integrity check):

- ``64k``: one 64 KiB piece;
- ``7b-block``: a 7B-class engine block, 2 MiB as 64 x 32 KiB pieces;
- ``32b-block``: a 32B-class block, 4 MiB as 128 x 32 KiB pieces;
- ``7b-batchN``: N such 2 MiB blocks in one call (``--batches``, 16 and 256);
- ``sparse16``: the sparse top-k fetch of 16 tokens per layer and KV head of a
  7B-class model (28 layers, 4 KV heads, head_dim 128, bfloat16) from 8 blocks.

The engine's pieces lie 64 KiB apart in GPU memory (as a paged cache's do: no
two pieces of a block touch), the pool's are contiguous in each pool block.
"copy" rows are ``GpuPool.scatter_read`` / ``gather_write``; "checked" rows
are ``read_blocks`` / ``write_blocks`` (headers on the CPU, CRC32C on the
GPU, a save's header sealed), as ``KVStore.load`` / ``save`` run them less
the index lookup and the RPCs.  Each row stands beside its floors measured in
the same run over the same bytes: one contiguous cudaMemcpy from (to) pinned
memory, one contiguous cudaMemcpy from (to) the registered pool, and one
cudaMemcpy per piece.  Every time is one synchronised call's wall time; p50
and p99 over ``--repeat`` calls after warm-up.

The crossover sweep times 2 MiB of pieces of each size on the copy engines
alone and on the SM kernel alone, and suggests the smallest piece size from
which the copy engines are as fast: pass it as ``GpuPool(crossover=...)``.

Without CUDA it refuses with one line.  Not thread-safe (one run owns the GPU).
"""

from __future__ import annotations

import ctypes
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from beluga.bench.stats import machine, summarize
from beluga.errors import BackendUnavailableError

PIECE = 32 << 10
STRIDE = 64 << 10  # the engine's pieces lie this far apart
BLOCK_7B, BLOCK_32B = 64 * PIECE, 128 * PIECE
POOL_BLOCK = BLOCK_32B
SWEEP_PIECES = (4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10)
COLUMNS = [
    ("row", "row"),
    ("direction", "dir"),
    ("check", "check"),
    ("bytes", "bytes"),
    ("p50_us", "p50 us"),
    ("p99_us", "p99 us"),
    ("gbps", "GB/s"),
    ("pinned_p50_us", "pinned us"),
    ("pool_p50_us", "pool us"),
    ("loop_p50_us", "loop us"),
    ("vs_pinned", "x pinned"),
]


def _need_cuda() -> Any:
    try:
        import torch
    except ImportError as e:
        raise BackendUnavailableError("beluga bench gpu needs torch with CUDA") from e
    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            "no CUDA GPU here (torch.cuda.is_available() is False); run it on a GPU machine"
        )
    return torch


def _times(fn: Callable[[], object], repeat: int, warmup: int = 3) -> list[int]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        t = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t)
    return out


class _Rig:
    """A scratch native pool in /dev/shm registered with the GPU, and engine-side buffers."""

    def __init__(
        self,
        torch: Any,
        nblocks: int,
        crossover: int | None,
        runtime: Any = None,
        device: str = "cuda",
    ) -> None:
        from beluga.coherence import digest
        from beluga.pool import Geometry, Pool
        from beluga.pool.layout import pool_size_for
        from beluga.transfer.gpu import GpuPool
        from beluga.transfer.gpu.plan import CROSSOVER

        self.torch = torch
        self.path = os.path.join("/dev/shm", f"beluga-bench-gpu-{uuid.uuid4().hex[:8]}")
        geometry = Geometry(max_hosts=2, block_size=POOL_BLOCK)
        size = pool_size_for(nblocks, geometry)
        self.pool = Pool.create(self.path, size, geometry=geometry, coherence="native")
        try:
            self.gpu = GpuPool(
                self.pool,
                device,
                runtime=runtime,
                crossover=CROSSOVER if crossover is None else crossover,
            )
        except BaseException:
            self.pool.close()
            Pool.destroy(self.path)
            raise
        self.sb = self.pool.superblock
        self.mem = self.pool.memory
        self.key = digest(b"bench gpu")
        self.device = device
        self.libcuda = getattr(self.gpu.runtime, "libcuda", None)  # None: a stand-in runtime
        if self.libcuda is not None:
            self.libcuda.cuMemcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t]
            self.libcuda.cuMemcpy.restype = ctypes.c_int
        span = nblocks * BLOCK_32B
        self.engine = torch.empty(span * STRIDE // PIECE, dtype=torch.uint8, device=device)
        self.engine.random_(0, 256)
        self.dense = torch.empty(span, dtype=torch.uint8, device=device)
        self.pinned = torch.empty(span, dtype=torch.uint8, pin_memory=device == "cuda")

    def table(self, nblocks: int, pieces: int, piece: int) -> np.ndarray:
        rows = np.zeros((nblocks, pieces, 4), np.uint64)
        k = np.arange(nblocks)[:, None]
        j = np.arange(pieces)[None, :]
        offs = np.array([self.sb.block_payload_offset(b) for b in range(nblocks)], np.uint64)
        rows[..., 1] = ((k * pieces + j) * (STRIDE if piece < STRIDE else piece)).astype(np.uint64)
        rows[..., 2] = offs[:, None] + (j * piece).astype(np.uint64)
        rows[..., 3] = piece
        return rows.reshape(-1, 4)

    def save_blocks(self, table: np.ndarray, nblocks: int, length: int) -> list[tuple]:
        blocks = []
        for b in range(nblocks):
            hdr, pay = self.sb.block_header_offset(b), self.sb.block_payload_offset(b)
            blocks.append((hdr, pay, self.key, b + 1, length, 0, 1, 1))
        return blocks

    def begin(self, blocks: list[tuple]) -> None:
        for hdr, pay, key, version, length, *_ in blocks:
            self.mem.begin_write(hdr, pay, key, version, length, writer=1, writer_gen=1)

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def copy(self, dst: int, src: int, n: int) -> None:
        """One synchronous cudaMemcpy (a stand-in's: memmove)."""
        if self.libcuda is None:
            ctypes.memmove(dst, src, n)
            return
        code = self.libcuda.cuMemcpy(dst, src, n)
        if code:
            raise BackendUnavailableError(f"cuMemcpy failed with code {code}")

    def close(self) -> None:
        from beluga.pool import Pool

        self.gpu.close()
        if hasattr(self.gpu.runtime, "close"):
            self.gpu.runtime.close()
        self.pool.close()
        Pool.destroy(self.path)


def _row(
    name: str, direction: str, check: str, nbytes: int, ns: list[int], floors: dict[str, list[int]]
) -> dict[str, Any]:
    s = summarize(sorted(ns), nbytes)
    row: dict[str, Any] = {
        "row": name,
        "direction": direction,
        "check": check,
        "bytes": nbytes,
        "p50_us": s["p50_us"],
        "p99_us": s["p99_us"],
        "gbps": nbytes / (s["p50_us"] * 1e3) if s["p50_us"] else 0.0,
    }
    for k, v in floors.items():
        f = summarize(sorted(v), nbytes)
        row[f"{k}_p50_us"], row[f"{k}_p99_us"] = f["p50_us"], f["p99_us"]
    if "pinned_p50_us" in row and row["p50_us"]:
        row["vs_pinned"] = row["pinned_p50_us"] / row["p50_us"]  # >= 0.85 is the target
    return row


def _floors(rig: _Rig, table: np.ndarray, nbytes: int, repeat: int, *, load: bool) -> dict:
    dense = rig.dense[:nbytes]
    pinned = rig.pinned[:nbytes]
    pool_dev = rig.gpu.device_address + int(table[0, 2])
    engine = rig.engine.data_ptr()

    def pinned_copy() -> None:
        (dense.copy_(pinned) if load else pinned.copy_(dense))
        rig.sync()

    def pool_copy() -> None:
        if load:
            rig.copy(dense.data_ptr(), pool_dev, nbytes)
        else:
            rig.copy(pool_dev, dense.data_ptr(), nbytes)

    def loop() -> None:
        for _, at, off, n in table.tolist():
            p = rig.gpu.device_address + off
            rig.copy(engine + at, p, n) if load else rig.copy(p, engine + at, n)

    return {
        "pinned": _times(pinned_copy, repeat),
        "pool": _times(pool_copy, repeat),
        "loop": _times(loop, max(3, repeat // 4)),
    }


def _blocks_rows(rig: _Rig, name: str, nblocks: int, pieces: int, repeat: int) -> list[dict]:
    table = rig.table(nblocks, pieces, PIECE if pieces > 1 else 64 << 10)
    length = int(table[: len(table) // nblocks, 3].sum())
    nbytes = length * nblocks
    buffers = [rig.engine]
    blocks = rig.save_blocks(table, nblocks, length)
    reads = [(h, p, POOL_BLOCK, k, v) for h, p, k, v, *_ in blocks]
    rows = []
    for load in (True, False):
        floors = _floors(rig, table, nbytes, repeat, load=load)
        direction = "load" if load else "save"
        if load:
            rig.begin(blocks)
            rig.gpu.write_blocks(buffers, table, blocks)  # published blocks to read
            copy = _times(lambda: rig.gpu.scatter_read(buffers, table), repeat)
            checked = _times(lambda: rig.gpu.read_blocks(buffers, table, reads), repeat)
            got = rig.gpu.read_blocks(buffers, table, reads)
            if any(g != length for g in got):
                raise AssertionError(f"{name}: a checked load missed ({got[:4]})")
        else:
            copy = _times(lambda: rig.gpu.gather_write(buffers, table), repeat)

            def save() -> None:
                rig.begin(blocks)
                rig.gpu.write_blocks(buffers, table, blocks)

            checked = _times(save, repeat)
        rows.append(_row(name, direction, "copy", nbytes, copy, floors))
        rows.append(_row(name, direction, "crc32c", nbytes, checked, floors))
    return rows


def _sparse_row(rig: _Rig, repeat: int) -> dict:
    from beluga.transfer import BlockFormat, KVSpec, sparse_fetch, sparse_shape

    torch = rig.torch
    spec = KVSpec(num_layers=28, num_kv_heads=4, head_dim=128, block_tokens=16, dtype="bfloat16")
    fmt = BlockFormat(spec, "NHD")
    nblocks = 8
    offs = [rig.sb.block_payload_offset(b) for b in range(nblocks)]
    positions = np.random.default_rng(1).integers(0, nblocks * 16, (28, 4, 16))
    out = torch.empty(sparse_shape(fmt, positions), dtype=torch.bfloat16, device=rig.device)
    ns = _times(
        lambda: sparse_fetch(rig.gpu, fmt, offs, positions, out, block_bytes=POOL_BLOCK), repeat
    )
    nbytes = out.numel() * 2
    return _row("sparse16", "load", "copy", nbytes, ns, {})


def _sweep(rig: _Rig, repeat: int) -> tuple[list[dict], int | None]:
    from beluga.transfer.gpu.plan import plan_moves

    out, suggested = [], None
    for piece in SWEEP_PIECES:
        pieces = BLOCK_7B // piece
        table = rig.table(1, pieces, piece)
        bases = np.array([rig.engine.data_ptr()], np.uint64)
        times = {}
        for path, crossover in (("copy_engines", 0), ("kernel", 1 << 62)):
            plan = plan_moves(
                table, bases, rig.gpu.device_address, to_pool=False, crossover=crossover
            )
            times[path] = summarize(
                sorted(_times(lambda p=plan: rig.gpu.runtime.execute(p, save=False), repeat)),
                BLOCK_7B,
            )["p50_us"]
        out.append({"piece": piece, **{f"{k}_p50_us": v for k, v in times.items()}})
        if suggested is None and times["copy_engines"] <= times["kernel"]:
            suggested = piece
    return out, suggested


def run(
    *,
    batches: list[int],
    repeat: int,
    crossover: int | None,
    runtime: Any = None,
    device: str = "cuda",
) -> dict[str, Any]:
    """Every row and its floors, the sparse fetch and the crossover sweep, as one document.

    ``runtime``/``device``: a stand-in runtime and "cpu" run the same rows on the CPU
    (a smoke test of the bench itself; its figures mean nothing)."""
    if runtime is None:
        torch = _need_cuda()
    else:
        import torch
    most = max([1, *batches])
    rig = _Rig(torch, max(most, 8), crossover, runtime, device)
    try:
        rows = []
        rows += _blocks_rows(rig, "64k", 1, 1, repeat)
        rows += _blocks_rows(rig, "7b-block", 1, 64, repeat)
        rows += _blocks_rows(rig, "32b-block", 1, 128, repeat)
        for n in batches:
            rows += _blocks_rows(rig, f"7b-batch{n}", n, 64, max(3, repeat * 16 // max(n, 16)))
        rows.append(_sparse_row(rig, repeat))
        sweep, suggested = _sweep(rig, repeat)
        gpu: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
        if device == "cuda":
            props = torch.cuda.get_device_properties(0)
            gpu |= {"name": props.name, "sms": props.multi_processor_count}
        return {
            "rows": rows,
            "crossover_sweep": sweep,
            "suggested_crossover": suggested,
            "crossover": rig.gpu.crossover,
            "batched_copy_engines": bool(getattr(rig.gpu.runtime, "batched", True)),
            "gpu": gpu,
            "invalidated_bytes": rig.gpu.stats["invalidated"],
            "retried_blocks": rig.gpu.stats["retried"],
        }
    finally:
        rig.close()


def chart(doc: dict[str, Any], path: str) -> None:
    """GB/s at p50 of each row beside its floors (pinned, pool, per-piece loop), as a PNG."""
    from beluga.bench.report import pyplot

    plt = pyplot()
    rows = [r for r in doc["rows"] if "pinned_p50_us" in r]
    labels = [f"{r['row']}\n{r['direction']} {r['check']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 5), dpi=100)
    try:
        x = np.arange(len(rows))
        width = 0.2
        for k, (key, name) in enumerate(
            (
                ("p50_us", "GpuPool"),
                ("pinned_p50_us", "pinned memcpy"),
                ("pool_p50_us", "pool memcpy"),
                ("loop_p50_us", "per-piece loop"),
            )
        ):
            gbps = [r["bytes"] / (r[key] * 1e3) if r.get(key) else 0 for r in rows]
            ax.bar(x + (k - 1.5) * width, gbps, width, label=name)
        ax.set_xticks(x, labels, fontsize=7, rotation=60, ha="right")
        ax.set_ylabel("GB/s at p50")
        ax.set_title("GPU data path beside its floors (one run)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def write_doc(result: dict[str, Any], json_path: str | None, chart_path: str | None) -> dict:
    from beluga.bench.stats import write_json

    doc = {"benchmark": "gpu", "machine": machine(), **result}
    if json_path:
        write_json(doc, json_path)
    if chart_path:
        chart(doc, chart_path)
    return doc


__all__ = ["COLUMNS", "chart", "run", "write_doc"]
