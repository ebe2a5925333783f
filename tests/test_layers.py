"""Imports only go downward: a layer never imports one above it.

:data:`LAYERS` is the one table of who may import whom: every source file
under ``beluga/`` is placed in exactly one layer, and a layer may import
itself and anything below it.  Only the pool layer touches a pool's raw
mapping: everything above loads and stores through its ``Memory``
(coherence).  What a source may do beyond that is a named
:data:`EXEMPTIONS` entry with its reason, never a silent hole.  The README's
layer picture is rendered from the same table (:func:`render_layers`).

Read from the source with ``ast`` (nothing is imported), so an import hidden
inside a function to dodge a cycle is caught as well as one at the top.  No
module imports another in a loop, directly or through others, even within one
layer: :func:`import_cycles` finds every loop of the import graph.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import beluga

ROOT = Path(beluga.__file__).parent
README = ROOT.parent / "README.md"


@dataclass(frozen=True)
class Layer:
    """One layer: its name, the sources it holds and its lines in the README's picture."""

    name: str
    #: paths under beluga/: a folder ("kv/") holds everything below it, a file only itself
    sources: tuple[str, ...]
    picture: tuple[str, ...]


#: the layers, top to bottom
LAYERS: tuple[Layer, ...] = (
    Layer(
        "cli",
        ("cli/", "__main__.py"),
        ("beluga pool | serve | stats | demo | bench | certify | chaos | proxy",),
    ),
    Layer(
        "bench",
        ("bench/",),
        (
            "benchmarks and certification, Mooncake Store run beside Beluga as the",
            "baseline (it drives the tier's Mooncake client, never the reverse)",
        ),
    ),
    Layer(
        "integrations",
        ("integrations/", "compat/"),
        (
            "vLLM KV connector, LMCache storage plugin, SGLang HiCache backend;",
            "compat: Mooncake Store's Python API over a Beluga pool",
        ),
    ),
    Layer(
        "serving",
        ("serving/",),
        (
            "engine over a real model (store-backed prefix cache), prefill/decode",
            "roles, engine processes, schedulers (locality-free, locality-aware),",
            "trace, and the PD proxy (OpenAI-compatible, on aiohttp)",
        ),
    ),
    Layer(
        "chaos, litmus",
        ("chaos/", "litmus/"),
        (
            "harnesses over a live pool: fault injection with every answer checked;",
            "coherence litmus tests across hosts (above the pool, never inside it)",
        ),
    ),
    Layer(
        "server",
        ("server/",),
        (
            "the metadata server: start (attach, take the seat, recover, serve),",
            "standby and fencing, the service (grants, commits, leases, eviction,",
            "recovery while serving), the pool index's writer, allocator, metrics",
        ),
    ),
    Layer(
        "kv",
        # beluga/__init__.py: the package's face, the exception tree and a lazy KVStore
        ("kv/", "__init__.py"),
        (
            "the client: block hashing, model identity, KVStore and THE data path",
            "(save / load), the RPC records it shares with the server;",
            "tier: the Mooncake Store cluster beyond one pod, and its client",
        ),
    ),
    Layer(
        "transfer",
        ("transfer/",),
        (
            "the data path's sources and sinks (Buffers, Pieces, EngineBlocks); KV",
            "layouts (vLLM flash NHD/HND, vLLM CPU, Hugging Face), gather / scatter",
            "of whole blocks and sparse token fetch, one C call per batch (one",
            "NVRTC-compiled CUDA kernel over the registered pool on GPUs)",
        ),
    ),
    Layer("rpc", ("rpc/",), ("slot rings in the pool: client, batch-first server, protocol",)),
    Layer("pool", ("pool/",), ("backends (shm, numa, dax, interleave), superblock, host table",)),
    Layer(
        "coherence",
        ("coherence/",),
        (
            "Memory: load / store / nt_store / flush / invalidate / fences,",
            "publish / read_validated, gather_write / scatter_read",
        ),
    ),
    Layer(
        "_native",
        ("_native/",),
        (
            "the C core, no Python in it (cpu.c, crc32c.c, blake3.c, memops.c, model.c,",
            "sabotage.c, block.c, blockio.c, sg.c, record.c, index.c, mirror.c, keytable.c,",
            "rpc.c; each opens with its design), and its bindings (*_py.c, helpers_py.c)",
        ),
    ),
    Layer(
        "units, errors",
        # child.py starts, waits for and stops processes with nothing of Beluga but errors;
        # signals.py records stop signals in a flag that bounded waits poll
        ("units.py", "errors.py", "child.py", "signals.py"),
        ("below everything: sizes, the exception tree, child processes and waits",),
    ),
)

#: what "the raw mapping" means in EXEMPTIONS: a Pool's ``.mapping``, the backend's bytes
RAW_MAPPING = "the raw mapping"
#: the layer that owns the raw mapping; every other one goes through the pool's Memory
MAPPING_OWNER = "pool"


@dataclass(frozen=True)
class Exemption:
    """A source that may reach past the rules: a module above it, or the raw mapping."""

    source: str  # path under beluga/
    reaches: str  # a module name (an import) or RAW_MAPPING
    reason: str


EXEMPTIONS: tuple[Exemption, ...] = (
    Exemption(
        "transfer/gpu/__init__.py",
        RAW_MAPPING,
        "CUDA registers the pool's bytes (cudaHostRegister) so that a GPU kernel loads and "
        "stores them itself; a CPU Memory cannot stand in for the device's own accesses",
    ),
    Exemption(
        "bench/certify.py",
        RAW_MAPPING,
        "certification times the GPU's own copies to and from the pinned pool region, "
        "which is the device's path, not the CPU's Memory",
    ),
)


def sources() -> list[str]:
    """Every Python source under beluga/, as a path relative to it."""
    return sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py"))


def _holds(entry: str, source: str) -> bool:
    return source.startswith(entry) if entry.endswith("/") else source == entry


def layer_of(source: str) -> int:
    """The index in LAYERS of the one layer that holds ``source``."""
    found = [i for i, layer in enumerate(LAYERS) for e in layer.sources if _holds(e, source)]
    assert len(found) == 1, (
        f"beluga/{source} is in {len(found)} layers, not one: place it in LAYERS"
    )
    return found[0]


def source_of(module: str) -> str | None:
    """The source file of a ``beluga`` module (None: no such module)."""
    parts = module.split(".")[1:]
    for candidate in ("/".join(parts) + ".py", "/".join([*parts, "__init__.py"])):
        if (ROOT / candidate).is_file():
            return candidate
    return None


def first_party_imports(path: Path) -> list[tuple[int, str]]:
    """Every ``beluga`` module a file imports, anywhere in it, with its line.

    ``from P import name`` imports the submodule ``P.name`` when there is
    one, else ``P`` (a name defined in P).
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                is_module = sub.split(".")[0] == "beluga" and source_of(sub) is not None
                found.append((node.lineno, sub if is_module else node.module))
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: relative import; write it absolute")
    return [(line, name) for line, name in found if name.split(".")[0] == "beluga"]


def mapping_reaches(path: Path) -> list[int]:
    """The lines of a file that reach an object's ``.mapping`` (a Pool's raw mapping)."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "mapping"
    ]


def exempted(source: str, reaches: str) -> bool:
    return any(e.source == source and e.reaches == reaches for e in EXEMPTIONS)


def import_problems(source: str, imports: list[tuple[int, str]]) -> list[str]:
    """What is wrong with a source's imports under LAYERS (empty: nothing)."""
    where, mine, out = f"beluga/{source}", layer_of(source), []
    for line, name in imports:
        target = source_of(name)
        if target is None:
            out.append(f"{where}:{line}: imports {name}, which is no module of beluga")
        elif layer_of(target) < mine and not exempted(source, name):
            above = LAYERS[layer_of(target)].name
            out.append(f"{where}:{line}: imports {name} ({above}, above {LAYERS[mine].name})")
    return out


def import_graph() -> dict[str, set[str]]:
    """Each source under beluga/ -> the sources it imports (anywhere in it, lazily or not).

    An import names one module: importing ``beluga.x.y`` runs
    ``beluga/x/__init__.py`` first, but what that one imports are its own edges.
    """
    graph: dict[str, set[str]] = {}
    for s in sources():
        targets = {source_of(name) for _, name in first_party_imports(ROOT / s)}
        graph[s] = {t for t in targets if t is not None and t != s}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One loop of each strongly connected group of the graph (Tarjan's), as the sources
    in import order, the first repeated at the end; empty: no loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_loop_in(graph, group) for group in groups]


def _loop_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A loop through the first source of a strongly connected group (a shortest one)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(group)} is no strongly connected group")


def render_layers() -> str:
    """The README's layer picture, from LAYERS."""
    width = max(len(layer.name) for layer in LAYERS) + 2
    lines = []
    for layer in LAYERS:
        first, *rest = layer.picture
        lines.append(f"{layer.name:<{width}}{first}")
        lines += [" " * width + line for line in rest]
    return "\n".join(lines)


def readme_picture(text: str) -> str:
    """The fenced block after the README's layers marker."""
    found = re.search(r"<!-- layers: .*?-->\s*```\n(.*?)\n```", text, re.S)
    assert found, f"{README.name} has no layers marker followed by a fenced picture"
    return found.group(1)


# -- the table itself ------------------------------------------------------------


def test_every_source_is_placed_in_exactly_one_layer() -> None:
    held = {
        s: [i for i, la in enumerate(LAYERS) for e in la.sources if _holds(e, s)] for s in sources()
    }
    assert not [s for s, at in held.items() if not at], "sources in no layer: place them"
    assert not [s for s, at in held.items() if len(at) > 1], "sources in two layers"
    empty = [e for la in LAYERS for e in la.sources if not any(_holds(e, s) for s in held)]
    assert not empty, f"layer entries that hold no source: {empty}"


def test_every_exemption_is_still_needed() -> None:
    """An exemption that nothing uses any more would hide the next real need for one."""
    for e in EXEMPTIONS:
        path = ROOT / e.source
        if e.reaches == RAW_MAPPING:
            assert mapping_reaches(path), f"{e.source} no longer reaches the raw mapping"
        else:
            imported = [name for _, name in first_party_imports(path)]
            assert e.reaches in imported, f"{e.source} no longer imports {e.reaches}"
            assert layer_of(source_of(e.reaches) or "") < layer_of(e.source), (
                f"{e.source} may import {e.reaches} under the layers alone"
            )


# -- the sources against the table -----------------------------------------------


@pytest.mark.parametrize("layer", [la.name for la in LAYERS])
def test_a_layer_imports_nothing_above_it(layer: str) -> None:
    mine = [s for s in sources() if LAYERS[layer_of(s)].name == layer]
    assert mine, f"no sources in layer {layer}"
    wrong = [p for s in mine for p in import_problems(s, first_party_imports(ROOT / s))]
    assert not wrong, "layer rule broken:\n" + "\n".join(wrong)


def test_only_the_pool_reaches_the_raw_mapping() -> None:
    """All access to shared structures goes through coherence: a Pool's Memory."""
    wrong = [
        f"beluga/{s}:{line}: reaches .mapping"
        for s in sources()
        if LAYERS[layer_of(s)].name != MAPPING_OWNER and not exempted(s, RAW_MAPPING)
        for line in mapping_reaches(ROOT / s)
    ]
    assert not wrong, "the raw mapping outside the pool:\n" + "\n".join(wrong)


def test_no_modules_import_each_other_in_a_loop() -> None:
    loops = import_cycles(import_graph())
    assert not loops, "import loops (each module imports the next):\n" + "\n".join(
        " -> ".join(f"beluga/{s}" for s in loop) for loop in loops
    )


def test_the_readme_picture_is_the_table() -> None:
    assert readme_picture(README.read_text()) == render_layers(), (
        "README.md's layer picture differs from tests/test_layers.py's LAYERS; "
        "put this in its place:\n" + render_layers()
    )


# -- the checks can fail -----------------------------------------------------------


def test_the_walk_sees_imports_hidden_in_functions(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from beluga.coherence import LINE\n"
        "def f():\n"
        "    from beluga.pool import Pool\n"
        "    import beluga.kv.store\n"
        "    from beluga import rpc, __version__\n"
    )
    imports = first_party_imports(source)
    names = [name for _, name in imports]
    assert names == ["beluga.coherence", "beluga.pool", "beluga.kv.store", "beluga.rpc", "beluga"]
    assert import_problems("coherence/__init__.py", imports) == [
        "beluga/coherence/__init__.py:3: imports beluga.pool (pool, above coherence)",
        "beluga/coherence/__init__.py:4: imports beluga.kv.store (kv, above coherence)",
        "beluga/coherence/__init__.py:5: imports beluga.rpc (rpc, above coherence)",
        "beluga/coherence/__init__.py:5: imports beluga (kv, above coherence)",
    ]
    assert import_problems("cli/common.py", imports) == []


def test_an_unknown_module_and_a_raw_mapping_are_seen(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("import beluga.nowhere\ndef f(pool):\n    return pool.mapping.buffer\n")
    assert import_problems("kv/store.py", first_party_imports(source)) == [
        "beluga/kv/store.py:1: imports beluga.nowhere, which is no module of beluga"
    ]
    assert mapping_reaches(source) == [3]


def test_a_loop_is_found_and_named_through_other_modules() -> None:
    graph = {
        "a.py": {"b.py"},
        "b.py": {"c.py"},
        "c.py": {"a.py", "d.py"},
        "d.py": set(),
        "e.py": {"f.py"},
        "f.py": {"e.py"},
        "g.py": {"a.py"},
    }
    assert import_cycles(graph) == [["a.py", "b.py", "c.py", "a.py"], ["e.py", "f.py", "e.py"]]
    assert import_cycles({"a.py": {"b.py"}, "b.py": {"c.py"}, "c.py": set()}) == []


def test_the_picture_is_read_from_its_marker() -> None:
    text = "# x\n<!-- layers: rendered by tests -->\n```\ncli  a\nkv   b\n```\nafter\n"
    assert readme_picture(text) == "cli  a\nkv   b"
    first = render_layers().splitlines()[0]
    assert first.startswith("cli") and first.endswith(LAYERS[0].picture[0])
