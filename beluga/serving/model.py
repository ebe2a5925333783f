"""An engine over a real transformers causal LM that reuses cached KV prefixes.

This is the model half of serving.  :meth:`ModelEngine.prefill` takes a
prompt and, optionally, the KV of its first ``n`` tokens (``n`` a multiple of
``block_tokens``, the tokens of an engine block, read back from the pool) and
computes only the remaining tokens, at the positions they have in the whole
prompt so that RoPE and the causal mask match a full recomputation.  The model
is a real Qwen2 or Llama implementation (grouped-query attention, RoPE,
RMSNorm) with seeded random weights built from a config, so nothing is
downloaded; what matters here is that the logits with a cached prefix equal
full recomputation, not the text.

The same code builds a tiny model on the CPU (float32, the tests) and a
7B-class one on a GPU (:data:`QWEN2_7B` in bfloat16, the benchmarks): the
model is constructed on its device in its dtype, and every weight is then
drawn in place there from one seeded generator, so a 15 GB model never passes
through host memory and one seed is one model on one device.
:func:`engine_memory_bytes` is what one engine needs on its GPU (weights,
the KV of its longest prompt, activations), so that several engines can be
budgeted onto one GPU.

The libraries whose behaviour decides the numbers are checked when an
engine starts (:func:`check_versions`): transformers 5.17, for one, takes
``cache=`` silently as an unknown keyword and builds a cache of its own, and
an engine over it would get no KV back.  A version outside :data:`SUPPORTED`
is refused with the version found and the range needed.

KV moves between the engine and the pool in the Hugging Face layout
(``[1, kv_heads, tokens, head_dim]`` per layer, the HND block format):

- :meth:`ModelEngine.kv_layout` describes a prefill's KV (or a prefix) for
  :func:`beluga.transfer.block_moves`, whose tables ``KVStore.save`` / ``load``
  move and checksum (through ``Memory.write_blocks`` / ``read_blocks``);
- :meth:`ModelEngine.empty_prefix` is a fresh cached prefix of whole engine
  blocks to read pool values into, for :meth:`ModelEngine.prefill`.

After a prefill, :meth:`ModelEngine.generate` decodes greedily over the same
KV cache, one token per forward pass, as a decode engine does once it holds
the prompt's KV (read from the pool, or computed).
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import transformers
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from beluga.errors import BackendUnavailableError, ServingError
from beluga.kv.identity import ModelIdentity
from beluga.transfer import KVLayout, KVSpec

FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
}

KV = list[tuple[torch.Tensor, torch.Tensor]]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INIT_STD = 0.02  # the weights' standard deviation (Qwen2's and Llama's initializer_range)

#: the versions an engine runs with, as pyproject's ``model`` extra pins them: (at least, below)
SUPPORTED = {
    "torch": ((2, 4), (2, 15)),
    "transformers": ((5, 24), (6,)),
}


def _release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string: '2.11.0+cu130' -> (2, 11, 0)."""
    numbers = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(n) for n in numbers.group(0).split(".")) if numbers else ()


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


def library_version(name: str) -> str:
    """The version of the library ``name`` as imported (transformers' lazy module object is
    replaced as its parts load, so it is looked up anew each time)."""
    return str(getattr(importlib.import_module(name), "__version__", ""))


def check_versions() -> None:
    """Refuse a torch or transformers outside :data:`SUPPORTED`, naming what was found.

    Both decide what an engine computes without saying so when they differ:
    an older transformers ignores the ``cache=`` this engine passes (5.17 did,
    and every request failed on a KV of None), and torch's kernels and
    caches are what the supported transformers was written against.
    """
    for name, (least, below) in SUPPORTED.items():
        found = library_version(name)
        release = _release(found)
        if not release or not least <= release < below:
            raise BackendUnavailableError(
                f"{name} {found or '(no version)'} is not supported by the serving engine: it "
                f"needs {name}>={_dotted(least)},<{_dotted(below)} (pip install "
                f"'{name}>={_dotted(least)},<{_dotted(below)}', or 'beluga-kvcache[model]')"
            )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Make tensors in ``dtype`` meanwhile, so a model is built in its dtype, not cast after."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@torch.no_grad()
def seeded_init(model: torch.nn.Module, seed: int, std: float = INIT_STD) -> None:
    """Draw every parameter in place, on its device, from one generator seeded with ``seed``.

    In name order: norms' weights 1, everything else (matrices, embeddings,
    biases) normal with ``std``.  The draws do not depend on how transformers
    initialises a module, so one seed gives one model whatever its version;
    a CPU and a GPU draw different numbers (their generators differ).
    """
    params = sorted(model.named_parameters(), key=lambda item: item[0])
    device = params[0][1].device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in params:
        owner = name.split(".")[-2] if "." in name else ""
        if "norm" in owner:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=generator)


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

    @property
    def num_params(self) -> int:
        """Parameters of a Qwen2/Llama of this shape (embeddings and head untied; Qwen2's
        q/k/v biases)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        if self.family == "qwen2":
            attention += q + 2 * kv
        mlp = 3 * h * self.intermediate_size
        return self.num_layers * (attention + mlp + 2 * h) + 2 * self.vocab_size * h + h


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
"""Qwen2-7B's shape: 7.6 B parameters, 15.2 GB in bfloat16, built on a GPU by the benchmarks
(``beluga bench e2e --model 7b``); its bfloat16 KV block of 16 tokens is 896 KiB."""

ACTIVATION_SLACK = 2.0  # over the activations counted below: temporaries, the allocator's rounding
CONTEXT_BYTES = 1 << 30  # what the CUDA context, cuBLAS workspaces and kernels take


def engine_memory_bytes(shape: ModelShape, dtype: str, max_tokens: int) -> int:
    """What one engine needs on its device to serve prompts of up to ``max_tokens``.

    The weights; three copies of the KV of ``max_tokens`` (a prefix read from
    the pool, the cache a prefill grows from it, the cache decoding grows
    from that); a prefill's largest activations (the MLP's gate, up and
    product rows, the attention's inputs and output, one layer at a time,
    and the causal mask of a prompt with a cached prefix), with
    :data:`ACTIVATION_SLACK`; and :data:`CONTEXT_BYTES`.  Several engines fit
    on one GPU when their sums do.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, not {max_tokens}")
    item = DTYPES[dtype].itemsize
    kv_per_token = shape.kv_spec(dtype).section_bytes * 2 * shape.num_layers // shape.block_tokens
    attention = 2 * shape.num_heads * shape.head_dim
    rows = 3 * shape.intermediate_size + 4 * shape.hidden_size + attention
    activations = max_tokens * rows * item + max_tokens * max_tokens  # a bool mask
    activations += shape.vocab_size * 4 * 2  # the last token's logits, and their float copy
    return (
        shape.num_params * item
        + 3 * max_tokens * kv_per_token
        + int(ACTIVATION_SLACK * activations)
        + CONTEXT_BYTES
    )


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
    """A seeded random-weight causal LM in ``dtype``, with prefix reuse.

    It runs on the CPU, or on ``device`` (a CUDA device): its KV cache then
    lives there and moves through a :class:`beluga.transfer.gpu.GpuPool`.
    The model is built on its device in its dtype and its weights drawn there
    (:func:`seeded_init`): one seed is one model on one kind of device, and
    :attr:`identity` (which keys its blocks in the pool) tells seeds,
    families and dtypes apart.  Starting one checks the library versions
    (:func:`check_versions`).  Not thread-safe (one forward pass at a time);
    not fork-safe once it has used a GPU.
    """

    def __init__(
        self,
        shape: ModelShape | None = None,
        *,
        seed: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
    ) -> None:
        check_versions()
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
        self.shape = shape or ModelShape()
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.kv_spec = self.shape.kv_spec(dtype)
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
        # made where it runs, in its dtype: a 7B model never exists in host memory or float32
        rngs = [self.device] if self.device.type == "cuda" else []  # transformers' own draws
        with torch.random.fork_rng(devices=rngs), _default_dtype(self.dtype), self.device:
            model: PreTrainedModel = model_cls(self.config)
        seeded_init(model, seed)
        self.model = model.eval()

    @cached_property
    def identity(self) -> ModelIdentity:
        """The model's identity for block keys: a fingerprint of its config and weights."""
        with torch.no_grad():
            return ModelIdentity.of_module(self.model, name=f"random-{self.shape.family}")

    @torch.no_grad()
    def prefill(
        self,
        token_ids: Sequence[int],
        cached_prefix_kv: KV | None = None,
        *,
        all_logits: bool = True,
    ) -> Prefill:
        """Logits of the tokens after the cached prefix, and the KV of every token.

        ``cached_prefix_kv`` is the per-layer (key, value) of the first ``n``
        tokens, each ``[1, kv_heads, n, head_dim]`` in the model's dtype, ``n``
        a multiple of ``block_tokens`` and smaller than the prompt (the last
        token is always computed: its logits choose the next token).  Without
        ``all_logits`` only the last token's logits are made (a 15K-token
        prompt's full logits would be gigabytes).
        """
        ids = self._check_tokens(token_ids).to(self.device)
        cached = 0 if cached_prefix_kv is None else self._check_prefix(cached_prefix_kv, len(ids))
        cache = DynamicCache(cached_prefix_kv, config=self.config)
        positions = torch.arange(cached, len(ids), device=self.device).unsqueeze(0)
        out = self.model(
            input_ids=ids[cached:].unsqueeze(0),
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
        )
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        if len(kv) != self.shape.num_layers or any(k is None for k, _ in kv):
            raise ServingError(
                f"transformers {transformers.__version__} did not fill the KV cache it was "
                "given (it built its own): the engine cannot save or reuse KV with it; install "
                "a supported transformers (beluga.serving.model.SUPPORTED)"
            )
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
                torch.empty(shape, dtype=self.dtype, device=self.device),
                torch.empty(shape, dtype=self.dtype, device=self.device),
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
