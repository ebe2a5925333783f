"""The sandbox end to end: a real guest, a real emulated CXL device.

Skips when the sandbox is not built (``python -m emulation build``); once it
is, every failure is real.  A few minutes at most under software emulation.
"""

from __future__ import annotations

import pytest

from emulation import Result, Sandbox, SandboxNotBuiltError, run
from emulation.runner import EXIT_TIMEOUT
from emulation.tests import running_children

pytestmark = pytest.mark.qemu

TIMEOUT_S = 240


@pytest.fixture(scope="module")
def built() -> Sandbox:
    try:
        return Sandbox.load()
    except SandboxNotBuiltError as e:
        pytest.skip(str(e))


def explain(result: Result) -> str:
    guest = result.guests[0]
    return f"{guest.problem}\n{result.output}\nconsole: {guest.console}"


def assert_nothing_left_running() -> None:
    alive = running_children()
    assert not alive, f"left running: {alive}"


def test_the_dax_check_passes_in_a_guest(built: Sandbox) -> None:
    result = run("dax", timeout=TIMEOUT_S, sandbox=built)
    assert result.returncode == 0, explain(result)
    assert "FAIL" not in result.output and "all steps passed" in result.output
    assert_nothing_left_running()


def test_two_guests_share_one_cxl_device(built: Sandbox) -> None:
    """Host ids claimed at once from both guests (the server in guest 0), blocks and the
    publish litmus across the guests, and a takeover between them (guest 1's standby
    fences guest 0's stopped server through the fence agent and serves): every step of the
    shared check passes."""
    result = run("shared", timeout=2 * TIMEOUT_S, sandbox=built)
    assert result.returncode == 0, "\n".join(explain_guest(result, g) for g in range(2))
    assert result.output.count("all steps passed") == 2
    assert "no id held twice" in result.output and "FAIL" not in result.output
    assert "the old server died by the fence" in result.output
    assert "guest 1's standby holds the seat" in result.output
    assert_nothing_left_running()


def explain_guest(result: Result, index: int) -> str:
    guest = result.guests[index]
    return f"guest {index}: {guest.problem}\nconsole: {guest.console}"


def test_a_script_exit_code_comes_back(built: Sandbox) -> None:
    command = ["sh", "-c", "test -c /dev/dax0.0 && echo dax-ready; exit 7"]
    result = run("dax", command, TIMEOUT_S, sandbox=built)
    assert result.returncode == 7, explain(result)
    assert result.output == "dax-ready\n"


def test_a_hung_guest_is_killed_at_the_timeout(built: Sandbox) -> None:
    result = run("dax", ["sleep", "1000"], timeout=3, sandbox=built)
    assert result.returncode == EXIT_TIMEOUT
    assert "killed" in result.guests[0].problem
    assert_nothing_left_running()
