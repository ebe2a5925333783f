"""Where an engine's KV bytes are: descriptors for the KV cache layouts engines use.

A :class:`KVLayout` is built from the tensors an engine registers (one entry
per layer) and validated against the model's :class:`KVSpec` before anything
else happens, so a wrong shape, dtype, device, stride order or layer count is
refused up front instead of scattering bytes into the wrong places.  It keeps
uint8 views of the tensors' memory (no copies): numpy arrays for a cache in
host memory, the buffers the data path hands to the C core; uint8 tensors
for a cache on a CUDA device, whose addresses the GPU path
(:mod:`beluga.transfer.gpu`) hands to its kernel.

Layouts (per layer; ``nb`` engine blocks of ``bs`` tokens, ``H`` KV heads of ``D``):

``KVLayout.flash_attention(spec, tensors, "NHD")``
    vLLM FlashAttention, ``[2, nb, bs, H, D]`` contiguous.
``KVLayout.flash_attention(spec, tensors, "HND")``
    vLLM FlashAttention with the HND stride order: memory is
    ``[2, nb, H, bs, D]``; the registered tensor is either that, contiguous,
    or vLLM's logical ``[2, nb, bs, H, D]`` view with permuted strides.
``KVLayout.cpu_attention(spec, tensors)``
    vLLM CPU_ATTN (``CPUAttentionBackend.get_kv_cache_shape``):
    ``[2, nb, H, bs, D]`` contiguous, each ``[bs, D]`` head slab repacked for
    the CPU's ISA, so only whole blocks move.
vLLM since 0.2x registers one 4-D view per layer instead, ``[nb, H, bs, 2*D]``
(each token's K and V side by side in the last axis; the attention backend
picks the memory order).  Both classmethods above accept it too:
``cpu_attention`` when it is contiguous (each head's K slab, then its V
slab), ``flash_attention`` when memory is ``[nb, H, bs, 2*D]`` ("HND") or
``[nb, bs, H, 2*D]`` ("NHD", a contiguous tensor or the logical view with
permuted strides).  The block format is the same either way, so engines
of both generations share blocks.

``KVLayout.hugging_face(spec, [(key, value), ...])``
    transformers caches, key and value ``[batch, H, seq, D]`` each; engine
    block ``b`` is tokens ``[j * bs, (j + 1) * bs)`` of batch row ``i``, where
    ``i, j = divmod(b, seq // bs)``; a partial last block is not addressable.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from beluga.errors import KVLayoutError
from beluga.transfer.format import BlockFormat, KVSpec


@dataclass(frozen=True)
class _Strides:
    """Element strides of one layout; every engine layout reduces to these numbers."""

    kv: int  # K to V inside one buffer (0 when K and V are separate buffers)
    block: int  # block to block inside one row
    blocks_per_row: int  # blocks per batch row (all of them for vLLM)
    row: int  # batch row to batch row (0 for vLLM)
    token: int
    head: int
    pieces: int  # contiguous runs per block of one layer's K or V
    piece: int  # distance between those runs


def host_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor's memory (any dtype, bf16 too), no copy."""
    if tensor.device.type != "cpu":
        raise KVLayoutError(
            f"a tensor on {tensor.device} cannot be a host buffer; this data path copies "
            "host memory (move the KV cache to the CPU, or put it on a CUDA device and move "
            "it through beluga.transfer.gpu.GpuPool)"
        )
    return _flat_bytes(tensor).numpy()


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory, on its own device, no copy."""
    if not tensor.is_contiguous():
        raise KVLayoutError(
            f"tensor with shape {tuple(tensor.shape)} and strides {tensor.stride()} is not "
            "contiguous; the data path addresses memory directly and would copy into a temporary"
        )
    return tensor.detach().reshape(-1).view(torch.uint8)


def _byte_buffers(tensors: Sequence[torch.Tensor]) -> tuple[list[Any], torch.device]:
    """The tensors' memory as byte buffers (numpy on the CPU, uint8 tensors on a GPU)."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise KVLayoutError(
                f"KV cache tensors are on {device} and on {t.device}; one engine's KV cache "
                "lives on one device"
            )
    if device.type == "cuda":
        return [_flat_bytes(t) for t in tensors], device
    return [host_bytes(t) for t in tensors], device


def _check_dtype(spec: KVSpec, tensor: torch.Tensor, where: str) -> None:
    if tensor.dtype != getattr(torch, spec.dtype):
        raise KVLayoutError(
            f"{where} is {tensor.dtype} but the KVSpec says {spec.dtype}; "
            "build the KVSpec from the engine's KV cache dtype"
        )


def _check_layers(spec: KVSpec, entries: Sequence[object], what: str) -> None:
    if len(entries) != spec.num_layers:
        raise KVLayoutError(
            f"got {len(entries)} per-layer {what} but the KVSpec has {spec.num_layers} layers; "
            "pass one entry per attention layer, in layer order"
        )


class KVLayout:
    """One engine's KV cache as byte buffers, and where each block, token and head lives."""

    def __init__(
        self,
        kind: str,
        fmt: BlockFormat,
        tensors: Sequence[torch.Tensor],
        buffers_per_layer: int,
        num_blocks: int,
        strides: _Strides,
    ) -> None:
        """Use the classmethods: they validate the tensors this is built from."""
        self.kind = kind
        self.format = fmt
        self.spec = fmt.spec
        buffers, self.device = _byte_buffers(tensors)
        self.buffers = tuple(buffers)  # numpy views on the CPU, uint8 tensors on a GPU
        self.num_blocks = num_blocks
        self._per_layer = buffers_per_layer
        self._s = strides

    def __repr__(self) -> str:
        return f"KVLayout({self.kind}, {self.spec}, num_blocks={self.num_blocks})"

    @classmethod
    def flash_attention(
        cls, spec: KVSpec, kv_caches: Sequence[torch.Tensor], order: str = "NHD"
    ) -> KVLayout:
        """vLLM FlashAttention per-layer caches, in the NHD or HND stride order."""
        if order not in ("NHD", "HND"):
            raise ValueError(f"FlashAttention order must be 'NHD' or 'HND', not {order!r}")
        _check_layers(spec, kv_caches, "KV cache tensors")
        if kv_caches[0].dim() == 4:
            return cls._flash_attention_views(spec, kv_caches, order)
        bs, heads, dim = spec.block_tokens, spec.num_kv_heads, spec.head_dim
        physical = []
        num_blocks = _num_blocks(kv_caches)
        logical = (2, num_blocks, bs, heads, dim)
        hnd = (2, num_blocks, heads, bs, dim)
        in_memory = logical if order == "NHD" else hnd
        for layer, t in enumerate(kv_caches):
            where = f"layer {layer} KV cache"
            _check_dtype(spec, t, where)
            if tuple(t.shape) == in_memory and t.is_contiguous():
                physical.append(t)
            elif order == "HND" and tuple(t.shape) == logical and _hnd_view(t).is_contiguous():
                physical.append(_hnd_view(t))
            else:
                raise KVLayoutError(
                    f"{where} has shape {tuple(t.shape)} and strides {t.stride()}, but vLLM "
                    f"FlashAttention {order} for {spec} needs {in_memory} in memory; check the "
                    "KVSpec against the model config and the backend's KV cache layout"
                )
        per_block = bs * heads * dim
        token, head = (heads * dim, dim) if order == "NHD" else (dim, bs * dim)
        strides = _Strides(
            kv=num_blocks * per_block,
            block=per_block,
            blocks_per_row=num_blocks,
            row=0,
            token=token,
            head=head,
            pieces=1,
            piece=0,
        )
        fmt = BlockFormat(spec, order)
        return cls(f"vllm-flash-{order.lower()}", fmt, physical, 1, num_blocks, strides)

    @classmethod
    def cpu_attention(cls, spec: KVSpec, kv_caches: Sequence[torch.Tensor]) -> KVLayout:
        """vLLM CPU_ATTN per-layer caches: whole blocks only (the slabs are ISA-packed)."""
        _check_layers(spec, kv_caches, "KV cache tensors")
        bs, heads, dim = spec.block_tokens, spec.num_kv_heads, spec.head_dim
        per_block = bs * heads * dim
        if kv_caches[0].dim() == 4:
            num_blocks = _num_view_blocks(kv_caches)
            shape: tuple[int, ...] = (num_blocks, heads, bs, 2 * dim)
            # each head's K slab, then its V slab: H runs per block of K (or V)
            strides = _Strides(
                kv=bs * dim,
                block=2 * per_block,
                blocks_per_row=num_blocks,
                row=0,
                token=dim,
                head=2 * bs * dim,
                pieces=heads,
                piece=2 * bs * dim,
            )
        else:
            num_blocks = _num_blocks(kv_caches)
            shape = (2, num_blocks, heads, bs, dim)
            strides = _Strides(
                kv=num_blocks * per_block,
                block=per_block,
                blocks_per_row=num_blocks,
                row=0,
                token=dim,
                head=bs * dim,
                pieces=1,
                piece=0,
            )
        for layer, t in enumerate(kv_caches):
            where = f"layer {layer} KV cache"
            _check_dtype(spec, t, where)
            if tuple(t.shape) != shape or not t.is_contiguous():
                raise KVLayoutError(
                    f"{where} has shape {tuple(t.shape)} and strides {t.stride()}, but vLLM "
                    f"CPU_ATTN for {spec} needs {shape} contiguous; check the KVSpec against "
                    "the model config"
                )
        fmt = BlockFormat(spec, "CPU")
        return cls("vllm-cpu", fmt, kv_caches, 1, num_blocks, strides)

    @classmethod
    def _flash_attention_views(
        cls, spec: KVSpec, kv_caches: Sequence[torch.Tensor], order: str
    ) -> KVLayout:
        """vLLM's 4-D per-layer views: K and V side by side in each token's last axis."""
        bs, heads, dim = spec.block_tokens, spec.num_kv_heads, spec.head_dim
        num_blocks = _num_view_blocks(kv_caches)
        logical = (num_blocks, heads, bs, 2 * dim)
        in_memory = logical if order == "HND" else (num_blocks, bs, heads, 2 * dim)
        physical = []
        for layer, t in enumerate(kv_caches):
            where = f"layer {layer} KV cache"
            _check_dtype(spec, t, where)
            if tuple(t.shape) == in_memory and t.is_contiguous():
                physical.append(t)
            elif order == "NHD" and tuple(t.shape) == logical and _nhd_view(t).is_contiguous():
                physical.append(_nhd_view(t))
            else:
                raise KVLayoutError(
                    f"{where} has shape {tuple(t.shape)} and strides {t.stride()}, but vLLM "
                    f"{order} views for {spec} need {in_memory} in memory (or a 5-D cache "
                    "with K and V first: [2, num_blocks, ...]); check the KVSpec against the "
                    "model config and the backend's KV cache layout"
                )
        token, head = (heads * 2 * dim, 2 * dim) if order == "NHD" else (2 * dim, bs * 2 * dim)
        # one run of head_dim per (token, head): K and V alternate in memory
        strides = _Strides(
            kv=dim,
            block=2 * bs * heads * dim,
            blocks_per_row=num_blocks,
            row=0,
            token=token,
            head=head,
            pieces=bs * heads,
            piece=2 * dim,
        )
        fmt = BlockFormat(spec, order)
        return cls(f"vllm-flash-{order.lower()}", fmt, physical, 1, num_blocks, strides)

    @classmethod
    def hugging_face(
        cls, spec: KVSpec, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> KVLayout:
        """transformers per-layer (key, value) tensors, each [batch, kv_heads, seq, head_dim]."""
        _check_layers(spec, kv, "(key, value) pairs")
        if any(len(pair) != 2 for pair in kv):
            raise KVLayoutError("each layer's entry must be a (key, value) pair of tensors")
        shape = tuple(kv[0][0].shape)
        if len(shape) != 4 or shape[1] != spec.num_kv_heads or shape[3] != spec.head_dim:
            raise KVLayoutError(
                f"layer 0 key has shape {shape}, but a Hugging Face cache for {spec} is "
                f"[batch, {spec.num_kv_heads}, seq, {spec.head_dim}]; check the KVSpec against "
                "the model config"
            )
        for layer, pair in enumerate(kv):
            for name, t in zip(("key", "value"), pair, strict=True):
                where = f"layer {layer} {name}"
                _check_dtype(spec, t, where)
                if tuple(t.shape) != shape:
                    raise KVLayoutError(
                        f"{where} has shape {tuple(t.shape)} but layer 0 key has {shape}; "
                        "every layer's key and value must have one shape"
                    )
        batch, heads, seq, dim = shape
        per_row = seq // spec.block_tokens
        strides = _Strides(
            kv=0,
            block=spec.block_tokens * dim,
            blocks_per_row=per_row,
            row=heads * seq * dim,
            token=dim,
            head=seq * dim,
            pieces=heads,
            piece=seq * dim,
        )
        fmt = BlockFormat(spec, "HND")
        tensors = [t for pair in kv for t in pair]
        return cls("hugging-face", fmt, tensors, 2, batch * per_row, strides)

    def check_blocks(self, block_ids: object) -> np.ndarray:
        """Engine block ids as an int64 array, refused when any is out of range."""
        ids = np.asarray(block_ids)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(f"engine block ids must be a 1-D sequence of ints, got {ids!r}")
        ids = ids.astype(np.int64)
        bad = ids[(ids < 0) | (ids >= self.num_blocks)]
        if bad.size:
            raise ValueError(
                f"engine block id {int(bad[0])} is out of range: this {self.kind} cache has "
                f"{self.num_blocks} blocks (0..{self.num_blocks - 1})"
            )
        return ids

    @property
    def run_bytes(self) -> int:
        """Length of each contiguous run in :attr:`block_runs`."""
        return self.spec.section_bytes // self._s.pieces

    @functools.cached_property
    def block_runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The runs that make up any one block, in pool order.

        Three flat arrays: buffer index, byte offset from the block's start in
        that buffer (add :meth:`block_starts`), byte offset inside the pool
        block.  Every block has the same runs, so they are computed once.
        """
        s = self._s
        layer = np.arange(self.spec.num_layers, dtype=np.int64)[:, None, None]
        kv = np.arange(2, dtype=np.int64)[None, :, None]
        piece = np.arange(s.pieces, dtype=np.int64)[None, None, :]
        shape = (self.spec.num_layers, 2, s.pieces)
        buffer = np.broadcast_to(self._buffer(layer, kv), shape).ravel()
        offset = np.broadcast_to((kv * s.kv + piece * s.piece) * self.spec.itemsize, shape).ravel()
        in_block = (((layer * 2 + kv) * s.pieces + piece) * self.run_bytes).ravel()
        return buffer, offset, in_block

    def block_starts(self, block_ids: np.ndarray) -> np.ndarray:
        """Byte offset of each (checked) block's first K element in its buffers."""
        return self._block_element(block_ids) * self.spec.itemsize

    def locate(
        self, block: object, layer: object, kv: object, token: object, head: object
    ) -> tuple[np.ndarray, np.ndarray]:
        """Buffer index and byte offset of the head_dim vector of (block, layer, K/V, token, head).

        Arguments broadcast like numpy arrays; ``kv`` is 0 for K, 1 for V.
        """
        if not self.format.token_addressable:
            raise ValueError(
                f"tokens of a {self.kind} cache are packed for the CPU's ISA inside each head's "
                "slab; only whole blocks can be located"
            )
        block = self.check_blocks(np.ravel(block)).reshape(np.shape(block))
        s = self.spec
        checks = (
            ("layer", layer, s.num_layers),
            ("kv", kv, 2),
            ("token", token, s.block_tokens),
            ("head", head, s.num_kv_heads),
        )
        for name, value, limit in checks:
            arr = np.asarray(value)
            if arr.size and (arr.min() < 0 or arr.max() >= limit):
                raise ValueError(f"{name} must be in 0..{limit - 1}")
        layer, kv, token, head = (np.asarray(a, dtype=np.int64) for a in (layer, kv, token, head))
        t = self._s
        element = self._block_element(block) + kv * t.kv + token * t.token + head * t.head
        offset = element * s.itemsize
        buffer, offset = np.broadcast_arrays(self._buffer(layer, kv), offset)
        return buffer, offset

    def _buffer(self, layer: np.ndarray, kv: np.ndarray) -> np.ndarray:
        """Buffer index of a layer's K or V (one buffer per layer, or one per tensor)."""
        return layer * self._per_layer + kv * (self._per_layer - 1)

    def _block_element(self, block: np.ndarray) -> np.ndarray:
        """Element offset of a block's first K element inside its buffers."""
        s = self._s
        row, col = np.divmod(block, max(s.blocks_per_row, 1))
        return row * s.row + col * s.block


def _hnd_view(t: torch.Tensor) -> torch.Tensor:
    """vLLM's logical [2, nb, bs, H, D] tensor seen in its HND memory order."""
    return t.permute(0, 1, 3, 2, 4)


def _num_blocks(kv_caches: Sequence[torch.Tensor]) -> int:
    """The block count every per-layer vLLM tensor must share (dim 1 of [2, nb, ...])."""
    first = kv_caches[0]
    if first.dim() != 5 or first.shape[0] != 2:
        raise KVLayoutError(
            f"layer 0 KV cache has shape {tuple(first.shape)}; a vLLM per-layer cache is "
            "5-D with K and V first: [2, num_blocks, ...]"
        )
    num_blocks = first.shape[1]
    for layer, t in enumerate(kv_caches):
        if t.dim() != 5 or t.shape[:2] != (2, num_blocks):
            raise KVLayoutError(
                f"layer {layer} KV cache has shape {tuple(t.shape)} but layer 0 has "
                f"{num_blocks} blocks; every layer must be [2, {num_blocks}, ...]"
            )
    return num_blocks


def _num_view_blocks(kv_caches: Sequence[torch.Tensor]) -> int:
    """The block count every 4-D per-layer vLLM view must share (dim 0 of [nb, ...])."""
    num_blocks = kv_caches[0].shape[0]
    for layer, t in enumerate(kv_caches):
        if t.dim() != 4 or t.shape[0] != num_blocks:
            raise KVLayoutError(
                f"layer {layer} KV cache has shape {tuple(t.shape)} but layer 0 has "
                f"{num_blocks} blocks; every layer must be a 4-D view [{num_blocks}, ...] "
                "(or every layer 5-D with K and V first: [2, num_blocks, ...])"
            )
    return num_blocks


def _nhd_view(t: torch.Tensor) -> torch.Tensor:
    """vLLM's logical [nb, H, bs, 2*D] view seen in its NHD memory order."""
    return t.permute(0, 2, 1, 3)
