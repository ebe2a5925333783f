"""Many engines, one pool: engine processes and the metadata server process, driven from here.

Each engine is its own process with its own mapping and RPC ring (an
emulated host), in the non-coherent model, so a block engine B loads from
the pool is one engine A wrote there, through flushes and invalidations.
Processes are forked to keep this quick; ``beluga demo`` spawns them.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from beluga.errors import KVLayoutError, ServingError
from beluga.kv import KVStore, ModelIdentity
from beluga.pool import Pool
from beluga.serving.cluster import Cluster, EngineConfig
from beluga.serving.engine import create_kv_pool, kv_format, kv_geometry, kv_pool_size
from beluga.serving.model import ModelEngine, ModelShape
from beluga.serving.scheduler import LocalityAware, LocalityFree
from beluga.serving.trace import TraceShape, lv_eval_trace
from tests.conftest import PREFIX, SHM

SHAPE = ModelShape(num_layers=2)
SEED = 9
BS = SHAPE.block_tokens
TOLERANCE = 1e-4


class Pinned:
    """Routes every request to the engines named, in turn."""

    name = "pinned"

    def __init__(self, *engines: int) -> None:
        self.engines = list(engines)

    def route(self, token_ids: Sequence[int], outstanding: Sequence[int]) -> int:
        return self.engines.pop(0)


def make_pool(path: str, blocks: int = 256) -> None:
    fmt = kv_format(ModelEngine(SHAPE, seed=SEED))
    create_kv_pool(path, kv_pool_size(blocks, kv_geometry(fmt)), fmt).close()


def cluster_on(
    path: str,
    shape: ModelShape = SHAPE,
    engines: int = 2,
    reply_timeout: float = 60,
    seed: int = SEED,
    identity: ModelIdentity | None = None,
    roles: Sequence[str] | None = None,
) -> Cluster:
    config = EngineConfig(shape, seed=seed, coherence="model", identity=identity)
    return Cluster(
        path,
        config,
        engines=engines,
        roles=roles,
        start_timeout=60,
        reply_timeout=reply_timeout,
        start_method="fork",
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    path = os.path.join(SHM, f"{PREFIX}cluster")
    make_pool(path)
    try:
        with cluster_on(path) as c:
            yield c
    finally:
        Pool.destroy(path)


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, SHAPE.vocab_size, n).tolist()


def test_engine_b_hits_the_blocks_engine_a_wrote_with_recomputed_logits(cluster: Cluster) -> None:
    tokens = prompt(1, 6 * BS + 7)
    (first,) = cluster.run([tokens], Pinned(0), salt="cross-host")
    (second,) = cluster.run([tokens], Pinned(1), salt="cross-host", want_logits=True)
    assert first.engine == 0 and second.engine == 1
    assert (first.served.cached_tokens, first.served.saved_blocks) == (0, 6)
    assert (second.served.cached_tokens, second.served.saved_blocks) == (6 * BS, 0)
    full = ModelEngine(SHAPE, seed=SEED).prefill(tokens).logits.numpy()
    logits = second.served.logits
    assert logits is not None and logits.shape == (7, SHAPE.vocab_size)
    assert float(np.abs(logits - full[6 * BS :]).max()) <= TOLERANCE


def test_a_trace_replayed_twice_hits_under_either_scheduler(cluster: Cluster) -> None:
    shape = TraceShape(documents=2, min_questions=2, max_questions=3, context_tokens=4 * BS)
    trace = lv_eval_trace(shape, SHAPE.vocab_size, seed=3)
    prompts = [r.token_ids for r in trace]
    for scheduler in (LocalityFree(2), LocalityAware(2)):
        passes = [cluster.run(prompts, scheduler, salt=scheduler.name) for _ in range(2)]
        for records in passes:
            assert [r.index for r in records] == list(range(len(trace)))
            assert all(r.queue >= 0 and r.ttft >= r.served.timings.ttft for r in records)
        for r in passes[1]:  # pass 1 stored every full block
            n = r.served.num_tokens
            assert r.served.cached_tokens == (n - 1) // BS * BS
            assert r.served.saved_blocks == 0
    homes = {(r.document, rec.engine) for r, rec in zip(trace, passes[0], strict=True)}
    assert len(homes) == shape.documents  # locality-aware: one engine per document


OTHER_MODELS = {
    "llama": (ModelShape(family="llama", num_layers=2), SEED, None),
    "fine-tune": (SHAPE, SEED + 1, None),
    # the same weights under a revision the user names: not the fingerprinted blocks
    "explicit-revision": (SHAPE, SEED, ModelIdentity.explicit("tiny-qwen2", "r2")),
}


@pytest.mark.leaves("keys")
def test_models_of_one_kv_shape_share_a_pool_but_never_a_block(shm_path: str) -> None:
    make_pool(shm_path)
    tokens = prompt(4, 4 * BS + 5)
    with cluster_on(shm_path, engines=1) as c:
        (first,) = c.run([tokens], Pinned(0))
        assert first.served.saved_blocks == 4
    for n, name in enumerate(sorted(OTHER_MODELS), start=2):
        shape, seed, identity = OTHER_MODELS[name]
        full = ModelEngine(shape, seed=seed).prefill(tokens).logits.numpy()
        with cluster_on(shm_path, shape, seed=seed, identity=identity) as c:
            (miss,) = c.run([tokens], Pinned(0), want_logits=True)
            (hit,) = c.run([tokens], Pinned(1), want_logits=True)
            with KVStore(shm_path) as store:
                assert store.stats()["keys"] == 4 * n, name  # four blocks per model
        assert (miss.served.cached_tokens, miss.served.saved_blocks) == (0, 4), name
        assert (hit.served.cached_tokens, hit.served.saved_blocks) == (4 * BS, 0), name
        for record in (miss, hit):
            logits = record.served.logits
            assert logits is not None
            assert float(np.abs(logits - full[-len(logits) :]).max()) <= TOLERANCE, name


def test_an_engine_for_another_kv_shape_is_refused_at_start(shm_path: str) -> None:
    make_pool(shm_path)
    with pytest.raises(KVLayoutError, match="L3H2D32B16"):
        cluster_on(shm_path, ModelShape(num_layers=3), engines=1).start()


def test_a_dead_engine_is_reported_not_waited_for(shm_path: str) -> None:
    make_pool(shm_path)
    with cluster_on(shm_path, engines=1) as c:
        os.kill(c.pids[0], signal.SIGKILL)
        with pytest.raises(ServingError, match=r"engine 0 .* exited with code -9"):
            c.run([prompt(2, 40)], LocalityFree(1))


@pytest.mark.leaves("keys")
def test_a_stalled_engine_times_out(shm_path: str) -> None:
    make_pool(shm_path)
    with cluster_on(shm_path, engines=1, reply_timeout=1.0) as c:
        os.kill(c.pids[0], signal.SIGSTOP)
        try:
            with pytest.raises(ServingError, match="no engine answered within 1 s"):
                c.run([prompt(3, 40)], LocalityFree(1))
        finally:
            os.kill(c.pids[0], signal.SIGCONT)


def test_a_cluster_without_its_pool_says_so(shm_path: str) -> None:
    with pytest.raises(ServingError, match=r"metadata server .* exited"):
        cluster_on(shm_path).start()


def test_a_cluster_must_be_started_and_routed_sensibly(shm_path: str) -> None:
    with pytest.raises(ValueError, match="at least one engine"):
        cluster_on(shm_path, engines=0)
    with pytest.raises(ServingError, match="not started"):
        cluster_on(shm_path).run([[1, 2]], LocalityFree(2))


@pytest.mark.leaves("keys")  # the prompt's blocks, which the decode engine loaded
def test_a_disaggregated_run_prefills_on_one_engine_and_decodes_a_single_engines_tokens(
    shm_path: str,
) -> None:
    """Prefill engine 0 saves each prompt's blocks; decode engine 1 loads them all, computes
    only the last partial block and generates what one engine alone would have."""
    make_pool(shm_path)
    document = prompt(20, 3 * BS)
    prompts = [document + prompt(21, 9), document + prompt(22, 20), prompt(23, 2 * BS + 1)]
    model = ModelEngine(SHAPE, seed=SEED)
    want = [model.generate(model.prefill(p), 5) for p in prompts]
    with cluster_on(shm_path, roles=["kv_producer", "kv_consumer"]) as c:
        runs = c.run_disaggregated(prompts, LocalityFree(1), LocalityFree(1), max_tokens=5)
    assert [list(r.decode.served.output) for r in runs] == want
    for run, tokens in zip(runs, prompts, strict=True):
        prefill, decode = run.prefill, run.decode
        assert (prefill.engine, decode.engine) == (0, 1)
        assert prefill.served.output == () and decode.served.saved_blocks == 0
        assert decode.served.cached_tokens == (len(tokens) - 1) // BS * BS
        assert prefill.end <= decode.arrival <= decode.start  # decode follows the commit
        assert 0 < run.handoff < run.ttft
        assert run.ttft == pytest.approx(decode.start + decode.served.timings.ttft)
    # the document's blocks are saved once, by the first prefill; the second hits them
    assert [r.prefill.served.saved_blocks for r in runs] == [3, 1, 2]
    assert runs[1].prefill.served.cached_tokens == 3 * BS


def test_a_disaggregated_run_needs_both_roles(cluster: Cluster) -> None:
    with pytest.raises(ServingError, match="kv_producer and kv_consumer engines"):
        cluster.run_disaggregated([prompt(24, 20)], LocalityFree(1), LocalityFree(1), max_tokens=2)
    with pytest.raises(ValueError, match="roles must be 2 of"):
        cluster_on("/nowhere", roles=["kv_both", "kv_decode"])
