"""The checks that catch each sabotage point, and the runner a mutation run spawns.

A *check* is a small protocol scenario between model hosts (each a Memory of
its own over one buffer or pool file, in this one process) that raises
:class:`Violation` when a promise of the protocol breaks: wrong or stale
bytes, a lost acknowledged write, a removed key back, a live host taken for
dead.  Every check passes on the correct core (tests/test_mutation.py runs
them all, with model eviction off and on); with a point armed, the checks
that :data:`CATCHERS` lists for it must raise.  They are deterministic: the
model is seeded and nothing depends on timing.  Windows inside one C call
are opened by crash sweeps (``litmus.sweep_crashes``): the writer's host dies
once k of its writes have landed, for every k, and another host looks at
what is left, which is any state a concurrent reader could have caught.

Four kinds of check, by the step they pin down:

- *a caching host*: a host reads, another rewrites, the first reads again:
  every invalidate and MFENCE a reader needs;
- *visible at return*: right after a call returns another host must see its
  effect (nothing leaves a write-combining buffer early: drain rate 0);
- *crash sweeps*: every state inside a write: every SFENCE that orders two
  stores (payload before header, grant before answer, clear before format);
- *the memops self-check*: native instruction choices, which the model
  replaces and so cannot see.

Run as ``python -m tests.sabotage_checks [CHECK ...]`` it runs the named
checks (default: the catchers of the point armed in ``BELUGA_SABOTAGE``, or
every check when none is) and prints one JSON line per check.  A catcher may
also be a pytest node id (a protocol test across processes), which the
mutation run runs with pytest.

The checks live by area: :mod:`.base` (Violation, the model, model hosts,
pool files), :mod:`.blocks` (block.c, blockio.c, record.c), :mod:`.rpc` (rpc.c),
:mod:`.pool` (the host table, formatting), :mod:`.server` (the metadata service
and the index), :mod:`.memops` (memops.c); this package's face holds the
registry (:data:`CHECKS`, :data:`CATCHERS`), :func:`run` and the runner.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable

from beluga._native import POINTS, _core
from beluga.coherence import ModelConfig
from tests.sabotage_checks.base import MUTATION_MODEL, Violation
from tests.sabotage_checks.blocks import (
    block_reread_on_a_caching_host,
    block_seal_of_a_foreign_payload,
    block_visible_at_return,
    device_read_on_a_caching_host,
    gather_and_scatter,
    read_blocks_on_a_caching_host,
    sweep_in_place,
    sweep_publish,
    sweep_write_blocks,
)
from tests.sabotage_checks.memops import memops_selfcheck
from tests.sabotage_checks.pool import (
    format_sweep,
    format_visible_at_return,
    hosts_grant_gone,
    hosts_grant_sweep,
    hosts_remote_heartbeat,
)
from tests.sabotage_checks.rpc import rpc_payload_sweep, rpc_ring_round_trips
from tests.sabotage_checks.server import (
    index_batch_probe_on_a_caching_host,
    index_move_sweep,
    index_probe_on_a_caching_host,
    service_answers_durable,
    service_commit_sweep,
    service_restart_on_a_caching_host,
)

# -- the registry ------------------------------------------------------------------


CHECKS: dict[str, Callable[[ModelConfig], None]] = {
    f.__name__: f
    for f in (
        sweep_publish,
        sweep_in_place,
        sweep_write_blocks,
        block_visible_at_return,
        block_reread_on_a_caching_host,
        read_blocks_on_a_caching_host,
        block_seal_of_a_foreign_payload,
        gather_and_scatter,
        device_read_on_a_caching_host,
        rpc_ring_round_trips,
        rpc_payload_sweep,
        hosts_remote_heartbeat,
        hosts_grant_gone,
        hosts_grant_sweep,
        format_sweep,
        format_visible_at_return,
        service_restart_on_a_caching_host,
        service_answers_durable,
        service_commit_sweep,
        index_probe_on_a_caching_host,
        index_batch_probe_on_a_caching_host,
        index_move_sweep,
        memops_selfcheck,
    )
}

_READERS = ("HEADER_INVALIDATE", "HEADER_MFENCE", "PAYLOAD_INVALIDATE", "PAYLOAD_MFENCE")
_RPC_READS = (
    "REQUEST_INVALIDATE",
    "REQUEST_MFENCE",
    "REQUEST_BUFFER_INVALIDATE",
    "REQUEST_BUFFER_MFENCE",
    "RESPONSE_INVALIDATE",
    "RESPONSE_MFENCE",
    "RESPONSE_BUFFER_INVALIDATE",
    "RESPONSE_BUFFER_MFENCE",
)

#: the cross-process test a mutation run also runs for the buffer points (R9/R10 and the client's)
RPC_SLOT_REUSE = (
    "tests/test_rpc.py::"
    "test_a_model_server_reusing_slots_reads_every_out_of_line_payload_fresh[evict-off]"
)

#: point -> the checks (or pytest node ids) that must catch it, cheapest first
CATCHERS: dict[str, list[str]] = {
    "BLOCK_WRITING_FENCE": ["sweep_publish", "sweep_in_place"],
    "BLOCK_PAYLOAD_FENCE": ["sweep_publish"],
    "BLOCK_PUBLISHED_FENCE": ["block_visible_at_return"],
    **{f"BLOCK_{s}": ["block_reread_on_a_caching_host"] for s in _READERS},
    "BLOCK_CHECKSUM_INVALIDATE": ["block_seal_of_a_foreign_payload"],
    "BLOCK_CHECKSUM_MFENCE": ["block_seal_of_a_foreign_payload", "sweep_in_place"],
    "BLOCKIO_WRITE_FENCE": ["sweep_write_blocks"],
    **{f"BLOCKIO_{s}": ["read_blocks_on_a_caching_host"] for s in _READERS},
    "GATHER_FENCE": ["gather_and_scatter"],
    "SCATTER_INVALIDATE": ["gather_and_scatter"],
    "SCATTER_MFENCE": ["gather_and_scatter"],
    "DEVICE_READ_INVALIDATE": ["device_read_on_a_caching_host"],
    "DEVICE_READ_MFENCE": ["device_read_on_a_caching_host"],
    "RPC_REQUEST_PAYLOAD_FENCE": ["rpc_payload_sweep"],
    "RPC_RESPONSE_PAYLOAD_FENCE": ["rpc_payload_sweep"],
    **{f"RPC_{s}": ["rpc_ring_round_trips"] for s in _RPC_READS},
    **{f"RPC_{s}": ["rpc_ring_round_trips", RPC_SLOT_REUSE] for s in _RPC_READS if "BUFFER" in s},
    "MEMOPS_NT_EDGE_FLUSH": ["memops_selfcheck"],
    "MEMOPS_INVALIDATE_FLUSHES": ["memops_selfcheck"],
    "HOSTS_SERVER_READ_INVALIDATE": ["hosts_remote_heartbeat"],
    "HOSTS_SERVER_READ_MFENCE": ["hosts_remote_heartbeat"],
    "HOSTS_HOLDER_READ_INVALIDATE": ["hosts_grant_gone"],
    "HOSTS_HOLDER_READ_MFENCE": ["hosts_grant_gone"],
    "HOSTS_GRANT_FENCE": ["hosts_grant_sweep"],
    "FORMAT_CLEAR_FENCE": ["format_sweep"],
    "FORMAT_FENCE": ["format_visible_at_return"],
    "SERVICE_RECOVER_INVALIDATE": ["service_restart_on_a_caching_host"],
    "SERVICE_RECOVER_MFENCE": ["service_restart_on_a_caching_host"],
    "SERVICE_COMMIT_FENCE": ["service_answers_durable"],
    "SERVICE_COMMIT_WORD_FENCE": ["service_commit_sweep"],
    "SERVICE_CLEAR_FENCE": ["service_answers_durable"],
    "INDEX_BUCKET_INVALIDATE": [
        "index_probe_on_a_caching_host",
        "index_batch_probe_on_a_caching_host",
    ],
    "INDEX_BUCKET_MFENCE": ["index_probe_on_a_caching_host", "index_batch_probe_on_a_caching_host"],
    "INDEX_MOVE_FENCE": ["index_move_sweep"],
}


def run(name: str, model: ModelConfig = MUTATION_MODEL) -> dict[str, str]:
    """Run one check: {"check", "outcome": passed | caught | error, "detail"}."""
    try:
        CHECKS[name](model)
    except Violation as e:
        return {"check": name, "outcome": "caught", "detail": str(e)}
    except Exception as e:  # the check itself broke: never counted as a catch
        detail = "".join(traceback.format_exception_only(e)).strip()
        return {"check": name, "outcome": "error", "detail": detail}
    return {"check": name, "outcome": "passed", "detail": ""}


def main(argv: list[str]) -> int:
    armed = _core.armed()
    names = argv or [n for n in (CATCHERS[armed] if armed else CHECKS) if n in CHECKS]
    for name in names:
        print(json.dumps({"point": armed, **run(name)}), flush=True)
    return 0


__all__ = ["CATCHERS", "CHECKS", "MUTATION_MODEL", "POINTS", "Violation", "run"]
