"""A CPU engine over a real transformers causal LM that reuses cached KV prefixes.

This is the model half of serving.  :meth:`ModelEngine.prefill` takes a
prompt and, optionally, the KV of its first ``n`` tokens (``n`` a multiple of
``block_tokens``, the tokens of an engine block, read back from the pool) and
computes only the remaining tokens, at the positions they have in the whole
prompt so that RoPE and the causal mask match a full recomputation.  The model
is a real Qwen2 or Llama implementation (grouped-query attention, RoPE,
RMSNorm) with seeded random weights built from a config, so nothing is
downloaded; what matters here is that the logits with a cached prefix equal
full recomputation, not the text.

KV moves between the engine and the pool in the Hugging Face layout
(``[1, kv_heads, tokens, head_dim]`` per layer, the HND block format):

- :meth:`ModelEngine.kv_layout` describes a prefill's KV (or a prefix) for
  :func:`beluga.transfer.block_moves`, whose tables the store's block calls
  (``KVStore.write_blocks`` / ``read_blocks``) move and checksum;
- :meth:`ModelEngine.empty_prefix` is a fresh cached prefix of whole engine
  blocks to read pool values into, for :meth:`ModelEngine.prefill`.

After a prefill, :meth:`ModelEngine.generate` decodes greedily over the same
KV cache, one token per forward pass, as a decode engine does once it holds
the prompt's KV (read from the pool, or computed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from beluga.kv.identity import ModelIdentity
from beluga.transfer import KVLayout, KVSpec

FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
}

KV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only model with grouped-query attention."""

    family: str = "qwen2"
    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 512
    vocab_size: int = 1024
    max_positions: int = 4096
    block_tokens: int = 16  # tokens per engine block

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"model family must be one of {sorted(FAMILIES)}, not {self.family!r}")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        self.kv_spec()  # the remaining dimensions are checked there

    def kv_spec(self, dtype: str = "float32") -> KVSpec:
        """The KV shape of this model's engine blocks, for a KV cache of ``dtype``."""
        return KVSpec(self.num_layers, self.num_kv_heads, self.head_dim, self.block_tokens, dtype)


QWEN2_7B = ModelShape(
    num_layers=28,
    hidden_size=3584,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    intermediate_size=18944,
    vocab_size=152064,
    max_positions=32768,
)
"""Qwen2-7B's shape, for benchmarks: its KV spec is real, but the model is never built here."""


@dataclass
class Prefill:
    """What one prefill produced."""

    logits: torch.Tensor  # [computed tokens, vocab]: one row per token not in the prefix
    kv: KV  # per layer (key, value), each [1, kv_heads, all tokens, head_dim]
    num_cached: int  # tokens whose KV came from the cached prefix
    block_tokens: int  # tokens per engine block

    @property
    def num_full_blocks(self) -> int:
        """Complete engine blocks of the prompt: the ones that can be saved to the pool."""
        return self.kv[0][0].shape[2] // self.block_tokens


class ModelEngine:
    """A seeded random-weight causal LM in float32, with prefix reuse.

    It runs on the CPU, or on ``device`` (a CUDA device): its KV cache then
    lives there and moves through a :class:`beluga.transfer.gpu.GpuPool`.
    The weights are drawn on the CPU either way, so one seed is one model,
    and :attr:`identity` (which keys its blocks in the pool) tells seeds and
    families apart.
    """

    def __init__(
        self, shape: ModelShape | None = None, *, seed: int = 0, device: str = "cpu"
    ) -> None:
        self.shape = shape or ModelShape()
        self.device = torch.device(device)
        self.kv_spec = self.shape.kv_spec("float32")
        config_cls, model_cls = FAMILIES[self.shape.family]
        s = self.shape
        self.config = config_cls(
            vocab_size=s.vocab_size,
            hidden_size=s.hidden_size,
            intermediate_size=s.intermediate_size,
            num_hidden_layers=s.num_layers,
            num_attention_heads=s.num_heads,
            num_key_value_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            max_position_embeddings=s.max_positions,
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model: PreTrainedModel = model_cls(self.config)
        self.model = model.to(torch.float32).to(self.device).eval()

    @cached_property
    def identity(self) -> ModelIdentity:
        """The model's identity for block keys: a fingerprint of its config and weights."""
        with torch.no_grad():
            return ModelIdentity.of_module(self.model, name=f"random-{self.shape.family}")

    @torch.no_grad()
    def prefill(self, token_ids: Sequence[int], cached_prefix_kv: KV | None = None) -> Prefill:
        """Logits of the tokens after the cached prefix, and the KV of every token.

        ``cached_prefix_kv`` is the per-layer (key, value) of the first ``n``
        tokens, each ``[1, kv_heads, n, head_dim]`` float32, ``n`` a multiple of
        ``block_tokens`` and smaller than the prompt (the last token is always
        computed: its logits choose the next token).
        """
        ids = self._check_tokens(token_ids).to(self.device)
        cached = 0 if cached_prefix_kv is None else self._check_prefix(cached_prefix_kv, len(ids))
        cache = DynamicCache(cached_prefix_kv, config=self.config)
        positions = torch.arange(cached, len(ids), device=self.device).unsqueeze(0)
        out = self.model(
            input_ids=ids[cached:].unsqueeze(0), position_ids=positions, cache=cache, use_cache=True
        )
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        return Prefill(out.logits[0], kv, cached, self.shape.block_tokens)

    @torch.no_grad()
    def generate(self, prefill: Prefill, max_tokens: int) -> list[int]:
        """``max_tokens`` output tokens, greedy: the first picked by the prefill's last logits,
        each next one by a forward pass of the one before over the KV cache.

        The prefill's own KV is left as it is (the cache grows into new tensors).
        """
        prompt_tokens = prefill.kv[0][0].shape[2]
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, not {max_tokens}")
        if prompt_tokens + max_tokens - 1 > self.shape.max_positions:
            raise ValueError(
                f"{prompt_tokens} prompt tokens and {max_tokens} output tokens exceed the "
                f"model's {self.shape.max_positions} positions"
            )
        cache = DynamicCache(prefill.kv, config=self.config)
        token = int(prefill.logits[-1].argmax())
        output = [token]
        for position in range(prompt_tokens, prompt_tokens + max_tokens - 1):
            out = self.model(
                input_ids=torch.tensor([[token]], device=self.device),
                position_ids=torch.tensor([[position]], device=self.device),
                cache=cache,
                use_cache=True,
            )
            token = int(out.logits[0, -1].argmax())
            output.append(token)
        return output

    def kv_layout(self, kv: KV) -> KVLayout:
        """The layout of a prefill's KV, or of a prefix, for moving whole blocks."""
        return KVLayout.hugging_face(self.kv_spec, kv)

    def empty_prefix(self, blocks: int) -> KV:
        """A cached prefix of ``blocks`` whole engine blocks to read pool values into."""
        s = self.kv_spec
        shape = (1, s.num_kv_heads, blocks * s.block_tokens, s.head_dim)
        return [
            (
                torch.empty(shape, dtype=torch.float32, device=self.device),
                torch.empty(shape, dtype=torch.float32, device=self.device),
            )
            for _ in range(s.num_layers)
        ]

    def _check_tokens(self, token_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(token_ids)
        if ids.ndim != 1 or not len(ids) or ids.is_floating_point() or ids.is_complex():
            raise ValueError("token_ids must be a non-empty 1-D sequence of ints")
        if ids.min() < 0 or ids.max() >= self.shape.vocab_size:
            raise ValueError(f"token ids must be in 0..{self.shape.vocab_size - 1}")
        if len(ids) > self.shape.max_positions:
            raise ValueError(
                f"{len(ids)} tokens exceed the model's {self.shape.max_positions} positions"
            )
        return ids.to(torch.long)

    def _check_prefix(self, prefix: KV, num_tokens: int) -> int:
        """The number of cached tokens, once the prefix is known to fit this model and prompt."""
        KVLayout.hugging_face(self.kv_spec, prefix)  # shapes, dtype, layers, contiguity
        batch, _, cached, _ = prefix[0][0].shape
        bs = self.shape.block_tokens
        if batch != 1 or cached % bs or cached >= num_tokens:
            raise ValueError(
                f"a cached prefix must be [1, kv_heads, n, head_dim] with n a multiple of {bs} "
                f"and below the prompt's {num_tokens} tokens, got batch {batch} and n={cached}; "
                "drop the last cached block when the whole prompt is cached"
            )
        return cached
