"""The KV data path against its alternatives, side by side in one run.

Shape: Qwen2-7B's KV (28 layers, 4 KV heads, head dim 128, bf16) in 16-token
vLLM FlashAttention NHD blocks: one pool block is 56 pieces of 16 KiB
(896 KiB).  Each write or read moves BLOCKS such blocks, three ways:

- ``one_call``: the data path, one gather_write / scatter_read call (the
  table is built inside the timed call);
- ``memcpy``: one contiguous copy of the same bytes through the same Memory
  (the bound a scatter-gather copy can approach);
- ``per_piece``: a Python loop with one Memory call per piece (the table is
  built beforehand, which flatters it).

- ``gpu_kernel`` (where CUDA exists): the same blocks between GPU memory and
  the registered pool, one kernel launch (:mod:`beluga.transfer.gpu`).

Sparse: 16 chosen tokens per layer and KV head out of a 512-token sequence,
K and V (3,584 fragments of 256 bytes), in one call or one call per fragment;
``extra_info`` carries the fragment count and fragments per second at the
median.  Compare the ratios within a run; absolute times belong to this
machine.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from beluga.coherence import Memory, attach
from beluga.pool import Geometry, Pool
from beluga.serving.model import QWEN2_7B
from beluga.transfer import (
    KVLayout,
    block_table,
    gather_write,
    scatter_read,
    sparse_fetch,
    sparse_shape,
    sparse_table,
)

SPEC = QWEN2_7B.kv_spec("bfloat16")
BLOCKS = 4
SEQUENCE_BLOCKS = 32
TOP_K = 16
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@dataclass
class Rig:
    layout: KVLayout
    mem: Memory
    stride: int
    block_ids: np.ndarray
    offsets: np.ndarray
    table: np.ndarray
    staging: np.ndarray  # BLOCKS pool blocks' worth of contiguous bytes


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    stride = -(-KVLayout.flash_attention(SPEC, _caches(1)).format.nbytes // 4096) * 4096
    layout = KVLayout.flash_attention(SPEC, _caches(2 * BLOCKS))
    pool = mmap.mmap(-1, stride * SEQUENCE_BLOCKS)
    mem = attach(pool, "native")
    block_ids = np.arange(1, 2 * BLOCKS, 2)
    offsets = np.arange(BLOCKS) * stride * 3 % (stride * SEQUENCE_BLOCKS)
    # random, not np.zeros: untouched zero pages all map one physical page and flatter a copy
    staging = np.random.default_rng(0).integers(0, 256, BLOCKS * layout.format.nbytes, np.uint8)
    yield Rig(
        layout, mem, stride, block_ids, offsets, block_table(layout, block_ids, offsets), staging
    )
    mem.release()
    pool.close()


def _caches(num_blocks: int, device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = (2, num_blocks, SPEC.block_tokens, SPEC.num_kv_heads, SPEC.head_dim)
    return [
        torch.randn(shape, generator=gen).to(torch.bfloat16).to(device)
        for _ in range(SPEC.num_layers)
    ]


def _moved(rig: Rig) -> int:
    return BLOCKS * rig.layout.format.nbytes


@pytest.mark.benchmark(group="write")
def test_write_one_call(benchmark, rig: Rig) -> None:
    moved = benchmark(
        gather_write, rig.mem, rig.layout, rig.block_ids, rig.offsets, block_bytes=rig.stride
    )
    assert moved == _moved(rig)


@pytest.mark.benchmark(group="write")
def test_write_memcpy(benchmark, rig: Rig) -> None:
    def copy() -> None:
        rig.mem.nt_store(0, rig.staging)
        rig.mem.sfence()

    benchmark(copy)


@pytest.mark.benchmark(group="write")
def test_write_per_piece(benchmark, rig: Rig) -> None:
    views = [memoryview(b) for b in rig.layout.buffers]

    def loop() -> None:
        for buf, boff, poff, n in rig.table.tolist():
            rig.mem.nt_store(poff, views[buf][boff : boff + n])
        rig.mem.sfence()

    benchmark(loop)


@pytest.mark.benchmark(group="read")
def test_read_one_call(benchmark, rig: Rig) -> None:
    moved = benchmark(
        scatter_read, rig.mem, rig.layout, rig.block_ids, rig.offsets, block_bytes=rig.stride
    )
    assert moved == _moved(rig)


@pytest.mark.benchmark(group="read")
def test_read_memcpy(benchmark, rig: Rig) -> None:
    def copy() -> None:
        rig.mem.invalidate(0, rig.staging.size)
        rig.mem.mfence()
        rig.mem.load_into(0, rig.staging)

    benchmark(copy)


@pytest.mark.benchmark(group="read")
def test_read_per_piece(benchmark, rig: Rig) -> None:
    views = [memoryview(b) for b in rig.layout.buffers]

    def loop() -> None:
        for buf, boff, poff, n in rig.table.tolist():
            rig.mem.invalidate(poff, n)
            rig.mem.mfence()
            rig.mem.load_into(poff, views[buf][boff : boff + n])

    benchmark(loop)


@pytest.fixture
def gpu_rig(shm_path: str, rig: Rig) -> Iterator[tuple[object, KVLayout, np.ndarray]]:
    """(a GpuPool on a real pool, a GPU cache of the rig's shape, pool offsets)."""
    from beluga.transfer.gpu import GpuPool

    geometry = Geometry(max_hosts=2, rpc_bytes_per_host=64 << 10, block_size=rig.stride)
    pool = Pool.create(shm_path, 64 << 20, geometry=geometry, coherence="native")
    layout = KVLayout.flash_attention(SPEC, _caches(2 * BLOCKS, "cuda"))
    offsets = np.array([pool.superblock.block_payload_offset(3 * b) for b in range(BLOCKS)])
    gpu = GpuPool(pool)
    yield gpu, layout, offsets
    gpu.close()
    pool.close()
    Pool.destroy(shm_path)


@cuda
@pytest.mark.benchmark(group="write")
def test_write_gpu_kernel(benchmark, rig: Rig, gpu_rig: tuple) -> None:
    gpu, layout, offsets = gpu_rig
    moved = benchmark(gather_write, gpu, layout, rig.block_ids, offsets, block_bytes=rig.stride)
    assert moved == _moved(rig)


@cuda
@pytest.mark.benchmark(group="read")
def test_read_gpu_kernel(benchmark, rig: Rig, gpu_rig: tuple) -> None:
    gpu, layout, offsets = gpu_rig
    moved = benchmark(scatter_read, gpu, layout, rig.block_ids, offsets, block_bytes=rig.stride)
    assert moved == _moved(rig)


@pytest.fixture(scope="module")
def sparse(rig: Rig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pool offsets of a 512-token sequence, chosen positions, output buffer)."""
    offsets = np.arange(SEQUENCE_BLOCKS) * rig.stride
    rng = np.random.default_rng(0)
    tokens = SEQUENCE_BLOCKS * SPEC.block_tokens
    shape = (SPEC.num_layers, SPEC.num_kv_heads, tokens)
    shuffled = rng.permuted(np.broadcast_to(np.arange(tokens), shape), axis=-1)
    positions = np.sort(shuffled[..., :TOP_K])
    out = np.zeros(int(np.prod(sparse_shape(rig.layout.format, positions))) * 2, np.uint8)
    return offsets, positions, out


@pytest.mark.benchmark(group="sparse")
def test_sparse_one_call(benchmark, rig: Rig, sparse: tuple) -> None:
    offsets, positions, out = sparse
    moved = benchmark(
        sparse_fetch, rig.mem, rig.layout.format, offsets, positions, out, block_bytes=rig.stride
    )
    assert moved == out.size
    _fragment_rate(benchmark, positions)


@pytest.mark.benchmark(group="sparse")
def test_sparse_per_fragment(benchmark, rig: Rig, sparse: tuple) -> None:
    offsets, positions, out = sparse
    rows = sparse_table(rig.layout.format, offsets, positions).tolist()
    view = memoryview(out)

    def loop() -> None:
        for _, boff, poff, n in rows:
            rig.mem.invalidate(poff, n)
            rig.mem.mfence()
            rig.mem.load_into(poff, view[boff : boff + n])

    benchmark(loop)
    _fragment_rate(benchmark, positions)


def _fragment_rate(benchmark, positions: np.ndarray) -> None:
    """Record the fragment count, and fragments per second at the median when timed."""
    fragments = 2 * positions.size  # K and V of each chosen (layer, head, token)
    benchmark.extra_info["fragments"] = fragments
    if benchmark.stats:  # None under --benchmark-disable
        benchmark.extra_info["fragments_per_s"] = fragments / benchmark.stats.stats.median
