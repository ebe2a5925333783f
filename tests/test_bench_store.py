"""``beluga bench store``: every figure is there and consistent; the baseline runs and stops.

The Mooncake comparison needs Mooncake (``ci/install-mooncake.sh``) and skips
with the availability check's own reason where it is missing.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator

import psutil
import pytest

from beluga.bench.store import (
    ALIGN_OPS,
    ALIGN_QUICK,
    BATCH,
    BATCH_LABEL,
    BATCH_OPS,
    SINGLE_OPS,
    TARGETS,
    serve_in_child,
)
from beluga.child import server_process
from beluga.cli import main
from beluga.errors import BackendUnavailableError
from beluga.kv import KVStore
from beluga.kv.tier.mooncake import check_available
from beluga.pool import Pool
from tests.conftest import SMALL

SIZES = {"16KiB": 16 << 10, "256KiB": 256 << 10, "2MiB": 2 << 20}


def _scratch_pools() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("beluga-bench-")}


@pytest.fixture
def no_scratch_left() -> Iterator[None]:
    before = _scratch_pools()
    yield
    assert _scratch_pools() <= before


def _bench(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["bench", "store", "--quick", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def _check_system(figures: dict[str, float], system: str) -> None:
    """Latencies ordered, throughput equal to bytes over the p50, per item = p50 / batch."""
    for label, nbytes in SIZES.items():
        for op in SINGLE_OPS:
            name = f"store.{system}.{op}.{label}"
            assert 0 < figures[f"{name}.p50_us"] <= figures[f"{name}.p99_us"]
            assert figures[f"{name}.gbps_at_p50"] == pytest.approx(
                nbytes / (figures[f"{name}.p50_us"] * 1e3)
            )
    for op in BATCH_OPS:
        name = f"store.{system}.{op}.{BATCH_LABEL}"
        assert 0 < figures[f"{name}.p50_us"] <= figures[f"{name}.p99_us"]
        assert figures[f"{name}.per_item_us"] == pytest.approx(figures[f"{name}.p50_us"] / BATCH)
    assert figures[f"store.{system}.is_exist.p50_us"] > 0


@pytest.mark.usefixtures("no_scratch_left")
def test_quick_json_has_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _bench(capsys)
    figures = doc["figures"]
    assert doc["benchmark"] == "store" and doc["server"] == "child process"
    assert doc["baseline"] is None
    assert all(math.isfinite(v) for v in figures.values())
    _check_system(figures, "beluga")
    for label in SIZES:
        memcpy = figures[f"store.memcpy.{label}.p50_us"]
        get = figures[f"store.beluga.get.{label}.p50_us"]
        assert figures[f"store.beluga.get.{label}.of_memcpy"] == pytest.approx(memcpy / get)
    assert not any(".mooncake." in name or "vs_mooncake" in name for name in figures)
    targets = {t["name"]: t for t in doc["targets"]}
    assert set(targets) == {name for name, source, *_ in TARGETS if source in figures}
    assert "lookup_prefix_256_p50_us" in targets and "get_16KiB_vs_mooncake" not in targets
    for t in targets.values():
        assert t["value"] == figures[f"store.target.{t['name']}"]
        assert t["met"] == (
            t["value"] >= t["goal"] if t["sense"] == ">=" else t["value"] <= t["goal"]
        )
    for label in SIZES:  # the floor of a read, measured on the value's own bytes
        floor = figures[f"store.beluga.invalidate_load.{label}.p50_us"]
        get_into = figures[f"store.beluga.get_into.{label}.p50_us"]
        assert figures[f"store.beluga.get_into.{label}.of_invalidate_load"] == pytest.approx(
            floor / get_into
        )
    for op in ("lookup_prefix", "lookup_prefix_cold"):  # a stored chain, and one not stored
        lookup = figures[f"store.beluga.{op}.256.p50_us"]
        assert figures[f"store.beluga.{op}.256.per_item_us"] == pytest.approx(lookup / 256)
    _check_sweep(doc["alignment"], figures, ALIGN_QUICK)


def _check_sweep(rows: list[dict], figures: dict[str, float], offsets: tuple[int, ...]) -> None:
    """Every operation at every offset; best and worst are the extremes of those p50s."""
    assert [r["op"] for r in rows] == list(ALIGN_OPS)
    for r in rows:
        p50 = {int(o): v for o, v in r["p50_us_by_offset"].items()}
        assert sorted(p50) == sorted(offsets) and all(v > 0 for v in p50.values())
        assert r["best_p50_us"] == min(p50.values()) == p50[r["best_offset"]]
        assert r["worst_p50_us"] == max(p50.values()) == p50[r["worst_offset"]]
        ratio = figures[f"store.align.{r['op']}.worst_of_best"]
        assert ratio == pytest.approx(max(p50.values()) / min(p50.values()))
        assert ratio >= 1


@pytest.mark.usefixtures("no_scratch_left")
def test_without_mooncake_beluga_runs_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "mooncake", None)
    assert main(["bench", "store", "--quick", "--sizes", "16K", "--baseline", "mooncake"]) == 0
    out, err = capsys.readouterr()
    assert "Mooncake is not installed" in err and "measured Beluga alone" in err
    assert "get_into" in out and "Mooncake" not in out


def test_a_running_server_is_used(shm_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A second server on the same rings would answer every request twice."""
    with (
        Pool.create(shm_path, 96 << 20, geometry=SMALL) as pool,
        server_process(serve_in_child, pool.spec),
    ):
        doc = _bench(capsys, "--pool", shm_path, "--sizes", "16K")
        assert doc["server"] == "already running"
        with KVStore(pool) as store:
            assert store.stats()["keys"] == 0  # everything the benchmark stored is gone


def test_a_small_named_pool_is_refused(pool: Pool, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "store", "--quick", "--pool", pool.spec]) == 2
    assert "use a bigger pool" in capsys.readouterr().err


@pytest.mark.usefixtures("no_scratch_left")
def test_beside_mooncake(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        check_available()
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    doc = _bench(capsys, "--baseline", "mooncake")
    figures = doc["figures"]
    assert doc["baseline"]["system"] == "mooncake" and doc["baseline"]["version"]
    _check_system(figures, "beluga")
    _check_system(figures, "mooncake")
    for op in (*SINGLE_OPS, *BATCH_OPS):
        label = BATCH_LABEL if op in BATCH_OPS else "16KiB"
        assert figures[f"store.vs_mooncake.{op}.{label}"] == pytest.approx(
            figures[f"store.mooncake.{op}.{label}.p50_us"]
            / figures[f"store.beluga.{op}.{label}.p50_us"]
        )
    assert [t["name"] for t in doc["targets"]] == [name for name, *_ in TARGETS]
    left = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
    assert not left, f"the benchmark left processes behind: {left}"
