"""Gather-write, scatter-read and sparse fetch between engine KV caches and pool blocks.

Each emulated host has its own Memory on one shared buffer.  Under the
non-coherent model the reader first caches stale lines of the whole pool, so a
read that did not invalidate would return zeros and the tests would fail.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from beluga.coherence import Memory, attach
from beluga.errors import KVLayoutError
from beluga.transfer import (
    BlockFormat,
    KVLayout,
    KVSpec,
    block_table,
    coalesce,
    gather_write,
    scatter_read,
    sparse_fetch,
    sparse_shape,
    sparse_table,
)

MODES = ("native", "model")
DTYPES = ("float16", "bfloat16", "float32")
KINDS = ("NHD", "HND", "HND-view", "CPU", "HF")
POOL_SLOTS = 8


def spec_of(dtype: str = "bfloat16") -> KVSpec:
    return KVSpec(num_layers=3, num_kv_heads=2, head_dim=16, block_tokens=16, dtype=dtype)


def random_tensor(shape: tuple[int, ...], dtype: str, gen: torch.Generator) -> torch.Tensor:
    """Random bytes seen as ``dtype``: every bit pattern (NaN payloads too) must survive."""
    t = getattr(torch, dtype)
    n = int(np.prod(shape)) * torch.empty(0, dtype=t).element_size()
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).view(t).reshape(shape)


class Engine:
    """One engine's KV cache in one layout, with torch indexing as the reference."""

    def __init__(self, kind: str, spec: KVSpec, num_blocks: int, seed: int | None) -> None:
        self.kind = kind
        gen = torch.Generator().manual_seed(seed or 0)
        bs, h, d = spec.block_tokens, spec.num_kv_heads, spec.head_dim

        def make(shape: tuple[int, ...]) -> torch.Tensor:
            if seed is None:
                return torch.zeros(shape, dtype=getattr(torch, spec.dtype))
            return random_tensor(shape, spec.dtype, gen)

        if kind == "HF":
            self.rows = 2 if num_blocks % 2 == 0 else 1
            self.per_row = num_blocks // self.rows
            shape = (self.rows, h, self.per_row * bs, d)
            self.kv = [(make(shape), make(shape)) for _ in range(spec.num_layers)]
            self.layout = KVLayout.hugging_face(spec, self.kv)
            return
        memory = (2, num_blocks, bs, h, d) if kind == "NHD" else (2, num_blocks, h, bs, d)
        self.tensors = [make(memory) for _ in range(spec.num_layers)]
        registered = self.tensors
        if kind == "HND-view":
            registered = [t.permute(0, 1, 3, 2, 4) for t in self.tensors]
        order = {"NHD": "NHD", "HND": "HND", "HND-view": "HND"}.get(kind)
        if kind == "CPU":
            self.layout = KVLayout.cpu_attention(spec, registered)
        else:
            self.layout = KVLayout.flash_attention(spec, registered, order)

    def block(self, layer: int, block: int) -> torch.Tensor:
        """The bytes of one engine block of one layer, K then V."""
        if self.kind == "HF":
            row, col = divmod(block, self.per_row)
            bs = self.layout.spec.block_tokens
            parts = [t[row, :, col * bs : (col + 1) * bs] for t in self.kv[layer]]
            return torch.stack(parts).contiguous().view(torch.uint8)
        return self.tensors[layer][:, block].contiguous().view(torch.uint8)

    def vector(self, block: int, layer: int, kv: int, token: int, head: int) -> torch.Tensor:
        """One token's head_dim vector (NHD, HND and HF engines)."""
        if self.kind == "HF":
            row, col = divmod(block, self.per_row)
            return self.kv[layer][kv][row, head, col * self.layout.spec.block_tokens + token]
        if self.kind == "NHD":
            return self.tensors[layer][kv, block, token, head]
        return self.tensors[layer][kv, block, head, token]


def slot_bytes(fmt: BlockFormat) -> int:
    """Pool block size as an allocator would choose it: the format rounded up to 4 KiB."""
    return -(-fmt.nbytes // 4096) * 4096


POOL_BYTES = slot_bytes(BlockFormat(spec_of("float32"), "HND")) * POOL_SLOTS


@pytest.fixture(params=MODES)
def hosts(request: pytest.FixtureRequest) -> Iterator[tuple[bytearray, Memory, Memory]]:
    """(pool, writer host, reader host), in each coherence mode."""
    pool = bytearray(POOL_BYTES)
    writer, reader = attach(pool, request.param), attach(pool, request.param)
    yield pool, writer, reader
    writer.release()
    reader.release()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_blocks_round_trip_bit_exact_between_hosts(kind: str, dtype: str, hosts: tuple) -> None:
    pool, writer, reader = hosts
    spec = spec_of(dtype)
    src = Engine(kind, spec, num_blocks=6, seed=1)
    dst = Engine(kind, spec, num_blocks=5, seed=None)
    stride = slot_bytes(src.layout.format)
    reader.load(0, len(pool))  # the reader now caches stale (zero) lines of every block
    offsets = [stride * slot for slot in (2, 7, 4)]
    moved = gather_write(writer, src.layout, [5, 0, 3], offsets, block_bytes=stride)
    assert moved == 3 * src.layout.format.nbytes
    for block, off in zip((5, 0, 3), offsets, strict=True):  # the canonical pool block bytes
        canonical = b"".join(src.block(i, block).numpy().tobytes() for i in range(3))
        assert pool[off : off + len(canonical)] == canonical
    scatter_read(reader, dst.layout, [1, 4, 0], offsets, block_bytes=stride)
    for layer in range(spec.num_layers):
        for s, d in ((5, 1), (0, 4), (3, 0)):
            assert torch.equal(dst.block(layer, d), src.block(layer, s))
        for untouched in (2, 3):
            assert not dst.block(layer, untouched).any()


@pytest.mark.parametrize("mode", MODES)
def test_hnd_and_hugging_face_engines_share_pool_blocks(mode: str) -> None:
    spec = spec_of("bfloat16")
    vllm, hf = Engine("HND-view", spec, 4, seed=3), Engine("HF", spec, 4, seed=None)
    stride = slot_bytes(vllm.layout.format)
    pool = bytearray(stride * 4)
    writer, reader = attach(pool, mode), attach(pool, mode)
    offsets = [stride * i for i in range(4)]
    gather_write(writer, vllm.layout, [3, 2, 1, 0], offsets, block_bytes=stride)
    scatter_read(reader, hf.layout, [0, 1, 2, 3], offsets, block_bytes=stride)
    for layer in range(spec.num_layers):
        for b in range(4):
            assert torch.equal(hf.block(layer, b), vllm.block(layer, 3 - b))
    writer.release()
    reader.release()


def test_model_mode_shows_why_reads_invalidate() -> None:
    spec = spec_of()
    src = Engine("NHD", spec, 2, seed=4)
    stride = slot_bytes(src.layout.format)
    pool = bytearray(stride * 2)
    writer, reader = attach(pool, "model"), attach(pool, "model")
    stale = reader.load(0, stride)
    gather_write(writer, src.layout, [1], [0], block_bytes=stride)
    writer.discard()  # non-temporal stores left nothing in the writer's cache to lose
    assert reader.load(0, stride) == stale == bytes(stride)  # a plain load sees stale lines
    dst = Engine("NHD", spec, 1, seed=None)
    scatter_read(reader, dst.layout, [0], [0], block_bytes=stride)
    assert all(torch.equal(dst.block(i, 0), src.block(i, 1)) for i in range(spec.num_layers))
    writer.release()
    reader.release()


class RecordingMemory:
    """Stands in for Memory to count the C calls and capture their tables."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.calls: list[tuple[str, int, np.ndarray]] = []

    def gather_write(self, buffers: list, table: np.ndarray) -> int:
        self.calls.append(("gather_write", len(buffers), table))
        return int(table[:, 3].sum())

    def scatter_read(self, buffers: list, table: np.ndarray) -> int:
        self.calls.append(("scatter_read", len(buffers), table))
        return int(table[:, 3].sum())


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_is_one_call_with_a_uint64_table_covering_each_block(kind: str) -> None:
    spec = spec_of()
    engine = Engine(kind, spec, 6, seed=5)
    fmt = engine.layout.format
    stride = slot_bytes(fmt)
    mem = RecordingMemory(stride * POOL_SLOTS)
    offsets = np.array([stride * s for s in (6, 1, 3)])
    gather_write(mem, engine.layout, [4, 5, 0], offsets, block_bytes=stride)
    scatter_read(mem, engine.layout, [4, 5, 0], offsets, block_bytes=stride)
    assert [c[0] for c in mem.calls] == ["gather_write", "scatter_read"]
    for _, nbuf, table in mem.calls:
        assert nbuf == len(engine.layout.buffers)
        assert table.dtype == np.uint64 and table.flags.c_contiguous and table.shape[1] == 4
        pieces = spec.num_layers * 2 * (spec.num_kv_heads if kind == "HF" else 1)
        assert len(table) == 3 * pieces
        pool = table[np.argsort(table[:, 2])]
        assert np.all(pool[1:, 2] >= pool[:-1, 2] + pool[:-1, 3])  # no pool byte twice
        for off in offsets:
            inside = (pool[:, 2] >= off) & (pool[:, 2] < off + fmt.nbytes)
            assert pool[inside, 3].sum() == fmt.nbytes


def test_runs_adjacent_on_both_sides_are_merged() -> None:
    spec = spec_of()
    one_block = Engine("NHD", spec, 1, seed=6)  # K and V of a layer touch, as in the pool
    table = block_table(one_block.layout, np.array([0]), np.array([0]))
    assert len(table) == spec.num_layers and set(table[:, 3]) == {2 * spec.section_bytes}
    hf_one = Engine("HF", spec, 1, seed=6)  # seq == block_tokens: the heads touch
    assert len(block_table(hf_one.layout, np.array([0]), np.array([0]))) == spec.num_layers * 2


def test_coalesce_merges_only_chains() -> None:
    rows = np.array(
        [[0, 0, 100, 8], [0, 8, 108, 8], [0, 16, 116, 4], [1, 20, 120, 4], [1, 24, 200, 4]],
        dtype=np.uint64,
    )
    merged = coalesce(rows)
    np.testing.assert_array_equal(
        merged, np.array([[0, 0, 100, 20], [1, 20, 120, 4], [1, 24, 200, 4]], dtype=np.uint64)
    )
    assert coalesce(rows[:1]).shape == (1, 4) and coalesce(rows[:0]).shape == (0, 4)


def bad_calls(stride: int) -> list:
    return [
        ("write", [6], [0], stride, ValueError, "engine block id 6 is out of range"),
        ("read", [-1], [0], stride, ValueError, "engine block id -1 is out of range"),
        ("write", [0], [0], stride - 4096, KVLayoutError, "cannot hold one"),
        ("write", [0], [64 + 8], stride, ValueError, "aligned"),
        ("read", [0], [stride * POOL_SLOTS - 64], stride, ValueError, "inside the"),
        ("write", [0, 1], [0], stride, ValueError, "got 1 pool offsets for 2 blocks"),
        ("write", [0, 1], [0, 64], stride, ValueError, "overlap"),
        ("read", [2, 2], [0, stride], stride, ValueError, "appears twice"),
        ("write", [0.0], [0], stride, ValueError, "1-D sequence of ints"),
        ("read", [0], [[0]], stride, ValueError, "1-D sequence of ints"),
    ]


@pytest.mark.parametrize("case", range(len(bad_calls(0))))
def test_bad_input_is_refused_before_a_byte_moves(case: int) -> None:
    spec = spec_of()
    engine = Engine("NHD", spec, 6, seed=7)
    stride = slot_bytes(engine.layout.format)
    what, ids, offsets, block_bytes, error, match = bad_calls(stride)[case]
    pool = bytearray(b"\xa5" * stride * POOL_SLOTS)
    before = [t.clone() for t in engine.tensors]
    mem = attach(pool, "native")
    call = gather_write if what == "write" else scatter_read
    with pytest.raises(error, match=match):
        call(mem, engine.layout, ids, offsets, block_bytes=block_bytes)
    mem.release()
    assert pool == bytearray(b"\xa5" * stride * POOL_SLOTS)
    unchanged = zip(before, engine.tensors, strict=True)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in unchanged)


def top_k(spec: KVSpec, tokens: int, k: int, seed: int, runs: bool) -> np.ndarray:
    """Chosen positions per (layer, head): scattered, or in short consecutive runs."""
    rng = np.random.default_rng(seed)
    shape = (spec.num_layers, spec.num_kv_heads)
    if not runs:
        return np.sort(rng.permuted(np.tile(np.arange(tokens), (*shape, 1)), axis=-1)[..., :k])
    starts = rng.integers(0, tokens - k, size=shape)
    return starts[..., None] + np.arange(k)


@pytest.mark.parametrize("runs", [False, True], ids=["scattered", "runs"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind", ["NHD", "HND", "HF"])
def test_sparse_fetch_gets_exactly_the_chosen_fragments(
    kind: str, dtype: str, hosts: tuple, runs: bool
) -> None:
    pool, writer, reader = hosts
    spec = spec_of(dtype)
    engine = Engine(kind, spec, 6, seed=8)
    fmt = engine.layout.format
    stride = slot_bytes(fmt)
    sequence = [5, 0, 3, 1]  # the request's engine blocks, in token order
    offsets = np.array([stride * s for s in (7, 2, 0, 5)])
    gather_write(writer, engine.layout, sequence, offsets, block_bytes=stride)
    reader.load(0, len(pool))
    positions = top_k(spec, tokens=4 * spec.block_tokens, k=5, seed=9, runs=runs)
    out = torch.zeros(sparse_shape(fmt, positions), dtype=getattr(torch, dtype))
    moved = sparse_fetch(
        reader, fmt, offsets, positions, out.view(torch.uint8).numpy(), block_bytes=stride
    )
    assert moved == out.numel() * out.element_size()
    for layer, kv, head, j in np.ndindex(*out.shape[:4]):
        block, token = divmod(int(positions[layer, head, j]), spec.block_tokens)
        expect = engine.vector(sequence[block], layer, kv, token, head)
        assert torch.equal(out[layer, kv, head, j].view(torch.uint8), expect.view(torch.uint8))


def test_sparse_table_merges_consecutive_tokens_in_head_major_blocks() -> None:
    spec = spec_of()
    positions = np.tile(np.arange(3, 8), (spec.num_layers, spec.num_kv_heads, 1))
    offsets = np.array([0])
    fragments = spec.num_layers * 2 * spec.num_kv_heads * 5
    hnd = sparse_table(BlockFormat(spec, "HND"), offsets, positions)
    nhd = sparse_table(BlockFormat(spec, "NHD"), offsets, positions)
    assert len(nhd) == fragments  # consecutive tokens of one head are H vectors apart
    assert len(hnd) == fragments // 5
    assert hnd[:, 3].sum() == nhd[:, 3].sum() == fragments * spec.head_dim * 2


def test_sparse_fetch_is_one_call() -> None:
    spec = spec_of()
    fmt = BlockFormat(spec, "NHD")
    mem = RecordingMemory(slot_bytes(fmt) * 2)
    positions = top_k(spec, 32, 4, seed=1, runs=False)
    out = np.zeros(int(np.prod(sparse_shape(fmt, positions))) * 2, np.uint8)
    sparse_fetch(mem, fmt, [0, slot_bytes(fmt)], positions, out, block_bytes=slot_bytes(fmt))
    assert len(mem.calls) == 1 and mem.calls[0][:2] == ("scatter_read", 1)


def test_sparse_fetch_refuses_bad_input() -> None:
    spec = spec_of()
    fmt = BlockFormat(spec, "HND")
    stride = slot_bytes(fmt)
    mem = RecordingMemory(stride * 2)
    good = top_k(spec, 32, 4, seed=2, runs=False)
    out = np.zeros(int(np.prod(sparse_shape(fmt, good))) * 2, np.uint8)
    offsets = [0, stride]
    with pytest.raises(ValueError, match=r"positions must be in 0\.\.31"):
        sparse_fetch(mem, fmt, offsets, good + 16, out, block_bytes=stride)
    with pytest.raises(ValueError, match=r"int array \[3, 2, k\]"):
        sparse_fetch(mem, fmt, offsets, good[:, :1], out, block_bytes=stride)
    with pytest.raises(ValueError, match=r"int array \[3, 2, k\]"):
        sparse_fetch(mem, fmt, offsets, good.astype(float), out, block_bytes=stride)
    with pytest.raises(ValueError, match="writable contiguous buffer"):
        sparse_fetch(mem, fmt, offsets, good, out[:-1], block_bytes=stride)
    with pytest.raises(ValueError, match="writable contiguous buffer"):
        sparse_fetch(mem, fmt, offsets, good, bytes(out.size), block_bytes=stride)
    with pytest.raises(KVLayoutError, match="CPU_ATTN"):
        sparse_fetch(mem, BlockFormat(spec, "CPU"), offsets, good, out, block_bytes=stride)
    with pytest.raises(KVLayoutError, match="cannot hold one"):
        sparse_fetch(mem, fmt, offsets, good, out, block_bytes=fmt.nbytes - 1)
    assert mem.calls == []
