"""The chaos tier: fault injection against a running pool, with every answer checked.

Jepsen-style: a real metadata server process, writer and reader processes
over ``beluga.KVStore``, and faults injected while they run (SIGKILL and
SIGSTOP of every role, a writer stalled mid-payload past its write lease,
hostile bytes in RPC slots, block headers and payloads).  Every value is
self-describing (:mod:`beluga.chaos.values`), so every byte a read returns
is checked, through every read path; the history of acknowledged writes
then says whether any was lost (:mod:`beluga.chaos.verifier`).

The promises checked: a read returns the committed bytes of that key or a
miss, never other bytes; an acknowledged write is never lost while the
pool holds it; every wait ends.

``beluga chaos`` runs it from the command line; ``tests/chaos`` runs a
bounded round in CI.
"""

from __future__ import annotations

from beluga.chaos.config import KINDS, ChaosConfig, ChaosError
from beluga.chaos.driver import ChaosDriver, run_chaos
from beluga.chaos.report import ChaosReport

__all__ = ["KINDS", "ChaosConfig", "ChaosDriver", "ChaosError", "ChaosReport", "run_chaos"]
