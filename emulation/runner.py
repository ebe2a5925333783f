"""Run a script in the guests of a topology and collect what each reported.

Every guest is one QEMU process in a session of its own, so ending it by
process group leaves nothing behind.  A run has one hard deadline for all of
its guests; when it passes, or the caller is interrupted, or one guest fails
(the others would only wait for it), every QEMU still running is ended:
SIGTERM, then SIGKILL a few seconds later.  A guest's exit code is read from
its serial console, where the guest init prints it between two markers.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from beluga.signals import raise_if_interrupted
from emulation.sandbox import GUEST_DIR, REPO, RUNS, Sandbox
from emulation.topology import LABEL_BYTES, GuestFiles, Topology, qemu_argv, topology_named

DEFAULT_TIMEOUT_S = 300.0
EXIT_TIMEOUT = 124  # the run's deadline passed first (as timeout(1) says)
EXIT_NO_REPORT = 125  # the sandbox failed: no exit code reported, or no device set up
KEEP_RUNS = 20  # run directories (console logs) kept under emulation/.cache/runs
POLL_S = 0.1
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TERM_GRACE_S = 5.0
#: how long to wait for a killed process group's members to be gone
KILL_WAIT_S = 10.0
#: Host paths the guest does not see: its own tmpfs is mounted over them.
GUEST_PRIVATE = (Path("/run"), Path("/dev/shm"), Path("/proc"), Path("/sys"))

_BEGIN = re.compile(r"^BELUGA-GUEST-BEGIN at ([\d.]+) s$", re.M)
_EXIT = re.compile(r"^BELUGA-GUEST-EXIT=(\d+) at ([\d.]+) s$", re.M)

Script = str | os.PathLike[str] | Sequence[str] | None


@dataclass(frozen=True)
class GuestResult:
    """What one guest reported."""

    index: int
    returncode: int
    output: str  # what the script printed (stdout and stderr, interleaved)
    console: Path  # the whole serial console: kernel, init and script
    problem: str  # why the script did not report an exit code; "" when it did
    boot_s: float | None  # guest uptime when the script started
    script_s: float | None  # how long the script ran


@dataclass(frozen=True)
class Result:
    """The outcome of one run: 0 only when every guest's script exited 0."""

    topology: str
    returncode: int
    guests: tuple[GuestResult, ...]
    seconds: float
    rundir: Path

    @property
    def output(self) -> str:
        """Every guest's output; with several guests each line names its guest."""
        if len(self.guests) == 1:
            return self.guests[0].output
        return "".join(
            f"guest{g.index}| {line}\n" for g in self.guests for line in g.output.splitlines()
        )


@dataclass(frozen=True)
class Outcome:
    """How a supervised process ended: ``exited`` (with status), ``timeout`` or ``stopped``."""

    how: str
    status: int | None = None


def run(
    topology: Topology | str,
    script: Script = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    *,
    sandbox: Sandbox | None = None,
) -> Result:
    """Boot the topology's guests, run ``script`` in each, and collect the results.

    ``script`` is a file (``.py`` runs with this Python, anything else with
    ``sh``), a command as a list of words, or None for the topology's own
    check.  Each guest sees the host's root read-only, runs in the checkout,
    and finds its role in ``BELUGA_GUEST_INDEX`` and ``BELUGA_GUESTS``.
    """
    if isinstance(topology, str):
        topology = topology_named(topology)
    if timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout}")
    command = _command(topology, script)
    sandbox = sandbox or Sandbox.load()
    rundir = _new_rundir(topology)
    files = [_guest_files(rundir, i) for i in range(topology.guests)]
    started = time.monotonic()
    try:
        argvs = [_prepare(topology, sandbox, f, i, command) for i, f in enumerate(files)]
        outcomes = supervise(
            argvs,
            [f.qemu_log for f in files],
            timeout,
            stop_others=lambda i: _report(files[i].console)[0] != 0,
        )
    finally:
        for f in files:
            for path in (f.numa_memory, f.cxl_memory):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
    guests = tuple(
        _result(i, f, o, timeout) for i, (f, o) in enumerate(zip(files, outcomes, strict=True))
    )
    # a script's own failure explains more than a guest stopped or timed out because of it
    failed = sorted((bool(g.problem), g.index) for g in guests if g.returncode)
    code = guests[failed[0][1]].returncode if failed else 0
    return Result(topology.name, code, guests, time.monotonic() - started, rundir)


def supervise(
    argvs: Sequence[Sequence[str]],
    logs: Sequence[Path],
    timeout: float,
    stop_others: Callable[[int], bool] = lambda _: False,
) -> list[Outcome]:
    """Run processes together under one deadline; end every one of them, always.

    ``stop_others(i)`` is asked when process ``i`` exits; True ends the rest.
    """
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for argv, log in zip(argvs, logs, strict=True):
            with open(log, "wb") as out:
                procs.append(
                    subprocess.Popen(
                        argv,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout
        outcomes: list[Outcome | None] = [None] * len(procs)
        while None in outcomes:
            for i, proc in enumerate(procs):
                if outcomes[i] is None and proc.poll() is not None:
                    outcomes[i] = Outcome("exited", proc.returncode)
                    if stop_others(i):
                        outcomes = [o or Outcome("stopped") for o in outcomes]
            if None not in outcomes:
                break
            if time.monotonic() >= deadline:
                outcomes = [o or Outcome("timeout") for o in outcomes]
            else:
                raise_if_interrupted()  # SIGTERM (python -m emulation): end them all, below
                time.sleep(POLL_S)
        return [o for o in outcomes if o is not None]
    finally:
        for proc in procs:
            _end(proc)


def _end(proc: subprocess.Popen[bytes]) -> None:
    """End a process and everything in its session: SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(TERM_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # SIGKILL is delivered, not done: a member that has not run since is still
    # "running". Wait until none is left but zombies (orphans reaped by init).
    deadline = time.monotonic() + KILL_WAIT_S
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is alive (not a zombie), read from /proc."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone while we looked
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _command(topology: Topology, script: Script) -> str:
    """The shell command line that runs the caller's script in the guest."""
    if script is None:
        return _python_or_sh(GUEST_DIR / topology.check)
    if isinstance(script, str | os.PathLike):
        path = Path(script).resolve()
        if not path.is_file():
            raise ValueError(f"no script file at {path}")
        hidden = next((p for p in GUEST_PRIVATE if path.is_relative_to(p)), None)
        if hidden is not None:
            raise ValueError(
                f"the guest cannot see {path}: it has its own {hidden}; move the script"
            )
        return _python_or_sh(path)
    words = list(script)
    if not words or not all(isinstance(w, str) and w for w in words):
        raise ValueError(f"a guest command is a non-empty list of non-empty words, not {script!r}")
    return shlex.join(words)


def _python_or_sh(path: Path) -> str:
    interpreter = _python() if path.suffix == ".py" else "sh"
    return shlex.join([interpreter, str(path)])


def _python() -> str:
    """This Python's path: the guest runs it from the shared host root.

    Not resolved through symlinks: a virtualenv's ``bin/python`` is a link to
    the base interpreter, and only the link's path finds the venv's packages.
    """
    return os.path.abspath(sys.executable)


def _new_rundir(topology: Topology) -> Path:
    """A fresh directory for this run's logs and label files; old ones are pruned."""
    RUNS.mkdir(parents=True, exist_ok=True)
    for old in sorted(RUNS.iterdir())[:-KEEP_RUNS]:
        shutil.rmtree(old, ignore_errors=True)
    prefix = f"{time.strftime('%Y%m%d-%H%M%S')}-{topology.name}-"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=RUNS))


def _guest_files(rundir: Path, index: int) -> GuestFiles:
    """The files of one guest; the memory files go when the run ends, the rest stay."""
    return GuestFiles(
        console=rundir / f"console-{index}.log",
        qemu_log=rundir / f"qemu-{index}.log",
        wrapper=rundir / f"guest-{index}.sh",
        label=rundir / f"label-{index}.bin",
        numa_memory=rundir / f"numa-memory-{index}.bin",
        cxl_memory=rundir / "cxl-memory.bin",
    )


def _prepare(
    topology: Topology, sandbox: Sandbox, files: GuestFiles, index: int, command: str
) -> list[str]:
    """Write the guest's wrapper and fresh label area; return its QEMU command line."""
    files.wrapper.write_text(_wrapper(topology, index, command))
    if topology.cxl_mib:
        # a label area reused from an earlier boot makes namespace creation fail (ENOSPC)
        with open(files.label, "wb") as f:
            f.truncate(LABEL_BYTES)
        if not files.cxl_memory.exists():
            with open(files.cxl_memory, "wb") as f:
                f.truncate(topology.cxl_mib << 20)
    return qemu_argv(
        topology,
        files,
        qemu=sandbox.qemu,
        kernel=sandbox.kernel,
        initramfs=sandbox.initramfs,
        accel=sandbox.accel,
    )


def _wrapper(topology: Topology, index: int, command: str) -> str:
    """The script the guest init runs in the chroot: environment, CXL set-up, the command."""
    env = {
        "PATH": f"{os.path.dirname(_python())}:{GUEST_PATH}",
        "HOME": "/run/home",
        "TMPDIR": "/run/tmp",
        "PYTHONPATH": str(REPO),
        "PYTHONDONTWRITEBYTECODE": "1",
        "BELUGA_TOPOLOGY": topology.name,
        "BELUGA_GUEST_INDEX": str(index),
        "BELUGA_GUESTS": str(topology.guests),
    }
    if topology.numa_node_mib:
        env["BELUGA_NUMA_NODE"] = "1"
    if topology.cxl_mib:
        env["BELUGA_DAX"] = "/dev/dax0.0"
    lines = ["# written by python -m emulation run; the guest init runs it in a chroot"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines += ['mkdir -p "$HOME" "$TMPDIR"', f"cd {shlex.quote(str(REPO))} || exit 125"]
    if topology.cxl_mib:
        lines.append(f"sh {shlex.quote(str(GUEST_DIR / 'cxl_setup.sh'))} || exit 125")
    lines.append(f"exec {command}")
    return "\n".join(lines) + "\n"


def _report(console: Path) -> tuple[int | None, str, float | None, float | None]:
    """Exit code, output, boot time and script time, as the console shows them."""
    try:
        text = console.read_text(errors="replace").replace("\r", "")
    except FileNotFoundError:
        return None, "", None, None
    begin = _BEGIN.search(text)
    end = next(reversed(list(_EXIT.finditer(text))), None)  # the script may print a marker too
    output = text[begin.end() + 1 if begin else 0 : end.start() if end else len(text)]
    boot = float(begin.group(1)) if begin else None
    if end is None:
        return None, output, boot, None
    script_s = float(end.group(2)) - boot if boot is not None else None
    return int(end.group(1)), output, boot, script_s


def _result(index: int, files: GuestFiles, outcome: Outcome, timeout: float) -> GuestResult:
    """A guest's result, with a problem that says why when it reported no exit code."""
    code, output, boot, script_s = _report(files.console)
    problem = ""
    if code is None:
        if outcome.how == "timeout":
            code, problem = EXIT_TIMEOUT, f"still running after the {timeout:g} s timeout; killed"
        elif outcome.how == "stopped":
            code, problem = EXIT_NO_REPORT, "stopped because another guest failed"
        else:
            code = EXIT_NO_REPORT
            problem = f"QEMU exited with status {outcome.status} before the script reported"
            said = _tail(files.qemu_log)
            if said:
                problem += f"; QEMU said: {said}"
    return GuestResult(index, code, output, files.console, problem, boot, script_s)


def _tail(path: Path, lines: int = 5) -> str:
    with contextlib.suppress(FileNotFoundError):
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    return ""
