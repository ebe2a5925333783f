"""The serving engine's KV path through the store: lookup, load, compute, save.

Two engines (two ModelEngines with one seed, each with its own KVStore and
so its own Memory and RPC ring) stand for two hosts; the metadata server
runs on a thread.  The stores use the non-coherent model, so a block that
engine B reads really went through gather-write, the pool and scatter-read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pytest

from beluga.errors import KVLayoutError
from beluga.kv import KVStore, ModelIdentity
from beluga.pool import Geometry, Pool
from beluga.pool.layout import plan
from beluga.server import MetadataServer
from beluga.serving.engine import (
    ServingEngine,
    check_kv_pool,
    create_kv_pool,
    kv_block_keys,
    kv_format,
    kv_geometry,
    kv_pool_size,
)
from beluga.serving.model import ModelEngine, ModelShape
from beluga.transfer import BlockFormat, EngineBlocks

#: engines save their prefixes to the pool for one another, as in service (tests/conftest.py)
pytestmark = pytest.mark.leaves("keys")
TOLERANCE = 1e-4
SHAPE = ModelShape(num_layers=2)
BS = SHAPE.block_tokens
WAIT_S = 30


@pytest.fixture(scope="module")
def models() -> tuple[ModelEngine, ModelEngine]:
    return ModelEngine(SHAPE, seed=5), ModelEngine(SHAPE, seed=5)


@dataclass
class Hosts:
    pool: Pool
    a: ServingEngine
    b: ServingEngine


@pytest.fixture
def hosts(shm_path: str, models: tuple[ModelEngine, ModelEngine]) -> Iterator[Hosts]:
    fmt = kv_format(models[0])
    pool = create_kv_pool(shm_path, kv_pool_size(64, kv_geometry(fmt)), fmt)
    server = MetadataServer(pool)
    thread = server.start_thread()
    stores = []
    try:
        stores = [KVStore(shm_path, coherence="model") for _ in models]
        yield Hosts(pool, *(ServingEngine(m, s) for m, s in zip(models, stores, strict=True)))
        stats = stores[0].stats()
        assert stats["writes_in_flight"] == 0, "a write was left reserved"
    finally:
        for s in stores:
            s.close()
        server.stop()
        thread.join(10)
        server.close()
        pool.close()
        Pool.destroy(shm_path)


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, SHAPE.vocab_size, n).tolist()


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


def test_host_b_reuses_host_a_blocks_and_matches_full_recomputation(hosts: Hosts) -> None:
    tokens = prompt(1, 5 * BS + 3)
    first = hosts.a.serve(tokens)
    assert (first.cached_tokens, first.saved_blocks) == (0, 5)
    second = hosts.b.serve(tokens, want_logits=True)
    assert (second.cached_tokens, second.saved_blocks) == (5 * BS, 0)
    assert second.logits is not None and second.logits.shape == (3, SHAPE.vocab_size)
    full = hosts.b.model.prefill(tokens).logits.numpy()
    assert max_diff(second.logits, full[5 * BS :]) <= TOLERANCE
    t = second.timings
    assert t.ttft == pytest.approx(t.lookup + t.load + t.compute)
    assert t.busy == pytest.approx(t.ttft + t.save)


def test_a_block_aligned_prompt_still_computes_its_last_block(hosts: Hosts) -> None:
    tokens = prompt(2, 4 * BS)
    assert hosts.a.serve(tokens).saved_blocks == 4
    again = hosts.b.serve(tokens, want_logits=True)
    assert again.cached_tokens == 3 * BS and again.saved_blocks == 0
    assert again.logits is not None and again.logits.shape[0] == BS


def test_a_shared_document_serves_another_question(hosts: Hosts) -> None:
    document = prompt(3, 3 * BS + 5)
    hosts.a.serve(document + prompt(4, 20))
    other = document + prompt(5, 30)
    served = hosts.b.serve(other, want_logits=True)
    assert served.cached_tokens == 3 * BS  # the block that straddles the question differs
    assert served.saved_blocks == len(other) // BS - 3
    full = hosts.b.model.prefill(other).logits.numpy()
    assert served.logits is not None and max_diff(served.logits, full[3 * BS :]) <= TOLERANCE


def test_a_salt_is_a_cache_of_its_own(hosts: Hosts) -> None:
    tokens = prompt(6, 3 * BS + 1)
    hosts.a.serve(tokens, salt="tenant-1")
    assert hosts.b.serve(tokens, salt="tenant-2").cached_tokens == 0
    assert hosts.b.serve(tokens, salt="tenant-1").cached_tokens == 3 * BS
    assert hosts.b.serve(tokens).cached_tokens == 0


def test_a_block_removed_after_the_lookup_ends_the_prefix(
    hosts: Hosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index said the block was there; by the time it is read it is not: the
    validated read drops it and everything after, and never uses its bytes."""
    tokens = prompt(7, 4 * BS + 2)
    hosts.a.serve(tokens)
    read = hosts.b.store.load
    third = hosts.b.keys(tokens)[2]

    def read_after_removal(*args: object, **kwargs: object) -> list[bool]:
        assert hosts.a.store.remove(third)  # the server clears its header
        got = read(*args, **kwargs)  # type: ignore[arg-type]
        assert got == [True, True, False, True]
        return got

    monkeypatch.setattr(hosts.b.store, "load", read_after_removal)
    served = hosts.b.serve(tokens, want_logits=True)
    assert served.cached_tokens == 2 * BS
    # blocks 2 and 3 are computed again; 2 is saved, 3 is still in the pool (skipped)
    assert served.saved_blocks == 1
    assert hosts.a.store.batch_is_exist(hosts.b.keys(tokens)) == [True] * 4
    full = hosts.b.model.prefill(tokens).logits.numpy()
    assert served.logits is not None and max_diff(served.logits, full[2 * BS :]) <= TOLERANCE


def test_a_corrupted_block_is_recomputed_never_used(hosts: Hosts) -> None:
    """Hostile bytes in a committed block's payload: the load's checksum drops it."""
    tokens = prompt(9, 4 * BS + 2)
    hosts.a.serve(tokens)
    (ref,) = hosts.b.store.locate([hosts.b.keys(tokens)[1]], prefix=False)
    assert ref is not None
    with Pool.attach(hosts.b.store.pool.spec) as rogue:
        rogue.memory.nt_store(ref.payload_offset + 100, b"\x7f\x7f\x7f\x7f")
        rogue.memory.sfence()
    served = hosts.b.serve(tokens, want_logits=True)
    assert served.cached_tokens == BS  # block 0 only: block 1 fails its checksum
    full = hosts.b.model.prefill(tokens).logits.numpy()
    assert served.logits is not None and max_diff(served.logits, full[BS:]) <= TOLERANCE


def test_block_keys_carry_the_model_the_kv_format_and_the_salt(hosts: Hosts) -> None:
    tokens = prompt(8, 2 * BS)
    mine = hosts.a.keys(tokens)
    model = hosts.a.identity
    assert model == hosts.b.identity  # two engines of one seed: one model
    assert mine == hosts.b.keys(tokens) == kv_block_keys(hosts.a.format, model, tokens)
    assert len(mine) == 2 and mine != hosts.a.keys(tokens, "salt")
    for order in ("NHD", "CPU"):
        fmt = BlockFormat(hosts.a.format.spec, order)
        assert not set(kv_block_keys(fmt, model, tokens)) & set(mine)
    other = kv_format(ModelEngine(ModelShape(num_layers=1), seed=5))
    assert not set(kv_block_keys(other, model, tokens)) & set(mine)
    named = ModelIdentity.explicit("random-qwen2", "v1")
    assert not set(kv_block_keys(hosts.a.format, named, tokens)) & set(mine)


def test_a_model_of_another_kv_shape_is_refused_before_anything_is_written(
    hosts: Hosts,
) -> None:
    other = ModelEngine(ModelShape(num_layers=3), seed=5)
    before = hosts.a.store.stats()
    with pytest.raises(KVLayoutError, match=r"L2H2D32B16.*L3H2D32B16.*create_kv_pool"):
        ServingEngine(other, hosts.a.store)
    after = hosts.a.store.stats()
    assert after["puts"] == 0  # nothing committed ...
    assert after["blocks_used"] == before["blocks_used"]  # ... nor reserved
    assert after["writes_in_flight"] == 0 and after["keys"] == before["keys"]


def test_a_pool_not_made_for_kv_is_refused(shm_path: str, models: tuple) -> None:
    fmt = kv_format(models[0])
    with (
        Pool.create(shm_path, 32 << 20, geometry=Geometry(max_hosts=4)) as pool,
        pytest.raises(KVLayoutError, match="its label is empty"),
    ):
        check_kv_pool(pool, fmt)


def test_a_pool_with_blocks_too_small_is_refused(shm_path: str) -> None:
    fmt = kv_format(ModelEngine(ModelShape(num_layers=1, head_dim=64), seed=0))
    assert fmt.nbytes > 4096
    small = Geometry(max_hosts=4, block_size=4096)
    with pytest.raises(ValueError, match="cannot hold one"):
        create_kv_pool(shm_path, 32 << 20, fmt, geometry=small)
    with (
        Pool.create(shm_path, 32 << 20, geometry=small, label=fmt.fingerprint) as pool,
        pytest.raises(KVLayoutError, match=f"at least {fmt.pool_block_bytes}"),
    ):
        check_kv_pool(pool, fmt)


def fits(size: int, geometry: Geometry) -> int:
    try:
        return plan(size, geometry).nblocks
    except ValueError:
        return 0


def test_kv_pools_are_labelled_and_sized_for_their_blocks(models: tuple) -> None:
    fmt = kv_format(models[0])
    geometry = kv_geometry(fmt)
    assert geometry.block_size == fmt.pool_block_bytes >= fmt.nbytes
    assert fmt.pool_block_bytes % 4096 == 0 and fmt.pool_block_bytes - fmt.nbytes < 4096
    assert len(fmt.fingerprint.encode()) <= 64
    for blocks in (1, 100, 1000):
        size = kv_pool_size(blocks, geometry)
        assert plan(size, geometry).nblocks >= blocks
        assert fits(size - (2 << 20), geometry) < blocks  # and no smaller pool would do
    with pytest.raises(ValueError, match="at least one block"):
        kv_pool_size(0, geometry)


SAME_SHAPE_MODELS = {
    "llama": (ModelShape(family="llama", num_layers=2), 5),  # another architecture
    "fine-tune": (SHAPE, 6),  # the same architecture with other weights
}


@pytest.mark.parametrize("other", sorted(SAME_SHAPE_MODELS))
def test_two_models_of_one_kv_shape_never_share_a_block(hosts: Hosts, other: str) -> None:
    shape, seed = SAME_SHAPE_MODELS[other]
    model = ModelEngine(shape, seed=seed)
    assert model.kv_spec == hosts.a.model.kv_spec  # the pool's format fits both
    b = ServingEngine(model, hosts.b.store)
    tokens = prompt(9, 4 * BS + 3)
    assert hosts.a.serve(tokens).saved_blocks == 4
    first = b.serve(tokens, want_logits=True)
    assert (first.cached_tokens, first.saved_blocks) == (0, 4)  # not the other model's blocks
    assert not set(b.keys(tokens)) & set(hosts.a.keys(tokens))
    assert hosts.a.store.stats()["keys"] == 8
    for engine in (b, hosts.a):  # each hits its own blocks, and they are its own KV
        again = engine.serve(tokens, want_logits=True)
        assert again.cached_tokens == 4 * BS
        full = engine.model.prefill(tokens).logits.numpy()
        assert again.logits is not None and max_diff(again.logits, full[4 * BS :]) <= TOLERANCE
    assert first.logits is not None
    assert max_diff(first.logits, model.prefill(tokens).logits.numpy()) <= TOLERANCE


def greedy(model: ModelEngine, tokens: list[int], n: int) -> list[int]:
    """A single engine's output: the whole prompt computed, then n tokens decoded."""
    return model.generate(model.prefill(tokens), n)


def test_a_decode_engine_loads_the_whole_prompt_and_generates_a_single_engines_tokens(
    hosts: Hosts,
) -> None:
    tokens = prompt(10, 5 * BS + 7)
    producer = ServingEngine(hosts.a.model, hosts.a.store, role="kv_producer")
    consumer = ServingEngine(hosts.b.model, hosts.b.store, role="kv_consumer")
    prefilled = producer.serve(tokens)
    assert (prefilled.saved_blocks, prefilled.output, prefilled.refused_blocks) == (5, (), 0)
    assert hosts.a.store.batch_is_exist(producer.keys(tokens)) == [True] * 5
    decoded = consumer.serve(tokens, max_tokens=6)
    assert (decoded.cached_tokens, decoded.saved_blocks) == (5 * BS, 0)
    assert list(decoded.output) == greedy(hosts.b.model, tokens, 6)
    assert decoded.timings.decode > 0 and decoded.tpot == decoded.timings.decode / 5
    assert decoded.timings.busy == pytest.approx(decoded.timings.ttft + decoded.timings.decode)


def test_a_block_missing_at_decode_is_recomputed_not_guessed_and_not_saved(hosts: Hosts) -> None:
    tokens = prompt(11, 4 * BS + 3)
    keys = hosts.a.keys(tokens)
    hosts.a.serve(tokens)
    assert hosts.a.store.remove(keys[2])
    consumer = ServingEngine(hosts.b.model, hosts.b.store, role="kv_consumer")
    decoded = consumer.serve(tokens, max_tokens=4, want_logits=True)
    assert (decoded.cached_tokens, decoded.saved_blocks) == (2 * BS, 0)  # blocks 2, 3 computed
    assert hosts.a.store.batch_is_exist(keys) == [True, True, False, True]  # a consumer saves none
    assert list(decoded.output) == greedy(hosts.b.model, tokens, 4)
    full = hosts.b.model.prefill(tokens).logits.numpy()
    assert decoded.logits is not None and max_diff(decoded.logits, full[2 * BS :]) <= TOLERANCE


class HeldBlocks(EngineBlocks):
    """A save source that stops once its extents are reserved: a writer caught mid-write."""

    def __init__(
        self, *args: object, reserved: threading.Event, release: threading.Event, **kw: object
    ) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.reserved, self.release = reserved, release

    def moves(self, mem: object, chosen: Sequence[int], places: Sequence, *, write: bool) -> tuple:
        self.reserved.set()
        assert self.release.wait(WAIT_S), "never released"
        return super().moves(mem, chosen, places, write=write)  # type: ignore[arg-type]


def test_a_prefill_engine_hands_off_only_once_another_writers_blocks_are_committed(
    hosts: Hosts,
) -> None:
    """Engine B reserved the prompt's blocks and is still writing them when engine A, a
    prefill engine, computes the same prompt: A's save skips them (counted as computed
    twice, as the server counts them), waits for them, and A returns only after B has
    committed them."""
    tokens = prompt(12, 4 * BS + 5)
    keys = hosts.b.keys(tokens)
    kv = hosts.b.model.prefill(tokens).kv
    reserved, release = threading.Event(), threading.Event()
    source = HeldBlocks(
        hosts.b.model.kv_layout(kv), list(range(4)), reserved=reserved, release=release
    )
    events: list[str] = []  # B's save can only end after A waits: B is held until then
    writer = threading.Thread(
        target=lambda: events.append(f"B stored {len(hosts.b.store.save(keys, source).stored)}")
    )
    skipped = hosts.a.store.stats()["duplicate_writes_skipped"]

    def release_once_a_waits() -> None:
        deadline = time.monotonic() + WAIT_S
        while hosts.a.store.stats()["duplicate_writes_skipped"] - skipped < 4:
            assert time.monotonic() < deadline, "A never found B's blocks being written"
            time.sleep(0.005)
        events.append("A waits")
        release.set()

    releaser = threading.Thread(target=release_once_a_waits)
    writer.start()
    try:
        assert reserved.wait(WAIT_S)
        producer = ServingEngine(hosts.a.model, hosts.a.store, role="kv_producer")
        releaser.start()
        served = producer.serve(tokens)
        at_handoff = hosts.a.store.batch_is_exist(keys)  # before B's thread may even return
    finally:
        release.set()
        writer.join(WAIT_S)
        releaser.join(WAIT_S)
    assert at_handoff == [True] * 4 and events == ["A waits", "B stored 4"]
    assert (served.saved_blocks, served.duplicate_blocks, served.refused_blocks) == (0, 4, 0)
    assert hosts.a.store.stats()["duplicate_writes_skipped"] - skipped >= 4  # A asked again


def test_roles_are_checked(hosts: Hosts) -> None:
    with pytest.raises(ValueError, match="role must be one of"):
        ServingEngine(hosts.a.model, hosts.a.store, role="kv_proxy")
