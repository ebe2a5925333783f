"""Beluga's C core (beluga_native.h maps its files).  Import it through beluga.coherence.

``_core`` is the production build.  Only a mutation run (tests/test_mutation.py)
loads the sabotage build instead: it builds ``_core_sabotage`` into a
temporary directory and names the file in ``BELUGA_SABOTAGE_CORE`` (and the
point to arm in ``BELUGA_SABOTAGE``) in the processes it spawns; nothing else
sets them, no package ships that file, and an armed core refuses native mode
(sabotage.c says why it cannot be armed by accident).

:func:`step` is how Python code names a protocol step after a sabotage point
(``_core.SABOTAGE_POINTS``, one table for C and Python): it returns the
operation itself, so a guarded call costs what the plain call costs, except
in a mutation run that armed that point.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

from beluga.errors import CoherenceError, RpcError

SABOTAGE_CORE_ENV = "BELUGA_SABOTAGE_CORE"  # path of a _core_sabotage build (mutation runs)
SABOTAGE_ENV = "BELUGA_SABOTAGE"  # the point it arms
SABOTAGE_LOG_ENV = "BELUGA_SABOTAGE_LOG"  # where fired points are recorded


def _load_sabotage_core(path: str) -> ModuleType:
    name = "beluga._native._core_sabotage"
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None or not os.path.isfile(path):
        raise ImportError(f"{SABOTAGE_CORE_ENV}={path} is not a built sabotage core")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    if not module.SABOTAGE_BUILD:
        raise ImportError(f"{path} is not a sabotage build of the C core")
    sys.modules[name] = module
    point = os.environ.get(SABOTAGE_ENV, "")
    if point:
        module._arm(point)
    return module


_core: Any
if os.environ.get(SABOTAGE_CORE_ENV):
    _core = _load_sabotage_core(os.environ[SABOTAGE_CORE_ENV])
else:
    from beluga._native import _core

_core._register_errors(CoherenceError, RpcError)


class Point(NamedTuple):
    """A sabotage point: a protocol step, where it is, and why hardware needs it."""

    name: str
    where: str
    step: str
    why: str


POINTS: dict[str, Point] = {row[0]: Point(*row) for row in _core.SABOTAGE_POINTS}

Op = Callable[..., Any]


def step(point: str, op: Op) -> Op:
    """``op``, the protocol step named ``point``; a no-op only where a mutation run armed it.

    Bind the result once, at import (``_fence = step("X_FENCE", Memory.sfence)``)
    and call it instead of the plain operation.
    """
    if point not in POINTS:
        raise ValueError(f"{point!r} is not a sabotage point (see _core.SABOTAGE_POINTS)")
    if _core.armed() != point:
        return op

    def skipped(*args: object, **kwargs: object) -> None:
        _core._fired(point)

    return skipped


__all__ = ["POINTS", "Point", "_core", "step"]
