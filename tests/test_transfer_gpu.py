"""The GPU data path: copy engines and a kernel over the registered pool, CRC32C on the GPU.

On a GPU machine, one command runs every test here, the CUDA ones included::

    python setup.py build_ext --inplace -q && python -m pytest -v -rs tests/test_transfer_gpu.py

Without CUDA the tests marked ``cuda`` skip and say why; the rest run
everywhere: they drive :class:`GpuPool` with the stand-in runtime of
tests/gpu_standin.py, which runs the planned copy-engine runs, kernel rows
and CRC step (kernels.cu built for the host) on the CPU, moving pool bytes as
a device sees them through its host.  So registration in chunks, the
planner, batching, the status word, the header-before/after protocol and the
invalidate rule (under the model) are checked end to end through
``KVStore.save`` / ``load`` even here.
"""

from __future__ import annotations

import contextlib
import random
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from beluga._native import _core
from beluga.coherence import ModelConfig, digest, parse_header
from beluga.errors import BackendUnavailableError, KVLayoutError
from beluga.kv import KVStore
from beluga.pool import Geometry, Pool
from beluga.server import MetadataServer
from beluga.transfer import (
    Buffers,
    EngineBlocks,
    KVLayout,
    KVSpec,
    block_table,
    gather_write,
    scatter_read,
    sparse_fetch,
    sparse_shape,
)
from beluga.transfer.gpu import GpuPool
from beluga.transfer.gpu.kernels import host_library, pow8_table
from beluga.transfer.gpu.plan import plan_moves
from tests.gpu_standin import StandInCuda

__all__ = ["StandInCuda"]  # tests/test_serving_gpu.py takes it from here

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=16, block_tokens=16, dtype="bfloat16")
BLOCK = 8192  # a pool block: one 6 KiB engine block, rounded up to whole pages
GEOMETRY = Geometry(max_hosts=4, rpc_bytes_per_host=64 << 10, block_size=BLOCK)
NUM_BLOCKS = 6
HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(
    not HAS_CUDA,
    reason="no CUDA device (torch.cuda.is_available() is False): run this module on a GPU "
    "machine with: python -m pytest -v -rs tests/test_transfer_gpu.py",
)


@pytest.fixture
def pool(shm_path: str) -> Iterator[Pool]:
    p = Pool.create(shm_path, 32 << 20, geometry=GEOMETRY)
    yield p
    p.close()
    Pool.destroy(shm_path)


def caches(device: str, seed: int | None) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, SPEC.block_tokens, SPEC.num_kv_heads, SPEC.head_dim)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(3)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(torch.bfloat16).to(device) for _ in range(3)]


def offsets(pool: Pool, slots: list[int]) -> list[int]:
    return [pool.superblock.block_payload_offset(s) for s in slots]


def pool_bytes(pool: Pool, offs: list[int], n: int) -> list[bytes]:
    return [bytes(pool.mapping.buffer[o : o + n]) for o in offs]


def test_the_stand_in_path_writes_what_the_cpu_path_writes(pool: Pool) -> None:
    src = caches("cpu", seed=1)
    layout = KVLayout.flash_attention(SPEC, src)
    ids, n = [4, 1, 3], layout.format.nbytes
    cpu_offs, gpu_offs = offsets(pool, [0, 2, 4]), offsets(pool, [1, 3, 5])
    gather_write(pool.memory, layout, ids, cpu_offs, block_bytes=BLOCK)
    runtime = StandInCuda()
    with GpuPool(pool, runtime=runtime, chunk_bytes=4 << 20) as gpu:
        assert len(runtime.registered) == 8  # a 32 MiB pool in 4 MiB chunks
        moved = gather_write(gpu, layout, ids, gpu_offs, block_bytes=BLOCK)
        assert moved == 3 * n and runtime.launches == 1  # one plan for the whole batch
        assert pool_bytes(pool, gpu_offs, n) == pool_bytes(pool, cpu_offs, n)
        back = caches("cpu", seed=None)
        out = KVLayout.flash_attention(SPEC, back)
        assert scatter_read(gpu, out, [0, 5, 2], gpu_offs, block_bytes=BLOCK) == 3 * n
        assert runtime.launches == 2
    assert not runtime.registered  # closing unregistered every chunk
    for layer in range(3):
        for dst, source in ((0, 4), (5, 1), (2, 3)):
            assert torch.equal(back[layer][:, dst], src[layer][:, source])


def test_a_failed_registration_undoes_the_chunks_before_it(pool: Pool) -> None:
    runtime = StandInCuda(fail_at=3)
    with pytest.raises(BackendUnavailableError, match="cudaHostRegister"):
        GpuPool(pool, runtime=runtime, chunk_bytes=4 << 20)
    assert not runtime.registered


def test_a_device_view_in_pieces_is_refused(pool: Pool) -> None:
    runtime = StandInCuda(gap=1 << 30)
    with pytest.raises(BackendUnavailableError, match="not contiguous"):
        GpuPool(pool, runtime=runtime, chunk_bytes=4 << 20)
    assert not runtime.registered


def test_the_gpu_path_refuses_what_it_cannot_move(pool: Pool, shm_path: str) -> None:
    with pytest.raises(ValueError, match="multiple of 4096"):
        GpuPool(pool, runtime=StandInCuda(), chunk_bytes=1000)
    blind = StandInCuda()
    blind.sees_model = False  # as a real GPU: its accesses bypass the simulated cache
    with (
        Pool.attach(shm_path, coherence="model") as modelled,
        pytest.raises(ValueError, match="native coherence"),
    ):
        GpuPool(modelled, runtime=blind)
    gpu = GpuPool(pool, runtime=StandInCuda())
    layout = KVLayout.flash_attention(SPEC, caches("cpu", seed=2))
    before = bytes(pool.mapping.buffer[: 1 << 20])
    with pytest.raises(ValueError, match="out of range"):
        gather_write(gpu, layout, [NUM_BLOCKS], offsets(pool, [0]), block_bytes=BLOCK)
    gpu.close()
    with pytest.raises(ValueError, match="closed"):
        gather_write(gpu, layout, [0], offsets(pool, [0]), block_bytes=BLOCK)
    assert bytes(pool.mapping.buffer[: 1 << 20]) == before


def test_a_gpu_cache_is_refused_by_the_cpu_path_and_vice_versa(pool: Pool) -> None:
    layout = KVLayout.flash_attention(SPEC, caches("cpu", seed=4))
    gpu = GpuPool(pool, runtime=StandInCuda())
    gpu.device = torch.device("cuda", 0)  # as a real one would be
    with pytest.raises(KVLayoutError, match="GpuPool moves KV on cuda:0"):
        gather_write(gpu, layout, [0], offsets(pool, [0]), block_bytes=BLOCK)
    gpu.close()


def test_a_cache_split_across_devices_is_refused() -> None:
    mixed = caches("cpu", seed=None)
    mixed[1] = mixed[1].to("meta")
    with pytest.raises(KVLayoutError, match="lives on one device"):
        KVLayout.flash_attention(SPEC, mixed)


# -- the planner: copy engines, kernel rows, CRC segments ---------------------------------


def crc_status(plan, *, save: bool) -> np.ndarray:
    """What the CRC kernel writes for a plan, computed by its host build."""
    state = np.zeros(len(plan.blocks), [("acc", "<u4"), ("pad", "<u4"), ("done", "<u8")])
    status = np.zeros(len(plan.blocks), np.uint32)
    blocks, segs, pow8 = np.ascontiguousarray(plan.blocks), plan.segs, pow8_table()
    host_library().beluga_crc_blocks_host(
        segs.ctypes.data,
        len(segs),
        blocks.ctypes.data,
        state.ctypes.data,
        status.ctypes.data,
        pow8.ctypes.data,
        plan.chunk,
        1 if save else 0,
    )
    assert (state["done"] == plan.blocks["total"]).all()
    return status


def test_rows_from_the_crossover_up_go_to_the_copy_engines_the_rest_to_the_kernel() -> None:
    table = np.array(
        [
            [0, 0, 0, 1000],
            [0, 1000, 4096, 40000],
            [0, 41000, 65536, 32768],
            [0, 80000, 1 << 20, 100],
        ],
        dtype=np.uint64,
    )
    plan = plan_moves(table, np.array([1 << 40]), 1 << 30, to_pool=False, crossover=32768)
    assert plan.ce_len.tolist() == [40000, 32768] and plan.rows["len"].tolist() == [1000, 100]
    assert plan.ce_src.tolist() == [(1 << 30) + 4096, (1 << 30) + 65536]  # the pool's side
    assert plan.ce_dst.tolist() == [(1 << 40) + 1000, (1 << 40) + 41000]
    saved = plan_moves(table, np.array([1 << 40]), 1 << 30, to_pool=True, crossover=0)
    assert len(saved.rows) == 0 and saved.ce_dst.tolist()[0] == 1 << 30  # all engines, to pool


def test_a_run_across_two_pool_blocks_is_one_copy_and_each_block_gets_its_own_crc() -> None:
    rng = np.random.default_rng(1)
    engine = rng.integers(0, 256, 16384, dtype=np.uint8)
    table = np.array([[0, 0, 4096, 16384]], dtype=np.uint64)  # blocks at 4096 and 12288
    halves = [_core.crc32c(engine[:8192].tobytes()), _core.crc32c(engine[8192:].tobytes())]
    blocks = (
        np.array([4096, 12288]),
        np.array([8192, 8192]),
        np.array([8192, 8192]),
        np.array(halves),
    )
    plan = plan_moves(
        table, np.array([engine.ctypes.data]), 0, to_pool=True, crossover=4096, blocks=blocks
    )
    assert plan.ce_len.tolist() == [16384] and plan.tiled.all()
    assert crc_status(plan, save=True).tolist() == halves
    wrong = (blocks[0], blocks[1], blocks[2], np.array([halves[0], halves[1] ^ 1]))
    load = plan_moves(table, np.array([engine.ctypes.data]), 0, to_pool=False, blocks=wrong)
    assert crc_status(load, save=False).tolist() == [0, 1]  # only the second block differs


def test_a_loads_crc_counts_overlapping_bytes_once_and_takes_gaps_from_the_pool() -> None:
    rng = np.random.default_rng(2)
    pool = rng.integers(0, 256, 4096, dtype=np.uint8)
    dest = np.zeros(2048, np.uint8)
    table = np.array([[0, 0, 100, 500], [0, 1000, 300, 400], [0, 1500, 900, 50]], np.uint64)
    for _, at, off, n in table.tolist():  # what the copies bring
        dest[at : at + n] = pool[off : off + n]
    expect = _core.crc32c(pool[:1200].tobytes())  # the block is [0, 1200): gaps at 0, 700, 950
    blocks = (np.array([0]), np.array([1200]), np.array([4096]), np.array([expect]))
    plan = plan_moves(
        table,
        np.array([dest.ctypes.data]),
        pool.ctypes.data,
        to_pool=False,
        blocks=blocks,
        chunk=16,
    )
    assert crc_status(plan, save=False).tolist() == [0] and not plan.tiled[0]
    dest[1000 + 350] ^= 1  # a byte of the second row that the first one does not cover
    assert crc_status(plan, save=False).tolist() == [1]
    dest[1000 + 350] ^= 1
    dest[150] ^= 1  # the overlap counts the first row's copy
    assert crc_status(plan, save=False).tolist() == [1]


def test_a_row_past_a_blocks_length_fails_that_block() -> None:
    table = np.array([[0, 0, 0, 5000]], np.uint64)
    blocks = (np.array([0]), np.array([4000]), np.array([8192]), np.array([0]))
    plan = plan_moves(table, np.array([1 << 40]), 0, to_pool=False, blocks=blocks)
    assert plan.too_long.tolist() == [True]
    outside = np.array([[0, 0, 9000, 10]], np.uint64)
    with pytest.raises(ValueError, match="outside every block"):
        plan_moves(outside, np.array([1 << 40]), 0, to_pool=False, blocks=blocks)


# -- through the store, with the stand-in runtime --------------------------------------


@contextlib.contextmanager
def served(path: str, coherence: str) -> Iterator[tuple[KVStore, GpuPool, StandInCuda]]:
    """A pool in the given coherence mode, its server on a thread, a store, its GpuPool."""
    pool = Pool.create(path, 32 << 20, geometry=GEOMETRY, coherence=coherence)
    server = MetadataServer(pool)
    thread = server.start_thread()
    runtime = StandInCuda()
    try:
        with (
            KVStore(path, coherence=coherence) as store,
            GpuPool(store.pool, runtime=runtime) as gpu,
        ):
            yield store, gpu, runtime
    finally:
        server.stop()
        thread.join(timeout=10)
        server.close()
        pool.close()
        Pool.destroy(path)


def payload(store: KVStore, ref) -> bytes:
    return bytes(store.pool.mapping.buffer[ref.payload_offset : ref.payload_offset + ref.length])


def header_crc(store: KVStore, ref) -> int:
    line = bytes(store.pool.mapping.buffer[ref.header_offset : ref.header_offset + 64])
    h = parse_header(line)
    assert h is not None
    return h.payload_crc


@pytest.mark.leaves("keys")
def test_a_gpu_save_and_load_checksum_on_the_gpu_and_never_touch_a_payload_on_the_cpu(
    shm_path: str,
) -> None:
    with served(shm_path, "model") as (store, gpu, runtime):
        src = caches("cpu", seed=11)
        layout = KVLayout.flash_attention(SPEC, src)
        keys = [b"k0", b"k1", b"k2"]
        assert store.save(keys, EngineBlocks(layout, [4, 1, 3], mover=gpu)).stored == [0, 1, 2]
        refs = store.locate(keys)
        store.mem.sfence()  # nothing of the payloads is in the model's buffers: it is memory
        for r in refs:  # sealed with the GPU's CRC of its source, which is the pool's bytes'
            assert header_crc(store, r) == _core.crc32c(payload(store, r))
        back = caches("cpu", seed=None)
        assert (
            store.load(
                refs, EngineBlocks(KVLayout.flash_attention(SPEC, back), [0, 5, 2], mover=gpu)
            )
            == [True] * 3
        )
        for layer in range(3):
            for dst, source in ((0, 4), (5, 1), (2, 3)):
                assert torch.equal(back[layer][:, dst], src[layer][:, source])
        assert runtime.launches == 2 and runtime.crc_segments > 0  # one plan each way
        granule = store.mem.record_granule
        for r in refs:  # the CPU read headers only: no payload granule was ever touched
            for off in range(r.payload_offset, r.payload_offset + r.length, granule):
                assert store.mem.record_state(off) == "clean", off
        assert gpu.stats["invalidated"] == 0 and gpu.stats["retried"] == 0


@pytest.mark.leaves("keys")
@pytest.mark.parametrize("coherence", ["native", "model"])
def test_a_corrupted_pool_byte_makes_the_gpu_load_a_miss_never_other_bytes(
    shm_path: str, coherence: str
) -> None:
    with served(shm_path, coherence) as (store, gpu, _):
        src = caches("cpu", seed=12)
        layout = KVLayout.flash_attention(SPEC, src)
        keys = [b"c0", b"c1", b"c2"]
        store.save(keys, EngineBlocks(layout, [0, 1, 2], mover=gpu))
        refs = store.locate(keys)
        store.mem.sfence()
        store.pool.mapping.buffer[refs[1].payload_offset + 77] ^= 0x20  # memory, behind caches
        back = caches("cpu", seed=None)
        got = store.load(
            refs, EngineBlocks(KVLayout.flash_attention(SPEC, back), [3, 4, 5], mover=gpu)
        )
        assert got == [True, False, True]
        assert gpu.stats["retried"] == 1  # read once more with its ranges invalidated, then a miss
        for layer in range(3):
            assert torch.equal(back[layer][:, 3], src[layer][:, 0])
            assert torch.equal(back[layer][:, 5], src[layer][:, 2])


@pytest.mark.leaves("keys")
def test_a_partial_load_is_validated_over_the_whole_value_on_the_gpu(shm_path: str) -> None:
    with served(shm_path, "model") as (store, gpu, _):
        src = caches("cpu", seed=13)
        layout = KVLayout.flash_attention(SPEC, src)
        n = layout.format.nbytes
        rng = random.Random(5)
        values = [rng.randbytes(2 * n) for _ in range(2)]
        store.save([b"p0", b"p1"], Buffers(values))
        refs = store.locate([b"p0", b"p1"])
        back = caches("cpu", seed=None)
        out = KVLayout.flash_attention(SPEC, back)
        sink = EngineBlocks(out, [1, 2], mover=gpu, at=n, value_bytes=2 * n)
        assert store.load(refs, sink) == [True, True]
        got = [gather_bytes(out, b) for b in (1, 2)]
        assert got == [v[n:] for v in values]  # the second half of each value, in place
        store.pool.mapping.buffer[refs[0].payload_offset + 5] ^= 1  # a byte the load does not move
        assert store.load(refs, sink) == [False, True]


def gather_bytes(layout: KVLayout, block: int) -> bytes:
    """An engine block's bytes in the pool's block format (the CPU path's table, in numpy)."""
    buf = np.zeros(layout.format.nbytes, np.uint8)
    table = block_table(layout, np.array([block]), np.array([0]))
    for b, at, off, length in table.tolist():
        raw = np.asarray(layout.buffers[b]).view(np.uint8).reshape(-1)
        buf[off : off + length] = raw[at : at + length]
    return buf.tobytes()


def twins(size: int, at: int = 4992) -> tuple[bytes, bytes]:
    """Two payloads with one CRC32C that differ in the one line at ``at`` (litmus' trick: a
    message followed by its own CRC leaves the register constant, so a common tail ends both
    alike).  The default puts that line in a block's second 4 KiB granule, among the last 64
    lines an invalidation of the block dooms (the model completes older ones at once)."""
    rng = random.Random(7)
    head, tail = rng.randbytes(at), rng.randbytes(size - at - 64)

    def twin() -> bytes:
        body = head + rng.randbytes(60)
        return body + struct.pack("<I", _core.crc32c(body)) + tail

    return twin(), twin()


@pytest.mark.leaves("writes")  # blocks published by hand, never committed
def test_a_gpu_load_invalidates_what_this_host_cached_and_nothing_else(shm_path: str) -> None:
    """Under the model: the reader's CPU caches a block, another host rewrites it (a payload
    with the same CRC32C, so only the invalidation can tell them apart); the reader's GPU
    load must get the new bytes.  Blocks its CPU never read are never invalidated."""
    Pool.create(shm_path, 32 << 20, geometry=GEOMETRY, coherence="model").close()
    still = ModelConfig(evict_rate=0.0)
    with (
        Pool.attach(shm_path, coherence="model", model=still) as writer,
        Pool.attach(shm_path, coherence="model", model=still) as reader,
        GpuPool(reader, runtime=StandInCuda()) as gpu,
    ):
        sb, key = reader.superblock, digest(b"rewritten")
        hdr, pay = sb.block_header_offset(0), sb.block_payload_offset(0)
        old, new = twins(6000)
        assert _core.crc32c(old) == _core.crc32c(new) and old != new
        writer.memory.publish(hdr, pay, key, 1, old)
        seen = np.zeros(len(old), np.uint8)
        assert reader.memory.read_validated(hdr, pay, sb.block_size, key, 1, seen) == len(old)
        assert reader.memory.record_state(pay) == "touched"
        writer.memory.publish(hdr, pay, key, 2, new)
        dest = np.zeros(len(new), np.uint8)
        table = np.array([[0, 0, pay, len(new)]], np.uint64)
        block = [(hdr, pay, sb.block_size, key, 2)]
        assert gpu.read_blocks([dest], table, block) == [len(new)]
        assert dest.tobytes() == new and gpu.stats["retried"] == 0
        assert reader.memory.record_state(pay) == 2 and gpu.stats["invalidated"] > 0
        spent = gpu.stats["invalidated"]
        dest[:] = 0
        assert gpu.read_blocks([dest], table, block) == [len(new)] and dest.tobytes() == new
        other_hdr, other = sb.block_header_offset(3), sb.block_payload_offset(3)
        writer.memory.publish(other_hdr, other, key, 3, old)
        table3 = np.array([[0, 0, other, len(old)]], np.uint64)
        assert gpu.read_blocks([dest], table3, [(other_hdr, other, sb.block_size, key, 3)]) == [
            len(old)
        ]
        assert gpu.stats["invalidated"] == spent  # neither a block read again nor one never read


@pytest.mark.leaves("writes")  # blocks published by hand, never committed
def test_a_line_refilled_at_a_gpu_loads_invalidation_is_not_trusted_for_a_later_version(
    shm_path: str,
) -> None:
    """Under a model that refills every invalidated line at the fence (a prefetch in flight):
    the reader's CPU caches version 1, its GPU load of version 1 invalidates and the lines
    come straight back; after another host writes version 2 (same CRC32C), the GPU load of
    version 2 must not take those lines for its own."""
    Pool.create(shm_path, 32 << 20, geometry=GEOMETRY, coherence="model").close()
    refills = ModelConfig(evict_rate=0.0, refill_rate=1.0)
    with (
        Pool.attach(shm_path, coherence="model", model=refills) as writer,
        Pool.attach(shm_path, coherence="model", model=refills) as reader,
        GpuPool(reader, runtime=StandInCuda()) as gpu,
    ):
        sb, key = reader.superblock, digest(b"refilled")
        hdr, pay = sb.block_header_offset(1), sb.block_payload_offset(1)
        old, new = twins(6000)
        writer.memory.publish(hdr, pay, key, 1, old)
        assert reader.memory.read_validated(hdr, pay, sb.block_size, key, 1, bytearray(8192)) > 0
        dest = np.zeros(len(old), np.uint8)
        table = np.array([[0, 0, pay, len(old)]], np.uint64)
        assert gpu.read_blocks([dest], table, [(hdr, pay, sb.block_size, key, 1)]) == [len(old)]
        writer.memory.publish(hdr, pay, key, 2, new)
        got = gpu.read_blocks([dest], table, [(hdr, pay, sb.block_size, key, 2)])
        assert got == [len(new)] and dest.tobytes() == new


@pytest.mark.leaves("keys")
def test_a_sparse_fetch_from_a_gpu_pool_is_one_kernel_launch_with_the_cpus_bytes(
    shm_path: str,
) -> None:
    with served(shm_path, "native") as (store, gpu, runtime):
        src = caches("cpu", seed=14)
        layout = KVLayout.flash_attention(SPEC, src)
        keys = [b"s0", b"s1", b"s2"]
        store.save(keys, EngineBlocks(layout, [0, 1, 2], mover=gpu))
        offs = [r.payload_offset for r in store.locate(keys)]
        fmt = layout.format
        positions = np.random.default_rng(3).integers(0, 48, (3, 2, 16))
        want = np.zeros(sparse_shape(fmt, positions), np.uint16)
        sparse_fetch(store.mem, fmt, offs, positions, want, block_bytes=BLOCK)
        got = torch.zeros(sparse_shape(fmt, positions), dtype=torch.bfloat16)
        launches, rows = runtime.launches, runtime.kernel_rows
        sparse_fetch(gpu, fmt, offs, positions, got, block_bytes=BLOCK)
        assert runtime.launches == launches + 1 and runtime.kernel_rows > rows
        assert got.view(torch.uint16).numpy().tobytes() == want.tobytes()
        with pytest.raises(ValueError, match="at least"):
            sparse_fetch(gpu, fmt, offs, positions, got[:1], block_bytes=BLOCK)


# -- on a real GPU ---------------------------------------------------------------------


@cuda
def test_gpu_blocks_round_trip_through_the_pool_in_one_kernel(pool: Pool) -> None:
    src = caches("cuda", seed=5)
    layout = KVLayout.flash_attention(SPEC, src)
    ids, n = [4, 1, 3], layout.format.nbytes
    cpu_offs, gpu_offs = offsets(pool, [0, 2, 4]), offsets(pool, [1, 3, 5])
    host = KVLayout.flash_attention(SPEC, [t.cpu() for t in src])
    gather_write(pool.memory, host, ids, cpu_offs, block_bytes=BLOCK)
    with GpuPool(pool, chunk_bytes=4 << 20) as gpu:
        assert gather_write(gpu, layout, ids, gpu_offs, block_bytes=BLOCK) == 3 * n
        assert pool_bytes(pool, gpu_offs, n) == pool_bytes(pool, cpu_offs, n)
        back = caches("cuda", seed=None)
        out = KVLayout.flash_attention(SPEC, back)
        scatter_read(gpu, out, [0, 5, 2], cpu_offs, block_bytes=BLOCK)  # written by the CPU
    for layer in range(3):
        for dst, source in ((0, 4), (5, 1), (2, 3)):
            assert torch.equal(back[layer][:, dst], src[layer][:, source])


@cuda
def test_the_cpu_path_refuses_a_gpu_cache(pool: Pool) -> None:
    layout = KVLayout.flash_attention(SPEC, caches("cuda", seed=6))
    with pytest.raises(KVLayoutError, match="GpuPool"):
        gather_write(pool.memory, layout, [0], offsets(pool, [0]), block_bytes=BLOCK)


@pytest.mark.leaves("writes")  # the bench seals blocks in its scratch pool, then destroys it
def test_the_gpu_bench_runs_every_row_beside_its_floors_on_the_stand_in(tmp_path: Path) -> None:
    """``beluga bench gpu``'s own code, on the CPU (its figures mean nothing here)."""
    from beluga.bench import gpu as gpu_bench

    doc = gpu_bench.run(batches=[2], repeat=2, crossover=None, runtime=StandInCuda(), device="cpu")
    names = {(r["row"], r["direction"], r["check"]) for r in doc["rows"]}
    for row in ("64k", "7b-block", "32b-block", "7b-batch2"):
        for direction in ("load", "save"):
            assert {(row, direction, "copy"), (row, direction, "crc32c")} <= names
    assert ("sparse16", "load", "copy") in names
    for r in doc["rows"]:
        if r["row"] != "sparse16":
            assert {"pinned_p50_us", "pool_p50_us", "loop_p50_us", "p99_us"} <= set(r), r
    assert [s["piece"] for s in doc["crossover_sweep"]] == list(gpu_bench.SWEEP_PIECES)
    assert doc["retried_blocks"] == 0
    gpu_bench.chart(doc, str(tmp_path / "gpu.png"))
    assert (tmp_path / "gpu.png").stat().st_size > 0
