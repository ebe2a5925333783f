"""``beluga bench e2e --baseline mooncake`` at toy size: both systems hit, exactly, and report.

The run needs Mooncake (``ci/install-mooncake.sh``, part of ``ci/install.sh``)
and skips with the availability check's own reason where it is missing.
"""

from __future__ import annotations

from multiprocessing import resource_tracker
from pathlib import Path

import numpy as np
import pytest

from beluga.bench import e2e, e2e_mooncake, e2e_pd, e2e_settings
from beluga.errors import BackendUnavailableError
from beluga.kv.tier.mooncake import check_available
from beluga.serving.cluster import Record
from beluga.serving.model import ModelEngine
from beluga.serving.trace import TraceShape
from tests.test_certify import assert_valid_png

TOY = TraceShape(documents=2, min_questions=2, max_questions=2, context_tokens=64)
TOLERANCE = 1e-4  # float32 logits, prefix reused vs recomputed (as tests/test_serving_cluster.py)
ROW_FIELDS = (
    "hit_ratio",
    "ttft_mean_s",
    "ttft_p99_s",
    "load_ms_per_block",
    "save_ms_per_block",
    "qps",
    "imbalance",
    "load_share_of_ttft",
)


@pytest.fixture(scope="module")
def mooncake_installed() -> None:
    """Skip without Mooncake; start multiprocessing's resource tracker before the leak check.

    The Mooncake engines are spawned, and the first spawn starts the tracker,
    one helper process per interpreter that lives as long as it does.
    """
    try:
        check_available()
    except BackendUnavailableError as exc:
        pytest.skip(f"Mooncake is not usable here: {exc}")
    resource_tracker.ensure_running()


@pytest.mark.leaves("keys")
@pytest.mark.slow  # ~30 s: the Mooncake engines are spawned (they import torch)
def test_both_systems_hit_with_recomputed_logits_and_report(
    mooncake_installed: None, shm_path: str, tmp_path: Path
) -> None:
    settings = e2e_settings.Settings(model="tiny", trace=TOY, start_method="fork")
    seen: dict[tuple[str, int], list[Record]] = {}
    doc = e2e_mooncake.run(
        settings,
        shm_path,
        on_record=lambda system, p, r: seen.setdefault((system, p), []).append(r),
        want_logits=True,
    )

    trace = settings.requests()
    model = ModelEngine(settings.shape, seed=settings.seed)
    full = [model.prefill(r.token_ids).logits.numpy() for r in trace]
    for system in e2e_mooncake.SYSTEMS:
        hits = seen[(system, 2)]
        assert len(hits) == len(trace)
        for record in hits:
            served = record.served
            assert served.cached_tokens == (served.num_tokens - 1) // 16 * 16, system
            assert served.saved_blocks == 0
            assert served.logits is not None
            want = full[record.index][served.cached_tokens :]
            assert float(np.abs(served.logits - want).max()) <= TOLERANCE, system

    rows = {(r["system"], r["pass"]): r for r in doc["rows"]}
    assert sorted(rows) == [("beluga", 1), ("beluga", 2), ("mooncake", 1), ("mooncake", 2)]
    assert rows[("beluga", 2)]["scheduler"] == "locality-free"
    assert rows[("mooncake", 2)]["scheduler"] == "locality-aware"
    for key, row in rows.items():
        for field in ROW_FIELDS:
            assert field in row, (key, field)
        assert row["requests"] == len(trace) and row["imbalance"] >= 1.0
    for system in e2e_mooncake.SYSTEMS:
        second = rows[(system, 2)]
        assert second["load_ms_per_block"] > 0 and 0 < second["load_share_of_ttft"] < 1
        assert rows[(system, 1)]["save_ms_per_block"] > 0
    headline = doc["headline"]
    assert headline["pass2_ttft_fraction"] > 0 and headline["pass2_qps_ratio"] > 0
    scale = doc["paper_scale"]
    assert scale["block_bytes"] == 4 << 20 and scale["blocks_per_request"] == 937
    assert set(scale["systems"]) == {"beluga", "mooncake"} and scale["kv_gap_s_per_hit"]

    assert "Beluga's mean TTFT is" in e2e_mooncake.summary(doc)
    e2e_mooncake.chart(doc, str(tmp_path / "e2e-mooncake.png"))
    assert_valid_png(tmp_path / "e2e-mooncake.png")


def _row(system: str, pass_no: int, **costs: float | None) -> dict:
    return {
        "system": system,
        "pass": pass_no,
        "block_bytes": 1 << 20,
        "load_ms_per_block": None,
        "lookup_ms_per_key": 0.01,
        "save_ms_per_block": None,
        **costs,
    }


def test_the_headline_and_the_paper_scale_come_from_the_per_block_costs() -> None:
    rows = [
        _row("beluga", 1, save_ms_per_block=1.0),
        _row("beluga", 2, load_ms_per_block=0.5, ttft_mean_s=1.0, qps=4.0, service_mean_s=0.5),
        _row("mooncake", 1, save_ms_per_block=4.0),
        _row("mooncake", 2, load_ms_per_block=2.0, ttft_mean_s=4.0, qps=1.0, service_mean_s=2.0),
    ]
    headline = e2e_mooncake.headline(rows)
    assert headline["pass2_ttft_fraction"] == pytest.approx(0.25)
    assert headline["pass2_qps_ratio"] == pytest.approx(4.0)
    assert headline["pass2_load_per_block_ratio"] == pytest.approx(4.0)
    scale = e2e_mooncake.paper_scale(rows)
    beluga, mooncake = scale["systems"]["beluga"], scale["systems"]["mooncake"]
    assert beluga["load_ms_per_block"] == pytest.approx(0.5 * 4)  # 4 MiB blocks over 1 MiB
    assert beluga["load_s"] == pytest.approx(937 * 2.0 / 1e3)
    assert mooncake["save_s"] == pytest.approx(937 * 16.0 / 1e3)
    assert scale["kv_gap_s_per_hit"] == pytest.approx(937 * (8.0 - 2.0) / 1e3)


@pytest.mark.leaves("keys")  # the run's blocks stay in its scratch pool until it goes
@pytest.mark.slow  # ~40 s: the Mooncake engines are spawned (they import torch)
def test_both_systems_hand_off_over_their_store_and_decode_a_single_engines_tokens(
    mooncake_installed: None, shm_path: str, tmp_path: Path
) -> None:
    settings = e2e_settings.Settings(
        model="tiny", trace=TOY, engines=2, pd=(1, 1), max_tokens=3, start_method="fork"
    )
    decoded: dict[str, list[Record]] = {}
    doc = e2e_pd.run(
        settings,
        shm_path,
        baseline="mooncake",
        on_record=lambda system, r: decoded.setdefault(system, []).append(r),
    )
    trace = settings.requests()
    model = ModelEngine(settings.shape, seed=settings.seed)
    want = [model.generate(model.prefill(r.token_ids), 3) for r in trace]
    for system in ("beluga", "mooncake"):
        assert sorted(r.index for r in decoded[system]) == list(range(len(trace)))
        for record in decoded[system]:
            assert list(record.served.output) == want[record.index], system
            assert record.served.cached_tokens == (record.served.num_tokens - 1) // 16 * 16
    rows = {r["system"]: r for r in doc["rows"]}
    assert rows["beluga"]["evictions"] == 0 and rows["mooncake"]["evictions"] == 0
    assert all(r["recomputed_blocks"] == 0 and r["handoff_mean_ms"] > 0 for r in rows.values())
    h = doc["headline"]
    assert h["qps_ratio"] > 0 and h["paper_qps_ratio"] == [3.41, 9.47]
    c = doc["settings"]["capacity"]
    assert c["mooncake_segment_bytes"] * c["mooncake_evicts_above"] >= c["budget_bytes"]
    assert c["beluga_data_bytes"] * c["beluga_evicts_above"] >= c["budget_bytes"]
    assert "QPS" in e2e_pd.summary(doc)
    e2e_pd.chart(doc, str(tmp_path / "pd.png"))
    assert_valid_png(tmp_path / "pd.png")


def test_both_stores_get_one_budget_never_below_mooncakes_smallest_segment() -> None:
    toy = e2e_settings.Settings(model="tiny", trace=TOY)
    least = int(e2e_mooncake.MOONCAKE_LEAST_SEGMENT * e2e_mooncake.MOONCAKE_HIGH_WATERMARK)
    assert e2e.capacity_budget(toy, 1) < least
    assert e2e_mooncake.capacity_budget(toy) == least  # raised for both stores alike
    big = e2e_settings.Settings(model="tiny", trace=TOY, capacity=100 << 20)
    assert e2e_mooncake.capacity_budget(big) == 100 << 20
    segment = e2e_mooncake.segment_bytes(100 << 20)
    assert segment % (1 << 20) == 0 and segment * 0.9 >= 100 << 20 > (segment - (1 << 20)) * 0.9
    with pytest.raises(ValueError, match="--capacity must be at least"):
        e2e_mooncake.capacity_budget(
            e2e_settings.Settings(model="tiny", trace=TOY, capacity=1 << 20)
        )


def test_the_masters_counters_are_read_from_its_prometheus_page(tmp_path: Path) -> None:
    page = tmp_path / "metrics"
    page.write_text(
        "# HELP master_evicted_key_count keys evicted\n"
        "master_evicted_key_count 12\n"
        'segment_allocated_bytes{segment="127.0.0.1:1"} 4\n'
        "master_put_start_alloc_failures_total 3\n"
    )
    assert e2e_mooncake.master_counters(page.as_uri()) == {
        "evictions": 12,
        "puts_without_room": 3,
        "duplicate_writes_skipped": None,
    }
    missing = e2e_mooncake.master_counters((tmp_path / "gone").as_uri())
    assert set(missing.values()) == {None}
