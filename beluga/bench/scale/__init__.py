"""``beluga bench scale``: how the metadata server's costs grow with the pool.

Measured here, in one process, with the metadata service driven directly (no
RPC, as tests/test_service.py drives it), on pools of a few sizes filled to
a fraction with one-block values:

recovery      a restarted server's whole recovery at once (``recover()``): load
              and parse every block header and commit word, rebuild the index
              and the allocator, repair the pool index; against block count and
              key count.  Until issue 36 a server answered no write before it
              was done, so this was also the takeover's write outage; and
              the same after a crash that lost the pool index's slot of one
              key in 1,000 (``recovery_lost_s``: recovery's last step names
              them again), as a crash under writers leaves it
takeover      a server taking over as ``beluga serve`` does now (recovery while
              serving): takeover to its first acknowledged write, with recovery
              at once as the baseline ("before"); then writers overwriting
              stored keys in batches (a shuffled order, each key once a pass,
              as at the pod), the service's recovery steps
              between them as the server's loop runs them, against time: the
              write rate while recovering and after, how long until the rate
              stays at 90% of its rate after recovery ("full throughput"), and
              how long until recovery is done
fill          ALLOC and COMMIT batches of 256 (the server's side only: the
              payload publish between them is the writer's and is not timed)
full GC       one full ``gc.collect()`` with the recovered server alive (it
              scans every object the server holds: a pause of every RPC)
tick          one ``tick()`` of the server (hint folding, one index scrub
              step of 64 buckets, lease checks) and the scrub step alone
writers       ALLOC/COMMIT batch throughput and p50/p99 against 1..16 hosts
              writing at once, each with its own host id (``writers``), and
              ``put_batch`` through the real server the same way (``writers_rpc``)
reads         one-sided read p50/p99, hits and misses, against the pool
              index's load factor, 10..90% (``reads``)

Each size curve is fitted as cost = a + b x (least squares over the sizes
run) and extrapolated to the paper's pod: 8 TB of 64 KiB blocks (128 M
blocks) and 16 hosts, with the assumptions stated in the report
(``ASSUMPTIONS``).

The rooms: ``pools`` (geometry, scratch pools, values through the service),
``server`` (one pool of a size: recovery, takeover, fill, full GC, tick),
``clients`` (writers against hosts, reads against the index's load), ``pod``
(the fits, the extrapolation and its assumptions: :func:`run`) and ``text``
(the table's columns, the summary).  This module is the package's face.
"""

from __future__ import annotations

from beluga.bench.scale.clients import HOSTS, LOADS, reads, writers, writers_rpc
from beluga.bench.scale.pod import run
from beluga.bench.scale.pools import GEOMETRY
from beluga.bench.scale.text import columns, format_extrapolation

__all__ = [
    "GEOMETRY",
    "HOSTS",
    "LOADS",
    "columns",
    "format_extrapolation",
    "reads",
    "run",
    "writers",
    "writers_rpc",
]
