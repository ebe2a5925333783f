"""``beluga bench scale`` at a small size: every figure is there, consistent, and sane.

No timing is asserted: only what the figures must satisfy whatever the
machine's speed (percentiles ordered, counts as computed here, extrapolations
that follow from the rows by the stated rule).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from beluga.bench import scale
from beluga.bench.scale.server import LOST_EVERY
from beluga.cli import main
from beluga.server.recovery_state import RECOVERY_REGION
from beluga.units import MiB

SMALL = 64 * MiB


def _scratch_pools() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("beluga-scale-")}


@pytest.fixture
def no_scratch_left() -> Iterator[None]:
    before = _scratch_pools()
    yield
    assert _scratch_pools() <= before


@pytest.fixture(scope="module")
def doc() -> dict:
    return scale.run(
        [SMALL],
        0.5,
        hosts=(1, 2),
        loads=(0.2, 0.6),
        writer_pool=SMALL,
        writer_batch=16,
        read_pool=SMALL,
        rate_after_s=0.3,
    )


def _ordered(row: dict, *names: str) -> None:
    for name in names:
        assert 0 < row[f"{name}_p50_us"] <= row[f"{name}_p99_us"], (name, row)


def test_the_writers_curve_has_every_host_count_and_its_keys(doc: dict) -> None:
    rows = doc["writers"]
    assert [r["hosts"] for r in rows] == [1, 2]
    for r in rows:
        rounds = max(8, 128 // r["hosts"])  # at least 128 host-batches a point
        assert r["batch"] == 16 and r["keys"] == rounds * r["hosts"] * 16
        assert r["keys_per_s"] > 0
        _ordered(r, "alloc_batch", "commit_batch")


def test_the_writers_through_the_server_each_have_their_own_host_id(doc: dict) -> None:
    rows = doc["writers_rpc"]
    assert [r["hosts"] for r in rows] == [1, 2]
    for r in rows:
        assert len(set(r["host_ids"])) == r["hosts"]
        assert r["keys"] == (32 // r["hosts"]) * r["hosts"] * 16 and r["keys_per_s"] > 0
        _ordered(r, "put_batch")
    w = doc["extrapolated"]["writers_rpc"]
    assert w["hosts"] == 2 and w["keys_per_s"] == rows[-1]["keys_per_s"]


def test_the_reads_curve_reaches_each_load_and_reads_every_stored_key(doc: dict) -> None:
    rows = doc["reads"]
    assert [r["target_load"] for r in rows] == [0.2, 0.6]
    for r in rows:
        # filled one entry past the target at most, and never full at these loads
        assert r["target_load"] <= r["load"] <= r["target_load"] + 1 / r["index_slots"] + 1e-9
        assert r["insert_failures"] == 0
        _ordered(r, "hit", "miss")


def test_the_extrapolation_follows_from_the_rows(doc: dict) -> None:
    e = doc["extrapolated"]
    pod_keys = (8 << 40) // (64 << 10) // 2
    two = doc["writers"][-1]
    w = e["writers"]
    assert w["hosts"] == 2 and w["fill_s"] == pytest.approx(pod_keys / two["keys_per_s"])
    assert w["alloc_batch_p99_us"] == pytest.approx(two["alloc_batch_p99_us"] * 16 / 2)
    (row,) = doc["rows"]
    assert row["recovery_us_per_block"] == pytest.approx(1e6 * row["recovery_s"] / row["blocks"])
    # one key in LOST_EVERY lost its slot, and recovery named each again (else it raises)
    assert row["lost_insertions"] == -(-row["keys"] // LOST_EVERY)
    assert row["recovery_lost_s"] > 0 and e["lost_every"] == LOST_EVERY
    assert e["recovery_lost_s"] == pytest.approx(
        row["recovery_lost_s"] / row["blocks"] * e["pod_blocks"]
    )
    assert e["full_gc_s"] == pytest.approx(row["full_gc_ms"] / row["keys"] * pod_keys / 1e3)
    adopt = e["index_adopt"]  # measured in an index of the pod's region count, not fitted
    assert adopt["pod_regions"] == e["pod_blocks"] // RECOVERY_REGION == 32_768
    assert adopt["measured_regions"] == -(-row["blocks"] // RECOVERY_REGION)
    assert adopt["pod_us"] > 0 and adopt["measured_us"] > 0
    evict = e["index_evict"]
    assert evict["pod_regions"] == adopt["pod_regions"] and evict["pod_us"] > 0
    r = e["reads"]
    assert r["pod_load"] == pytest.approx(0.5 / 3)
    # the pod's load lies below the first measured one: interpolation holds it there
    first = doc["reads"][0]
    assert r["pod_load"] < first["load"] and r["hit_p99_us"] == first["hit_p99_us"]
    text = scale.format_extrapolation(doc)
    assert "hosts writing at once" in text and "index's load" in text
    assert "through the real server" in text
    assert f"{w['keys_per_s']:,.0f} keys/s" in text


def test_the_takeover_figures_follow_from_the_run(doc: dict) -> None:
    (row,) = doc["rows"]
    assert row["first_write_before_s"] > 0 and row["first_write_after_s"] > 0
    t = row["takeover"]
    windows, w = t["rate_windows"], t["window_s"]
    assert windows and all(r >= 0 for r in windows)
    assert t["first_write_s"] > 0 and 0 < t["recovery_done_s"] < len(windows) * w
    # full throughput ends a window, the last one below 90% of the rate after recovery
    full = t["full_throughput_s"]
    assert full == pytest.approx(round(full / w) * w) and full <= len(windows) * w
    assert all(r >= 0.9 * t["keys_per_s_after"] for r in windows[round(full / w) :])
    if full:
        assert windows[round(full / w) - 1] < 0.9 * t["keys_per_s_after"]
    e = doc["extrapolated"]["takeover"]
    pod_blocks = (8 << 40) // (64 << 10)
    for name, got in (
        ("first_write_before_s", row["first_write_before_s"]),
        ("first_write_after_s", row["first_write_after_s"]),
        ("full_throughput_s", full),
        ("recovery_done_s", t["recovery_done_s"]),
    ):  # one size: a line through the origin
        assert e[name] == pytest.approx(got / row["blocks"] * pod_blocks), name
    assert "takeover to the first acknowledged write" in scale.format_extrapolation(doc)


@pytest.mark.usefixtures("no_scratch_left")
def test_the_writers_refuse_a_pool_too_small_for_their_batches() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        scale.writers(SMALL, hosts=(16,), batch=256)


def test_the_command_refuses_loads_and_hosts_out_of_range(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "scale", "--sizes", "64M", "--loads", "1.5"]) == 2
    assert "--loads" in capsys.readouterr().err
    assert main(["bench", "scale", "--sizes", "64M", "--hosts", "17"]) == 2
    assert "--hosts" in capsys.readouterr().err


def test_the_index_adopt_figure_refuses_nonsense_and_counts_every_key() -> None:
    from beluga.bench.scale.keyindex import adopt_us, evict_us

    with pytest.raises(ValueError, match="keys >= 1"):
        adopt_us(4, keys=0)
    with pytest.raises(ValueError, match="regions >= 1"):
        evict_us(0)
    assert adopt_us(40, keys=200) > 0  # (it asserts every key was indexed once)
    assert evict_us(40, keys=200) > 0  # (it asserts the adopted keys went, and only they)
