"""The KV data path: engine KV layouts, block format, gather/scatter, sparse fetch.

- :mod:`beluga.transfer.buffers`: :class:`Values`, what the store's one
  data-path API (``KVStore.save`` / ``KVStore.load``) moves: :class:`Buffers`,
  :class:`Pieces`, and :class:`EngineBlocks` (whole engine blocks of a KV
  cache); :func:`as_buffer`.
- :mod:`beluga.transfer.format`: :class:`KVSpec` (a model's KV shape) and
  :class:`BlockFormat` (how one engine block's KV lies in its pool value).
- :mod:`beluga.transfer.layouts`: :class:`KVLayout`, built from an engine's
  registered KV tensors (vLLM FlashAttention NHD/HND, vLLM CPU_ATTN, Hugging
  Face); needs torch.
- :mod:`beluga.transfer.datapath`: :func:`block_moves` (the checked table that
  ``KVStore.save`` / ``load`` hand to ``Memory.write_blocks`` /
  ``read_blocks``, which move and checksum whole blocks), the raw
  :func:`gather_write` / :func:`scatter_read`, and :func:`sparse_fetch`, each
  one C call through a coherence ``Memory``.
- :mod:`beluga.transfer.gpu`: :class:`GpuPool`, the pool registered with CUDA,
  which moves a GPU cache's blocks with one kernel instead.

Everything but :mod:`~beluga.transfer.layouts` works without torch, so the
store imports this package on a machine without it; ``KVLayout`` and
``host_bytes`` are imported on first use.
"""

from typing import Any

from beluga.transfer.buffers import Buffers, Pieces, Values, as_buffer
from beluga.transfer.datapath import (
    EngineBlocks,
    block_moves,
    block_table,
    coalesce,
    gather_write,
    scatter_read,
    sparse_fetch,
    sparse_shape,
    sparse_table,
)
from beluga.transfer.format import DTYPE_SIZES, ORDERS, BlockFormat, K, KVSpec, V
from beluga.transfer.gpu import GpuPool


def __getattr__(name: str) -> Any:
    """``KVLayout`` and ``host_bytes`` need torch: import them when asked for."""
    if name in ("KVLayout", "host_bytes"):
        from beluga.transfer import layouts

        return getattr(layouts, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DTYPE_SIZES",
    "ORDERS",
    "BlockFormat",
    "Buffers",
    "EngineBlocks",
    "GpuPool",
    "K",
    "KVLayout",
    "KVSpec",
    "Pieces",
    "V",
    "Values",
    "as_buffer",
    "block_moves",
    "block_table",
    "coalesce",
    "gather_write",
    "host_bytes",
    "scatter_read",
    "sparse_fetch",
    "sparse_shape",
    "sparse_table",
]
