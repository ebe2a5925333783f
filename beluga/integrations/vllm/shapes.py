"""What the engine's KV looks like to the pool: shapes, layouts and key namespaces.

:func:`engine_kv` reads vLLM's config and KV cache config once, refuses a
setup the connector cannot serve (pipeline parallelism, several KV cache
groups, attention it cannot move) with a message that names the setting, and
returns the :class:`EngineKV` both halves key and size blocks by.
"""

from __future__ import annotations

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
    def format(self) -> BlockFormat:
        """How one shard of an engine block lies in its pool value: the CPU_ATTN order, the
        layout of vLLM's CPU backend (``format.nbytes`` is the value's length)."""
        return BlockFormat(self.spec, "CPU")

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
