"""The runner of Mooncake's own store tests (mooncake_own_tests.py, here): its parsing,
its verdict, and that a file which hangs is killed and its tests reported hung.

Mooncake's tests themselves are not in this project (ci/mooncake-own-tests.sh fetches
them); here the runner works on small test files of our own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from beluga.compat.mooncake import DIFFERENCES
from tests.compat_mooncake import mooncake_own_tests as runner

A, B, C, D = (f"test_x.py::T::test_{c}" for c in "abcd")


def test_verbose_lines_give_each_tests_last_outcome() -> None:
    out = "\n".join(
        [
            f"{A} PASSED                    [ 25%]",
            f"{B} FAILED                    [ 50%]",
            f"{C} PASSED                    [ 75%]",
            f"{C} ERROR                     [ 75%]",  # passed, then its teardown failed
            "FAILED test_x.py::T::test_b - AssertionError: 1 != 2",  # the summary: not a result
            f"{D} SKIPPED (no GPU)          [100%]",
        ]
    )
    assert runner.parse_outcomes(out) == {A: "passed", B: "failed", C: "error", D: "skipped"}


def test_the_verdict_sorts_every_disagreement() -> None:
    mooncake = {A: "passed", B: "passed", C: "passed", D: "failed"}
    beluga = {A: "passed", B: "failed", C: "hung", D: "passed"}
    verdict = runner.compare(mooncake, beluga, {B: "a reason"})
    assert verdict.documented == [B] and verdict.regressions == [C]
    assert verdict.beluga_only == [D] and verdict.stale == []
    assert not verdict.ok
    (row,) = verdict.rows
    assert row == {"file": "test_x.py", "tests": 4, "mooncake_passed": 3, "beluga_passed": 2,
                   "documented": 1, "regressions": 1}  # fmt: skip


def test_a_difference_that_passes_or_names_no_test_is_stale() -> None:
    outcomes = {A: "passed", B: "failed"}
    gone = "test_x.py::T::test_gone"
    verdict = runner.compare(outcomes, dict(outcomes), {A: "was different", gone: "renamed"})
    assert verdict.stale == [A, gone] and verdict.regressions == [] and not verdict.ok
    assert runner.compare(outcomes, dict(outcomes), {}).ok  # the same answers: nothing to say


def test_the_documented_differences_name_files_the_runner_runs() -> None:
    assert {t.split("::")[0] for t in DIFFERENCES} <= set(runner.FILES)


def test_a_file_that_hangs_is_killed_and_its_unfinished_tests_are_hung(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    (tmp_path / "test_x.py").write_text(
        "import os, time\n"
        "def test_a():\n    pass\n"
        "def test_b():\n    assert False\n"
        f"def test_c():\n    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "    time.sleep(600)\n"
        "def test_d():\n    pass\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = runner.run_file(sys.executable, tmp_path, "test_x.py", env, timeout_s=20)
    assert run.timed_out
    assert run.outcomes == {
        "test_x.py::test_a": "passed",
        "test_x.py::test_b": "failed",
        "test_x.py::test_c": runner.HUNG,
        "test_x.py::test_d": runner.HUNG,
    }
    pid = int(pid_file.read_text())  # the hung pytest is gone, not left running
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


def test_a_file_that_does_not_import_is_one_error(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text("from mooncake.store import NoSuchName\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = runner.run_file(sys.executable, tmp_path, "test_x.py", env, timeout_s=60)
    assert not run.timed_out
    assert list(run.outcomes.values()) == ["error"]


def test_a_folder_without_mooncakes_tests_exits_2_and_says_what_to_give(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert runner.main([str(tmp_path)]) == 2
    assert "mooncake-wheel/tests folder of a Mooncake checkout" in capsys.readouterr().err
