"""Run Mooncake's own store tests against Mooncake and against the drop-in, and compare.

::

    git -C MOONCAKE_CHECKOUT archive v0.3.13 mooncake-wheel/tests | tar -x -C /tmp/mc
    python -m tests.compat_mooncake.mooncake_own_tests /tmp/mc/mooncake-wheel/tests [--json OUT]

(``ci/mooncake-own-tests.sh`` does both.)  Mooncake's tests are not part of
this project: they are read from the folder given, copied into scratch
folders, and run unchanged, one ``pytest -v`` per file (:data:`FILES`):

- **on Mooncake**: the installed ``mooncake`` wheel (``ci/install-mooncake.sh``),
  with a master on loopback serving the HTTP metadata and a standalone
  ``mooncake_client`` for the dummy-client tests, set up as Mooncake's own
  ``scripts/run_tests.sh`` does (``--default_kv_lease_ttl=500``, the tests'
  default ports 50051, 8080 and 50052, which must be free);
- **on Beluga**: a scratch pool with its metadata server, and a
  ``conftest.py`` that calls :func:`beluga.compat.mooncake.install`, so the
  tests' ``from mooncake.store import ...`` gets the drop-in.

Every test's outcome on each side is parsed from pytest's verbose lines; a
file that runs past ``--timeout`` is killed and its unfinished tests count
as hung.  The verdict: a test that passes on Mooncake and not on Beluga is a
**regression** unless :data:`beluga.compat.mooncake.DIFFERENCES` names it;
a difference listed there whose test now passes on Beluga, or that names no
test of the files run, is **stale**.  Either makes the exit status 1, so
the list of differences cannot drift from the behaviour.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from beluga.compat.mooncake import DIFFERENCES, LEASE_ENV
from beluga.errors import BelugaError

#: Mooncake's store test files (``mooncake-wheel/tests``) that the drop-in answers for
FILES = (
    "test_distributed_object_store.py",
    "test_replicated_distributed_object_store.py",
    "test_put_get_tensor.py",
    "test_batch_replica_clear.py",
    "test_dummy_client.py",
)
#: the ports Mooncake's tests assume: master RPC, HTTP metadata, the dummy tests' real client
MOONCAKE_PORTS = (50051, 8080, 50052)
#: the lease Mooncake's own CI gives keys (ms), which the tests read as DEFAULT_KV_LEASE_TTL
LEASE_TTL_MS = 500
#: bytes of the Beluga side's scratch pool: the tests' stress case keeps 800 MiB live
POOL_BYTES = 4 << 30
PASS = "passed"
HUNG = "hung"  # still running, or never started, when the file's time ran out
_LINE = re.compile(r"^(\S+\.py::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
#: what runs a child so that the kernel kills it if this process dies (pdeathsig)
_SETPRIV = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
_CONFTEST = """\
# written by tests.compat_mooncake.mooncake_own_tests: Mooncake's imports get the Beluga drop-in
from beluga.compat.mooncake import install

install()
"""


@dataclass
class FileRun:
    """One test file's run on one side: each test's outcome (pytest's word, lower case, or
    :data:`HUNG`), whether its time ran out, and the tail of its output."""

    outcomes: dict[str, str] = field(default_factory=dict)
    timed_out: bool = False
    seconds: float = 0.0
    tail: str = ""


def parse_outcomes(output: str) -> dict[str, str]:
    """Test id -> outcome from ``pytest -v`` output (the last word given for an id wins:
    a test that passed and then errored in teardown is an error)."""
    outcomes: dict[str, str] = {}
    for line in output.splitlines():
        m = _LINE.match(line.strip())
        if m:
            outcomes[m.group(1)] = m.group(2).lower()
    return outcomes


def collect(python: str, folder: Path, name: str, env: Mapping[str, str]) -> list[str]:
    """The ids of a file's tests (empty if it does not import: its run reports why)."""
    proc = subprocess.run(
        [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", name],
        cwd=folder, env=dict(env), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return [line for line in proc.stdout.splitlines() if line.startswith(f"{name}::")]


def run_file(
    python: str, folder: Path, name: str, env: Mapping[str, str], timeout_s: float
) -> FileRun:
    """Run one test file verbosely in its own session; kill the session after ``timeout_s``."""
    ids = collect(python, folder, name, env)
    argv = [*_SETPRIV, python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "addopts="]
    argv.append(name)
    started = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=folder, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=30)
    run = FileRun(parse_outcomes(output), timed_out, time.monotonic() - started, output[-3000:])
    for test_id in ids:
        run.outcomes.setdefault(test_id, HUNG if timed_out else "error")
    if not ids and not run.outcomes:  # nothing collected: the file failed at import
        run.outcomes[f"{name}::<import>::<import>"] = "error"
    return run


@dataclass
class Verdict:
    """The two sides compared (see the module docstring)."""

    rows: list[dict[str, Any]]
    regressions: list[str]
    documented: list[str]
    stale: list[str]
    beluga_only: list[str]

    @property
    def ok(self) -> bool:
        return not self.regressions and not self.stale


def compare(
    mooncake: Mapping[str, str], beluga: Mapping[str, str], differences: Mapping[str, str]
) -> Verdict:
    """Compare outcomes (test id -> outcome) under the documented ``differences``."""
    regressions, documented, stale, beluga_only = [], [], [], []
    for test_id in sorted(set(mooncake) | set(beluga)):
        theirs, ours = mooncake.get(test_id), beluga.get(test_id)
        if theirs == PASS and ours != PASS:
            (documented if test_id in differences else regressions).append(test_id)
        elif ours == PASS and test_id in differences:
            stale.append(test_id)  # listed as different, yet it passes
        elif ours == PASS and theirs != PASS:
            beluga_only.append(test_id)
    stale += [t for t in differences if t not in mooncake and t not in beluga]
    rows = []
    for name in sorted({t.split("::")[0] for t in set(mooncake) | set(beluga)}):
        ids = {t for t in set(mooncake) | set(beluga) if t.split("::")[0] == name}
        rows.append(
            {
                "file": name,
                "tests": len(ids),
                "mooncake_passed": sum(mooncake.get(t) == PASS for t in ids),
                "beluga_passed": sum(beluga.get(t) == PASS for t in ids),
                "documented": sum(t in documented for t in ids),
                "regressions": sum(t in regressions for t in ids),
            }
        )
    return Verdict(rows, regressions, documented, stale, beluga_only)


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _wait_port(port: int, process: subprocess.Popen[bytes], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        if process.poll() is not None:
            raise BelugaError(f"{what} exited ({process.returncode}) before listening on {port}")
        if time.monotonic() > deadline:
            raise BelugaError(f"{what} did not listen on port {port} within {timeout_s} s")
        time.sleep(0.1)


@contextlib.contextmanager
def mooncake_cluster(logdir: Path) -> Iterator[dict[str, str]]:
    """Mooncake's master (with the HTTP metadata server) and a real client, on the tests'
    ports; the environment their tests read."""
    from beluga.kv.tier.mooncake import check_available, child_env

    install = check_available()
    taken = [port for port in MOONCAKE_PORTS if not _port_free(port)]
    if taken:
        raise BelugaError(
            f"ports {taken} are in use; Mooncake's tests need {list(MOONCAKE_PORTS)} free: "
            "stop what listens there (another Mooncake master?) and run again"
        )
    env = child_env(install.libdir)
    started: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(logdir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [*_SETPRIV, *argv], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
        started.append(proc)
        return proc

    rpc, metadata, client = MOONCAKE_PORTS
    try:
        master = spawn("master", [
            str(install.master), f"--default_kv_lease_ttl={LEASE_TTL_MS}",
            "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={metadata}", "--logtostderr=true",
        ])  # fmt: skip
        _wait_port(rpc, master, "mooncake_master", 30)
        _wait_port(metadata, master, "mooncake_master's metadata server", 30)
        real = spawn("client", [
            str(install.storage), "--host=127.0.0.1", f"--port={client}",
            "--global_segment_size=1GB", f"--master_server_address=127.0.0.1:{rpc}",
            f"--metadata_server=http://127.0.0.1:{metadata}/metadata", "--logtostderr=true",
        ])  # fmt: skip
        _wait_port(client, real, "mooncake_client", 60)
        yield {
            **env,
            "MC_METADATA_SERVER": f"http://127.0.0.1:{metadata}/metadata",
            "MASTER_SERVER": f"127.0.0.1:{rpc}",
            "DEFAULT_KV_LEASE_TTL": str(LEASE_TTL_MS),
        }
    finally:
        for proc in reversed(started):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@contextlib.contextmanager
def beluga_pool() -> Iterator[dict[str, str]]:
    """A scratch pool with its metadata server in a child process; the tests' environment."""
    from beluga.child import server_process
    from beluga.pool import Geometry, Pool

    path = f"/dev/shm/beluga-mooncake-tests-{uuid.uuid4().hex[:12]}"
    geometry = Geometry(max_hosts=32, rpc_bytes_per_host=256 << 10, block_size=16 << 10)
    pool = Pool.create(path, POOL_BYTES, geometry=geometry)
    try:
        with server_process(_serve, pool.spec):
            yield {
                **os.environ,
                "BELUGA_POOL": pool.spec,
                "DEFAULT_KV_LEASE_TTL": str(LEASE_TTL_MS),
                LEASE_ENV: str(LEASE_TTL_MS),  # the drop-in's counterpart of the master's flag
            }
    finally:
        pool.close()
        Pool.destroy(path)


def _serve(spec: str, ready: Any) -> None:
    from beluga.server.server import serve

    serve(spec, coherence="native", ready=ready)


def run_side(
    side: str, source: Path, python: str, timeout_s: float, files: Sequence[str]
) -> dict[str, FileRun]:
    """Copy the files into a scratch folder and run each on ``side`` ("mooncake", "beluga")."""
    with tempfile.TemporaryDirectory(prefix=f"beluga-mc-{side}-") as scratch:
        folder = Path(scratch)
        for name in files:
            shutil.copy(source / name, folder / name)
        if side == "beluga":
            (folder / "conftest.py").write_text(_CONFTEST)
            env_cm = beluga_pool()
        else:
            env_cm = mooncake_cluster(folder)
        runs: dict[str, FileRun] = {}
        with env_cm as env:
            env = {
                **env,
                "PYTHONPATH": os.pathsep.join(filter(None, [_root(), env.get("PYTHONPATH")])),
            }
            for name in files:
                runs[name] = run_file(python, folder, name, env, timeout_s)
                print(f"{side}: {name}: {_summary(runs[name])}", file=sys.stderr, flush=True)
        return runs


def _root() -> str:
    return str(Path(__file__).resolve().parents[2])


def _summary(run: FileRun) -> str:
    words = [o for o in run.outcomes.values()]
    counts = {w: words.count(w) for w in sorted(set(words))}
    late = " (timed out)" if run.timed_out else ""
    return f"{counts} in {run.seconds:.0f} s{late}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.compat_mooncake.mooncake_own_tests")
    parser.add_argument("tests", type=Path, help="a Mooncake checkout's mooncake-wheel/tests")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per test file")
    parser.add_argument("--json", type=Path, help="write every outcome and the verdict here")
    parser.add_argument("--file", action="append", choices=FILES, help="run only these files")
    args = parser.parse_args(argv)
    files = args.file or list(FILES)
    missing = [name for name in files if not (args.tests / name).is_file()]
    if missing:
        print(f"error: {args.tests} has no {', '.join(missing)}: give the mooncake-wheel/tests "
              "folder of a Mooncake checkout", file=sys.stderr)  # fmt: skip
        return 2
    try:
        sides = {s: run_side(s, args.tests, sys.executable, args.timeout, files)
                 for s in ("mooncake", "beluga")}  # fmt: skip
    except BelugaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    outcomes = {s: {t: o for r in runs.values() for t, o in r.outcomes.items()}
                for s, runs in sides.items()}  # fmt: skip
    differences = {t: r for t, r in DIFFERENCES.items() if t.split("::")[0] in files}
    verdict = compare(outcomes["mooncake"], outcomes["beluga"], differences)
    _print(verdict, differences)
    if args.json:
        args.json.write_text(json.dumps({
            "outcomes": outcomes, "rows": verdict.rows, "regressions": verdict.regressions,
            "documented": verdict.documented, "stale": verdict.stale,
            "beluga_only": verdict.beluga_only,
            "tails": {s: {n: r.tail for n, r in runs.items() if any(
                o != PASS for o in r.outcomes.values())} for s, runs in sides.items()},
        }, indent=2))  # fmt: skip
    return 0 if verdict.ok else 1


def _print(verdict: Verdict, differences: Mapping[str, str]) -> None:
    head = ("file", "tests", "mooncake_passed", "beluga_passed", "documented", "regressions")
    print("| " + " | ".join(head) + " |")
    print("| --- " * len(head) + "|")
    for row in [*verdict.rows, {"file": "total", **{k: sum(r[k] for r in verdict.rows)
                                                     for k in head[1:]}}]:  # fmt: skip
        print("| " + " | ".join(str(row[k]) for k in head) + " |")
    for test_id in verdict.documented:
        print(f"documented: {test_id}: {differences[test_id]}")
    for test_id in verdict.beluga_only:
        print(f"passes on Beluga only: {test_id}")
    for test_id in verdict.regressions:
        print(f"REGRESSION (passes on Mooncake, not on Beluga, not documented): {test_id}")
    for test_id in verdict.stale:
        print(f"STALE difference (passes on Beluga, or names no test): {test_id}")


if __name__ == "__main__":
    sys.exit(main())
