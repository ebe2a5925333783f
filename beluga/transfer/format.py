"""The block format: how one engine block's KV, every layer, K and V, lies in the pool.

An engine block is ``block_tokens`` tokens (16 by default, vLLM's block size);
its KV of every layer is one pool value, whose extent is one pool block of at
least :attr:`BlockFormat.nbytes` bytes.  The value's payload is
``2 * num_layers`` equal sections, in the order::

    layer 0 K | layer 0 V | layer 1 K | layer 1 V | ... | layer L-1 V

Each section is one engine block of one layer's K or V in one of three inner
orders:

``NHD``
    ``[block_tokens, num_kv_heads, head_dim]``: vLLM FlashAttention (NHD).
``HND``
    ``[num_kv_heads, block_tokens, head_dim]``: vLLM FlashAttention with the HND
    stride order, and Hugging Face ``[batch, heads, seq, dim]`` caches, so those
    two kinds of engine can read each other's blocks.
``CPU``
    ``[num_kv_heads, block_tokens * head_dim]``: vLLM's CPU_ATTN backend, which
    repacks each head's slab for its ISA (AMX tiles).  The slab moves whole;
    no single token inside it can be addressed.

Why this shape: for the vLLM layouts every section is the engine's own
contiguous run for that block, copied as is, so a block moves as
``2 * num_layers`` pieces with no reshuffling on either side; the layer-major
order keeps one layer's K and V together for a later per-layer load.  The
format is a pure function of the model's KV shape and the engine's order, so
every host that computes the same :class:`BlockFormat` reads the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

K, V = 0, 1
PAGE = 4096  # pool blocks are whole 4 KiB pages (beluga.pool.Geometry)
DTYPE_SIZES = {"float16": 2, "bfloat16": 2, "float32": 4}
ORDERS = ("NHD", "HND", "CPU")


@dataclass(frozen=True)
class KVSpec:
    """The shape of one model's KV cache; it fixes what one engine block's pool value holds."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int = 16  # tokens per engine block
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVSpec.{name} must be a positive int, not {value!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(
                f"KVSpec.dtype must be one of {sorted(DTYPE_SIZES)}, not {self.dtype!r}"
            )

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def section_bytes(self) -> int:
        """Bytes of one engine block of one layer's K (or V)."""
        return self.block_tokens * self.num_kv_heads * self.head_dim * self.itemsize


@dataclass(frozen=True)
class BlockFormat:
    """The byte layout of one engine block's pool value for a model shape and an inner order."""

    spec: KVSpec
    order: str

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"BlockFormat.order must be one of {ORDERS}, not {self.order!r}")

    @property
    def nbytes(self) -> int:
        """Payload bytes of one engine block's value (a pool block must hold at least this)."""
        return 2 * self.spec.num_layers * self.spec.section_bytes

    @property
    def pool_block_bytes(self) -> int:
        """The smallest pool block size, bytes (whole 4 KiB pages), that holds one engine block."""
        return -(-self.nbytes // PAGE) * PAGE

    @property
    def fingerprint(self) -> str:
        """Everything that fixes an engine block's bytes, short enough for a pool label (64 bytes).

        Engines put it in their block keys' extra keys, so blocks of two formats
        never share a key, and a pool made for KV blocks carries it as its label,
        so an engine of another shape is refused before it writes.
        """
        s = self.spec
        return (
            f"beluga-kv/{self.order}/{s.dtype}/"
            f"L{s.num_layers}H{s.num_kv_heads}D{s.head_dim}B{s.block_tokens}"
        )

    @property
    def token_addressable(self) -> bool:
        """False for CPU_ATTN blocks, whose per-head slabs are packed for an ISA."""
        return self.order != "CPU"

    def fragment_offsets(
        self, layer: np.ndarray, kv: np.ndarray, token: np.ndarray, head: np.ndarray
    ) -> np.ndarray:
        """Byte offsets, in an engine block's value, of the named head_dim vectors (broadcast)."""
        if not self.token_addressable:
            raise ValueError(
                "tokens inside a CPU_ATTN block are packed for the CPU's ISA and cannot be "
                "fetched one by one; move whole blocks, or use an NHD/HND layout"
            )
        s = self.spec
        layer, kv, token, head = (np.asarray(a, dtype=np.int64) for a in (layer, kv, token, head))
        if self.order == "NHD":
            inner = token * s.num_kv_heads + head
        else:
            inner = head * s.block_tokens + token
        section = (layer * 2 + kv) * (s.section_bytes // s.itemsize)
        return (section + inner * s.head_dim) * s.itemsize
