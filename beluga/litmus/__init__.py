"""Coherence litmus tests: small programs that either catch a bug or prove a recipe.

Each pattern is a writer and an observer running on different hosts (processes
here; machines in the lab) over a few lines of one pool.  Buggy patterns must
be caught whenever the hosts are not hardware-coherent (always under the
``model`` coherence mode, and on real CXL); correct ones must never be.

The rooms:

``area``      the area's lines, the words in them, the roles' control channel
``outcome``   what an observation saw (:class:`Seen`) and a run's :class:`LitmusResult`
``twins``     two payloads with one CRC32C, and the block that holds them
``patterns``  every pattern's writer and observer, and the table :data:`PATTERNS`
``runner``    one role on this host (:func:`run_role`), every role in its own process
              (:func:`run_local`)
``sweeps``    crash sweeps: every state inside one write (:data:`SWEEPS`, :func:`run_sweep`)

This module is the package's face: the names callers use, nothing else.
"""

from __future__ import annotations

from beluga.litmus.area import AREA_BYTES, BLOCK_BYTES, reset_area
from beluga.litmus.outcome import LitmusResult, Seen, judge
from beluga.litmus.patterns import PATTERNS, Pattern
from beluga.litmus.runner import run_local, run_role
from beluga.litmus.sweeps import SWEEP_TWINS, SWEEPS, run_sweep, sweep_crashes
from beluga.litmus.twins import TWINS

__all__ = [
    "AREA_BYTES",
    "BLOCK_BYTES",
    "PATTERNS",
    "SWEEPS",
    "SWEEP_TWINS",
    "TWINS",
    "LitmusResult",
    "Pattern",
    "Seen",
    "judge",
    "reset_area",
    "run_local",
    "run_role",
    "run_sweep",
    "sweep_crashes",
]
