"""KV layout descriptors and the pool block format: geometry and validation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from beluga.errors import KVLayoutError
from beluga.transfer import BlockFormat, KVLayout, KVSpec, host_bytes

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_tokens=4, dtype="float32")
NB = 3  # engine blocks per vLLM cache


def numbered(shape: tuple[int, ...], layer: int) -> torch.Tensor:
    """A float32 tensor whose every element is unique across layers."""
    n = int(np.prod(shape))
    return (torch.arange(n, dtype=torch.float32) + layer * 100_000).reshape(shape)


def vllm_caches(order: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(registered tensors, tensors indexed [kv, block, token, head]) for each vLLM form."""
    bs, h, d = SPEC.block_tokens, SPEC.num_kv_heads, SPEC.head_dim
    if order == "NHD":
        regs = [numbered((2, NB, bs, h, d), layer) for layer in range(SPEC.num_layers)]
        return regs, regs
    raw = [numbered((2, NB, h, bs, d), layer) for layer in range(SPEC.num_layers)]
    views = [t.permute(0, 1, 3, 2, 4) for t in raw]  # vLLM's logical NHD view of HND memory
    return (raw if order == "HND" else views), views


def vector_at(layout: KVLayout, buffer: int, offset: int) -> np.ndarray:
    return layout.buffers[buffer][offset : offset + SPEC.head_dim * 4].view(np.float32)


def all_coordinates(num_blocks: int) -> itertools.product:
    s = SPEC
    return itertools.product(
        range(num_blocks),
        range(s.num_layers),
        range(2),
        range(s.block_tokens),
        range(s.num_kv_heads),
    )


@pytest.mark.parametrize("order", ["NHD", "HND", "HND-view"])
def test_flash_attention_locate_agrees_with_tensor_indexing(order: str) -> None:
    regs, logical = vllm_caches(order)
    layout = KVLayout.flash_attention(SPEC, regs, order[:3])
    assert layout.num_blocks == NB and layout.format == BlockFormat(SPEC, order[:3])
    coords = np.array(list(all_coordinates(NB))).T
    buffers, offsets = layout.locate(*coords)
    for (block, layer, kv, token, head), buf, off in zip(coords.T, buffers, offsets, strict=True):
        expect = logical[layer][kv, block, token, head].numpy()
        np.testing.assert_array_equal(vector_at(layout, buf, off), expect)


def test_hugging_face_locate_maps_blocks_to_batch_rows_and_sequence_slices() -> None:
    bs = SPEC.block_tokens
    shape = (2, SPEC.num_kv_heads, 3 * bs + 1, SPEC.head_dim)  # a partial last block
    kv = [(numbered(shape, 2 * i), numbered(shape, 2 * i + 1)) for i in range(SPEC.num_layers)]
    layout = KVLayout.hugging_face(SPEC, kv)
    assert layout.num_blocks == 6 and layout.format == BlockFormat(SPEC, "HND")
    coords = np.array(list(all_coordinates(6))).T
    buffers, offsets = layout.locate(*coords)
    for (block, layer, which, token, head), buf, off in zip(
        coords.T, buffers, offsets, strict=True
    ):
        row, col = divmod(int(block), 3)
        expect = kv[layer][which][row, head, col * bs + token].numpy()
        np.testing.assert_array_equal(vector_at(layout, buf, off), expect)


def test_cpu_attention_moves_whole_blocks_only() -> None:
    s = SPEC
    caches = [numbered((2, NB, s.num_kv_heads, s.block_tokens, s.head_dim), i) for i in range(3)]
    layout = KVLayout.cpu_attention(SPEC, caches)
    assert layout.format.order == "CPU" and not layout.format.token_addressable
    with pytest.raises(ValueError, match="packed for the CPU"):
        layout.locate(0, 0, 0, 0, 0)


def test_buffers_share_memory_with_the_registered_tensors() -> None:
    regs, _ = vllm_caches("HND-view")
    layout = KVLayout.flash_attention(SPEC, regs, "HND")
    layout.buffers[1][:4] = np.frombuffer(np.float32(-7.0).tobytes(), np.uint8)
    assert regs[1][0, 0, 0, 0, 0].item() == -7.0


def test_bf16_tensors_become_byte_buffers_without_a_copy() -> None:
    t = torch.zeros(4, 8, dtype=torch.bfloat16)
    b = host_bytes(t)
    assert b.dtype == np.uint8 and b.size == 64
    b[:2] = torch.tensor([1.5], dtype=torch.bfloat16).view(torch.uint8).numpy()
    assert t[0, 0].item() == 1.5


@pytest.mark.parametrize("dtype,itemsize", [("float16", 2), ("bfloat16", 2), ("float32", 4)])
def test_pool_block_size_follows_the_model_shape(dtype: str, itemsize: int) -> None:
    spec = KVSpec(num_layers=28, num_kv_heads=4, head_dim=128, block_tokens=16, dtype=dtype)
    for order in ("NHD", "HND", "CPU"):
        assert BlockFormat(spec, order).nbytes == 28 * 2 * 16 * 4 * 128 * itemsize


def test_fragment_offsets_follow_the_inner_order() -> None:
    s = SPEC
    nhd, hnd = BlockFormat(s, "NHD"), BlockFormat(s, "HND")
    section = s.section_bytes
    # layer 1, V, token 2, head 1
    assert nhd.fragment_offsets(1, 1, 2, 1) == 3 * section + (2 * 2 + 1) * 8 * 4
    assert hnd.fragment_offsets(1, 1, 2, 1) == 3 * section + (1 * 4 + 2) * 8 * 4
    with pytest.raises(ValueError, match="CPU_ATTN"):
        BlockFormat(s, "CPU").fragment_offsets(0, 0, 0, 0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": 0},
        {"head_dim": -1},
        {"block_tokens": True},
        {"num_kv_heads": 2.0},
        {"dtype": "int8"},
    ],
)
def test_kvspec_refuses_nonsense(kwargs: dict[str, object]) -> None:
    base = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8}
    with pytest.raises(ValueError, match="KVSpec"):
        KVSpec(**{**base, **kwargs})


def test_block_format_refuses_an_unknown_order() -> None:
    with pytest.raises(ValueError, match="order"):
        BlockFormat(SPEC, "THD")


def nhd(nb: int = NB, d: int = SPEC.head_dim) -> torch.Tensor:
    return torch.zeros(2, nb, SPEC.block_tokens, SPEC.num_kv_heads, d)


@pytest.mark.parametrize(
    "caches,order,match",
    [
        ([nhd(), nhd()], "NHD", "got 2 per-layer"),
        ([nhd(), nhd(), nhd(d=16)], "NHD", "layer 2 KV cache has shape"),
        ([nhd(), nhd(), nhd(nb=4)], "NHD", "layer 2 KV cache has shape .* 3 blocks"),
        ([nhd(), nhd(), nhd().to(torch.float16)], "NHD", "layer 2 KV cache is torch.float16"),
        ([nhd()[1], nhd(), nhd()], "NHD", "5-D with K and V first"),
        ([nhd(nb=6)[:, ::2]] * 3, "NHD", "strides"),
        ([nhd()] * 3, "HND", "needs .* in memory"),  # NHD memory is not HND
        ([nhd().to("meta")] * 3, "NHD", "on meta"),
    ],
)
def test_flash_attention_refuses_mismatched_tensors(
    caches: list[torch.Tensor], order: str, match: str
) -> None:
    with pytest.raises(KVLayoutError, match=match):
        KVLayout.flash_attention(SPEC, caches, order)


def test_cpu_attention_refuses_nhd_tensors() -> None:
    with pytest.raises(KVLayoutError, match="CPU_ATTN"):
        KVLayout.cpu_attention(SPEC, [nhd()] * 3)


def test_flash_attention_refuses_an_unknown_order() -> None:
    with pytest.raises(ValueError, match="'NHD' or 'HND'"):
        KVLayout.flash_attention(SPEC, [nhd()] * 3, "THD")


def hf_pair(seq: int = 8, heads: int = 2, dtype: torch.dtype = torch.float32) -> tuple:
    return (torch.zeros(1, heads, seq, 8, dtype=dtype), torch.zeros(1, heads, seq, 8, dtype=dtype))


@pytest.mark.parametrize(
    "kv,match",
    [
        ([hf_pair()] * 2, "got 2 per-layer"),
        ([hf_pair(heads=4)] * 3, "layer 0 key has shape"),
        ([hf_pair(), hf_pair(), (hf_pair()[0], hf_pair(seq=12)[1])], "layer 2 value has shape"),
        ([hf_pair(), hf_pair(dtype=torch.bfloat16), hf_pair()], "layer 1 key is torch.bfloat16"),
        ([hf_pair(), hf_pair(), hf_pair()[:1]], "pair"),
        ([(torch.zeros(1, 8, 2, 8).transpose(1, 2),) * 2] * 3, "not contiguous"),
    ],
)
def test_hugging_face_refuses_mismatched_tensors(kv: list, match: str) -> None:
    with pytest.raises(KVLayoutError, match=match):
        KVLayout.hugging_face(SPEC, kv)


def test_locate_refuses_out_of_range_coordinates() -> None:
    layout = KVLayout.flash_attention(SPEC, [nhd()] * 3)
    with pytest.raises(ValueError, match="engine block id 3 is out of range"):
        layout.locate(3, 0, 0, 0, 0)
    with pytest.raises(ValueError, match=r"token must be in 0\.\.3"):
        layout.locate(0, 0, 0, 4, 0)
    with pytest.raises(ValueError, match=r"kv must be in 0\.\.1"):
        layout.locate(0, 0, 2, 0, 0)
