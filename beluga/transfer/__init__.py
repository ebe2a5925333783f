"""The KV data path: engine KV layouts, block format, gather/scatter, sparse fetch.

- :mod:`beluga.transfer.format`: :class:`KVSpec` (a model's KV shape) and
  :class:`BlockFormat` (how one engine block's KV lies in its pool value).
- :mod:`beluga.transfer.layouts`: :class:`KVLayout`, built from an engine's
  registered KV tensors (vLLM FlashAttention NHD/HND, vLLM CPU_ATTN, Hugging
  Face); needs torch.
- :mod:`beluga.transfer.datapath`: :func:`block_moves` (the checked table that
  ``KVStore.read_blocks`` / ``write_blocks`` move and checksum whole blocks
  with), the raw :func:`gather_write` / :func:`scatter_read`, and
  :func:`sparse_fetch`, each one C call through a coherence ``Memory``.
- :mod:`beluga.transfer.gpu`: :class:`GpuPool`, the pool registered with CUDA,
  which moves a GPU cache's blocks with one kernel instead.
"""

from beluga.transfer.datapath import (
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
from beluga.transfer.layouts import KVLayout, host_bytes

__all__ = [
    "DTYPE_SIZES",
    "ORDERS",
    "BlockFormat",
    "GpuPool",
    "K",
    "KVLayout",
    "KVSpec",
    "V",
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
