"""Imports only go downward: a layer never imports one above it.

Read from the source with ``ast`` (nothing is imported), so an import hidden
inside a function to dodge a cycle is caught as well as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import beluga

ROOT = Path(beluga.__file__).parent

#: each lower layer and the first-party modules it may import (itself included)
MAY_IMPORT = {
    "coherence": ("beluga._native", "beluga.errors", "beluga.coherence"),
}


def first_party_imports(path: Path) -> list[tuple[int, str]]:
    """Every ``beluga`` module a file imports, anywhere in it, with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "beluga":  # from beluga import pool: the submodule is the import
                found += [(node.lineno, f"beluga.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: relative import; write it absolute")
    return [(line, name) for line, name in found if name.split(".")[0] == "beluga"]


def _allowed(name: str, allowed: tuple[str, ...]) -> bool:
    return any(name == a or name.startswith(a + ".") for a in allowed)


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_lower_layer_imports_nothing_above_it(layer: str) -> None:
    files = sorted((ROOT / layer).rglob("*.py"))
    assert files, f"no sources under {ROOT / layer}"
    wrong = [
        f"{path.relative_to(ROOT.parent)}:{line}: imports {name}"
        for path in files
        for line, name in first_party_imports(path)
        if not _allowed(name, MAY_IMPORT[layer])
    ]
    assert not wrong, "layer rule broken:\n" + "\n".join(wrong)


def test_the_walk_sees_imports_hidden_in_functions(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from beluga.coherence import LINE\n"
        "def f():\n"
        "    from beluga.pool import Pool\n"
        "    import beluga.kv.store\n"
        "    from beluga import rpc\n"
    )
    names = [name for _, name in first_party_imports(source)]
    assert names == ["beluga.coherence", "beluga.pool", "beluga.kv.store", "beluga.rpc"]
    assert [n for n in names if not _allowed(n, MAY_IMPORT["coherence"])] == names[1:]
