"""What the engine's KV looks like to the pool: KV cache groups, layouts and key namespaces.

:func:`engine_kv` reads vLLM's config and KV cache config once, refuses a
setup the connector cannot serve (pipeline parallelism, attention it cannot
move, groups of different block sizes) with a message that names the
setting, and returns the :class:`EngineKV` both halves key and size blocks by.

vLLM's hybrid KV cache manager (on by default, :class:`~.connector.BelugaConnector`
implements ``SupportsHMA``) splits a model that mixes sliding-window and
full-attention layers into KV cache groups, one :class:`KVGroup` each: an
engine block of a group holds that group's layers only, and a sliding-window
group keeps only the blocks inside the window (vLLM makes the others its
null block).  The pool holds one value per (block hash, group, shard), under
a namespace that names the group's layers, so groups never share a key.
Without the hybrid manager a model has one group of every layer, keyed as
before groups existed.
"""

from __future__ import annotations

import dataclasses
import platform
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from beluga.errors import KVLayoutError
from beluga.kv import KVNamespace, ModelIdentity, resolve_model
from beluga.transfer import BlockFormat, KVSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups as the pool stores it; immutable.

    A pool value holds one shard of one engine block of the group: every layer
    of ``layer_names``, K and V (``spec``), under the shard's namespace.
    ``window``: a sliding-window group's window, in tokens (vLLM keeps, and a
    hit needs, only the blocks that the next token attends to); None for full
    attention and MLA, whose hit needs every block of the prefix.
    """

    index: int  # vLLM's KV cache group id
    spec: KVSpec
    layer_names: tuple[str, ...]
    namespaces: tuple[KVNamespace, ...]  # by shard
    window: int | None = None
    retained: int = 0  # tokens vLLM keeps below the window (its extra_retained_tokens)

    @property
    def format(self) -> BlockFormat:
        """How one shard of an engine block lies in its pool value: the CPU_ATTN order, the
        layout of vLLM's CPU backend (``format.nbytes`` is the value's length)."""
        return BlockFormat(self.spec, "CPU")

    def first_kept(self, computed_tokens: int) -> int:
        """The first block that a request with ``computed_tokens`` computed still holds: a
        sliding-window group's blocks before it are vLLM's null block (its
        ``get_num_skipped_tokens``), a full-attention group keeps every block."""
        if self.window is None:
            return 0
        skipped = max(0, computed_tokens - self.window + 1 - self.retained)
        return skipped // self.spec.block_tokens


@dataclass(frozen=True)
class EngineKV:
    """The engine's KV cache groups and the key namespaces their blocks live under; immutable.

    A pool block holds one shard of one group's engine block under that
    shard's namespace.  With attention heads split across tensor-parallel
    ranks, a shard is one rank's KV heads: one namespace per rank, each
    naming the TP size and the rank, so an engine of another TP size, or
    another rank, never reads a shard as its own.  With MLA every rank holds
    the same latent KV: one shard, whose namespace names neither, so rank 0
    saves it once and every rank of any TP size loads it.

    ``epoch``: how many times the engine reset its connector cache
    (``reset_prefix_cache(reset_connector=True)``); from the first reset on
    the namespaces name it (see :meth:`at_epoch`).
    """

    groups: tuple[KVGroup, ...]
    hash_ratio: int  # vLLM block hashes per engine block
    tp_size: int
    attention: str = ""  # the MLA backend whose cache layout the namespaces name; "" for MHA
    epoch: int = 0

    @property
    def block_tokens(self) -> int:
        """Tokens per engine block (every group's)."""
        return self.groups[0].spec.block_tokens

    @property
    def shards(self) -> int:
        """How many shards an engine block has (TP ranks, or 1 for MLA)."""
        return len(self.groups[0].namespaces)

    def shard(self, rank: int) -> int:
        """The shard tensor-parallel ``rank`` holds."""
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"tensor-parallel rank {rank} is not in 0..{self.tp_size - 1}")
        return rank if self.shards > 1 else 0

    def saves(self, rank: int) -> bool:
        """Whether ``rank`` saves its shard (of a replicated one, only rank 0 does)."""
        return self.shard(rank) == rank

    def key(self, block_hash: bytes, shard: int, group: int = 0) -> bytes:
        """The pool key of one shard of one group's engine block with this vLLM hash."""
        return self.groups[group].namespaces[shard].key(bytes(block_hash))

    def at_epoch(self, epoch: int) -> EngineKV:
        """This engine's KV after ``epoch`` resets: the same groups, namespaces that name the
        epoch (none before the first reset), so no key of another epoch is found."""
        if epoch == self.epoch:
            return self

        def moved(ns: KVNamespace) -> KVNamespace:
            base = ns.scope[:-1] if self.epoch else ns.scope
            return KVNamespace(ns.model, ns.layout, (*base, f"reset={epoch}") if epoch else base)

        groups = tuple(
            dataclasses.replace(g, namespaces=tuple(moved(ns) for ns in g.namespaces))
            for g in self.groups
        )
        return dataclasses.replace(self, groups=groups, epoch=epoch)


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


def _attention_kv(spec: Any, num_layers: int, block_size: int) -> KVSpec:
    """Full or sliding-window attention with equal K and V heads as a pool block."""
    kind = type(spec).__name__
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        raise KVLayoutError(
            f"BelugaConnector moves attention with equal K and V head sizes, not this {kind} "
            f"(K {spec.head_size}, V {spec.head_size_v}): remove it from kv_transfer_config"
        )
    dtype = str(spec.dtype).removeprefix("torch.")
    try:
        return KVSpec(num_layers, spec.num_kv_heads, spec.head_size, block_size, dtype)
    except ValueError as e:
        raise KVLayoutError(f"BelugaConnector cannot store this KV cache: {e}") from None


def _check_groups(kv_cache_config: KVCacheConfig, block_size: int) -> None:
    """Refuse groups the connector cannot key by one block hash per engine block."""
    groups = kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    served = ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec")
    other = sorted({k for k in kinds if k not in served})
    if other:
        raise KVLayoutError(
            f"BelugaConnector moves full attention, sliding-window attention and MLA, not "
            f"{', '.join(other)}: remove it from kv_transfer_config"
        )
    if "MLAAttentionSpec" in kinds and len(groups) > 1:
        raise KVLayoutError(
            "BelugaConnector moves MLA as the model's only KV cache group, not beside "
            f"{len(groups) - 1} other groups: set disable_hybrid_kv_cache_manager=True "
            "(--disable-hybrid-kv-cache-manager)"
        )
    sizes = sorted({g.kv_cache_spec.block_size for g in groups})
    if sizes != [block_size]:
        raise KVLayoutError(
            f"the KV cache groups have block sizes {sizes}, not block_size {block_size} "
            "each; BelugaConnector keys every group's blocks by the same block hashes: set "
            "disable_hybrid_kv_cache_manager=True (--disable-hybrid-kv-cache-manager)"
        )


def engine_kv(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> EngineKV:
    """The engine's KV groups and key namespaces; a setup the connector cannot serve raises."""
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
    block_size = vllm_config.cache_config.block_size
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or block_size
    if block_size % hash_block_size:
        raise KVLayoutError(
            f"block_size {block_size} is not a multiple of the prefix-cache hash block size "
            f"{hash_block_size}; set block_size to a multiple of it"
        )
    _check_groups(kv_cache_config, block_size)
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    model = model_identity(vllm_config)
    scope = (
        "vllm",
        str(vllm_config.cache_config.prefix_caching_hash_algo),
        str(extra.get("namespace", "")),
    )
    tp = parallel.tensor_parallel_size
    several = len(kv_cache_config.kv_cache_groups) > 1
    attention = ""
    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec, names = group.kv_cache_spec, tuple(group.layer_names)
        if type(spec).__name__ == "MLAAttentionSpec":
            kv = _mla_kv(spec, len(names), block_size)
            attention = _cpu_mla_backend(vllm_config)
            tag = f"mla-{attention}"
        else:
            kv = _attention_kv(spec, len(names), block_size)
            tag = _layout_tag(vllm_config, kv_cache_config, spec)
        layout = f"{kv!r}/{tag}"
        # one group alone is keyed as before groups existed; several: each names its layers
        group_scope = (*scope, f"kv-cache-group={index}:{','.join(names)}") if several else scope
        if attention:  # every rank holds the same latent KV: one shard, for any TP size
            namespaces: tuple[KVNamespace, ...] = (KVNamespace(model, layout, group_scope),)
        else:
            namespaces = tuple(
                KVNamespace(model, layout, (*group_scope, f"tp-size={tp}", f"tp-rank={rank}"))
                for rank in range(tp)
            )
        window = getattr(spec, "sliding_window", None)
        groups.append(
            KVGroup(
                index,
                kv,
                names,
                namespaces,
                window=window if type(spec).__name__ == "SlidingWindowSpec" else None,
                retained=int(getattr(spec, "extra_retained_tokens", 0) or 0),
            )
        )
    return EngineKV(tuple(groups), block_size // hash_block_size, tp, attention)


def tp_rank(vllm_config: VllmConfig) -> int:
    """This worker's tensor-parallel rank (vLLM's TP group, else the config's rank)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return vllm_config.parallel_config.rank % vllm_config.parallel_config.tensor_parallel_size
