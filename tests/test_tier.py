"""Pods that share KV through a Mooncake Store cluster (beluga.kv.tier).

A pod is a pool and its metadata server.  Two pods here (two pools, two
servers) share one real Mooncake cluster on loopback: a master and two
storage processes.  An engine in pod B hits blocks first written in pod A,
through Mooncake, with logits equal to a full recompute; once promoted, pod B
serves them from its own pool.  A server demotes what it evicts.  When the
tier is unreachable a pod keeps serving from its pool, with one warning.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest

from beluga.bench.mooncake import MooncakeBaseline
from beluga.errors import BackendUnavailableError
from beluga.kv import KVStore
from beluga.kv.tier import MooncakeTier, TierConfig
from beluga.kv.tier.mooncake import check_available
from beluga.pool import Geometry, Pool
from beluga.server import MetadataServer
from beluga.serving.engine import (
    ServingEngine,
    create_kv_pool,
    kv_format,
    kv_geometry,
    kv_pool_size,
)
from beluga.serving.model import ModelEngine, ModelShape

from .test_store import value_of

#: pods keep the blocks their engines saved, as in service (tests/conftest.py)
pytestmark = pytest.mark.leaves("keys")
SHAPE = ModelShape(num_layers=2)
BS = SHAPE.block_tokens
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def cluster() -> Iterator[MooncakeBaseline]:
    try:
        check_available()
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    with MooncakeBaseline(
        segment_size=64 << 20, local_buffer_size=16 << 20, storage_processes=2
    ) as mc:
        yield mc


@pytest.fixture(scope="module")
def tier(cluster: MooncakeBaseline) -> Iterator[MooncakeTier]:
    """One client of the cluster for this process (pods on other machines have their own)."""
    t = MooncakeTier(TierConfig(cluster.metadata_url, cluster.master_address, write_through=True))
    yield t
    t.close()


@dataclass
class Pod:
    pool: Pool
    server: MetadataServer
    store: KVStore


@contextmanager
def pod(
    size: int, fmt_pool: object, tier: MooncakeTier | None, **server_options: object
) -> Iterator[Pod]:
    """A pool of its own, its metadata server (on a thread) and one client store."""
    path = f"/dev/shm/beluga-test-pod-{uuid.uuid4().hex[:12]}"
    pool = fmt_pool(path, size) if callable(fmt_pool) else Pool.create(path, size)
    server = MetadataServer(pool, tier=tier, **server_options)
    thread = server.start_thread()
    store = None
    try:
        store = KVStore(path, tier=tier)
        yield Pod(pool, server, store)
    finally:
        if store is not None:
            store.close()
        server.stop()
        thread.join(10)
        server.close()
        pool.close()
        Pool.destroy(path)


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, SHAPE.vocab_size, n).tolist()


def test_pod_b_hits_pod_a_blocks_through_mooncake(tier: MooncakeTier) -> None:
    model_a, model_b = ModelEngine(SHAPE, seed=5), ModelEngine(SHAPE, seed=5)
    fmt = kv_format(model_a)
    size = kv_pool_size(64, kv_geometry(fmt))

    def make(path: str, n: int) -> Pool:
        return create_kv_pool(path, n, fmt)

    tokens = prompt(11, 5 * BS + 3)
    with pod(size, make, tier) as a, pod(size, make, tier) as b:
        first = ServingEngine(model_a, a.store).serve(tokens)
        assert (first.cached_tokens, first.saved_blocks) == (0, 5)
        assert tier.flush(30), "the write-through queue did not drain"
        engine_b = ServingEngine(model_b, b.store)
        lookups = tier.counters["tier_lookups"]
        second = engine_b.serve(tokens, want_logits=True)
        assert second.cached_tokens == 5 * BS, "pod B did not find pod A's blocks in Mooncake"
        full = model_b.prefill(tokens).logits.numpy()
        assert second.logits is not None
        assert float(np.abs(second.logits - full[5 * BS :]).max()) <= TOLERANCE
        stats = b.store.stats()
        assert stats["promotions"] >= 5 and stats["tier_hits"] >= 5
        assert tier.counters["tier_lookups"] > lookups
        # promoted: pod B's next request is served from its own pool, not the tier
        lookups = tier.counters["tier_lookups"]
        third = engine_b.serve(tokens, want_logits=True)
        assert third.cached_tokens == 5 * BS and tier.counters["tier_lookups"] == lookups


def test_a_pod_demotes_what_it_evicts(tier: MooncakeTier) -> None:
    geometry = Geometry(max_hosts=4, rpc_bytes_per_host=256 << 10, block_size=16 << 10)

    def make(path: str, n: int) -> Pool:
        return Pool.create(path, n, geometry=geometry)

    reading = MooncakeTier(TierConfig(tier.config.metadata_url, tier.config.master_address))
    try:
        with pod(16 << 20, make, reading) as b:
            no_write_through = MooncakeTier(
                TierConfig(tier.config.metadata_url, tier.config.master_address)
            )
            try:
                with pod(16 << 20, make, no_write_through) as a:
                    tag = uuid.uuid4().hex[:8]
                    keys = [f"{tag}-{i}" for i in range(a.pool.superblock.nblocks + 40)]
                    for k in keys:
                        a.store.put(k, value_of(k, 12000))
                    assert no_write_through.flush(30)
                    stats = a.store.stats()
                    assert stats["evictions"] >= 40 and stats["demotions"] >= 40
                    assert a.store.index.get(keys[0]) is None  # evicted from pod A's pool
            finally:
                no_write_through.close()
            assert b.store.get(keys[0]) == value_of(keys[0], 12000)  # demoted, found by pod B
            assert b.store.index.get(keys[0]) == value_of(keys[0], 12000)  # and promoted
    finally:
        reading.close()


def test_an_unreachable_tier_keeps_the_pod_serving(
    shm_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    def down(_: TierConfig) -> object:
        raise ConnectionRefusedError("no Mooncake master at 127.0.0.1:1")

    tier = MooncakeTier(TierConfig("http://127.0.0.1:1/metadata", "127.0.0.1:1"), connect=down)
    geometry = Geometry(max_hosts=4, rpc_bytes_per_host=256 << 10, block_size=16 << 10)
    try:
        with (
            caplog.at_level(logging.WARNING, "beluga.tier"),
            pod(16 << 20, lambda p, n: Pool.create(p, n, geometry=geometry), tier) as a,
        ):
            a.store.put("here", b"in the pool")
            for _ in range(3):
                assert a.store.get("here") == b"in the pool"
                assert a.store.get("absent") is None and not a.store.is_exist("absent")
                assert a.store.lookup_prefix(["here", "absent"]) == 1
            stats = a.store.stats()["client_tier"]
            assert stats["tier_up"] is False and stats["tier_outages"] == 1
        warnings = [r for r in caplog.records if r.name == "beluga.tier"]
        assert len(warnings) == 1 and "serving from the pool alone" in warnings[0].getMessage()
    finally:
        tier.close()


def test_a_tier_spec_parses_and_refuses_nonsense() -> None:
    c = TierConfig.parse("mooncake:http://h:8080/metadata,h:50051,write-through")
    assert (c.metadata_url, c.master_address, c.write_through) == (
        "http://h:8080/metadata",
        "h:50051",
        True,
    )
    assert TierConfig.parse(c.spec()) == c
    for bad in ("redis:x,y", "mooncake:only-one", "mooncake:a,b,c"):
        with pytest.raises(ValueError, match="a tier is 'mooncake:"):
            TierConfig.parse(bad)
    assert os.environ.get("BELUGA_TIER") is None
