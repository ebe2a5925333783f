"""``beluga certify`` on shm and on stand-in DAX files, so that the lab suite cannot rot.

Speed is never asserted: the checks are that every section ran, the report
is complete and well formed, and the verdict follows behaviour.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from beluga.bench import certify, report
from beluga.cli import main
from beluga.errors import BackendUnavailableError, PoolError
from beluga.pool import Pool, numa
from tests.conftest import SMALL

MiB = 1 << 20
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}  # colour type -> samples per pixel
ROOT = Path(__file__).resolve().parents[1]


def assert_valid_png(path: Path) -> None:
    """Signature, chunk CRCs, IHDR first and IEND last, and pixel data of the right size."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    pos, kinds, header, pixels = 8, [], b"", b""
    while pos < len(data):
        (length,) = struct.unpack_from(">I", data, pos)
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack_from(">I", data, pos + 8 + length)
        assert zlib.crc32(kind + body) == crc, f"{path.name}: bad CRC in {kind!r}"
        kinds.append(kind)
        header = body if kind == b"IHDR" else header
        pixels += body if kind == b"IDAT" else b""
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and pos == len(data)
    width, height, depth, colour = struct.unpack_from(">IIBB", header)
    assert width > 100 and height > 100 and depth == 8
    assert len(zlib.decompress(pixels)) == height * (1 + width * PNG_CHANNELS[colour])


def certify_leftovers() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("beluga-certify-")}


def read_report(out: Path) -> dict[str, Any]:
    return json.loads((out / "report.json").read_text())


def check_report(out: Path) -> dict[str, Any]:
    """What every quick run must produce, whatever the target."""
    doc = read_report(out)
    for key in ("suite", "version", "started", "machine", "target", "settings", "sections"):
        assert key in doc, key
    assert doc["quick"] is True and doc["verdict"] == {"ok": True, "problems": []}
    assert set(doc["sections"]) == set(certify.SECTIONS)
    for name in ("latency", "bandwidth", "rpc", "litmus"):
        assert doc["sections"][name]["status"] == "ok", doc["sections"][name]
    for name in ("gpu", "copy_engine"):
        sec = doc["sections"][name]
        assert sec["status"] == "ok" or sec["reason"]
    latency = doc["sections"]["latency"]
    assert {r["method"] for r in latency["rows"]} >= {
        "load",
        "invalidate_load",
        "nt_store",
        "store_flush",
    }
    assert [r["threads"] for r in doc["sections"]["bandwidth"]["rows"]][:1] == [1]
    assert [d["depth"] for d in doc["sections"]["rpc"]["depths"]] == list(certify.RPC_DEPTHS)
    rows = {r["pattern"]: r for r in doc["sections"]["litmus"]["rows"]}
    assert all(rows[p]["violations"] == 0 for p in rows if not rows[p]["is_bug"])
    beside = {r["figure"]: r for r in doc["paper"]["beside_paper"]}
    nt = beside[report.PAPER["nt_store_16k"].label]
    assert nt["paper"] == 2.41 and nt["ratio"] == pytest.approx(nt["here"] / 2.41)
    assert report.PAPER["rpc_qd128"].label in beside
    assert len(doc["paper"]["shape"]) == len(report.SHAPE)
    assert {"latency.png", "bandwidth.png", "rpc.png"} <= set(doc["charts"])
    for chart in doc["charts"]:
        assert_valid_png(out / chart)
    summary = (out / "summary.md").read_text()
    assert "**PASS**" in summary and "This machine is not the paper's" in summary
    assert all(f"]({chart})" in summary for chart in doc["charts"])
    return doc


@pytest.mark.leaves("writes")  # certify's sections seal blocks with no server
def test_quick_shm_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = certify_leftovers()
    out = tmp_path / "report"
    assert main(["certify", "--backend", "shm", "--quick", "--out", str(out)]) == 0
    assert "report.json" in capsys.readouterr().out
    doc = check_report(out)
    assert doc["target"]["backend"] == "shm"
    assert doc["sections"]["interleave"]["status"] == "skipped"
    assert certify_leftovers() == before, "the scratch pool must be removed"


@pytest.mark.leaves("writes")  # certify's sections seal blocks with no server
def test_quick_run_on_stand_in_dax_devices_measures_interleaving(tmp_path: Path) -> None:
    devices = [tmp_path / "dax0", tmp_path / "dax1"]
    for d in devices:
        with open(d, "wb") as f:
            f.truncate(64 * MiB)
    out = tmp_path / "report"
    args = ["certify", "--quick", "--out", str(out)]
    assert main([*args, "--dax", str(devices[0]), "--dax", str(devices[1])]) == 0
    doc = check_report(out)
    assert doc["target"]["backend"] == "interleave" and len(doc["target"]["children"]) == 2
    inter = doc["sections"]["interleave"]
    assert inter["status"] == "ok" and inter["stripe"] == 2 * MiB
    assert inter["single_device"] == f"dax:{devices[0]}"
    assert len(inter["rows"]) == len(doc["sections"]["bandwidth"]["rows"])
    assert all(r["gain"] == pytest.approx(r["interleaved_gbps"] / r["gbps"]) for r in inter["rows"])
    for d in devices:  # the suite leaves no pool behind on the devices
        with pytest.raises(PoolError, match="not a Beluga pool"):
            Pool.attach(f"dax:{d}")


def test_two_roles_share_one_pool(shm_path: str, tmp_path: Path) -> None:
    """The cross-host form, with both "hosts" on this machine: the writer adopts the trials."""
    writer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "beluga",
            "certify",
            "--role",
            "writer",
            "--pool",
            shm_path,
            "--timeout",
            "60",
            "--out",
            str(tmp_path / "writer"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        args = ["certify", "--role", "observer", "--pool", shm_path, "--trials", "20"]
        assert main([*args, "--timeout", "60", "--out", str(tmp_path / "observer")]) == 0
        output, _ = writer.communicate(timeout=60)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.communicate()
    assert writer.returncode == 0, output
    seen = read_report(tmp_path / "observer")["sections"]["litmus_cross_host"]
    assert seen["role"] == "observer"
    assert [r["pattern"] for r in seen["rows"]] == list(certify.litmus.PATTERNS)
    for r in seen["rows"]:
        assert r["is_bug"] or (r["violations"] == 0 and r["confirmed"] > 0), r
    wrote = read_report(tmp_path / "writer")["sections"]["litmus_cross_host"]
    assert wrote["role"] == "writer"
    assert all(r["trials_written"] == 20 for r in wrote["rows"] if r["pattern"] != "publish")
    assert "observer host's report" in (tmp_path / "writer" / "summary.md").read_text()
    assert not os.path.exists(shm_path), "the observer removes its pool"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "exactly one of --dax"),
        (["--backend", "shm", "--numa", "0"], "got --numa, --backend/--pool"),
        (["--backend", "shm", "--sections", "latency,warp"], "unknown certify sections"),
        (["--backend", "shm", "--threads", "0"], "--threads must be at least 1"),
        (["--backend", "shm", "--trials", "0"], "--trials must be at least 1"),
        (["--dax", "/nonexistent/dax9.9"], "no device at /nonexistent/dax9.9"),
    ],
)
def test_bad_requests_say_what_to_do(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["certify", "--out", str(tmp_path / "r"), *args]) != 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_an_existing_pool_is_kept_without_force(
    shm_path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    Pool.create(shm_path, 32 * MiB, geometry=SMALL, label="precious").close()
    try:
        assert main(["certify", "--pool", shm_path, "--quick", "--out", str(tmp_path)]) == 1
        assert "--force" in capsys.readouterr().err
        with Pool.attach(shm_path) as pool:
            assert pool.superblock.label == "precious"
    finally:
        Pool.destroy(shm_path)


def test_a_lone_writer_gives_up_with_advice(
    shm_path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["certify", "--role", "writer", "--pool", shm_path, "--timeout", "0.2"]
    assert main([*args, "--out", str(tmp_path)]) == 1
    assert "--role observer" in capsys.readouterr().err


def test_a_caught_correct_recipe_fails_the_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken_memory(pool: Pool, s: certify.Settings) -> dict[str, Any]:
        caught = certify.litmus.LitmusResult("flush", 7, 1, 6, 5)
        return {"status": "ok", "mode": "native", "rows": [certify.litmus_row(caught, False)]}

    monkeypatch.setitem(certify.ON_POOL, "litmus", broken_memory)
    out = tmp_path / "report"
    assert main(["certify", "--backend", "shm", "--sections", "litmus", "--out", str(out)]) == 1
    assert "'flush' saw a stale value at trial 6" in capsys.readouterr().err
    assert read_report(out)["verdict"]["ok"] is False
    assert "**FAIL**" in (out / "summary.md").read_text()


@pytest.mark.leaves("writes")  # certify's sections seal blocks with no server
def test_without_matplotlib_the_report_says_why_there_are_no_charts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing() -> None:
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(report, "pyplot", missing)
    args = ["certify", "--backend", "shm", "--quick", "--sections", "latency"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    doc = read_report(tmp_path)
    assert doc["charts"] == [] and "matplotlib" in doc["charts_skipped"]
    assert "- charts: matplotlib is not installed" in (tmp_path / "summary.md").read_text()
    assert not list(tmp_path.glob("*.png"))


def test_gpu_copies_release_the_pool_view(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU section on a stand-in CUDA (CPU tensors): it pins, copies, unpins, lets go."""
    torch = pytest.importorskip("torch")
    calls: list[tuple[str, int]] = []
    cudart = SimpleNamespace(
        cudaHostRegister=lambda ptr, n, flags: calls.append(("register", ptr)) or 0,
        cudaHostUnregister=lambda ptr: calls.append(("unregister", ptr)) or 0,
    )
    fake = SimpleNamespace(
        from_numpy=torch.from_numpy,
        uint8=torch.uint8,
        empty=lambda n, dtype, device: torch.empty(n, dtype=dtype),
        cuda=SimpleNamespace(
            is_available=lambda: True,
            cudart=lambda: cudart,
            synchronize=lambda: None,
            get_device_name=lambda: "stand-in GPU",
        ),
    )
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(certify, "GPU_NODES", ("/dev/null",))
    args = ["certify", "--backend", "shm", "--quick", "--sections", "gpu"]
    assert main([*args, "--out", str(tmp_path)]) == 0  # a leaked view would fail the close
    gpu = read_report(tmp_path)["sections"]["gpu"]
    assert gpu["status"] == "ok" and gpu["pinned"] and gpu["device"] == "stand-in GPU"
    assert len(gpu["rows"]) == 2 * len(certify.GPU_SIZES)
    assert [c[0] for c in calls] == ["register", "unregister"] and calls[0][1] == calls[1][1]
    assert_valid_png(tmp_path / "gpu.png")


def test_paper_ratios_and_shape() -> None:
    doc = {
        "target": {"children": [{}, {}]},
        "sections": {
            "latency": {
                "status": "ok",
                "figures": {
                    "memops.nt_store.16KiB.p50_us": 1.0,
                    "memops.invalidate_load.16KiB.p50_us": 3.0,
                },
            },
            "bandwidth": {
                "status": "ok",
                "rows": [
                    {"direction": "write", "threads": 1, "gbps": 20.0},
                    {"direction": "write", "threads": 2, "gbps": 45.0},
                ],
            },
            "rpc": {"status": "skipped", "reason": "not asked"},
        },
    }
    got = report.comparisons(doc)
    beside = {r["figure"]: r for r in got["beside_paper"]}
    assert beside[report.PAPER["nt_store_16k"].label]["ratio"] == pytest.approx(1 / 2.41)
    per_device = beside[report.PAPER["write_per_device"].label]
    assert per_device["here"] == 22.5 and per_device["ratio"] == pytest.approx(1.0)
    assert report.PAPER["rpc_qd1"].label not in beside  # not measured, not compared
    (shape,) = got["shape"]
    assert shape["here"] == 3.0 and shape["paper"] == pytest.approx(5.98 / 2.41)


def run_hwtests(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BELUGA_HW_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "hwtests"],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_hwtests_skip_when_no_hardware_is_configured() -> None:
    out = run_hwtests({})
    assert out.returncode == 0, out.stdout
    assert "no CXL hardware configured" in out.stdout and " passed" not in out.stdout


def test_hwtests_fail_on_a_wrong_device(tmp_path: Path) -> None:
    standin = tmp_path / "dax0"
    standin.write_bytes(bytes(MiB))
    out = run_hwtests({"BELUGA_HW_DAX": str(standin)})
    assert out.returncode == 1
    assert "is a regular file, not a device-DAX device" in out.stdout


@pytest.mark.slow
def test_hwtests_pass_on_stand_ins(tmp_path: Path) -> None:
    """The chicken bit lets the hardware suite itself run here, on files and node 0."""
    devices = [tmp_path / "dax0", tmp_path / "dax1"]
    for d in devices:
        with open(d, "wb") as f:
            f.truncate(64 * MiB)
    env = {"BELUGA_HW_STAND_IN": "1", "BELUGA_HW_DAX": ",".join(map(str, devices))}
    nodes = numa.list_nodes()
    with contextlib.suppress(BackendUnavailableError):
        numa._libnuma(numa.LIBNUMA)
        env["BELUGA_HW_NUMA"] = str(nodes[0].node) if nodes else ""
    out = run_hwtests(env)
    assert out.returncode == 0, out.stdout[-3000:]
    assert " passed" in out.stdout and " error" not in out.stdout
