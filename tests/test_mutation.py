"""Mutation score: every named sabotage point, armed alone, is caught under the model.

The points (``_core.SABOTAGE_POINTS``, defined in beluga_native.h) are every
fence, flush, invalidate and ordering step the protocols need on real CXL
hardware.  This test builds the sabotage core (the same sources with
``-DBL_SABOTAGE``) into a temporary directory, then for each point spawns a
process that loads it with that point armed and runs the point's catchers
(``tests.sabotage_checks.CATCHERS``).  A point counts as caught only when a
catcher saw a promise broken (a ``Violation``, not any error) *and* the point
really skipped its step in some process.  Every check must also pass on the
production core (eviction off and on) and on the sabotage core with nothing
armed, so a catch is the sabotage's doing.

It prints the score (caught / points) and which check caught each point.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from xml.etree import ElementTree

import pytest
from setuptools import Distribution, Extension

from beluga._native import POINTS, _core, step
from beluga.coherence import Memory, ModelConfig
from tests import sabotage_checks as checks

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 2  # CI machines have two cores
POINT_TIMEOUT_S = 120


def build_sabotage_core(dest: Path) -> Path:
    """Compile beluga._native._core_sabotage (the core with -DBL_SABOTAGE) into dest."""
    sources = sorted(glob.glob(str(ROOT / "beluga" / "_native" / "*.c")))
    ext = Extension(
        "beluga._native._core_sabotage",
        sources=sources,
        depends=glob.glob(str(ROOT / "beluga" / "_native" / "*.h")),
        define_macros=[("BL_SABOTAGE", "1")],
        extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    )
    cmd = Distribution({"ext_modules": [ext]}).get_command_obj("build_ext")
    cmd.build_lib, cmd.build_temp, cmd.parallel = str(dest), str(dest / "tmp"), WORKERS
    cmd.ensure_finalized()
    cmd.run()
    return Path(cmd.get_ext_fullpath(ext.name))


@pytest.fixture(scope="module")
def sabotage_core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield build_sabotage_core(tmp_path_factory.mktemp("sabotage-core"))


@dataclass
class PointRun:
    point: str
    outcomes: list[dict[str, str]]
    fired: bool
    seconds: float

    @property
    def caught_by(self) -> list[str]:
        return [o["check"] for o in self.outcomes if o["outcome"] == "caught"]

    @property
    def caught(self) -> bool:
        return self.fired and bool(self.caught_by)


def run_armed(core: Path, point: str | None, log: Path) -> PointRun:
    """Run a point's catchers (none armed: every check) in fresh processes on the sabotage core."""
    env = {
        **os.environ,
        "BELUGA_SABOTAGE_CORE": str(core),
        "BELUGA_SABOTAGE": point or "",
        "BELUGA_SABOTAGE_LOG": str(log),
        "BELUGA_COHERENCE": "model",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    start = time.monotonic()
    nodes = [n for n in checks.CATCHERS.get(point or "", []) if n not in checks.CHECKS]
    done = subprocess.run(
        [sys.executable, "-m", "tests.sabotage_checks"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=POINT_TIMEOUT_S,
        check=False,
    )
    outcomes = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not outcomes:
        outcomes.append(
            {"check": "(process)", "outcome": "error", "detail": done.stderr[-2000:].strip()}
        )
    outcomes += [run_test(node, env, log.with_suffix(".xml")) for node in nodes]
    fired = log.exists() and point in log.read_text().split()
    return PointRun(point or "(none)", outcomes, fired, time.monotonic() - start)


def run_test(node: str, env: dict[str, str], report: Path) -> dict[str, str]:
    """Run one pytest test as a catcher: caught when it fails (not when its set-up errs)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            node,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=POINT_TIMEOUT_S,
        check=False,
    )
    case = ElementTree.parse(report).find(".//testcase") if report.exists() else None
    if case is None:
        return {"check": node, "outcome": "error", "detail": "pytest ran no such test"}
    failure, error = case.find("failure"), case.find("error")
    if failure is not None:
        return {"check": node, "outcome": "caught", "detail": failure.get("message", "")}
    if error is not None:
        return {"check": node, "outcome": "error", "detail": error.get("message", "")}
    return {"check": node, "outcome": "passed", "detail": ""}


# -- the points and their catchers -------------------------------------------------


def test_every_point_has_catchers_and_every_catcher_exists() -> None:
    assert set(checks.CATCHERS) == set(POINTS), "a point without catchers, or a stale name"
    for names in checks.CATCHERS.values():
        assert names[0] in checks.CHECKS  # the cheapest catcher is an in-process check
        assert all(n in checks.CHECKS or "::" in n for n in names)
    for p in POINTS.values():  # each point says what it removes and why hardware needs it
        assert p.where and p.step and p.why, p


@pytest.mark.parametrize("evict_rate", [0.0, ModelConfig.evict_rate], ids=["evict-off", "evict-on"])
@pytest.mark.parametrize("name", list(checks.CHECKS))
def test_every_check_passes_on_the_production_core(name: str, evict_rate: float) -> None:
    model = replace(ModelConfig(), evict_rate=evict_rate)
    assert checks.run(name, model) == {"check": name, "outcome": "passed", "detail": ""}


# -- the switch ----------------------------------------------------------------------


def test_the_production_core_cannot_be_armed() -> None:
    assert not _core.SABOTAGE_BUILD and _core.armed() is None
    with pytest.raises(ValueError, match="production core has no sabotage points"):
        _core._arm("GATHER_FENCE")
    assert step("GATHER_FENCE", Memory.sfence) is Memory.sfence  # the plain call, no wrapper
    with pytest.raises(ValueError, match="not a sabotage point"):
        step("NO_SUCH_POINT", Memory.sfence)


def test_an_armed_core_runs_under_the_model_only(sabotage_core: Path, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "BELUGA_SABOTAGE_CORE": str(sabotage_core),
        "BELUGA_SABOTAGE": "GATHER_FENCE",
        "PYTHONPATH": str(ROOT),
    }
    code = (
        "from beluga._native import _core; from beluga.coherence import Memory;"
        "assert _core.SABOTAGE_BUILD and _core.armed() == 'GATHER_FENCE';"
        "Memory(bytearray(4096), 'model');"
        "Memory(bytearray(4096), 'native')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "runs under the model only" in done.stderr, done.stderr


def test_every_check_passes_on_the_unarmed_sabotage_core(
    sabotage_core: Path, tmp_path: Path
) -> None:
    run = run_armed(sabotage_core, None, tmp_path / "fired")
    assert [o["check"] for o in run.outcomes] == list(checks.CHECKS)
    assert all(o["outcome"] == "passed" for o in run.outcomes), run.outcomes
    assert not (tmp_path / "fired").exists()  # nothing armed, nothing skipped


# -- the mutation run -----------------------------------------------------------------


def test_every_point_is_caught(
    sabotage_core: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    start = time.monotonic()
    with ThreadPoolExecutor(WORKERS) as pool:
        runs = list(
            pool.map(
                lambda point: run_armed(sabotage_core, point, tmp_path / f"{point}.fired"),
                POINTS,
            )
        )
    elapsed = time.monotonic() - start
    caught = [r for r in runs if r.caught]
    with capsys.disabled():
        print(f"\nmutation score: {len(caught)}/{len(runs)} points caught in {elapsed:.1f} s")
        for r in runs:
            verdict = ", ".join(r.caught_by) if r.caught else "MISSED"
            print(f"  {r.point:32} {verdict}  ({r.seconds:.1f} s)")
    missed = {
        r.point: [o for o in r.outcomes if o["outcome"] != "caught"] + [{"fired": str(r.fired)}]
        for r in runs
        if not r.caught
    }
    assert not missed, missed
