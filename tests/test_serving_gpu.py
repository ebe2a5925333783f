"""Serving as the paper does, on GPUs: real-sized engines, several on one GPU, clear refusals.

On a GPU machine one command runs every test here, the CUDA ones included::

    python setup.py build_ext --inplace -q && python -m pytest -v -rs tests/test_serving_gpu.py

Everywhere else the tests marked ``cuda`` skip and say why, and the rest run
the same code at a tiny size on the CPU: bfloat16 engines, the GPU data path
driven through the stand-in CUDA runtime of tests/test_transfer_gpu.py (which
"registers" by bookkeeping and runs the kernel's rows with memmove), the
version refusals (versions faked, nothing installed), the memory budgets, the
LV-Eval-like trace and the automatic rate.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import transformers

from beluga.bench import e2e, e2e_pd, e2e_report, e2e_settings
from beluga.bench.mooncake import MooncakeBaseline
from beluga.bench.mooncake_engine import MooncakeServingEngine
from beluga.cli import demo
from beluga.errors import BackendUnavailableError, ServingError
from beluga.kv import KVStore
from beluga.kv.tier.mooncake import check_available
from beluga.pool import Pool
from beluga.server import MetadataServer
from beluga.serving import cluster as cluster_module
from beluga.serving import model as model_module
from beluga.serving.cluster import Cluster, EngineConfig, check_gpu_budget
from beluga.serving.engine import (
    ServingEngine,
    create_kv_pool,
    kv_format,
    kv_geometry,
    kv_pool_size,
)
from beluga.serving.model import (
    CONTEXT_BYTES,
    QWEN2_7B,
    SUPPORTED,
    ModelEngine,
    ModelShape,
    engine_memory_bytes,
)
from beluga.serving.trace import LV_EVAL_15K, TraceShape, lv_eval_trace
from beluga.transfer.gpu import GpuPool
from tests.test_transfer_gpu import StandInCuda

SHAPE = ModelShape(num_layers=2)
BS = SHAPE.block_tokens
TOLERANCE = 1e-4  # float32 logits, a prefix reused against recomputed
H200_BYTES = 143_771 << 20  # the total memory the lent H200 reported (2026-12-04)
TOY = TraceShape(documents=2, min_questions=2, max_questions=2, context_tokens=64)
HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(
    not HAS_CUDA,
    reason="no CUDA device (torch.cuda.is_available() is False): run this module on a GPU "
    "machine with: python -m pytest -v -rs tests/test_serving_gpu.py",
)


def prompt(seed: int, n: int, vocab: int = SHAPE.vocab_size) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def cut(kv: list, n: int) -> list:
    return [(k[:, :, :n].contiguous(), v[:, :, :n].contiguous()) for k, v in kv]


class Hosts:
    """A KV pool attached in native coherence (the GPU path needs it), its metadata server on
    a thread, and one store per engine; every key a test saves is removed before the pool
    goes, so the pool is left as it was found."""

    def __init__(self, path: str, model: ModelEngine, stores: int, blocks: int) -> None:
        fmt = kv_format(model)
        self.pool = create_kv_pool(path, kv_pool_size(blocks, kv_geometry(fmt)), fmt)
        self.server = MetadataServer(self.pool)
        self.thread = self.server.start_thread()
        self.stores = [KVStore(path, coherence="native") for _ in range(stores)]
        self.saved: list[bytes] = []

    def remove_saved(self) -> None:
        """Remove every key saved (each must be there: a key that vanished is a bug)."""
        keys = list(dict.fromkeys(self.saved))
        gone = [self.stores[0].remove(k) for k in keys]
        assert all(gone), f"{gone.count(False)} of {len(keys)} saved keys were not in the pool"
        self.saved.clear()

    def close(self) -> None:
        for s in self.stores:
            s.close()
        self.server.stop()
        self.thread.join(10)
        self.server.close()
        self.pool.close()
        Pool.destroy(self.pool.spec)


@contextlib.contextmanager
def hosts(path: str, model: ModelEngine, stores: int = 2, blocks: int = 64) -> Iterator[Hosts]:
    h = Hosts(path, model, stores, blocks)
    try:
        yield h
        h.remove_saved()
    finally:
        h.close()


# -- refusals: library versions -------------------------------------------------


def fake_version(monkeypatch: pytest.MonkeyPatch, name: str, version: str) -> None:
    """Make the engine see ``version`` of library ``name`` (the others as they are)."""
    real = model_module.library_version
    monkeypatch.setattr(
        model_module, "library_version", lambda lib: version if lib == name else real(lib)
    )


def test_a_transformers_older_than_supported_is_refused_at_engine_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """transformers 5.17 ignores ``cache=`` and the engine got no KV back: refuse it, naming
    the version found and the range needed."""
    fake_version(monkeypatch, "transformers", "5.17.0")
    with pytest.raises(BackendUnavailableError, match=r"transformers 5\.17\.0 .*>=5\.24,<6"):
        ModelEngine(SHAPE)


@pytest.mark.parametrize("version", ["2.3.1+cu121", "2.15.0", "nightly"])
def test_a_torch_outside_the_supported_range_is_refused(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    fake_version(monkeypatch, "torch", version)
    with pytest.raises(
        BackendUnavailableError, match=rf"torch {re.escape(version)} .*>=2\.4,<2\.15"
    ):
        ModelEngine(SHAPE)


@pytest.mark.parametrize(
    ("name", "version"), [("torch", "2.11.0+cu130"), ("transformers", "5.24.0.dev0")]
)
def test_versions_inside_the_range_start(
    monkeypatch: pytest.MonkeyPatch, name: str, version: str
) -> None:
    """The lent GPU machine's torch build, and a development transformers at the floor."""
    fake_version(monkeypatch, name, version)
    assert ModelEngine(ModelShape(num_layers=1)).prefill(prompt(1, 20)).num_cached == 0


def test_the_supported_versions_are_the_projects() -> None:
    """The ranges the engine enforces are the ones pyproject's ``model`` extra installs, and
    the versions it checks are those imported."""
    assert model_module.library_version("torch") == str(torch.__version__)
    assert model_module.library_version("transformers") == transformers.__version__
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    project = tomllib.loads(pyproject.read_text())["project"]
    extra = {r.split(">=")[0]: r for r in project["optional-dependencies"]["model"]}
    for name, (least, below) in SUPPORTED.items():
        floor, ceiling = (".".join(map(str, v)) for v in (least, below))
        assert extra[name] == f"{name}>={floor},<{ceiling}"


def test_a_cluster_engine_with_an_old_transformers_fails_its_start(
    shm_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal reaches the driver from the engine process (forked: it inherits the fake)."""
    fmt = kv_format(ModelEngine(SHAPE))
    create_kv_pool(shm_path, kv_pool_size(16, kv_geometry(fmt)), fmt).close()
    fake_version(monkeypatch, "transformers", "5.17.0")
    config = EngineConfig(SHAPE, coherence="model")
    cluster = Cluster(shm_path, config, engines=1, start_timeout=60, start_method="fork")
    try:
        with pytest.raises(BackendUnavailableError, match=r"transformers 5\.17\.0"):
            cluster.start()
    finally:
        cluster.close()
        Pool.destroy(shm_path)


def test_a_transformers_that_ignores_the_cache_is_caught_not_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever the version says: a model that builds its own cache instead of filling the
    one passed leaves the engine no KV to save or reuse; that stops the prefill."""
    model = ModelEngine(SHAPE)
    forward = model.model.forward

    def ignoring_the_cache(*args: object, cache: object = None, **kwargs: object) -> object:
        return forward(*args, **kwargs)  # as 5.17 did: its own DynamicCache

    monkeypatch.setattr(model.model, "forward", ignoring_the_cache)
    with pytest.raises(ServingError, match="did not fill the KV cache"):
        model.prefill(prompt(2, 40))


# -- the model: any dtype, made where it runs --------------------------------------


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_parameter_count_is_the_models(family: str) -> None:
    shape = dataclasses.replace(SHAPE, family=family)
    model = ModelEngine(shape).model
    assert shape.num_params == sum(p.numel() for p in model.parameters())


def test_qwen2_7b_has_qwen2_7bs_parameters_and_kv_blocks() -> None:
    """Qwen2-7B: 7.62 B parameters (its model card), 896 KiB bfloat16 KV per 16 tokens."""
    assert round(QWEN2_7B.num_params / 1e9, 2) == 7.62
    assert dataclasses.replace(QWEN2_7B, num_layers=1).num_params == sum(
        p.numel() for p in _meta_model(dataclasses.replace(QWEN2_7B, num_layers=1)).parameters()
    )
    assert 2 * QWEN2_7B.kv_spec("bfloat16").section_bytes * QWEN2_7B.num_layers == 896 << 10


def _meta_model(shape: ModelShape) -> torch.nn.Module:
    """A model of ``shape`` with no storage (only its parameter count is read)."""
    config = transformers.Qwen2Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        return transformers.Qwen2ForCausalLM(config)


def test_a_bfloat16_engine_is_made_in_bfloat16_and_keys_apart_from_float32() -> None:
    wide = ModelEngine(SHAPE, seed=3)
    narrow = ModelEngine(SHAPE, seed=3, dtype="bfloat16")
    assert {p.dtype for p in narrow.model.parameters()} == {torch.bfloat16}
    assert narrow.kv_spec.dtype == "bfloat16" and kv_format(narrow) != kv_format(wide)
    assert narrow.identity != wide.identity
    assert narrow.empty_prefix(2)[0][0].dtype == torch.bfloat16
    out = narrow.prefill(prompt(3, 40))
    assert out.kv[0][0].dtype == torch.bfloat16 and out.logits.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        ModelEngine(SHAPE, dtype="int8")


def test_one_seed_draws_one_model_and_norms_start_at_one() -> None:
    one, same, other = (ModelEngine(SHAPE, seed=s, dtype="bfloat16") for s in (4, 4, 5))
    for (name, a), b, c in zip(
        one.model.named_parameters(),
        same.model.parameters(),
        other.model.parameters(),
        strict=True,
    ):
        assert torch.equal(a, b), name
        if "norm" in name:
            assert torch.equal(a, torch.ones_like(a)) and torch.equal(c, a), name
        else:
            assert not torch.equal(a, c), name


def test_only_the_last_tokens_logits_are_made_unless_all_are_asked_for() -> None:
    model = ModelEngine(SHAPE, seed=6)
    tokens = prompt(6, 3 * BS + 5)
    full = model.prefill(tokens)
    last = model.prefill(tokens, all_logits=False)
    assert full.logits.shape == (len(tokens), SHAPE.vocab_size)
    assert last.logits.shape == (1, SHAPE.vocab_size)
    assert float((last.logits[0] - full.logits[-1]).abs().max()) <= TOLERANCE
    assert model.generate(last, 3) == model.generate(full, 3)


def test_bfloat16_engines_reuse_each_others_blocks_bit_exactly(shm_path: str) -> None:
    """A bfloat16 hit is exactly the prefill given the writer's own prefix: every byte of the
    KV went through the pool unchanged."""
    writer, reader = (ModelEngine(SHAPE, seed=7, dtype="bfloat16") for _ in range(2))
    tokens = prompt(7, 5 * BS + 3)
    with hosts(shm_path, writer) as h:
        engines = [ServingEngine(m, s) for m, s in zip((writer, reader), h.stores, strict=True)]
        h.saved += engines[0].keys(tokens)[:5]
        assert engines[0].serve(tokens).saved_blocks == 5
        hit = engines[1].serve(tokens, want_logits=True)
        assert hit.cached_tokens == 5 * BS and hit.logits is not None
        own = writer.prefill(tokens)
        expected = reader.prefill(tokens, cut(own.kv, 5 * BS)).logits.float().numpy()
        assert np.array_equal(hit.logits.astype(np.float32), expected)


# -- the GPU data path, driven on the CPU -----------------------------------------------


def test_engines_moving_kv_through_a_gpu_pool_share_prefixes(shm_path: str) -> None:
    """ServingEngine with a GpuPool (the stand-in runtime: the rows it would hand the
    kernel, copied with memmove): each save and load is one launch over the registered pool,
    and the hit's logits are the CPU path's, which match recomputation."""
    models = [ModelEngine(SHAPE, seed=8) for _ in range(3)]
    tokens = prompt(8, 5 * BS + 3)
    with hosts(shm_path, models[0], stores=3) as h:
        runtimes = [StandInCuda(), StandInCuda()]
        gpus = [GpuPool(h.stores[i].pool, runtime=runtimes[i]) for i in range(2)]
        try:
            engines = [ServingEngine(models[i], h.stores[i], gpu=gpus[i]) for i in range(2)]
            h.saved += engines[0].keys(tokens)[:5]
            assert engines[0].serve(tokens).saved_blocks == 5
            assert runtimes[0].launches > 0 and runtimes[1].launches == 0  # the save's copies
            hit = engines[1].serve(tokens, want_logits=True)
            assert hit.cached_tokens == 5 * BS and runtimes[1].launches > 0  # the load's
            cpu_path = ServingEngine(models[2], h.stores[2])  # the C call, same blocks
            assert cpu_path.gpu is None
            on_cpu = cpu_path.serve(tokens, want_logits=True)
            assert on_cpu.cached_tokens == 5 * BS
            assert hit.logits is not None and on_cpu.logits is not None
            assert np.array_equal(hit.logits, on_cpu.logits)
            full = models[1].prefill(tokens).logits.numpy()
            assert float(np.abs(hit.logits - full[5 * BS :]).max()) <= TOLERANCE
            for e in engines:
                e.close()
            assert all(r.registered for r in runtimes)  # a GpuPool passed in stays the caller's
        finally:
            for g in gpus:
                g.close()
        assert not any(r.registered for r in runtimes)


# -- the fair Mooncake: its staging ---------------------------------------------------------


@pytest.fixture(scope="module")
def mooncake() -> Iterator[MooncakeBaseline]:
    """A private Mooncake Store on loopback (skips where Mooncake is not installed)."""
    try:
        check_available()
    except BackendUnavailableError as exc:
        pytest.skip(f"Mooncake is not usable here: {exc}")
    with MooncakeBaseline(segment_size=64 << 20, local_buffer_size=16 << 20) as baseline:
        yield baseline


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_mooncake_engines_stage_bfloat16_blocks_exactly(
    mooncake: MooncakeBaseline, device: str
) -> None:
    """Mooncake's engine puts and gets bfloat16 blocks through its staging slots, two at a
    time (so three batches each way), pinned for a GPU's DMA: a hit is exactly the prefill
    given the computed prefix."""
    model = ModelEngine(SHAPE, seed=9, device=device, dtype="bfloat16")
    engine = MooncakeServingEngine(model, mooncake.client, staging_blocks=2)
    tokens = prompt(9, 5 * BS + 3)
    try:
        assert engine.pinned == (device == "cuda") == engine._host.is_pinned()
        assert engine.serve(tokens, salt=device).saved_blocks == 5
        hit = engine.serve(tokens, salt=device, want_logits=True)
        assert hit.cached_tokens == 5 * BS and hit.logits is not None
        own = model.prefill(tokens)
        expected = model.prefill(tokens, cut(own.kv, 5 * BS)).logits.float().cpu().numpy()
        assert np.array_equal(hit.logits, expected)
    finally:
        engine.close()
        for key in engine.keys(tokens, salt=device)[:5]:
            mooncake.client.remove(key)


# -- several engines on one GPU: memory budgets -----------------------------------------


def test_four_7b_engines_of_the_ci_run_fit_on_the_lent_h200() -> None:
    """gpu-check's serving step runs two systems of two 7B engines over 15K-token prompts at
    once; the budgets the settings give them must fit, and a fifth pair must not."""
    settings = e2e_settings.Settings(model="7b", device="cuda", trace=LV_EVAL_15K, rate=None)
    budget = settings.memory_bytes
    assert budget is not None
    weights = QWEN2_7B.num_params * 2
    kv = (LV_EVAL_15K.max_prompt_tokens // 16) * (896 << 10)
    assert budget >= weights + 3 * kv + CONTEXT_BYTES
    check_gpu_budget(budget, 4, H200_BYTES, "cuda:0")
    with pytest.raises(ServingError, match=r"7 engines of .* GiB each need .* cuda:0 has"):
        check_gpu_budget(budget, 7, H200_BYTES, "cuda:0")
    assert e2e_settings.Settings(model="tiny").memory_bytes is None  # no budget on the CPU
    generated = e2e_settings.Settings(model="7b", device="cuda", pd=(1, 1), engines=2, rate=None)
    assert generated.memory_bytes == engine_memory_bytes(
        QWEN2_7B, "bfloat16", generated.trace.max_prompt_tokens + generated.max_tokens
    )


def test_a_cluster_over_its_gpus_memory_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cluster_module, "gpu_bytes", lambda device: 10 << 30)
    config = EngineConfig(SHAPE, device="cuda:0", memory_bytes=6 << 30)
    cluster = Cluster("/dev/shm/beluga-test-never-made", config, engines=2)
    with pytest.raises(ServingError, match=r"2 engines of 6\.0 GiB each need 12\.0 GiB"):
        cluster.start()
    assert not cluster.engines and cluster.server is None


def test_7b_runs_on_a_gpu_and_is_refused_on_the_cpu() -> None:
    with pytest.raises(ValueError, match="model '7b' runs on a GPU"):
        e2e_settings.Settings(model="7b", trace=LV_EVAL_15K)
    settings = e2e_settings.Settings(model="7b", device="cuda", trace=LV_EVAL_15K)
    assert settings.kv_dtype == "bfloat16" and settings.format.nbytes == 896 << 10
    assert e2e_settings.Settings(model="tiny").kv_dtype == "float32"


# -- the trace and the rate --------------------------------------------------------------


def test_the_lv_eval_trace_has_15k_token_documents_shared_by_their_questions() -> None:
    trace = lv_eval_trace(LV_EVAL_15K, QWEN2_7B.vocab_size, seed=0)
    assert len({r.document for r in trace}) == LV_EVAL_15K.documents
    context = LV_EVAL_15K.context_tokens
    assert context >= 15_000 and context // 16 == 937  # the paper's blocks per hit
    documents: dict[int, tuple[int, ...]] = {}
    for r in trace:
        assert context + 16 <= len(r.token_ids) <= LV_EVAL_15K.max_prompt_tokens
        assert documents.setdefault(r.document, r.token_ids[:context]) == r.token_ids[:context]


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_e2e_args(parser, figures=True)
    return parser.parse_args(list(argv))


def test_the_command_line_rate_is_automatic_on_a_gpu_only() -> None:
    assert demo.e2e_settings(bench_args("--device", "cpu")).rate == 0.0
    assert demo.e2e_settings(bench_args("--device", "cpu", "--rate", "auto")).rate is None
    assert demo.e2e_settings(bench_args("--device", "cpu", "--rate", "1.5")).rate == 1.5
    on_gpu = demo.e2e_settings(bench_args("--device", "cuda", "--model", "7b"))
    assert on_gpu.rate is None and on_gpu.trace.context_tokens == LV_EVAL_15K.context_tokens
    assert demo.e2e_settings(bench_args("--device", "cpu")).trace.context_tokens == 4096
    with pytest.raises(SystemExit):
        bench_args("--rate", "fast")


@pytest.mark.leaves("keys")  # the run's blocks stay in its scratch pool until it goes
def test_an_automatic_rate_is_measured_once_and_spaces_the_arrivals(shm_path: str) -> None:
    settings = e2e_settings.Settings(
        model="tiny",
        trace=TOY,
        rate=None,
        repeat=2,
        schedulers=("locality-free",),
        start_method="fork",
    )
    arrivals: list[float] = []
    phases: list[str] = []
    doc = e2e.run(
        settings,
        shm_path,
        on_record=lambda scheduler, pass_no, r: arrivals.append(r.arrival),
        on_phase=phases.append,
    )
    found = doc["settings"]["calibration"]
    assert phases.count("measuring a rate below saturation") == 1  # the first run only
    assert found["prompt_tokens"] == TOY.max_prompt_tokens and found["service_s"] > 0
    rate = doc["settings"]["rate"]
    assert rate == pytest.approx(e2e.UTILISATION * settings.engines / found["service_s"])
    requests = len(settings.requests())
    assert len(arrivals) == 2 * 2 * requests
    assert max(arrivals) > 0  # Poisson arrivals, not the whole trace at once
    assert "automatic: 50% of what 2 engines served" in e2e_report.arrivals_note(doc["settings"])
    with pytest.raises(ValueError, match="the rate is automatic"):
        settings.arrivals(0)


@pytest.mark.leaves("keys")  # the run's blocks stay in its scratch pool until it goes
def test_a_disaggregated_rate_is_measured_on_its_prefill_engines(shm_path: str) -> None:
    settings = e2e_settings.Settings(
        model="tiny", trace=TOY, engines=2, pd=(1, 1), max_tokens=2, rate=None, start_method="fork"
    )
    doc = e2e_pd.run(settings, shm_path)
    found = doc["settings"]["calibration"]
    assert found["engines"] == 1  # the one prefill engine computed the calibration's prompt
    assert doc["settings"]["rate"] == pytest.approx(e2e.UTILISATION / found["service_s"])
    (row,) = doc["rows"]
    assert row["requests"] == len(settings.requests()) and row["service_qps"] > 0


# -- on a real GPU ---------------------------------------------------------------------


@cuda
def test_gpu_engines_share_prefixes_with_recomputed_logits(shm_path: str) -> None:
    shape = ModelShape(num_layers=2)
    models = [ModelEngine(shape, seed=4, device="cuda") for _ in range(2)]
    tokens = prompt(1, 83, shape.vocab_size)
    with hosts(shm_path, models[0]) as h:
        engines = [ServingEngine(m, s) for m, s in zip(models, h.stores, strict=True)]
        try:
            h.saved += engines[0].keys(tokens)[:5]  # removed by hosts(): the pool stays clean
            assert engines[0].serve(tokens).saved_blocks == 5
            hit = engines[1].serve(tokens, want_logits=True)
            assert hit.cached_tokens == 80 and hit.logits is not None
            full = models[1].prefill(tokens).logits.cpu().numpy()
            assert float(np.abs(hit.logits - full[80:]).max()) <= TOLERANCE
        finally:
            for e in engines:
                e.close()


@cuda
def test_a_7b_wide_model_is_made_on_the_gpu_in_bfloat16_not_in_host_memory() -> None:
    """Two layers of Qwen2-7B's widths (2.3 GB in bfloat16, its embeddings and head):
    built on the GPU, host memory grows by far less than the weights, and one seed is one
    model there."""
    shape = dataclasses.replace(QWEN2_7B, num_layers=2)
    weights = shape.num_params * 2
    warm = torch.empty(1 << 10, device="cuda", dtype=torch.bfloat16)  # load the kernels
    warm.normal_(generator=torch.Generator(device="cuda").manual_seed(0)).fill_(1.0)
    before = psutil.Process().memory_info().rss
    model = ModelEngine(shape, seed=1, device="cuda", dtype="bfloat16")
    grown = psutil.Process().memory_info().rss - before
    assert grown < weights // 4, f"host memory grew {grown >> 20} MiB for {weights >> 20} MiB"
    assert {(p.device.type, p.dtype) for p in model.model.parameters()} == {
        ("cuda", torch.bfloat16)
    }
    tokens = prompt(2, 40, shape.vocab_size)
    first = model.prefill(tokens, all_logits=False).logits
    del model
    again = ModelEngine(shape, seed=1, device="cuda", dtype="bfloat16")
    assert torch.equal(again.prefill(tokens, all_logits=False).logits, first)


@cuda
def test_a_gpu_engine_stays_within_its_memory_budget(shm_path: str) -> None:
    """A miss, then a hit that decodes, through the pool: the allocator's peak is inside
    what :func:`engine_memory_bytes` budgets for the longest prompt."""
    shape = ModelShape(
        num_layers=4,
        hidden_size=1024,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        intermediate_size=2816,
        vocab_size=32000,
        max_positions=8192,
    )
    tokens = prompt(3, 4000, shape.vocab_size)
    models = [ModelEngine(shape, seed=2, device="cuda", dtype="bfloat16") for _ in range(2)]
    with hosts(shm_path, models[0], blocks=300) as h:
        engines = [ServingEngine(m, s) for m, s in zip(models, h.stores, strict=True)]
        try:
            h.saved += engines[0].keys(tokens)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            engines[0].serve(tokens)
            assert engines[1].serve(tokens, max_tokens=4).cached_tokens == 3984
            peak = torch.cuda.max_memory_allocated() - base  # the second model's weights
        finally:
            for e in engines:
                e.close()
    one_model = shape.num_params * 2
    budget = engine_memory_bytes(shape, "bfloat16", len(tokens) + 4) - CONTEXT_BYTES
    assert peak <= budget - one_model, f"peak {peak >> 20} MiB over {budget >> 20} MiB"
