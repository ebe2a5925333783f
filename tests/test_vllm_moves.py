"""The vLLM worker's block moves (:mod:`beluga.integrations.moves`), with vLLM-shaped caches.

The worker hands these moves its registered KV caches and the blocks a step
names; nothing here imports vLLM, so the moves run in CI with caches shaped as
vLLM's GPU worker registers them: FlashAttention ``[2, num_blocks, block_size,
kv_heads, head_dim]`` per layer in bfloat16, in the NHD order (contiguous) or
the HND one (that logical shape over ``[2, num_blocks, kv_heads, block_size,
head_dim]`` memory), one shard of the heads per tensor-parallel rank.  Every
saved value is checked byte for byte against the block format computed here
from the cache itself, and read back into a fresh cache.

On the CPU the FlashAttention caches move through a GpuPool whose runtime is
the stand-in of tests/test_transfer_gpu.py (the rows its kernel would copy,
copied with memmove), and through the pool's Memory; on a GPU machine the
``cuda`` tests move real CUDA caches through a real GpuPool::

    python setup.py build_ext --inplace -q && python -m pytest -v -rs tests/test_vllm_moves.py
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from beluga.errors import KVLayoutError
from beluga.integrations.moves import (
    BlockMoves,
    GpuPools,
    engine_layout,
    flash_attention_layout,
)
from beluga.kv import KVNamespace, KVStore, ModelIdentity
from beluga.pool import Geometry, Pool
from beluga.server import MetadataServer
from beluga.transfer import KVLayout, KVSpec
from beluga.transfer.gpu import GpuPool
from tests.test_transfer_gpu import StandInCuda

HEADS, DIM, BS, LAYERS = 4, 16, 16, 3
SPEC = KVSpec(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, block_tokens=BS)
NB = 6  # engine blocks per cache
GEOMETRY = Geometry(max_hosts=4, rpc_bytes_per_host=64 << 10, block_size=16 << 10)
MODEL = ModelIdentity.explicit("vllm-shaped", "test")
HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(
    not HAS_CUDA,
    reason="no CUDA device (torch.cuda.is_available() is False): run this module on a GPU "
    "machine with: python -m pytest -v -rs tests/test_vllm_moves.py",
)


@dataclasses.dataclass
class Served:
    """A pool for blocks of up to 16 KiB, its metadata server on a thread, one store."""

    pool: Pool
    store: KVStore


@pytest.fixture
def served(shm_path: str) -> Iterator[Served]:
    pool = Pool.create(shm_path, 32 << 20, geometry=GEOMETRY)
    server = MetadataServer(pool)
    thread = server.start_thread()
    store = KVStore(shm_path, coherence="native")
    try:
        yield Served(pool, store)
        assert store.stats()["writes_in_flight"] == 0
    finally:
        store.close()
        server.stop()
        thread.join(10)
        server.close()
        pool.close()
        Pool.destroy(shm_path)


def flash_caches(
    order: str, seed: int | None, device: str = "cpu", heads: int = HEADS
) -> list[torch.Tensor]:
    """Per-layer caches as vLLM's FlashAttention registers them (zeros when ``seed`` is None)."""
    memory = (2, NB, BS, heads, DIM) if order == "NHD" else (2, NB, heads, BS, DIM)
    gen = torch.Generator().manual_seed(seed or 0)
    out = []
    for _ in range(LAYERS):
        t = torch.zeros(memory) if seed is None else torch.randn(memory, generator=gen)
        t = t.to(torch.bfloat16).to(device)
        out.append(t if order == "NHD" else t.permute(0, 1, 3, 2, 4))  # the logical view
    return out


def block_value(caches: list[torch.Tensor], block: int, order: str) -> bytes:
    """The pool value of one engine block, from the caches: layer by layer, K then V, each
    [block_size, heads, dim] (NHD) or [heads, block_size, dim] (HND)."""
    sections = []
    for t in caches:
        for kv in (0, 1):
            logical = t[kv, block].cpu()  # [bs, heads, dim]
            section = logical if order == "NHD" else logical.permute(1, 0, 2)
            sections.append(section.contiguous().view(torch.uint8).reshape(-1))
    return torch.cat(sections).numpy().tobytes()


def keys(*names: str, rank: int = 0, tp: int = 1, layout: str = "flash") -> list[bytes]:
    ns = KVNamespace(MODEL, layout, ("vllm", f"tp-size={tp}", f"tp-rank={rank}"))
    return [ns.key(name.encode()) for name in names]


def stand_in() -> tuple[GpuPools, list[StandInCuda]]:
    """GpuPools whose GpuPools run on the stand-in runtime (each one's runtime is kept)."""
    runtimes: list[StandInCuda] = []

    def make(pool: Pool) -> GpuPool:
        runtimes.append(StandInCuda())
        return GpuPool(pool, runtime=runtimes[-1])

    return GpuPools(make=make), runtimes


def remove(store: KVStore, names: list[bytes]) -> None:
    assert all(store.remove(k) for k in names)


@pytest.mark.parametrize("mover", ["memory", "gpu-pool"])
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_flash_attention_blocks_are_saved_in_the_block_format_and_reload(
    served: Served, order: str, mover: str
) -> None:
    src = flash_caches(order, seed=1)
    gpus, runtimes = stand_in() if mover == "gpu-pool" else (None, [])
    moves = BlockMoves([KVLayout.flash_attention(SPEC, src, order)], gpus)
    assert moves.on_gpu == (mover == "gpu-pool")
    names = keys("a", "b", "c", layout=order)
    saved = moves.save(served.store, moves.layouts[0], names, [3, 1, 4])
    assert saved.stored == [0, 1, 2]
    for name, block in zip(names, [3, 1, 4], strict=True):
        assert served.store.get(name) == block_value(src, block, order)
    dst = flash_caches(order, seed=None)
    back = BlockMoves([KVLayout.flash_attention(SPEC, dst, order)], gpus)
    refs = served.store.locate(names)
    assert back.load(served.store, back.layouts[0], [0, 5, 2], refs) == [True] * 3
    for got, want in zip(dst, src, strict=True):
        for into, source in ((0, 3), (5, 1), (2, 4)):
            assert torch.equal(got[:, into], want[:, source])
        assert not got[:, [1, 3, 4]].any()
    if runtimes:  # the saves and loads went through the GpuPool's rows, one registration
        assert len(runtimes) == 1 and runtimes[0].launches >= 2
    moves.close()
    back.close()
    assert not any(r.registered for r in runtimes)
    remove(served.store, names)


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_tensor_parallel_ranks_move_their_own_heads_under_their_own_keys(
    served: Served, order: str
) -> None:
    """Two ranks of one engine each hold half the KV heads: each saves its shard, whose bytes
    are those heads' block format, and loads back exactly its own."""
    full = flash_caches(order, seed=2)  # the model's KV, every head
    half = HEADS // 2
    shard_spec = dataclasses.replace(SPEC, num_kv_heads=half)
    names = {rank: keys("x", "y", rank=rank, tp=2, layout=order) for rank in range(2)}
    gpus, _ = stand_in()
    for rank in range(2):
        heads = slice(rank * half, (rank + 1) * half)
        shard = [t[:, :, :, heads].contiguous() for t in full]  # what rank holds, NHD memory
        if order == "HND":
            shard = [t.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4) for t in shard]
        moves = BlockMoves([KVLayout.flash_attention(shard_spec, shard, order)], gpus)
        assert moves.save(served.store, moves.layouts[0], names[rank], [2, 5]).stored == [0, 1]
        for name, block in zip(names[rank], [2, 5], strict=True):
            assert served.store.get(name) == block_value(shard, block, order)
    assert served.store.get(names[0][0]) != served.store.get(names[1][0])
    for rank in range(2):
        dst = flash_caches(order, seed=None, heads=half)
        moves = BlockMoves([KVLayout.flash_attention(shard_spec, dst, order)], gpus)
        refs = served.store.locate(names[rank])
        assert moves.load(served.store, moves.layouts[0], [0, 1], refs) == [True, True]
        heads = slice(rank * half, (rank + 1) * half)
        for got, want in zip(dst, full, strict=True):
            assert torch.equal(got[:, [0, 1]], want[:, [2, 5], :, heads])
    gpus.close()
    remove(served.store, names[0] + names[1])


def test_layer_by_layer_loads_fill_one_layer_from_the_whole_value(served: Served) -> None:
    """The worker's layer-wise loads: a layout of one layer reads its part of each value
    (``at``), and the whole value is still validated."""
    src = flash_caches("HND", seed=3)
    moves = BlockMoves([KVLayout.flash_attention(SPEC, src, "HND")])
    names = keys("l0", "l1")
    moves.save(served.store, moves.layouts[0], names, [1, 2])
    one = dataclasses.replace(SPEC, num_layers=1)
    layer_bytes = 2 * one.section_bytes
    dst = flash_caches("HND", seed=None)
    layers = BlockMoves([KVLayout.flash_attention(one, [t], "HND") for t in dst])
    refs = served.store.locate(names)
    got = layers.load(
        served.store,
        layers.layouts[1],
        [4, 0],
        refs,
        at=layer_bytes,
        value_bytes=moves.layouts[0].format.nbytes,
    )
    assert got == [True, True]
    assert torch.equal(dst[1][:, [4, 0]], src[1][:, [1, 2]])
    assert not dst[0].any() and not dst[2].any()  # the other layers are left alone
    remove(served.store, names)


def test_a_block_changed_in_the_pool_reloads_as_invalid_never_as_its_bytes(
    served: Served,
) -> None:
    src = flash_caches("NHD", seed=4)
    gpus, _ = stand_in()
    moves = BlockMoves([KVLayout.flash_attention(SPEC, src, "NHD")], gpus)
    names = keys("p", "q", "r")
    moves.save(served.store, moves.layouts[0], names, [0, 1, 2])
    refs = served.store.locate(names)
    assert refs[1] is not None
    at = refs[1].payload_offset + 100
    served.pool.mapping.buffer[at] ^= 0xFF  # one byte of the middle block's payload
    dst = flash_caches("NHD", seed=None)
    back = BlockMoves([KVLayout.flash_attention(SPEC, dst, "NHD")], gpus)
    assert back.load(served.store, back.layouts[0], [0, 1, 2], refs) == [True, False, True]
    assert torch.equal(dst[0][:, 0], src[0][:, 0]) and torch.equal(dst[0][:, 2], src[0][:, 2])
    assert served.store.locate([names[1]]) == [None]  # dropped: its recomputation can be saved
    gpus.close()
    remove(served.store, [names[0], names[2]])


def test_gpu_pools_lend_one_registration_per_store_and_close_it_after_its_last_move(
    served: Served,
) -> None:
    gpus, runtimes = stand_in()
    with gpus.lend(served.store) as first, gpus.lend(served.store) as again:
        assert first is again and len(runtimes) == 1
        gpus.drop(served.store)  # an outage drops the store while a move still copies
        assert runtimes[0].registered  # not unregistered under the move
    assert not runtimes[0].registered  # the last move gave it back: closed
    with KVStore(served.pool.spec, coherence="native") as other:
        with gpus.lend(served.store):
            pass
        with gpus.lend(other):  # a reconnected store: the old store's GpuPool is let go
            assert len(runtimes) == 3 and not runtimes[1].registered and runtimes[2].registered
        gpus.close()
        assert not runtimes[2].registered
    gpus.close()  # twice is fine


def test_a_flash_attention_caches_order_is_read_from_its_strides() -> None:
    """vLLM lays every layer out in the KV cache layout it resolved (LBNHC: NHD, LBHNC: HND);
    the worker moves the tensors in the order their memory has, 5-D caches and 4-D views."""
    for order in ("NHD", "HND"):
        five = flash_caches(order, seed=None)
        assert flash_attention_layout(SPEC, five).format.order == order
        hnd_view = torch.zeros((NB, HEADS, BS, 2 * DIM), dtype=torch.bfloat16)  # [nb,H,bs,2D]
        nhd_view = torch.zeros((NB, BS, HEADS, 2 * DIM), dtype=torch.bfloat16).transpose(1, 2)
        view = hnd_view if order == "HND" else nhd_view
        assert flash_attention_layout(SPEC, [view] * LAYERS).format.order == order
    flashinfer = [torch.zeros((NB, 2, BS, HEADS, DIM), dtype=torch.bfloat16)] * LAYERS
    with pytest.raises(KVLayoutError, match="FlashAttention in no order"):
        flash_attention_layout(SPEC, flashinfer)
    with pytest.raises(KVLayoutError, match="FlashAttention NHD for"):
        flash_attention_layout(SPEC, flash_caches("HND", seed=None), "NHD")
    with pytest.raises(KVLayoutError, match="moves FlashAttention's NHD and HND"):
        flash_attention_layout(SPEC, flash_caches("HND", seed=None), "LHBNC")


def test_the_worker_takes_cpu_caches_as_cpu_attn_and_cuda_ones_as_flash_attention() -> None:
    view = torch.zeros((NB, HEADS, BS, 2 * DIM), dtype=torch.bfloat16)  # vLLM-CPU's 4-D view
    layout = engine_layout(SPEC, [view] * LAYERS, "")
    assert layout.kind == "vllm-cpu" and layout.format.order == "CPU"
    on_meta = [t.to("meta") for t in flash_caches("NHD", seed=None)]
    with pytest.raises(KVLayoutError, match=r"on meta.*--kv-transfer-config"):
        engine_layout(SPEC, on_meta, "NHD")


# -- on a real GPU ---------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_cuda_flash_attention_blocks_move_through_a_gpu_pool_byte_exact(
    served: Served, order: str
) -> None:
    """What the worker does with a CUDA KV cache: FlashAttention layout in the engine's
    order, moved by a GpuPool registered over the store's pool; bytes, then a reload."""
    src = flash_caches(order, seed=5, device="cuda")
    moves = BlockMoves([engine_layout(SPEC, src)])  # the order read from the strides
    assert moves.layouts[0].format.order == order
    assert moves.on_gpu
    moves.prepare(served.store)  # registers at start, as the worker does
    names = keys("g1", "g2", "g3", layout=order)
    assert moves.save(served.store, moves.layouts[0], names, [5, 0, 2]).stored == [0, 1, 2]
    for name, block in zip(names, [5, 0, 2], strict=True):
        assert served.store.get(name) == block_value(src, block, order)
    dst = flash_caches(order, seed=None, device="cuda")
    back = BlockMoves([engine_layout(SPEC, dst)])
    refs = served.store.locate(names)
    assert back.load(served.store, back.layouts[0], [1, 2, 3], refs) == [True] * 3
    for got, want in zip(dst, src, strict=True):
        assert torch.equal(got[:, [1, 2, 3]], want[:, [5, 0, 2]])
        assert not got[:, [0, 4, 5]].any()
    moves.close()
    back.close()
    remove(served.store, names)


@cuda
def test_a_cuda_cache_in_no_order_moved_is_refused_at_start() -> None:
    flashinfer = [torch.zeros((NB, 2, BS, HEADS, DIM), dtype=torch.bfloat16, device="cuda")]
    with pytest.raises(KVLayoutError, match="FlashAttention in no order"):
        engine_layout(SPEC, flashinfer * LAYERS)
    hnd = flash_caches("HND", seed=None, device="cuda")
    with pytest.raises(KVLayoutError, match="FlashAttention NHD for"):
        engine_layout(SPEC, hnd, "NHD")


def test_stand_in_rows_land_where_a_gpu_would_put_them(served: Served) -> None:
    """The stand-in's copies are the GpuPool's rows: the same pool bytes as the Memory path."""
    src = flash_caches("HND", seed=6)
    gpus, _ = stand_in()
    via_gpu = BlockMoves([KVLayout.flash_attention(SPEC, src, "HND")], gpus)
    via_memory = BlockMoves([KVLayout.flash_attention(SPEC, src, "HND")])
    a, b = keys("via-gpu"), keys("via-memory")
    via_gpu.save(served.store, via_gpu.layouts[0], a, [4])
    via_memory.save(served.store, via_memory.layouts[0], b, [4])
    value = served.store.get(a[0])
    assert value is not None and value == served.store.get(b[0])
    assert np.frombuffer(value, np.uint8).any()
    gpus.close()
    remove(served.store, a + b)
