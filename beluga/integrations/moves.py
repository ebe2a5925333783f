"""An engine's block moves between its paged KV cache and the pool, on the CPU or a GPU.

What a framework's worker does with its KV cache once the framework has said
which blocks to move, without the framework (nothing here imports vLLM), so
that the very moves a connector makes are tested with tensors shaped as the
framework shapes them:

:func:`engine_layout`
    the layout of the KV cache an engine registers: host tensors are vLLM's
    CPU backend (CPU_ATTN); CUDA tensors are FlashAttention in the memory
    order they have (NHD or HND: vLLM resolves one KV cache layout per
    engine, ``KVCacheConfig.kv_cache_layout``, LBNHC or LBHNC, and lays
    every layer out by it; its name is in the blocks' key namespace, and the
    tensors' strides say which order to move them in); anything else, or
    tensors in neither order, is refused at start.
:class:`GpuPools`
    one :class:`~beluga.transfer.gpu.GpuPool` per store connection: the
    pool's mapping registered with CUDA on first use, and unregistered
    before the store is let go, never while a move still uses it.
:class:`BlockMoves`
    ``load`` and ``save`` of engine blocks through ``KVStore.load`` /
    ``KVStore.save`` with :class:`~beluga.transfer.EngineBlocks`, whose mover
    is the pool's ``Memory`` for a host cache and a ``GpuPool`` for a CUDA
    one: the same two pieces the serving engine moves a GPU model's KV with
    (:class:`beluga.serving.engine.ServingEngine`).

A GpuPool holds a view of its store's mapping, so it must be closed before
that store is: a worker that drops a store after an outage calls
:meth:`BlockMoves.forget` first, and :meth:`BlockMoves.close` before its
link closes the store.  A GpuPool lent to a move is closed by whoever gives
it back last.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from beluga.errors import KVLayoutError
from beluga.kv import BlockRef, KVStore, Saved
from beluga.pool import Pool
from beluga.transfer import EngineBlocks, KVLayout, KVSpec
from beluga.transfer.gpu import GpuPool

GPU_ORDERS = ("NHD", "HND")  # FlashAttention's memory orders (vLLM's KV cache layouts)


def engine_layout(
    spec: KVSpec, tensors: Sequence[torch.Tensor], gpu_order: str | None = None
) -> KVLayout:
    """The layout of one KV cache group's per-layer tensors, refused with the reason when it
    cannot be moved: CPU_ATTN in host memory; on a CUDA device FlashAttention in
    ``gpu_order``, or, by default, in whichever of NHD and HND the tensors' strides have
    (when both fit, as with one KV head, the two put the same bytes in a block)."""
    device = tensors[0].device
    if device.type == "cpu":
        return KVLayout.cpu_attention(spec, tensors)
    if device.type != "cuda":
        raise KVLayoutError(
            f"the KV cache is on {device}; BelugaConnector moves KV caches in host memory "
            "(vLLM's CPU backend) or on a CUDA device (FlashAttention, NHD or HND): serve on "
            "one of those or remove it from --kv-transfer-config"
        )
    return flash_attention_layout(spec, tensors, gpu_order)


def flash_attention_layout(
    spec: KVSpec, tensors: Sequence[torch.Tensor], order: str | None = None
) -> KVLayout:
    """FlashAttention per-layer tensors (vLLM's 5-D caches or 4-D views) in ``order``, or in
    whichever of NHD and HND their strides have; refused when in neither."""
    if order is not None and order not in GPU_ORDERS:
        raise KVLayoutError(
            f"the engine lays its GPU KV cache out as {order!r}; BelugaConnector moves "
            f"FlashAttention's {' and '.join(GPU_ORDERS)} (vLLM's LBNHC and LBHNC layouts)"
        )
    refusals = []
    for candidate in [order] if order else GPU_ORDERS:
        try:
            return KVLayout.flash_attention(spec, tensors, candidate)
        except KVLayoutError as e:
            refusals.append(str(e))
    raise KVLayoutError(
        "the KV cache is FlashAttention in no order BelugaConnector moves ("
        + "; ".join(refusals)
        + "): serve with an NHD or HND KV cache layout (VLLM_KV_CACHE_LAYOUT) or remove it "
        "from --kv-transfer-config"
    )


class GpuPools:
    """One :class:`GpuPool` for the store connection in use, registered on first use.

    ``make(pool)`` registers one (default ``GpuPool(pool, device)``).  A store
    other than the last one seen retires the last one's GpuPool; :meth:`drop`
    retires it at once (before that store is closed).  A retired GpuPool is
    closed when the last move that borrowed it gives it back.  Thread-safe (a
    worker's load and save threads share it); not fork-safe (CUDA state).
    """

    def __init__(self, device: Any = None, make: Callable[[Pool], GpuPool] | None = None) -> None:
        self._make = make or (lambda pool: GpuPool(pool, device))
        self._lock = threading.Lock()
        self._store: KVStore | None = None
        self._gpu: GpuPool | None = None
        self._users: dict[GpuPool, int] = {}  # lent GpuPools, current or retired

    @contextlib.contextmanager
    def lend(self, store: KVStore) -> Iterator[GpuPool]:
        """The GpuPool of ``store``'s pool for one move (registered now if need be)."""
        with self._lock:
            if self._store is not store:
                self._retire()
                self._gpu, self._store = self._make(store.pool), store
            gpu = self._gpu
            assert gpu is not None
            self._users[gpu] = self._users.get(gpu, 0) + 1
        try:
            yield gpu
        finally:
            with self._lock:
                self._users[gpu] -= 1
                done = not self._users[gpu] and gpu is not self._gpu
                if not self._users[gpu]:
                    del self._users[gpu]
            if done:
                gpu.close()

    def drop(self, store: KVStore) -> None:
        """Retire ``store``'s GpuPool (the store is about to be let go)."""
        with self._lock:
            if self._store is store:
                self._retire()

    def close(self) -> None:
        """Retire the GpuPool in use; safe to call twice."""
        with self._lock:
            self._retire()

    def _retire(self) -> None:
        """Under the lock: stop lending the current GpuPool; close it unless a move has it."""
        gpu, self._gpu, self._store = self._gpu, None, None
        if gpu is not None and gpu not in self._users:
            gpu.close()


class BlockMoves:
    """An engine's block moves between its KV cache and a store, by :class:`KVLayout`.

    ``gpus``: the :class:`GpuPools` that move the cache (by default one is
    made when a layout is on a CUDA device; a cache in host memory moves
    through the pool's ``Memory``); give one to move host layouts through a
    GpuPool too (a stand-in CUDA runtime, in tests).  Thread-safe: loads and
    saves may run on several threads at once, as their store allows.
    """

    def __init__(self, layouts: Sequence[KVLayout], gpus: GpuPools | None = None) -> None:
        on_gpu = {layout.device for layout in layouts if layout.device.type == "cuda"}
        if len(on_gpu) > 1:
            raise KVLayoutError(
                f"the KV cache spans devices {sorted(map(str, on_gpu))}; one worker moves the "
                "KV cache of one GPU"
            )
        self.layouts = list(layouts)
        self._gpus = gpus if gpus is not None or not on_gpu else GpuPools(next(iter(on_gpu)))

    @property
    def on_gpu(self) -> bool:
        """Whether moves go through a GpuPool."""
        return self._gpus is not None

    @contextlib.contextmanager
    def _mover(self, store: KVStore) -> Iterator[GpuPool | None]:
        if self._gpus is None:
            yield None
            return
        with self._gpus.lend(store) as gpu:
            yield gpu

    def prepare(self, store: KVStore) -> None:
        """Register the pool for the GPU now (at engine start), so a refusal is seen there."""
        with self._mover(store):
            pass

    def load(
        self,
        store: KVStore,
        layout: KVLayout,
        engine_blocks: np.ndarray | Sequence[int],
        refs: Sequence[BlockRef | None],
        *,
        at: int = 0,
        value_bytes: int | None = None,
    ) -> list[bool]:
        """Read pool blocks (their bytes from ``at`` on, of values of ``value_bytes``) into
        engine blocks, each validated by the store: which ones are intact."""
        with self._mover(store) as gpu:
            sink = EngineBlocks(layout, engine_blocks, at=at, value_bytes=value_bytes, mover=gpu)
            return store.load(refs, sink, drop_corrupt=True)

    def save(
        self,
        store: KVStore,
        layout: KVLayout,
        keys: Sequence[bytes],
        engine_blocks: np.ndarray | Sequence[int],
        *,
        attempts: int = 2,
    ) -> Saved:
        """Write engine blocks under ``keys`` (blocks the pool holds, or another engine is
        writing, are skipped; a lease lost is tried ``attempts`` times in all)."""
        with self._mover(store) as gpu:
            source = EngineBlocks(layout, engine_blocks, mover=gpu)
            return store.save(keys, source, attempts=attempts)

    def forget(self, store: KVStore) -> None:
        """Let go of what was registered for ``store`` (call before the store is dropped)."""
        if self._gpus is not None:
            self._gpus.drop(store)

    def close(self) -> None:
        """Let go of every registration (call before the store is closed); safe twice."""
        if self._gpus is not None:
            self._gpus.close()
