"""The GPU data path: gather-write / scatter-read as one kernel over the registered pool.

On a GPU machine, one command runs every test here, the CUDA ones included::

    python setup.py build_ext --inplace -q && python -m pytest -v -rs tests/test_transfer_gpu.py

Without CUDA the tests marked ``cuda`` skip and say why; the rest run
everywhere: they drive :class:`GpuPool` with a stand-in runtime that
"registers" by bookkeeping and runs the kernel's rows with memmove, so the
registration in chunks, the address arithmetic and the clean-up are checked
against the CPU path byte for byte even here.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from beluga.errors import BackendUnavailableError, KVLayoutError
from beluga.pool import Geometry, Pool
from beluga.transfer import KVLayout, KVSpec, block_table, gather_write, scatter_read
from beluga.transfer.gpu import GpuPool, _merged_ranges

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


class StandInCuda:
    """A runtime that keeps books instead of calling CUDA, and copies rows with memmove."""

    device = torch.device("cpu")

    def __init__(self, fail_at: int | None = None, gap: int = 0) -> None:
        self.registered: dict[int, int] = {}
        self.calls = 0
        self.fail_at = fail_at
        self.gap = gap  # > 0: each chunk's device address is this far past the last one's
        self.launches = 0

    def register(self, address: int, nbytes: int) -> None:
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            raise BackendUnavailableError("cudaHostRegister failed with CUDA error 1")
        self.registered[address] = nbytes

    def unregister(self, address: int) -> None:
        del self.registered[address]

    def device_pointer(self, address: int) -> int:
        assert address in self.registered, "asked for the device address of unregistered memory"
        return address + self.gap * sorted(self.registered).index(address)

    def copy_rows(self, rows: np.ndarray) -> None:
        self.launches += 1
        for src, dst, n in rows.tolist():
            ctypes.memmove(dst, src, n)


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
        assert moved == 3 * n and runtime.launches == 1  # one launch for the whole batch
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
    with (
        Pool.attach(shm_path, coherence="model") as modelled,
        pytest.raises(ValueError, match="native coherence"),
    ):
        GpuPool(modelled, runtime=StandInCuda())
    gpu = GpuPool(pool, runtime=StandInCuda())
    layout = KVLayout.flash_attention(SPEC, caches("cpu", seed=2))
    before = bytes(pool.mapping.buffer[: 1 << 20])
    with pytest.raises(ValueError, match="out of range"):
        gather_write(gpu, layout, [NUM_BLOCKS], offsets(pool, [0]), block_bytes=BLOCK)
    gpu.close()
    with pytest.raises(ValueError, match="closed"):
        gather_write(gpu, layout, [0], offsets(pool, [0]), block_bytes=BLOCK)
    assert bytes(pool.mapping.buffer[: 1 << 20]) == before


def test_reads_invalidate_one_range_per_pool_block() -> None:
    layout = KVLayout.flash_attention(SPEC, caches("cpu", seed=3))
    offs = np.array([5 * BLOCK, BLOCK, 3 * BLOCK])
    table = block_table(layout, np.array([0, 1, 2]), offs)
    n = layout.format.nbytes
    assert _merged_ranges(table[:, 2], table[:, 3]) == [(o, n) for o in sorted(offs.tolist())]
    adjacent = block_table(layout, np.array([0, 1]), np.array([0, n]))
    assert _merged_ranges(adjacent[:, 2], adjacent[:, 3]) == [(0, 2 * n)]
    assert _merged_ranges(np.array([], np.uint64), np.array([], np.uint64)) == []


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
