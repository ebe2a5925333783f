# THEORY OF OPERATION
#
# Assumed: the configured memory (see conftest.py) is scratch, and this host
# has a CPU to spare for the RPC server process that the suite starts.
#
# Checked: 'beluga certify --quick' runs end to end on each configured kind
# of memory (the devices, interleaved every 2 MiB when there are several; the
# NUMA node): it exits 0, every section ran or was skipped with a reason, the
# verdict passes (no correct litmus recipe caught, no section broke), every
# figure is positive and finite, interleaving was measured exactly when
# several devices are configured, and the report is written (JSON, Markdown,
# and the charts unless matplotlib is missing, which the report then says).
#
# Speed is reported, never judged, here: compare reports instead.
"""The certification suite on the device (see the THEORY OF OPERATION above)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from beluga.bench.certify import SECTIONS
from beluga.cli import main
from beluga.pool import parse_spec
from beluga.pool.interleave import InterleaveBackend

pytestmark = pytest.mark.hw


def numbers(value: Any) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in numbers(v)]
    return []


def test_quick_certification_passes(hw_target: str, tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert main(["certify", "--pool", hw_target, "--force", "--quick", "--out", str(out)]) == 0
    doc = json.loads((out / "report.json").read_text())
    assert doc["verdict"] == {"ok": True, "problems": []}
    assert set(doc["sections"]) == set(SECTIONS)
    for name, sec in doc["sections"].items():
        assert sec["status"] in ("ok", "skipped"), f"{name}: {sec}"
        assert sec["status"] == "ok" or sec["reason"], f"{name} skipped without a reason"
    for name in ("latency", "bandwidth", "rpc", "litmus"):
        assert doc["sections"][name]["status"] == "ok"
        values = numbers(doc["sections"][name])
        assert all(math.isfinite(v) and v >= 0 for v in values), name
    assert all(r["gbps"] > 0 for r in doc["sections"]["bandwidth"]["rows"])
    assert all(d["requests"] > 0 for d in doc["sections"]["rpc"]["depths"])
    striped = isinstance(parse_spec(hw_target), InterleaveBackend)
    assert (doc["sections"]["interleave"]["status"] == "ok") == striped
    assert (out / "summary.md").read_text().count("**PASS**") == 1
    for chart in doc["charts"]:
        assert (out / chart).stat().st_size > 0
    assert doc["charts"] or "matplotlib" in doc["charts_skipped"]
