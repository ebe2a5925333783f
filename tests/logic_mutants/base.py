"""What a logic mutant is, where framework venvs live, and the test files mutants name.

A mutant replaces ``anchor`` (which must occur exactly once in ``path``) by
``replacement``; its ``tests`` are the pytest nodes that cover it and ``why``
says in one line why they catch it.  ``cheap`` mutants run in every pytest
run (their tests take seconds); the rest run with ``BELUGA_MUTATION=all``.
``venv`` names a framework venv (ci/install-frameworks.sh) whose interpreter
runs the tests.  Anchors are short and avoid code others are changing often.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

FRAMEWORK_VENVS = Path(
    os.environ.get(
        "BELUGA_FRAMEWORK_VENVS",
        os.path.join(
            os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
            "beluga",
            "framework-venvs",
        ),
    )
)


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    path: str
    anchor: str
    replacement: str
    tests: tuple[str, ...]
    why: str
    cheap: bool = False
    venv: str | None = None


#: the tests aimed at the logic mutants survived, by area
IX = "tests/test_logic_index.py::"
SX = "tests/test_logic_server.py::"
CX = "tests/test_logic_client.py::"
#: the other test files mutants name
SVC = "tests/test_service.py::"
HOSTS = "tests/test_hosts.py::"
STORE = "tests/test_store.py::"
BLOCKS = "tests/test_store_blocks.py::"
VLLM = "tests/frameworks/test_vllm_parallel.py::"
RETIRED = "tests/test_retired.py::"
MOONCAKE = "tests/compat_mooncake/test_values.py::"
RESTARTS = "tests/test_rpc_restarts.py::"
GPU = "tests/test_transfer_gpu.py::"
REC = "tests/test_recovery.py::"
RECI = "tests/test_recovery_interleavings.py::"
DYING = "tests/test_dying_servers.py::"
