"""``beluga bench rpc --contended N``: quiet and contended figures in one document, no leftovers."""

from __future__ import annotations

import json

import psutil
import pytest

from beluga.bench.rpc import cpu_hogs
from beluga.cli import main


def test_cpu_hogs_burn_while_the_context_runs_and_stop_after() -> None:
    with cpu_hogs(2) as pids:
        assert len(pids) == 2
        assert all(psutil.Process(p).is_running() for p in pids)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


def test_contended_run_reports_both_loads(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "rpc", "--iterations", "100", "--duration", "0.02", "--contended", "1"]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["contended"] == 1
    assert [r["load"] for r in doc["rows"]] == ["quiet"] * 4 + ["1 hogs"] * 4
    figures = doc["figures"]
    for prefix in ("rpc", "rpc.contended"):
        for transport in ("slot-c", "slot-python", "tcp", "unix"):
            p50, p99 = (
                figures[f"{prefix}.{transport}.rtt_p50_us"],
                figures[f"{prefix}.{transport}.rtt_p99_us"],
            )
            assert 0 < p50 <= p99
            assert figures[f"{prefix}.{transport}.mops_d128"] > 0
    assert set(doc["targets"]) == {
        "quiet_slot_c_p50_ok",
        *(
            f"contended_{s}_{p}_vs_tcp_ok"
            for s in ("slot-c", "slot-python")
            for p in ("p50", "p99")
        ),
    }


def test_contended_must_be_a_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "rpc", "--contended", "-1"]) == 2
    assert "--contended" in capsys.readouterr().err
