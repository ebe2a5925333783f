"""BelugaConnector: the class vLLM loads; it only forwards each hook to its role's half.

Beside the v1 API's hooks it implements ``SupportsHMA`` (vLLM's hybrid KV
cache manager: every KV cache group, see :mod:`.shapes`), ``take_events``
(:mod:`.events`), ``reset_cache`` (an epoch, see :mod:`.scheduler`) and
reports its hits as host memory (``CacheHitSource.HOST``: the pool is memory
each host maps).  Sleep mode is refused: it discards and remaps the GPU KV
cache under the addresses BelugaConnector's moves were built over.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from beluga.integrations._link import StoreLink
from beluga.integrations.vllm.metrics import BelugaConnectorStats, BelugaPromMetrics
from beluga.integrations.vllm.options import Options
from beluga.integrations.vllm.scheduler import BelugaMetadata, BelugaScheduler
from beluga.integrations.vllm.shapes import engine_kv, tp_rank
from beluga.integrations.vllm.worker import BelugaWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class BelugaConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over a Beluga pool: forwards each hook to its role's half.

    ``scheduler`` (a :class:`BelugaScheduler`) in the engine core,
    ``worker`` (a :class:`BelugaWorker`) in the model runner; the other is
    None.  Not thread-safe, as its halves.  Its pool connection is fork-safe
    (a forked child connects its own), but vLLM builds connectors in the
    processes that use them, and so should anyone else.
    """

    _cache_hit_source = CacheHitSource.HOST

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """No (vLLM >= 0.33 asks): see the module docstring."""
        return False

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.model_config is not None and vllm_config.model_config.enable_sleep_mode:
            raise ValueError(
                "BelugaConnector does not follow sleep mode (it discards and remaps the KV "
                "cache, on GPUs, where BelugaConnector does not run): set "
                "enable_sleep_mode=False (drop --enable-sleep-mode), or remove BelugaConnector "
                "from --kv-transfer-config"
            )
        config = self._kv_transfer_config
        self.options = Options.of(config.kv_role, config.kv_connector_extra_config)
        self.kv = engine_kv(vllm_config, kv_cache_config)
        self.link = StoreLink(
            self.options.pool,
            who=f"BelugaConnector ({role.name.lower()})",
            coherence=self.options.coherence,
            timeout_s=self.options.timeout_s,
            retry_s=self.options.retry_s,
        )
        self.scheduler: BelugaScheduler | None = None
        self.worker: BelugaWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            assert kv_cache_config is not None  # engine_kv refused None
            self.scheduler = BelugaScheduler(
                vllm_config, kv_cache_config, self.kv, self.link, self.options
            )
        else:
            events = vllm_config.kv_events_config
            self.worker = BelugaWorker(
                self.kv,
                self.link,
                self.options,
                tp_rank(vllm_config),
                events=events is not None and bool(events.enable_kv_cache_events),
            )

    # ==============================
    # Scheduler side
    # ==============================

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        assert self.scheduler is not None
        self.scheduler.null_block = gpu_block_pool.null_block.block_id

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
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

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def take_events(self) -> Iterable[KVCacheEvent]:
        assert self.scheduler is not None
        return self.scheduler.take_events()

    def reset_cache(self) -> bool:
        assert self.scheduler is not None
        return self.scheduler.reset_cache()

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

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        assert self.worker is not None
        return self.worker.get_kv_cache_events()

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


def register_by_name() -> None:
    """Register the class under its name: ``MultiConnector`` rebuilds a child's stats by name.

    vLLM looks a connector loaded by ``kv_connector_module_path`` up by its
    class name only there; loading the module (which vLLM does wherever it
    builds the connector or its metrics) registers it.
    """
    with contextlib.suppress(ValueError):  # registered already: this module, loaded again
        KVConnectorFactory.register_connector(
            BelugaConnector.__name__, "beluga.integrations.vllm", BelugaConnector.__name__
        )
