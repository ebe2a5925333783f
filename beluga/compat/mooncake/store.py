"""``MooncakeDistributedStore``: Mooncake Store's client class, one mixin per duty."""

from __future__ import annotations

from beluga.compat.mooncake.parallel import ParallelTensors
from beluga.compat.mooncake.ranges import RangedAccess
from beluga.compat.mooncake.segments import Segments


class MooncakeDistributedStore(ParallelTensors, RangedAccess, Segments):
    """Mooncake Store's client class, backed by a Beluga pool (see the package docstring).

    Its forms come from one class per duty, each over
    :class:`~beluga.compat.mooncake.core.StoreCore` (life cycle, tables and
    batch steps): :mod:`~beluga.compat.mooncake.objects` (byte values),
    :mod:`~beluga.compat.mooncake.tensors`, :mod:`~beluga.compat.mooncake.parallel`
    (``*_with_tp``, ``*_with_parallelism``), :mod:`~beluga.compat.mooncake.ranges`
    (sessions, multi-buffer values, ranged reads) and
    :mod:`~beluga.compat.mooncake.segments` (segments, replicas, tasks).

    Thread-safe: threads may share one store; ``close`` waits for calls in
    flight.  Not fork-safe: a forked child makes and sets up its own (the
    parent's answers ``-600`` / ``b""`` / ``None`` in the child, and closing it
    there leaves the parent connected).
    """
