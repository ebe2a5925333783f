"""vLLM's 4-D per-layer KV views ([nb, H, bs, 2*D]) write the same pool blocks as the 5-D caches.

Newer vLLM (the CPU build 0.32 and the 0.33 release) registers one view per
layer with each token's K and V side by side in the last axis.  A pool block
must not depend on which generation wrote it: these tests fill a 5-D cache and
a 4-D view with the same K and V, write both, and compare the bytes.
"""

from __future__ import annotations

import pytest
import torch

from beluga.coherence import attach
from beluga.errors import KVLayoutError
from beluga.transfer import KVLayout, KVSpec, gather_write, scatter_read

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4, dtype="bfloat16")
NB = 5


def five_d(kind: str, gen: torch.Generator) -> list[torch.Tensor]:
    """Old-style caches: [2, nb, H, bs, D] (CPU, HND) or [2, nb, bs, H, D] (NHD)."""
    bs, h, d = SPEC.block_tokens, SPEC.num_kv_heads, SPEC.head_dim
    shape = (2, NB, bs, h, d) if kind == "NHD" else (2, NB, h, bs, d)
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(SPEC.num_layers)]


def four_d(kind: str, old: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same K and V as vLLM's 4-D views: logical [nb, H, bs, 2*D]."""
    views = []
    for t in old:
        hnd = t if kind != "NHD" else t.permute(0, 1, 3, 2, 4)  # [2, nb, H, bs, D]
        logical = torch.cat([hnd[0], hnd[1]], dim=-1)  # [nb, H, bs, 2D]
        if kind == "NHD":  # memory [nb, bs, H, 2D], registered as the logical view
            logical = logical.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        elif kind == "CPU":  # memory [nb, H, (K slab | V slab)], shaped [nb, H, bs, 2D]
            logical = torch.cat([hnd[0], hnd[1]], dim=2).reshape(logical.shape)
        views.append(logical)
    return views


def layout(kind: str, caches: list[torch.Tensor]) -> KVLayout:
    if kind == "CPU":
        return KVLayout.cpu_attention(SPEC, caches)
    return KVLayout.flash_attention(SPEC, caches, kind)


@pytest.mark.parametrize("mode", ["native", "model"])
@pytest.mark.parametrize("kind", ["CPU", "HND", "NHD"])
def test_four_d_views_write_and_read_the_same_pool_blocks(kind: str, mode: str) -> None:
    old = five_d(kind, torch.Generator().manual_seed(7))
    new = four_d(kind, old)
    old_layout, new_layout = layout(kind, old), layout(kind, new)
    assert new_layout.format == old_layout.format
    stride = -(-old_layout.format.nbytes // 64) * 64
    pool = bytearray(stride * 4)
    writer, reader = attach(pool, mode), attach(pool, mode)
    gather_write(writer, old_layout, [3, 1], [0, stride], block_bytes=stride)
    gather_write(writer, new_layout, [3, 1], [2 * stride, 3 * stride], block_bytes=stride)
    assert pool[: 2 * stride] == pool[2 * stride :]
    back = [torch.zeros_like(t) for t in new]
    scatter_read(reader, layout(kind, back), [0, 4], [0, stride], block_bytes=stride)
    for got, want in zip(back, new, strict=True):
        assert torch.equal(got[0], want[3]) and torch.equal(got[4], want[1])
        assert not got[1:4].any()
    writer.release()
    reader.release()


def test_four_d_views_are_refused_when_the_spec_or_order_is_wrong() -> None:
    new = four_d("HND", five_d("HND", torch.Generator().manual_seed(1)))
    with pytest.raises(KVLayoutError, match="NHD views"):
        KVLayout.flash_attention(SPEC, new, "NHD")  # HND memory registered as NHD
    wide = KVSpec(2, 2, 16, 4, "bfloat16")
    with pytest.raises(KVLayoutError, match="CPU_ATTN"):
        KVLayout.cpu_attention(wide, new)
    with pytest.raises(KVLayoutError, match="every layer must be a 4-D view"):
        KVLayout.cpu_attention(SPEC, [new[0], new[1][:3]])
