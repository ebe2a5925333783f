"""The end-to-end experiment behind ``beluga demo`` and ``beluga bench e2e``, at toy sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from beluga.bench import e2e
from beluga.cli import main
from beluga.serving.cluster import Record
from beluga.serving.engine import Served, Timings
from beluga.serving.trace import TraceShape
from tests.test_certify import assert_valid_png

TOY = TraceShape(documents=2, min_questions=2, max_questions=2, context_tokens=64)


def record(engine: int, start: float, busy: float, cached: int = 0, tokens: int = 100) -> Record:
    timings = Timings(lookup=0.0, load=0.0, compute=busy, save=0.0)
    return Record(0, engine, 0.0, start, Served(tokens, cached, 0, timings, None))


def test_a_summary_row_counts_hits_ttft_and_imbalance() -> None:
    records = [record(0, 0.0, 1.0, 50), record(0, 1.0, 2.0, 0), record(1, 0.0, 0.5, 100)]
    row = e2e.summarize(records, engines=2)
    assert row["requests"] == 3
    assert row["hit_ratio"] == pytest.approx(150 / 300)
    assert row["ttft_mean_s"] == pytest.approx((1.0 + 3.0 + 0.5) / 3)
    assert row["ttft_p99_s"] == pytest.approx(3.0)
    assert row["queue_mean_s"] == pytest.approx(1 / 3)
    assert row["busy_s"] == [3.0, 0.5]
    assert row["imbalance"] == pytest.approx(3.0 / 1.75)
    assert row["makespan_s"] == pytest.approx(3.0)
    assert row["qps"] == pytest.approx(1.0)


def test_targets_compare_pass_two_with_pass_one() -> None:
    rows = [
        {"scheduler": "a", "pass": 1, "ttft_mean_s": 10.0},
        {"scheduler": "a", "pass": 2, "ttft_mean_s": 1.0},
        {"scheduler": "b", "pass": 1, "ttft_mean_s": 10.0},
        {"scheduler": "b", "pass": 2, "ttft_mean_s": 3.0},
    ]
    verdicts = {t["scheduler"]: (t["pass2_over_pass1_ttft"], t["met"]) for t in e2e.targets(rows)}
    assert verdicts == {"a": (pytest.approx(0.1), True), "b": (pytest.approx(0.3), False)}


@pytest.mark.leaves("keys")
def test_the_experiment_runs_both_schedulers_twice_and_cleans_up(shm_path: str) -> None:
    settings = e2e.Settings(model="tiny", trace=TOY, start_method="fork")
    phases: list[str] = []
    seen: list[tuple[str, int]] = []
    result = e2e.run(
        settings,
        shm_path,
        on_record=lambda s, p, r: seen.append((s, p)),
        on_phase=phases.append,
    )
    assert not os.path.exists(shm_path)
    n = result["requests_per_pass"]
    assert n == 4 and len(seen) == 4 * n
    assert [(r["scheduler"], r["pass"]) for r in result["rows"]] == [
        ("locality-free", 1),
        ("locality-free", 2),
        ("locality-aware", 1),
        ("locality-aware", 2),
    ]
    prompts = [len(r.token_ids) for r in settings.requests()]
    best = sum((t - 1) // 16 * 16 for t in prompts) / sum(prompts)
    for row in result["rows"]:
        assert row["requests"] == n and row["imbalance"] >= 1.0
        if row["pass"] == 2:
            assert row["hit_ratio"] == pytest.approx(best)
            assert row["saved_blocks"] == 0
    assert {t["scheduler"] for t in result["targets"]} == {"locality-free", "locality-aware"}
    assert result["settings"]["kv_format"] == "beluga-kv/HND/float32/L4H2D32B16"
    assert any("pass 2" in p for p in phases)


def test_the_chart_is_a_png(tmp_path: Path) -> None:
    rows = [
        {"scheduler": s, "pass": p, "ttft_mean_s": 1.0 / p, "ttft_p99_s": 2.0 / p}
        for s in ("locality-free", "locality-aware")
        for p in (1, 2)
    ]
    doc = {
        "rows": rows,
        "settings": {"model": "tiny", "engines": 2, "trace": {"context_tokens": 64}},
    }
    e2e.chart(doc, str(tmp_path / "ttft.png"))
    assert_valid_png(tmp_path / "ttft.png")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": "huge"}, "unknown model 'huge'"),
        ({"schedulers": ("round-robin",)}, "schedulers must be some of"),
        ({"trace": TraceShape(context_tokens=20000)}, "exceed model"),
        ({"engines": 0}, "engines and threads"),
    ],
)
def test_settings_are_checked(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        e2e.Settings(**changes)


def test_the_demo_refuses_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--model", "huge"]) == 2
    assert "unknown model 'huge'" in capsys.readouterr().err


TOY_ARGS = ["--model", "tiny", "--documents", "2", "--questions", "1", "2"]
TOY_ARGS += ["--context-tokens", "64"]


def beluga(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run(
        [sys.executable, "-m", "beluga", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


@pytest.mark.slow
def test_beluga_demo_prints_the_summary(tmp_path: Path) -> None:
    done = beluga("demo", *TOY_ARGS, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "locality-free" in done.stdout and "locality-aware" in done.stdout
    assert "TTFT mean s" in done.stdout and "pass-2 mean TTFT is" in done.stdout
    assert "req" in done.stderr  # the progress bar


@pytest.mark.slow
def test_beluga_bench_e2e_writes_json_and_a_chart(tmp_path: Path) -> None:
    done = beluga("bench", "e2e", *TOY_ARGS, "--json", "--chart", "ttft.png", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["benchmark"] == "e2e" and len(doc["rows"]) == 4
    assert all(np.isfinite(r["ttft_mean_s"]) for r in doc["rows"])
    assert_valid_png(tmp_path / "ttft.png")
