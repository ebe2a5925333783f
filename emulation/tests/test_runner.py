"""Running guests without QEMU: process supervision, reports, scripts, the CLI."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from emulation import runner, sandbox
from emulation.__main__ import main
from emulation.errors import SandboxNotBuiltError
from emulation.runner import EXIT_NO_REPORT, EXIT_TIMEOUT, run, supervise
from emulation.sandbox import Sandbox
from emulation.tests import running_children

# A stand-in for QEMU: writes the console a guest would, from the -chardev
# path and the beluga.run= wrapper on its command line, and exits like QEMU.
FAKE_QEMU = textwrap.dedent(
    """\
    import re, sys, time
    args = sys.argv[1:]
    console = args[args.index("-chardev") + 1].split("path=", 1)[1]
    wrapper = re.search(r"beluga.run=(\\S+)", args[args.index("-append") + 1]).group(1)
    index = int(wrapper.rsplit("-", 1)[1].split(".")[0])
    behaviour = open(wrapper).read().rsplit("exec ", 1)[1].split()
    with open(console, "w") as out:
        out.write("[    0.1] kernel noise\\r\\nBELUGA-GUEST-BEGIN at 2.50 s\\r\\n")
        out.write(f"hello from guest {index}\\r\\n")
        out.flush()
        if behaviour[index] == "hang":
            time.sleep(600)
        if behaviour[index] != "crash":
            out.write(f"BELUGA-GUEST-EXIT={behaviour[index]} at 4.00 s\\r\\n")
    """
)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Sandbox:
    """A sandbox whose QEMU is the stand-in, with runs kept under tmp_path."""
    qemu = tmp_path / "qemu"
    qemu.write_text(f"#!{sys.executable}\n{FAKE_QEMU}")
    qemu.chmod(0o755)
    monkeypatch.setattr(runner, "RUNS", tmp_path / "runs")
    return Sandbox(str(qemu), tmp_path / "k", tmp_path / "i", "test", "tcg")


@pytest.fixture(autouse=True)
def nothing_left_running() -> Iterator[None]:
    yield
    alive = running_children()
    assert not alive, f"left running: {alive}"


def test_a_guest_reports_its_exit_code_output_and_times(fake: Sandbox) -> None:
    result = run("dax", ["3"], timeout=30, sandbox=fake)
    assert result.returncode == 3
    (guest,) = result.guests
    assert guest.output == "hello from guest 0\n"
    assert (guest.boot_s, guest.script_s, guest.problem) == (2.5, 1.5, "")
    assert (result.rundir / "label-0.bin").stat().st_size == 1 << 20
    assert not (result.rundir / "cxl-memory.bin").exists()  # memory goes, logs stay
    assert (result.rundir / "console-0.log").exists()


def test_the_wrapper_sets_up_the_device_only_where_there_is_one(fake: Sandbox) -> None:
    dax = run("dax", ["0"], timeout=30, sandbox=fake).rundir / "guest-0.sh"
    numa = run("numa", ["0"], timeout=30, sandbox=fake).rundir / "guest-0.sh"
    assert "cxl_setup.sh" in dax.read_text() and "BELUGA_DAX=/dev/dax0.0" in dax.read_text()
    assert "cxl_setup.sh" not in numa.read_text() and "BELUGA_NUMA_NODE=1" in numa.read_text()
    assert f"PYTHONPATH={runner.REPO}" in numa.read_text()


def test_each_guest_of_a_topology_reports_and_lines_name_their_guest(fake: Sandbox) -> None:
    result = run("shared", ["0", "0"], timeout=30, sandbox=fake)
    assert result.returncode == 0
    assert result.output == "guest0| hello from guest 0\nguest1| hello from guest 1\n"


def test_a_failing_guest_stops_the_other_and_its_own_code_is_returned(fake: Sandbox) -> None:
    started = time.monotonic()
    result = run("shared", ["hang", "5"], timeout=60, sandbox=fake)
    assert time.monotonic() - started < 30  # not the whole timeout
    assert result.returncode == 5
    assert result.guests[0].returncode == EXIT_NO_REPORT
    assert "another guest failed" in result.guests[0].problem


def test_a_hung_guest_is_killed_at_the_timeout(fake: Sandbox) -> None:
    result = run("dax", ["hang"], timeout=1, sandbox=fake)
    assert result.returncode == EXIT_TIMEOUT
    assert "after the 1 s timeout; killed" in result.guests[0].problem


def test_a_guest_that_dies_without_a_report_says_so(fake: Sandbox) -> None:
    result = run("dax", ["crash"], timeout=30, sandbox=fake)
    assert result.returncode == EXIT_NO_REPORT
    assert "QEMU exited with status 0 before the script reported" in result.guests[0].problem


def test_supervise_ends_the_whole_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    outcomes = supervise(
        [["sh", "-c", f"sleep 600 & echo $! > {pidfile}; wait"]], [tmp_path / "log"], 1
    )
    assert outcomes == [runner.Outcome("timeout")]
    grandchild = int(pidfile.read_text())
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == "zombie"


def test_bad_scripts_are_refused_before_any_launch(fake: Sandbox, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no script file"):
        run("dax", tmp_path / "missing.py", sandbox=fake)
    hidden = Path("/dev/shm") / f"beluga-emu-test-{os.getpid()}.sh"
    hidden.write_text("true\n")
    try:
        with pytest.raises(ValueError, match="has its own /dev/shm"):
            run("dax", hidden, sandbox=fake)
    finally:
        hidden.unlink()
    with pytest.raises(ValueError, match="non-empty list"):
        run("dax", [], sandbox=fake)
    with pytest.raises(ValueError, match="timeout"):
        run("dax", ["true"], timeout=0, sandbox=fake)


def test_a_script_file_runs_with_python_or_sh(fake: Sandbox, tmp_path: Path) -> None:
    script = tmp_path / "check.py"
    script.write_text("print('hi')\n")
    wrapper = run("dax", script, timeout=1, sandbox=fake).rundir / "guest-0.sh"
    assert f"exec {os.path.abspath(sys.executable)} {script}" in wrapper.read_text()


def test_without_a_build_the_user_is_told_to_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sandbox, "KERNEL", tmp_path / "vmlinuz")
    with pytest.raises(SandboxNotBuiltError, match="run python -m emulation build first"):
        run("dax", ["true"])
    assert main(["run", "dax", "--", "true"]) == 1
    assert "run python -m emulation build first" in capsys.readouterr().err


def test_the_cli_refuses_a_script_and_a_command_together(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["run", "dax", "--script", "x.py", "--", "true"]) == 2
    assert "not both" in capsys.readouterr().err
