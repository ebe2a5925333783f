"""Mooncake's request, descriptor and settings classes: plain data with Mooncake's fields.

:class:`ReplicateConfig` (and :func:`config_code`, which checks one as
Mooncake's client does), the tensor-parallelism requests, the replica
descriptors of ``get_replica_desc``, :class:`BufferHandle` (what
``get_buffer`` returns) and :func:`parse_size` (the sizes of ``setup``'s
configuration dict).
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass, field
from typing import Any

from beluga.compat.mooncake.codes import INVALID_PARAMS, OK, ReplicaStatus, SoftPinAction


@dataclass
class ParallelAxis:
    """One axis of a Mooncake tensor-parallelism request (its fields and defaults)."""

    kind: str = ""
    rank: int = 0
    size: int = 1
    split_dim: int | None = None
    expert_id: int | None = None
    stage_id: int | None = None


@dataclass
class TensorParallelism:
    """Mooncake's tensor-parallelism request: its axes.  The ``*_with_parallelism`` forms
    refuse one (``-600``): the pool stores whole tensors, or ``*_with_tp`` shards."""

    axes: list[ParallelAxis] = field(default_factory=list)


@dataclass
class ReadTarget:
    """Mooncake's read request of the ``*_with_parallelism`` reads (refused when given)."""

    mode: str = "as_stored"
    parallelism: TensorParallelism | None = None


@dataclass(frozen=True)
class Descriptor:
    """Where a replica's bytes are (Mooncake's buffer descriptor): here the pool's block."""

    buffer_address: int
    size: int
    transport_endpoint: str


@dataclass(frozen=True)
class MemoryDescriptor:
    """A memory replica's descriptor."""

    buffer_descriptor: Descriptor


@dataclass(frozen=True)
class ReplicaDescriptor:
    """One replica of a value: on a pool, its one copy, a memory replica, COMPLETE."""

    memory: MemoryDescriptor
    status: ReplicaStatus = ReplicaStatus.COMPLETE

    def is_memory_replica(self) -> bool:
        return True

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return False

    def get_memory_descriptor(self) -> MemoryDescriptor:
        return self.memory

    def get_disk_descriptor(self) -> Any:
        raise RuntimeError("Expected DiskDescriptor")  # Mooncake's words for a memory replica


_U64 = 1 << 64


@dataclass
class ReplicateConfig:
    """Mooncake's replication settings: accepted, checked as Mooncake checks them, else ignored.

    A Beluga pool holds one copy of each value that every host of the pod
    reads directly, so there is nothing to replicate or pin.  Soft-pin fields
    are checked as Mooncake does: a TTL is only valid with
    ``SoftPinAction.ENABLE`` (a write given one with another action is
    ``-600``).  Not thread-safe to mutate while a call uses it; fork-safe
    (plain data).
    """

    replica_num: int = 1
    with_soft_pin: bool = False
    with_hard_pin: bool = False
    preferred_segment: str = ""
    preferred_segments: list[str] = field(default_factory=list)
    prefer_alloc_in_same_node: bool = False
    soft_pin_action: SoftPinAction = SoftPinAction.PRESERVE
    dfs_replica_num: int = 0
    nof_replica_num: int = 0
    preferred_nof_segments: list[str] = field(default_factory=list)
    group_ids: list[str] = field(default_factory=list)
    data_type: int = 0
    _soft_pin_ttl_ms: int | None = field(default=None, repr=False)

    @property
    def soft_pin_ttl_ms(self) -> int | None:
        """The soft pin's TTL in ms, or None (Mooncake's ``std::optional<uint64_t>``)."""
        return self._soft_pin_ttl_ms

    @soft_pin_ttl_ms.setter
    def soft_pin_ttl_ms(self, value: int | None) -> None:
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _U64
        ):
            raise TypeError(f"soft_pin_ttl_ms is None or a uint64, not {value!r}")
        self._soft_pin_ttl_ms = value


def config_code(config: object) -> int:
    """``-600`` for a soft-pin TTL without ``ENABLE`` (as Mooncake's client refuses), else 0."""
    ttl = getattr(config, "soft_pin_ttl_ms", None)
    action = getattr(config, "soft_pin_action", SoftPinAction.PRESERVE)
    if ttl is not None and int(action) != SoftPinAction.ENABLE:
        return INVALID_PARAMS
    return OK


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: object) -> int | None:
    """A size as Mooncake's config dict takes it ("16MB", "16 MB", "1GiB", 4096); None if refused.

    Units are binary (``MB`` = 2**20, as Mooncake's ``string_to_byte_size``);
    percentages and other forms are refused.
    """
    if isinstance(text, bool):
        return None
    if isinstance(text, int):
        return text if text >= 0 else None
    match = _SIZE.match(str(text))
    if match is None:
        return None
    scale = 1 << (10 * " kmgt".index(match.group(2).lower() or " "))
    return int(float(match.group(1)) * scale)


class BufferHandle(bytearray):
    """A value returned by ``get_buffer``: its bytes, with Mooncake's ``ptr()`` and ``size()``.

    A copy owned by Python (Mooncake's handle points into its client buffer);
    it supports the buffer protocol, so ``bytes(handle)`` and
    ``memoryview(handle)`` work.  ``ptr()`` stays valid while the handle lives.
    """

    def ptr(self) -> int:
        """The address of the first byte (0 for an empty value)."""
        if not self:
            return 0
        return ctypes.addressof(ctypes.c_char.from_buffer(self))

    def size(self) -> int:
        return len(self)
