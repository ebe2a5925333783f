"""The README and docs/ say what the code is: counts, paths and links that cannot drift.

The README is what a newcomer reads first, so it stays short (at most 200
lines) and its counts are read from the code they count: the sabotage points
from ``BL_SABOTAGE_POINTS`` in ``beluga_native.h``, the logic mutants, their
cheap subset and the equivalents from ``tests/logic_mutants/``.  Every
relative link and every repository path in backticks, in the README and in
``docs/``, names something that exists.  (The layer picture is checked by
``tests/test_layers.py``.)
"""

from __future__ import annotations

import re
from pathlib import Path

from tests import logic_mutants

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
HEADER = ROOT / "beluga" / "_native" / "beluga_native.h"
README_MAX_LINES = 200

#: top-level folders a path in backticks may start with
TOP = ("beluga", "tests", "ci", "docs", "emulation", "hwtests", "benchmarks", "deploy", "docker")
PATH_IN_TICKS = re.compile("`((?:" + "|".join(TOP) + r")/[A-Za-z0-9_./-]*)`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def sabotage_points(header: str) -> int:
    """How many X(...) rows the BL_SABOTAGE_POINTS table of beluga_native.h has."""
    start = header.index("#define BL_SABOTAGE_POINTS(X)")
    table = []
    for line in header[start:].splitlines()[1:]:
        table.append(line)
        if not line.rstrip().endswith("\\"):
            break
    return sum(1 for line in table if re.match(r"\s*X\(", line))


def readme_counts(text: str) -> dict[str, int]:
    """The counts the README states, by what they count (a missing one is absent)."""
    patterns = {
        "sabotage points": r"(\d+) sabotage points",
        "logic mutants": r"(\d+) logic mutants",
        "cheap": r"(\d+) of them run in every pytest run",
        "equivalents": r"(\d+) more were removed as equivalent",
    }
    found = {}
    flat = " ".join(text.split())
    for what, pattern in patterns.items():
        m = re.search(pattern, flat)
        if m:
            found[what] = int(m.group(1))
    return found


def code_counts() -> dict[str, int]:
    return {
        "sabotage points": sabotage_points(HEADER.read_text()),
        "logic mutants": len(logic_mutants.MUTANTS),
        "cheap": sum(m.cheap for m in logic_mutants.MUTANTS),
        "equivalents": len(logic_mutants.EQUIVALENT),
    }


def missing_paths(text: str, folder: Path) -> list[str]:
    """Repository paths in backticks and links relative to ``folder`` in ``text`` that
    name nothing."""
    out = []
    for raw in PATH_IN_TICKS.findall(text):
        path = raw.split("::")[0].rstrip(".")
        if any(c in path for c in "*{}") or path.endswith("/..."):
            continue
        if not (ROOT / path).exists():
            out.append(f"`{raw}`")
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        if not (folder / target).exists():
            out.append(f"link ({target})")
    return out


def test_the_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; keep it at most {README_MAX_LINES} and move the "
        "detail into docs/"
    )


def test_the_readme_counts_are_the_codes() -> None:
    stated = readme_counts(README.read_text())
    actual = code_counts()
    assert set(stated) == set(actual), f"the README states no count of {set(actual) - set(stated)}"
    assert stated == actual, f"README.md says {stated}; the code has {actual}"


def test_every_path_and_link_in_the_docs_exists() -> None:
    wrong = [
        f"{doc.relative_to(ROOT)}: {what}"
        for doc in documents()
        for what in missing_paths(doc.read_text(), doc.parent)
    ]
    assert not wrong, "documents name what is not in the repository:\n" + "\n".join(wrong)


def test_the_checks_see_a_wrong_count_a_missing_path_and_a_dead_link() -> None:
    text = "One of 12 sabotage points, 9 logic mutants; 4 of them run in every pytest\nrun."
    assert readme_counts(text) == {"sabotage points": 12, "logic mutants": 9, "cheap": 4}
    header = (
        "#define BL_SABOTAGE_POINTS(X) \\\n    X(A, 1) \\\n    X(B, 2) \\\n    X(C, 3)\n"
        "X(NOT_IN_TABLE)\n"
    )
    assert sabotage_points(header) == 3
    text = "see `beluga/no_such_room.py`, `beluga/kv/store.py`, `tests/test_docs.py::x`,\n"
    text += "[x](nowhere.md), [ok](usage.md), [web](https://example.com)\n"
    assert missing_paths(text, ROOT / "docs") == ["`beluga/no_such_room.py`", "link (nowhere.md)"]
