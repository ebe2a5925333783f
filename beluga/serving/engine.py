"""A serving engine whose prefix cache is the pool: one request, end to end.

For each request :meth:`ServingEngine.serve` does what a vLLM worker with a
KV connector does, in order, and times each step:

lookup
    block keys from the token ids (vLLM's chained hashes, with the request's
    cache salt as an extra key, in the model's :class:`~beluga.kv.KVNamespace`),
    then one batched ``KVStore.locate`` of the longest cached prefix, under a
    read lease;
load
    ``KVStore.load`` into the model's KV cache (:class:`~beluga.transfer.EngineBlocks`):
    the blocks go straight from the pool in one C call, each validated as it moves (header,
    CRC32C of the bytes as copied, header again); a block that changed or
    was corrupted meanwhile ends the usable prefix there, so a race costs
    recomputation, never wrong KV;
compute
    prefill only the tokens after the prefix; the first token is ready here,
    so time to first token is lookup + load + compute;
save
    ``KVStore.save`` of the new full engine blocks: one reserve, one C call
    that moves them, checksums what it stores and seals each header, one
    commit; a block another engine has committed or is writing is skipped.

A model on a CUDA device moves its KV with one kernel through the pool's
registered mapping (:class:`beluga.transfer.gpu.GpuPool`) instead of the
C call; everything else is the same.

Keys name the model: a block is keyed by the model's identity (a fingerprint
of its weights, or the revision the user gives; see :mod:`beluga.kv.identity`)
as well as by its block format, so two models never share a block, not even a
Qwen2 and a Llama of equal dimensions, or a model and its fine-tune.

A pool is made for one block format and may hold any number of models of
that format: :func:`create_kv_pool` writes the format's fingerprint into the
superblock label and sizes pool blocks to hold one engine block, and
:func:`check_kv_pool` refuses a model of another KV shape, dtype or order
before anything is written.  Which models share blocks is the keys' business,
not the pool's: serve models from one pool, or from one pool each, as capacity
planning prefers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from beluga.errors import KVLayoutError
from beluga.kv.hashing import HashFn, block_keys, hash_function
from beluga.kv.identity import KVNamespace, ModelIdentity
from beluga.kv.store import BlockRef, KVStore
from beluga.pool import Geometry, Pool
from beluga.pool.layout import pool_size_for
from beluga.serving.model import KV, ModelEngine
from beluga.transfer import BlockFormat, EngineBlocks
from beluga.transfer.gpu import GpuPool

KV_ORDER = "HND"  # Hugging Face caches are [batch, heads, tokens, dim]: HND blocks


def kv_format(model: ModelEngine) -> BlockFormat:
    """The block format of a model's KV cache."""
    return BlockFormat(model.kv_spec, KV_ORDER)


def kv_geometry(
    fmt: BlockFormat, *, max_hosts: int = 8, rpc_bytes_per_host: int = 256 << 10
) -> Geometry:
    """A pool geometry whose pool blocks each hold one engine block of ``fmt``."""
    return Geometry(
        max_hosts=max_hosts, rpc_bytes_per_host=rpc_bytes_per_host, block_size=fmt.pool_block_bytes
    )


def kv_pool_size(blocks: int, geometry: Geometry) -> int:
    """The smallest pool size (a 2 MiB multiple) with room for ``blocks`` pool blocks."""
    return pool_size_for(blocks, geometry)


def create_kv_pool(
    spec: str,
    size: int,
    fmt: BlockFormat,
    *,
    geometry: Geometry | None = None,
    coherence: str | None = None,
) -> Pool:
    """A new pool for ``fmt``: labelled with its fingerprint, pool blocks sized to fit."""
    geometry = geometry or kv_geometry(fmt)
    if geometry.block_size < fmt.nbytes:
        raise ValueError(
            f"geometry.block_size (a pool block, {geometry.block_size} bytes) cannot hold one "
            f"{fmt.nbytes}-byte engine block; use kv_geometry(fmt) or a block_size of at least "
            f"{fmt.pool_block_bytes}"
        )
    return Pool.create(spec, size, geometry=geometry, label=fmt.fingerprint, coherence=coherence)


def check_kv_pool(pool: Pool, fmt: BlockFormat) -> None:
    """Refuse a pool that was not made for blocks of ``fmt`` (nothing is written).

    Only the block format is checked: models of one format share a pool, each
    under its own keys (:func:`kv_namespace`).
    """
    sb = pool.superblock
    if sb.label != fmt.fingerprint:
        made_for = f"KV blocks {sb.label!r}" if sb.label else "no KV format (its label is empty)"
        raise KVLayoutError(
            f"pool {pool.spec} was made for {made_for}, but this model's KV blocks are "
            f"{fmt.fingerprint!r}; serve this model from a pool created for it "
            "(beluga.serving.engine.create_kv_pool, or 'beluga pool create --label "
            f"{fmt.fingerprint} --block-size {fmt.pool_block_bytes}')"
        )
    if sb.block_size < fmt.nbytes:
        raise KVLayoutError(
            f"pool {pool.spec} has {sb.block_size}-byte pool blocks, too small for one "
            f"{fmt.nbytes}-byte engine block of {fmt.fingerprint!r}; recreate it with a block "
            f"size of at least {fmt.pool_block_bytes}"
        )


def kv_namespace(model: ModelIdentity, fmt: BlockFormat) -> KVNamespace:
    """Where the serving engine keeps one model's blocks of ``fmt``."""
    return KVNamespace(model, fmt.fingerprint, ("beluga-engine",))


def kv_block_keys(
    fmt: BlockFormat,
    model: ModelIdentity,
    token_ids: Sequence[int],
    *,
    salt: str | None = None,
    hash_fn: HashFn | str = "sha256",
    seed: str | None = None,
) -> list[bytes]:
    """The block keys of a prompt for ``model``'s blocks of ``fmt``, with the salt if any.

    The namespace (:func:`kv_namespace`) keeps blocks of two models, KV
    shapes or orders from ever sharing a key; a salt (vLLM's ``cache_salt``)
    gives requests a cache namespace of their own.
    """
    extra = None if salt is None else (salt,)
    return block_keys(
        token_ids, kv_namespace(model, fmt), fmt.spec.block_tokens, hash_fn, extra, seed
    )


@dataclass(frozen=True)
class Timings:
    """Seconds spent in each step of one request."""

    lookup: float
    load: float
    compute: float
    save: float

    @property
    def ttft(self) -> float:
        """Time to first token: the saving happens after the first token is ready."""
        return self.lookup + self.load + self.compute

    @property
    def busy(self) -> float:
        """How long the request kept the engine busy."""
        return self.ttft + self.save


@dataclass
class Served:
    """What serving one request did."""

    num_tokens: int
    cached_tokens: int  # tokens whose KV was read from the pool
    saved_blocks: int
    timings: Timings
    logits: np.ndarray | None  # [computed tokens, vocab] float32, when asked for


def _leading(flags: Sequence[object]) -> int:
    """Length of the leading run of truthy items."""
    return next((i for i, ok in enumerate(flags) if not ok), len(flags))


class ServingEngine:
    """A model engine whose prefix cache is a KV store on a shared pool.

    ``identity`` overrides the model's own (:attr:`ModelEngine.identity`, a
    fingerprint of its weights), e.g. with
    ``ModelIdentity.explicit(name, revision)``: engines share blocks exactly
    when their identities and block formats agree.  Not thread-safe: one
    request at a time.
    """

    def __init__(
        self,
        model: ModelEngine,
        store: KVStore,
        *,
        identity: ModelIdentity | None = None,
        hash_fn: HashFn | str = "sha256",
        hash_seed: str | None = None,
    ) -> None:
        self.model = model
        self.store = store
        self.format = kv_format(model)
        check_kv_pool(store.pool, self.format)
        self.identity = identity if identity is not None else model.identity
        self.block_tokens = self.format.spec.block_tokens
        self.hash_fn = hash_function(hash_fn) if isinstance(hash_fn, str) else hash_fn
        self.hash_seed = hash_seed
        # KV on a GPU moves through one kernel over the registered pool; on the CPU, one C call
        self.gpu: GpuPool | None = None
        if model.device.type == "cuda":
            self.gpu = GpuPool(store.pool, model.device)

    def close(self) -> None:
        """Let go of the GPU registration, if any (before the store closes the pool)."""
        if self.gpu is not None:
            self.gpu.close()

    def keys(self, token_ids: Sequence[int], salt: str | None = None) -> list[bytes]:
        """The block keys of a prompt (see :func:`kv_block_keys`)."""
        return kv_block_keys(
            self.format,
            self.identity,
            token_ids,
            salt=salt,
            hash_fn=self.hash_fn,
            seed=self.hash_seed,
        )

    def serve(
        self, token_ids: Sequence[int], *, salt: str | None = None, want_logits: bool = False
    ) -> Served:
        """Prefill one prompt through the pool's prefix cache."""
        clock = time.perf_counter
        start = clock()
        keys = self.keys(token_ids, salt)
        found = self._locate(keys)
        looked_up = clock()
        # the last token is always computed (its logits pick the next token)
        loadable = found[: (len(token_ids) - 1) // self.block_tokens]
        prefix, used = self._load(loadable)
        loaded = clock()
        out = self.model.prefill(token_ids, prefix)
        computed = clock()
        # blocks found but dropped during the load may have changed: write them again
        stored = len(found) if len(used) == len(loadable) else len(used)
        saved = self._save(out.kv, keys, stored, out.num_full_blocks)
        done = clock()
        timings = Timings(looked_up - start, loaded - looked_up, computed - loaded, done - computed)
        return Served(
            len(token_ids),
            out.num_cached,
            saved,
            timings,
            out.logits.cpu().numpy() if want_logits else None,
        )

    def _locate(self, keys: list[bytes]) -> list[BlockRef]:
        """The longest run of leading keys the store holds (one batched lookup)."""
        if not keys:
            return []
        found = self.store.locate(keys, prefix=True)
        return [r for r in found[: _leading(found)] if r is not None]

    def _load(self, refs: list[BlockRef]) -> tuple[KV | None, list[BlockRef]]:
        """Read the blocks into a fresh prefix, each validated; keep the intact leading run."""
        if not refs:
            return None, []
        prefix = self.model.empty_prefix(len(refs))
        sink = EngineBlocks(self.model.kv_layout(prefix), np.arange(len(refs)), mover=self.gpu)
        intact = _leading(self.store.load(refs, sink, drop_corrupt=True))
        if intact == len(refs):
            return prefix, refs
        if intact == 0:
            return None, []
        tokens = intact * self.block_tokens
        cut = [(k[:, :, :tokens].contiguous(), v[:, :, :tokens].contiguous()) for k, v in prefix]
        return cut, refs[:intact]

    def _save(self, kv: KV, keys: list[bytes], first: int, end: int) -> int:
        """Write blocks ``first .. end`` of a prefill's KV into new pool blocks, sealed;
        how many were stored (a block committed already, or being written by another
        engine, is skipped)."""
        if end <= first:
            return 0
        source = EngineBlocks(self.model.kv_layout(kv), np.arange(first, end), mover=self.gpu)
        return len(self.store.save(keys[first:end], source).stored)
