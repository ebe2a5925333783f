"""A serving engine whose prefix cache is the pool: one request, end to end.

For each request :meth:`CachingEngine.serve` does what a vLLM worker with a
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
    commit; a block another engine has committed or is writing is skipped
    (and counted: it was computed twice);
decode
    with ``max_tokens``, greedy decoding over the KV cache
    (:meth:`~beluga.serving.model.ModelEngine.generate`).

The engine's role (vLLM's ``kv_role``, read once, at construction) decides
what follows the prefill, for prefill/decode disaggregation over the pool:

``kv_both``
    save the new blocks (the prefix cache of a single engine);
``kv_producer``
    a prefill engine: save every full block of the prompt, and return only
    once all of them are committed (blocks another engine was writing are
    waited for), so the request is handed off with its KV in the pool;
``kv_consumer``
    a decode engine: load the prompt's full blocks, compute only the rest
    (the partial last block, and any block missing or invalid in the pool:
    recomputed, never guessed), save nothing, generate.

The flow is :class:`CachingEngine`'s; a store implements its steps
(locate, fill a prefix, save, committed): :class:`ServingEngine` over a
pool, and ``beluga.bench.mooncake_engine`` over Mooncake Store.

A model on a CUDA device moves its KV through the pool's registered mapping
(:class:`beluga.transfer.gpu.GpuPool`, the mover of its
:class:`~beluga.transfer.EngineBlocks`) instead of the C call; everything
else is the same.  The vLLM connector moves a CUDA KV cache through the same
two pieces (:mod:`beluga.integrations.moves`).

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

import abc
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from beluga.errors import KVLayoutError
from beluga.kv.hashing import HashFn, block_keys, hash_function
from beluga.kv.identity import KVNamespace, ModelIdentity
from beluga.kv.store import BlockRef, KVStore, Saved
from beluga.pool import Geometry, Pool
from beluga.pool.layout import pool_size_for
from beluga.serving.model import KV, ModelEngine
from beluga.transfer import BlockFormat, EngineBlocks
from beluga.transfer.gpu import GpuPool

KV_ORDER = "HND"  # Hugging Face caches are [batch, heads, tokens, dim]: HND blocks
ROLES = ("kv_both", "kv_producer", "kv_consumer")  # vLLM's kv_role names
HANDOFF_TIMEOUT_S = 10.0  # a block another engine is writing commits in milliseconds


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
    save: float  # a kv_producer's includes waiting for blocks other engines were writing
    decode: float = 0.0  # generating the output tokens after the first

    @property
    def ttft(self) -> float:
        """Time to first token: the saving happens after the first token is ready."""
        return self.lookup + self.load + self.compute

    @property
    def busy(self) -> float:
        """How long the request kept the engine busy."""
        return self.ttft + self.save + self.decode


@dataclass
class Served:
    """What serving one request did."""

    num_tokens: int
    cached_tokens: int  # tokens whose KV was read from the pool
    saved_blocks: int
    timings: Timings
    logits: np.ndarray | None  # [computed tokens, vocab] float32, when asked for
    duplicate_blocks: int = 0  # computed here, but another engine had stored or was storing them
    refused_blocks: int = 0  # computed here, not stored (no room, or the write was lost)
    output: tuple[int, ...] = ()  # the generated tokens, greedy

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None with fewer than two."""
        return self.timings.decode / (len(self.output) - 1) if len(self.output) > 1 else None


def leading_run(flags: Sequence[object]) -> int:
    """Length of the leading run of truthy items."""
    return next((i for i, ok in enumerate(flags) if not ok), len(flags))


NOTHING_SAVED = Saved([], [], [])


class CachingEngine(abc.ABC):
    """The request flow of an engine whose prefix cache is a KV store; subclasses are stores.

    A subclass gives the steps: :meth:`keys`, :meth:`_locate` (the leading
    run of stored blocks), :meth:`_fill` (move located blocks into a prefix,
    each validated) and :meth:`_save` (store blocks of a prefill's KV; a
    ``kv_producer``'s save returns once they are committed, waiting up to
    ``handoff_timeout`` for blocks another engine is writing).  ``role`` is one
    of :data:`ROLES`.  Not thread-safe:
    one request at a time; not fork-safe (a store connection is a host's own).
    """

    def __init__(
        self,
        model: ModelEngine,
        *,
        role: str = "kv_both",
        identity: ModelIdentity | None = None,
        handoff_timeout: float = HANDOFF_TIMEOUT_S,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        self.model = model
        self.format = kv_format(model)
        self.identity = identity if identity is not None else model.identity
        self.block_tokens = self.format.spec.block_tokens
        self.role = role
        # the role, read once: what a request does with its blocks after the prefill
        self.saves = role != "kv_consumer"
        self.hands_off = role == "kv_producer"
        self.handoff_timeout = handoff_timeout

    @abc.abstractmethod
    def close(self) -> None:
        """Let go of what the engine holds in its store (before the store closes)."""

    @abc.abstractmethod
    def keys(self, token_ids: Sequence[int], salt: str | None = None) -> list[Any]:
        """The block keys of a prompt, as the store takes them."""

    @abc.abstractmethod
    def _locate(self, keys: list[Any]) -> list[Any]:
        """Where the leading run of stored blocks is (one batched lookup)."""

    @abc.abstractmethod
    def _fill(self, prefix: KV, refs: list[Any]) -> int:
        """Move located blocks into a fresh prefix, each validated: the intact leading run."""

    @abc.abstractmethod
    def _save(self, kv: KV, keys: list[Any], blocks: list[int]) -> Saved:
        """Store these blocks of a prefill's KV (positions in ``Saved`` index ``blocks``)."""

    def serve(
        self,
        token_ids: Sequence[int],
        *,
        salt: str | None = None,
        want_logits: bool = False,
        max_tokens: int = 0,
    ) -> Served:
        """Prefill one prompt through the store's prefix cache, then ``max_tokens`` tokens."""
        clock = time.perf_counter
        start = clock()
        keys = self.keys(token_ids, salt)
        found = self._locate(keys) if keys else []
        looked_up = clock()
        # the last token is always computed (its logits pick the next token)
        loadable = found[: (len(token_ids) - 1) // self.block_tokens]
        prefix, intact = self._load(loadable)
        loaded = clock()
        out = self.model.prefill(token_ids, prefix, all_logits=want_logits)
        computed = clock()
        del prefix  # the prefill's cache holds its own copy: one KV fewer while decoding
        # blocks found but dropped during the load may have changed: write them again
        first = len(found) if intact == len(loadable) else intact
        saved, refused = self._keep(out.kv, keys, first, out.num_full_blocks)
        kept = clock()
        output = self.model.generate(out, max_tokens) if max_tokens else []
        timings = Timings(
            looked_up - start,
            loaded - looked_up,
            computed - loaded,
            kept - computed if self.saves else 0.0,  # steps a request does not take cost nothing
            clock() - kept if max_tokens else 0.0,
        )
        return Served(
            len(token_ids),
            out.num_cached,
            len(saved.stored),
            timings,
            out.logits.float().cpu().numpy() if want_logits else None,
            duplicate_blocks=len(saved.present) + len(saved.in_flight),
            refused_blocks=refused,
            output=tuple(output),
        )

    def _load(self, refs: list[Any]) -> tuple[KV | None, int]:
        """Read the blocks into a fresh prefix, each validated; keep the intact leading run."""
        if not refs:
            return None, 0
        prefix = self.model.empty_prefix(len(refs))
        intact = self._fill(prefix, refs)
        if intact == len(refs):
            return prefix, intact
        if intact == 0:
            return None, 0
        tokens = intact * self.block_tokens
        cut = [(k[:, :, :tokens].contiguous(), v[:, :, :tokens].contiguous()) for k, v in prefix]
        return cut, intact

    def _keep(self, kv: KV, keys: list[Any], first: int, end: int) -> tuple[Saved, int]:
        """Save blocks ``first .. end`` of a prefill, as the role says; what the save did,
        and how many blocks were left out of the store in the end (lost, or still being
        written by another engine when a kv_producer's wait for it ran out)."""
        if not self.saves or end <= first:
            return NOTHING_SAVED, 0
        saved = self._save(kv, keys, list(range(first, end)))
        return saved, len(saved.lost) + len(saved.in_flight)


class ServingEngine(CachingEngine):
    """A model engine whose prefix cache is a KV store on a shared pool.

    ``identity`` overrides the model's own (:attr:`ModelEngine.identity`, a
    fingerprint of its weights), e.g. with
    ``ModelIdentity.explicit(name, revision)``: engines share blocks exactly
    when their identities and block formats agree.  ``role``: one of
    :data:`ROLES`.  ``gpu``: the :class:`GpuPool` that moves the KV (by
    default one is registered for a model on a CUDA device, and closed by
    :meth:`close`; one passed in stays the caller's).  Not thread-safe: one
    request at a time; not fork-safe (its store is not).
    """

    def __init__(
        self,
        model: ModelEngine,
        store: KVStore,
        *,
        role: str = "kv_both",
        identity: ModelIdentity | None = None,
        hash_fn: HashFn | str = "sha256",
        hash_seed: str | None = None,
        handoff_timeout: float = HANDOFF_TIMEOUT_S,
        gpu: GpuPool | None = None,
    ) -> None:
        super().__init__(model, role=role, identity=identity, handoff_timeout=handoff_timeout)
        self.store = store
        check_kv_pool(store.pool, self.format)
        self.hash_fn = hash_function(hash_fn) if isinstance(hash_fn, str) else hash_fn
        self.hash_seed = hash_seed
        # KV on a GPU moves through the registered pool; on the CPU, through one C call
        self.gpu = gpu
        self._owns_gpu = gpu is None and model.device.type == "cuda"
        if self._owns_gpu:
            self.gpu = GpuPool(store.pool, model.device)

    def close(self) -> None:
        """Let go of the GPU registration it made, if any (before the store closes the pool)."""
        if self._owns_gpu and self.gpu is not None:
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

    def _locate(self, keys: list[bytes]) -> list[BlockRef]:
        """The longest run of leading keys the store holds (one batched lookup)."""
        found = self.store.locate(keys, prefix=True)
        return [r for r in found[: leading_run(found)] if r is not None]

    def _fill(self, prefix: KV, refs: list[BlockRef]) -> int:
        """One validated load of the blocks into the prefix: the intact leading run."""
        sink = EngineBlocks(self.model.kv_layout(prefix), np.arange(len(refs)), mover=self.gpu)
        return leading_run(self.store.load(refs, sink, drop_corrupt=True))

    def _save(self, kv: KV, keys: list[bytes], blocks: list[int]) -> Saved:
        """Write these blocks of a prefill's KV into new pool blocks, sealed (a block
        committed already, or being written by another engine, is skipped)."""
        source = EngineBlocks(self.model.kv_layout(kv), blocks, mover=self.gpu)
        # a kv_producer waits for blocks another engine is writing: it hands them off
        wait = self.handoff_timeout if self.hands_off else 0.0
        return self.store.save([keys[b] for b in blocks], source, wait_s=wait)
