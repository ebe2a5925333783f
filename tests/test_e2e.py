"""The end-to-end experiment behind ``beluga demo`` and ``beluga bench e2e``, at toy sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from beluga.bench import e2e, e2e_figures, e2e_pd, e2e_report, e2e_settings
from beluga.cli import main
from beluga.server.service import HIGH_WATERMARK
from beluga.serving.cluster import Handoff, Record
from beluga.serving.engine import Served, Timings
from beluga.serving.model import ModelEngine
from beluga.serving.trace import TraceShape
from tests.test_certify import assert_valid_png

TOY = TraceShape(documents=2, min_questions=2, max_questions=2, context_tokens=64)


def record(engine: int, start: float, busy: float, cached: int = 0, tokens: int = 100) -> Record:
    timings = Timings(lookup=0.0, load=0.0, compute=busy, save=0.0)
    return Record(0, engine, 0.0, start, Served(tokens, cached, 0, timings, None))


def test_a_summary_row_counts_hits_ttft_and_imbalance() -> None:
    records = [record(0, 0.0, 1.0, 50), record(0, 1.0, 2.0, 0), record(1, 0.0, 0.5, 100)]
    row = e2e_figures.summarize(records, engines=2)
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
    verdicts = {
        t["scheduler"]: (t["pass2_over_pass1_ttft"], t["met"]) for t in e2e_figures.targets(rows)
    }
    assert verdicts == {"a": (pytest.approx(0.1), True), "b": (pytest.approx(0.3), False)}


@pytest.mark.leaves("keys")
def test_the_experiment_runs_both_schedulers_twice_and_cleans_up(shm_path: str) -> None:
    settings = e2e_settings.Settings(model="tiny", trace=TOY, start_method="fork")
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
    steps = {key: 0.25 for key, _, _ in e2e_report.STEPS}  # every row charts its steps
    rows = [
        {"scheduler": s, "pass": p, "ttft_mean_s": 1.0 / p, "ttft_p99_s": 2.0 / p, **steps}
        for s in ("locality-free", "locality-aware")
        for p in (1, 2)
    ]
    doc = {
        "rows": rows,
        "settings": {"model": "tiny", "engines": 2, "trace": {"context_tokens": 64}},
    }
    e2e_report.chart(doc, str(tmp_path / "ttft.png"))
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
        e2e_settings.Settings(**changes)


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
    args = [*TOY_ARGS, "--repeat", "1", "--json", "--chart", "ttft.png"]
    done = beluga("bench", "e2e", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["benchmark"] == "e2e" and len(doc["rows"]) == 4
    assert all(np.isfinite(r["ttft_mean_s"]) for r in doc["rows"])
    assert_valid_png(tmp_path / "ttft.png")


@pytest.mark.leaves("keys")  # the run's blocks stay in its scratch pool until it goes
def test_a_disaggregated_round_decodes_what_a_single_engine_would(shm_path: str) -> None:
    """CI's PD round of our own engines: one prefill and one decode engine over one pool;
    every decode loads the whole prompt's full blocks and generates a single engine's
    greedy tokens."""
    settings = e2e_settings.Settings(
        model="tiny", trace=TOY, engines=2, pd=(1, 1), max_tokens=4, start_method="fork"
    )
    decoded: list[Record] = []
    doc = e2e_pd.run(settings, shm_path, on_record=lambda system, r: decoded.append(r))
    assert not os.path.exists(shm_path)
    trace = settings.requests()
    model = ModelEngine(settings.shape, seed=settings.seed)
    assert sorted(r.index for r in decoded) == list(range(len(trace)))
    for record in decoded:
        tokens = trace[record.index].token_ids
        assert record.engine == 1 and record.served.saved_blocks == 0
        assert record.served.cached_tokens == (len(tokens) - 1) // 16 * 16
        assert list(record.served.output) == model.generate(model.prefill(tokens), 4)
    (row,) = doc["rows"]
    assert (row["system"], row["pd"], row["requests"]) == ("beluga", "1:1", len(trace))
    assert row["recomputed_blocks"] == 0 and row["output_tokens"] == 4 * len(trace)
    assert row["loaded_blocks"] == sum((len(r.token_ids) - 1) // 16 for r in trace)
    assert 0 < row["handoff_mean_ms"] / 1e3 < row["ttft_mean_s"]
    assert 0 < row["kv_share_of_ttft"] < 1 and row["tpot_mean_ms"] > 0 and row["qps"] > 0
    assert row["evictions"] == 0  # the pool holds the trace
    assert row["duplicate_blocks"] == row["store_duplicate_writes_skipped"]
    assert doc["settings"]["capacity"]["from"] == "the trace"
    assert "handoff" in e2e_pd.summary(doc)


def served(cached: int, tokens: int, compute: float, **kw: object) -> Served:
    timings = Timings(lookup=0.0, load=kw.pop("load", 0.0), compute=compute, save=0.0)  # type: ignore[arg-type]
    return Served(tokens, cached, kw.pop("saved", 0), timings, None, **kw)  # type: ignore[arg-type]


def test_duplicate_prefills_are_costed_by_their_share_of_compute() -> None:
    """Requests 0 and 1 of one document arrive together on two engines; 0 commits the
    document's 4 blocks first, 1 computes them again.  Request 2 hits them later."""
    records = [
        Record(0, 0, 0.0, 0.0, served(0, 80, 1.0, saved=5)),
        Record(1, 1, 0.0, 0.0, served(0, 80, 1.0, saved=1, duplicate_blocks=4)),
        Record(2, 0, 0.0, 1.0, served(64, 80, 0.25, load=0.04, saved=1)),
    ]
    cost = e2e_figures.duplicate_cost(records, documents=[7, 7, 7], block_tokens=16)
    assert cost["duplicate_requests"] == 1
    assert cost["duplicate_compute_s"] == pytest.approx(1.0 * 64 / 80)
    # loading costs 0.01 s a block (request 2's 4 blocks in 0.04 s)
    assert cost["wait_would_save_engine_s"] == pytest.approx(0.8 - 4 * 0.01)
    # waiting: request 0 is done at 1.0 s, then 4 loads, then the 16 tokens of its own
    assert cost["wait_ttft_mean_s"] == pytest.approx(1.0 + 0.04 + 0.2)
    assert cost["duplicate_ttft_mean_s"] == pytest.approx(1.0)
    assert cost["duplicate_share_of_busy"] == pytest.approx(0.8 / 2.29)
    alone = e2e_figures.duplicate_cost(records[:1], [7], 16)
    assert alone["duplicate_requests"] == 0 and alone["wait_would_save_engine_s"] is None


def test_a_hit_ratio_below_the_best_says_why() -> None:
    row = {"hit_ratio": 0.5, "best_hit_ratio": 0.9, "evictions": 3, "duplicate_blocks": 0}
    assert e2e_report.hit_shortfall(row) == "hit ratio 0.500 is below 0.900: 3 evictions"
    assert e2e_report.hit_shortfall({**row, "hit_ratio": 0.9}) is None
    assert e2e_report.hit_shortfall(row, 0.4) is None  # not below the baseline's
    unknown = e2e_report.hit_shortfall({**row, "evictions": None, "refused_blocks": 2})
    assert unknown is not None and "2 blocks the store refused" in unknown
    assert "evictions not reported" in unknown


def test_repetitions_give_medians_and_ranges() -> None:
    runs = [
        [{"system": "a", "n": 2, "t": 1.0, "busy": [1.0, 2.0], "x": None}],
        [{"system": "a", "n": 4, "t": 3.0, "busy": [3.0, 4.0], "x": 0.5}],
        [{"system": "a", "n": 3, "t": 2.0, "busy": [2.0, 9.0], "x": None}],
    ]
    (row,) = e2e_figures.median_rows(runs)
    assert row["system"] == "a" and row["n"] == 3 and isinstance(row["n"], int)
    assert row["t"] == 2.0 and row["busy"] == [2.0, 4.0] and row["x"] == 0.5
    assert row["ranges"] == {"n": [2, 4], "t": [1.0, 3.0], "x": [0.5, 0.5]}
    assert e2e_report.ranged(row, "t", 100) == "200 (100-300)"
    assert e2e_report.error_bars([row], "t").tolist() == [[1.0], [1.0]]
    assert e2e_figures.spread([None, None]) is None
    targets = e2e_figures.median_targets(
        [
            [{"scheduler": "a", "pass2_over_pass1_ttft": r, "target": 0.2, "met": r <= 0.2}]
            for r in (0.1, 0.3, 0.15)
        ]
    )
    assert targets == [
        {
            "scheduler": "a",
            "pass2_over_pass1_ttft": 0.15,
            "target": 0.2,
            "met": True,
            "range": [0.1, 0.3],
        }
    ]


def test_the_capacity_budget_is_what_the_pool_may_hold_below_its_watermark() -> None:
    settings = e2e_settings.Settings(model="tiny", trace=TOY)
    fmt = settings.format
    need = (
        e2e_figures.blocks_needed(settings.requests(), TOY, 16) * 2
        + 2 * e2e_settings.WARMUP_TOKENS // 16
    )
    budget = e2e.capacity_budget(settings, namespaces=2)
    assert budget == int(need * fmt.nbytes * e2e.HEADROOM)
    for capacity in (budget, 40 << 20):
        _, data = e2e.pool_for(settings, capacity)
        assert data * HIGH_WATERMARK >= capacity  # it holds the budget before it evicts
        assert (data - 2 * (2 << 20)) * HIGH_WATERMARK < capacity  # and not much more
    given = e2e_settings.Settings(model="tiny", trace=TOY, capacity=1 << 20)
    assert e2e.capacity_budget(given, 2) == 1 << 20
    assert e2e.capacity_note(given, 1 << 20)["from"] == "--capacity"


def test_a_disaggregated_row_splits_ttft_into_prefill_and_handoff() -> None:
    def timings(**t: float) -> Timings:
        return Timings(**{"lookup": 0.0, "load": 0.0, "compute": 0.0, "save": 0.0, **t})

    prefill = Served(40, 0, 2, timings(compute=0.5, save=0.1), None)
    decode = Served(
        40, 32, 0, timings(load=0.2, compute=0.05, decode=0.3), None, output=(1, 2, 3, 4)
    )
    runs = [
        Handoff(Record(0, 0, 0.0, 0.0, prefill), Record(0, 1, 0.6, 0.65, decode)),
        Handoff(Record(1, 0, 0.0, 0.6, prefill), Record(1, 1, 1.2, 1.2, decode)),
    ]
    row = e2e_pd.summarize(runs, block_tokens=16)
    # committed at 0.6 and 1.2; first tokens at 0.65+0.25 and 1.2+0.25
    assert row["handoff_mean_ms"] == pytest.approx(1e3 * (0.3 + 0.25) / 2)
    assert row["ttft_mean_s"] == pytest.approx((0.9 + 1.45) / 2)
    assert row["decode_wait_mean_ms"] == pytest.approx(1e3 * 0.05 / 2)
    assert row["kv_share_of_ttft"] == pytest.approx(2 * 0.3 / (0.9 + 1.45))
    assert row["tpot_mean_ms"] == pytest.approx(100.0)
    assert row["qps"] == pytest.approx(2 / (1.2 + 0.55))
    assert row["recomputed_blocks"] == 0 and row["loaded_blocks"] == 4
    assert row["decode_load_ms_per_block"] == pytest.approx(100.0)
    assert row["prefill_queue_mean_ms"] == pytest.approx(300.0)


def test_the_disaggregated_chart_is_a_png(tmp_path: Path) -> None:
    keys = [k for k, _ in e2e_pd.COLUMNS if k not in ("system", "pd")]
    extra = [
        "prefill_queue_mean_ms",
        "prefill_lookup_load_mean_ms",
        "prefill_compute_mean_ms",
        "decode_wait_mean_ms",
        "decode_lookup_mean_ms",
        "decode_compute_mean_ms",
    ]
    rows = [{"system": s, **dict.fromkeys(keys + extra, 1.0)} for s in ("beluga", "mooncake")]
    doc = {
        "rows": rows,
        "runs": [{}],
        "headline": {"qps_ratio": 2.0},
        "settings": {
            "pd": [1, 1],
            "model": "tiny",
            "block_bytes": 1 << 15,
            "trace": {"context_tokens": 64},
            "max_tokens": 4,
        },
    }
    e2e_pd.chart(doc, str(tmp_path / "pd.png"))
    assert_valid_png(tmp_path / "pd.png")


@pytest.mark.leaves("keys")  # each run's blocks stay in its scratch pool until it goes
def test_repeated_runs_and_bursts_report_ranges_and_count_duplicates_alike(
    shm_path: str,
) -> None:
    """Two runs from scratch of a bursty trace: the rows are the runs' medians, and the
    blocks engines report computing twice are exactly the writes the server skipped."""
    settings = e2e_settings.Settings(
        model="tiny",
        trace=TOY,
        schedulers=("locality-free",),
        repeat=2,
        burst=2,
        start_method="fork",
    )
    doc = e2e.run(settings, shm_path)
    assert len(doc["runs"]) == 2 and not os.path.exists(shm_path)
    for i, row in enumerate(doc["rows"]):
        values = [run["rows"][i]["ttft_mean_s"] for run in doc["runs"]]
        assert row["ranges"]["ttft_mean_s"] == [min(values), max(values)]
        assert min(values) <= row["ttft_mean_s"] <= max(values)
    for run in doc["runs"]:
        for row in run["rows"]:
            assert row["duplicate_blocks"] == row["store_duplicate_writes_skipped"]
            assert row["evictions"] == 0
    assert doc["targets"][0]["range"][0] <= doc["targets"][0]["pass2_over_pass1_ttft"]


@pytest.mark.slow
def test_beluga_bench_e2e_pd_writes_json_and_a_chart(tmp_path: Path) -> None:
    args = [*TOY_ARGS, "--pd", "1:1", "--max-tokens", "2", "--repeat", "1", "--rate", "50"]
    done = beluga("bench", "e2e", *args, "--json", "--chart", "pd.png", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["benchmark"] == "e2e-pd" and [r["system"] for r in doc["rows"]] == ["beluga"]
    assert doc["settings"]["pd"] == [1, 1] and doc["settings"]["rate"] == 50
    assert_valid_png(tmp_path / "pd.png")
