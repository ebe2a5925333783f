"""The drop-in's segments, replicas and tasks: no meaning on a pool, Mooncake's answers.

:class:`Segments` adds to :class:`~beluga.compat.mooncake.objects.ObjectStore`
Mooncake's segment mounts, replica descriptors, copy and move tasks and
``batch_replica_clear``, answering as Mooncake does (checked side by side;
see the package docstring).
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from beluga.compat.mooncake.checks import check_count, check_keys, check_list
from beluga.compat.mooncake.codes import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    OBJECT_NOT_FOUND,
    OK,
    TASK_NOT_FOUND,
)
from beluga.compat.mooncake.objects import ObjectStore
from beluga.compat.mooncake.records import Descriptor, MemoryDescriptor, ReplicaDescriptor


class Segments(ObjectStore):
    """Mooncake's segment, replica and task forms.

    Uses from :class:`StoreCore`: ``_remove`` and the tables ``_lock``,
    ``_store``, ``_segments``, ``_leases``, ``_lease_s`` and ``_hostname``;
    from :class:`ObjectStore`: ``get_size`` and ``is_exist``.  Thread- and
    fork-safety: the core's.
    """

    # -- segments, replicas and tasks: no meaning on a pool, Mooncake's answers -----

    def allocate_and_mount_segment(
        self, size: int, protocol: str = "tcp", location: str = ""
    ) -> dict[str, Any]:
        """Mooncake's answer to mounting memory; the pool's capacity is its own, so the
        segment adds nothing to it (``ret`` -600 before ``setup`` or for size 0)."""
        check_count(size, "size")
        return self._mount(size) if size else {"ret": INVALID_PARAMS, "segment_ids": []}

    def mount_segment(
        self, path: str, size: int, offset: int = 0, protocol: str = "tcp", location: str = ""
    ) -> dict[str, Any]:
        """As :meth:`allocate_and_mount_segment` for a file's memory (``ret`` -1 if it is
        not there, as Mooncake's)."""
        check_count(size, "size")
        check_count(offset, "offset")
        if not isinstance(path, str) or not os.path.exists(path):
            return {"ret": INTERNAL_ERROR, "segment_ids": []}
        return self._mount(size)

    def _mount(self, size: int) -> dict[str, Any]:
        with self._lock:
            if self._store is None:
                return {"ret": INVALID_PARAMS, "segment_ids": []}
            segment = f"beluga-{os.getpid()}-{random.getrandbits(64):016x}"
            self._segments.add(segment)
        return {"ret": OK, "segment_ids": [segment], "allocated_size": size}

    def unmount_segment(self, segment_ids: list[str], grace_period_seconds: int = 0) -> int:
        """0 when every id is a segment this handle mounted (forgotten now), else -1."""
        ids = [str(i) for i in check_list(segment_ids, "segment_ids")]
        check_count(grace_period_seconds, "grace_period_seconds")
        with self._lock:
            if not ids or not set(ids) <= self._segments:
                return INTERNAL_ERROR
            self._segments -= set(ids)
        return OK

    def unmount_and_free_segment(
        self, segment_ids: list[str], grace_period_seconds: int = 0
    ) -> int:
        """As :meth:`unmount_segment` (the memory was never the pool's to free)."""
        return self.unmount_segment(segment_ids, grace_period_seconds)

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        """0: a pool has no local disk segment."""
        check_count(grace_period_seconds, "grace_period_seconds")
        return OK

    def get_offload_rpc_read_count(self) -> int:
        """0: a pool offloads nothing to disk."""
        return 0

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The value's one replica, or ``[]`` for a missing key."""
        return self.batch_get_replica_desc([key]).get(key, [])

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        """Replicas of each present key (missing keys are left out, as in Mooncake)."""
        names = check_list(keys, "keys")
        sizes = [self.get_size(k) for k in names]
        where = self._hostname
        return {
            k: [ReplicaDescriptor(MemoryDescriptor(Descriptor(0, n, where)))]
            for k, n in zip(names, sizes, strict=True)
            if n >= 0
        }

    def create_copy_task(self, key: str, targets: list[str]) -> tuple[tuple[int, int], int]:
        """``-704`` for a missing key; else ``-600``: a pool holds one copy and has no
        segments to copy it to."""
        check_list(targets, "targets")
        return (0, 0), OBJECT_NOT_FOUND if self.is_exist(key) != 1 else INVALID_PARAMS

    def create_move_task(self, key: str, source: str, target: str) -> tuple[tuple[int, int], int]:
        """As :meth:`create_copy_task`: there is no segment to move a value between."""
        return (0, 0), OBJECT_NOT_FOUND if self.is_exist(key) != 1 else INVALID_PARAMS

    def query_task(self, task_id: tuple[int, int]) -> tuple[None, int]:
        """No task exists on a pool: ``(None, -1400)``."""
        return None, TASK_NOT_FOUND

    # -- replicas --------------------------------------------------------------

    def batch_replica_clear(self, keys: list[str], segment_name: str = "") -> list[str]:
        """Remove keys whose lease has expired; the keys removed.

        The pool holds one copy, so clearing a key's replicas removes it.  As
        in Mooncake a key put or read through this handle less than
        :data:`LEASE_TTL_MS` ago is skipped, and so is a missing key.  A
        ``segment_name`` other than "" or this handle's host name names no
        replica here and clears nothing.
        """
        names = list(check_list(keys, "keys"))
        if not isinstance(segment_name, str):
            raise TypeError(f"segment_name is a str, not {type(segment_name).__name__}")
        if segment_name not in ("", self._hostname) or not names:
            return []
        now = time.monotonic()
        with self._lock:
            leased = {k for k, t in self._leases.items() if now - t < self._lease_s}
        ks = check_keys(names)
        todo = [(n, k) for n, k in zip(names, ks, strict=True) if k is not None and k not in leased]
        codes = self._remove([k for _, k in todo])
        return [n for (n, _), c in zip(todo, codes, strict=True) if c == OK]
