"""The model engine: a cached prefix read back through pool blocks gives full-recompute logits.

Two engines with the same seed stand for two hosts serving one model; each
has its own Memory on one shared pool, so under the non-coherent model the
reader's KV really comes through gather-write, the pool and scatter-read.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from beluga.coherence import Memory, attach
from beluga.errors import KVLayoutError
from beluga.serving.model import QWEN2_7B, ModelEngine, ModelShape
from beluga.transfer import BlockFormat, gather_write, scatter_read

TOLERANCE = 1e-4
PROMPT_TOKENS = 75  # four full blocks and a partial one
SLOTS = 8


@pytest.fixture(scope="module")
def engines() -> tuple[ModelEngine, ModelEngine]:
    return ModelEngine(seed=11), ModelEngine(seed=11)


def prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    return np.random.default_rng(seed).integers(0, ModelShape().vocab_size, n).tolist()


def slot_bytes(engine: ModelEngine) -> int:
    return -(-BlockFormat(engine.kv_spec, "HND").nbytes // 4096) * 4096


@pytest.fixture(params=["native", "model"])
def hosts(
    request: pytest.FixtureRequest, engines: tuple[ModelEngine, ModelEngine]
) -> Iterator[tuple[bytearray, Memory, Memory]]:
    pool = bytearray(slot_bytes(engines[0]) * SLOTS)
    writer, reader = attach(pool, request.param), attach(pool, request.param)
    yield pool, writer, reader
    writer.release()
    reader.release()


def save_blocks(
    engine: ModelEngine, mem: Memory, kv: object, offsets: list[int], *, first: int = 0, stride: int
) -> None:
    """The raw move of a prefill's blocks ``first ..`` to pool offsets (no store here)."""
    blocks = np.arange(first, first + len(offsets))
    gather_write(mem, engine.kv_layout(kv), blocks, offsets, block_bytes=stride)


def load_prefix(engine: ModelEngine, mem: Memory, offsets: list[int], *, stride: int) -> object:
    """A fresh prefix of whole blocks read raw from pool offsets."""
    prefix = engine.empty_prefix(len(offsets))
    blocks = np.arange(len(offsets))
    scatter_read(mem, engine.kv_layout(prefix), blocks, offsets, block_bytes=stride)
    return prefix


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_cached_prefix_logits_equal_full_recomputation(
    engines: tuple[ModelEngine, ModelEngine], hosts: tuple
) -> None:
    a, b = engines
    pool, writer, reader = hosts
    stride = slot_bytes(a)
    tokens = prompt(1)
    full = a.prefill(tokens)
    assert full.logits.shape == (PROMPT_TOKENS, ModelShape().vocab_size)
    assert full.num_full_blocks == 4
    offsets = [stride * s for s in (6, 1, 4, 0)]
    reader.load(0, len(pool))  # stale lines: only an invalidating read sees the blocks
    save_blocks(a, writer, full.kv, offsets, stride=stride)
    reference = b.prefill(tokens)  # host B's own full recomputation
    for blocks in (1, 2, 3, 4):
        cached = blocks * 16
        prefix = load_prefix(b, reader, offsets[:blocks], stride=stride)
        for (pk, pv), (fk, fv) in zip(prefix, full.kv, strict=True):
            assert torch.equal(pk, fk[:, :, :cached]) and torch.equal(pv, fv[:, :, :cached])
        out = b.prefill(tokens, prefix)
        assert out.num_cached == cached and out.logits.shape[0] == PROMPT_TOKENS - cached
        assert max_diff(out.logits, reference.logits[cached:]) <= TOLERANCE
        for (ok, ov), (rk, rv) in zip(out.kv, reference.kv, strict=True):
            assert max(max_diff(ok, rk), max_diff(ov, rv)) <= TOLERANCE


def test_a_shared_prefix_serves_a_different_continuation(
    engines: tuple[ModelEngine, ModelEngine], hosts: tuple
) -> None:
    a, b = engines
    _, writer, reader = hosts
    stride = slot_bytes(a)
    first = prompt(2)
    second = first[:48] + prompt(3, 30)
    saved = a.prefill(first)
    offsets = [stride * s for s in (3, 5, 2)]
    save_blocks(a, writer, saved.kv, offsets, stride=stride)
    out = b.prefill(second, load_prefix(b, reader, offsets, stride=stride))
    assert max_diff(out.logits, b.prefill(second).logits[48:]) <= TOLERANCE


def test_blocks_saved_from_later_in_the_prompt_land_where_asked(
    engines: tuple[ModelEngine, ModelEngine], hosts: tuple
) -> None:
    a, b = engines
    _, writer, reader = hosts
    stride = slot_bytes(a)
    tokens = prompt(4)
    full = a.prefill(tokens)
    save_blocks(a, writer, full.kv, [0, stride], stride=stride)
    save_blocks(a, writer, full.kv, [2 * stride], first=2, stride=stride)
    out = b.prefill(tokens, load_prefix(b, reader, [0, stride, 2 * stride], stride=stride))
    assert max_diff(out.logits, full.logits[48:]) <= TOLERANCE


def test_a_wrong_prefix_is_visible_in_the_logits(engines: tuple[ModelEngine, ModelEngine]) -> None:
    """The tolerance discriminates: another prompt's KV gives different logits."""
    a, _ = engines
    tokens = prompt(5)
    other = a.prefill(prompt(6))
    prefix = [(k[:, :, :32].contiguous(), v[:, :, :32].contiguous()) for k, v in other.kv]
    out = a.prefill(tokens, prefix)
    assert max_diff(out.logits, a.prefill(tokens).logits[32:]) > 100 * TOLERANCE


def test_prefill_leaves_the_cached_prefix_untouched(
    engines: tuple[ModelEngine, ModelEngine],
) -> None:
    a, _ = engines
    full = a.prefill(prompt(7))
    prefix = [(k[:, :, :16].clone(), v[:, :, :16].clone()) for k, v in full.kv]
    before = [(k.clone(), v.clone()) for k, v in prefix]
    a.prefill(prompt(7), prefix)
    assert all(
        torch.equal(k, bk) and torch.equal(v, bv)
        for (k, v), (bk, bv) in zip(prefix, before, strict=True)
    )


def test_llama_family_reuses_prefixes_too() -> None:
    shape = ModelShape(family="llama", num_layers=2, num_heads=4, num_kv_heads=1, hidden_size=128)
    engine = ModelEngine(shape, seed=3)
    tokens = prompt(8, 40)
    full = engine.prefill(tokens)
    prefix = [(k[:, :, :32].contiguous(), v[:, :, :32].contiguous()) for k, v in full.kv]
    assert max_diff(engine.prefill(tokens, prefix).logits, full.logits[32:]) <= TOLERANCE


def test_the_seed_fixes_the_weights() -> None:
    small = ModelShape(num_layers=1)
    tokens = prompt(9, 20)
    one, same, other = (ModelEngine(small, seed=s).prefill(tokens).logits for s in (1, 1, 2))
    assert torch.equal(one, same) and not torch.equal(one, other)


def cut(kv: list, n: int) -> list:
    return [(k[:, :, :n].contiguous(), v[:, :, :n].contiguous()) for k, v in kv]


def test_prefill_refuses_bad_prompts_and_prefixes(
    engines: tuple[ModelEngine, ModelEngine],
) -> None:
    a, _ = engines
    tokens = prompt(10, 40)
    kv = a.prefill(tokens).kv
    with pytest.raises(ValueError, match="multiple of 16"):
        a.prefill(tokens, cut(kv, 20))
    with pytest.raises(ValueError, match="drop the last cached block"):
        a.prefill(tokens[:32], cut(kv, 32))
    with pytest.raises(ValueError, match="batch 2"):
        a.prefill(tokens, [(torch.cat([k, k]), torch.cat([v, v])) for k, v in cut(kv, 16)])
    with pytest.raises(KVLayoutError, match="got 3 per-layer"):
        a.prefill(tokens, cut(kv, 16)[:3])
    with pytest.raises(KVLayoutError, match=r"torch\.float16"):
        a.prefill(tokens, [(k.half(), v.half()) for k, v in cut(kv, 16)])
    with pytest.raises(ValueError, match="token ids must be in"):
        a.prefill([0, ModelShape().vocab_size])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        a.prefill([])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        a.prefill([1.5, 2.0])
    with pytest.raises(ValueError, match="exceed"):
        ModelEngine(ModelShape(num_layers=1, max_positions=8)).prefill(list(range(9)))


def test_model_shapes_are_checked_and_describe_their_kv() -> None:
    with pytest.raises(ValueError, match="family"):
        ModelShape(family="gpt2")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelShape(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="head_dim"):
        ModelShape(head_dim=0)
    spec = QWEN2_7B.kv_spec("bfloat16")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_tokens) == (
        28,
        4,
        128,
        16,
    )
    assert BlockFormat(spec, "HND").nbytes == 28 * 2 * 16 * 4 * 128 * 2


def hugging_face_greedy(engine: ModelEngine, tokens: list[int], n: int) -> list[int]:
    """Transformers' own greedy generation: the reference the decode loop must match."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = engine.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
        )
    return out[0, len(tokens) :].tolist()


def test_greedy_decoding_matches_transformers_with_or_without_a_cached_prefix(
    engines: tuple[ModelEngine, ModelEngine],
) -> None:
    a, b = engines
    tokens = prompt(11)
    want = hugging_face_greedy(a, tokens, 6)
    full = a.prefill(tokens)
    before = [(k.clone(), v.clone()) for k, v in full.kv]
    assert a.generate(full, 6) == want
    prefix = cut(full.kv, 64)
    assert b.generate(b.prefill(tokens, prefix), 6) == want  # KV from another host's prefill
    assert b.generate(b.prefill(tokens, prefix), 1) == want[:1]
    assert all(  # the prefill's KV is still the prompt's alone
        torch.equal(k, bk) and torch.equal(v, bv)
        for (k, v), (bk, bv) in zip(full.kv, before, strict=True)
    )


def test_generate_refuses_no_tokens_and_too_many(engines: tuple[ModelEngine, ModelEngine]) -> None:
    a, _ = engines
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        a.generate(a.prefill(prompt(12, 20)), 0)
    short = ModelEngine(ModelShape(num_layers=1, max_positions=24))
    with pytest.raises(ValueError, match="exceed the model's 24 positions"):
        short.generate(short.prefill(prompt(12, 20)), 6)
