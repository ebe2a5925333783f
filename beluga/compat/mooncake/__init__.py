"""``MooncakeDistributedStore`` over a Beluga pool: Mooncake Store's Python API, one import away.

Code written against Mooncake Store (``from mooncake.store import
MooncakeDistributedStore``), including the Mooncake backends of vLLM, SGLang
and LMCache, runs on Beluga by importing this package instead::

    from beluga.compat.mooncake import MooncakeDistributedStore, ReplicateConfig

Every method has Mooncake's signature and returns what Mooncake returns: 0 or
a negative :class:`ErrorCode` for writes, the value or ``b""`` for ``get``,
1 / 0 / a negative code for ``is_exist``, byte counts or negative codes for
``get_into`` and ``get_size``.  Arguments of the wrong type raise
``TypeError``, as Mooncake's bindings do; nothing else raises.  The codes and
the edge cases were taken from Mooncake 0.3.13 run side by side (see
``tests/compat_mooncake/``).

**Which pool.** ``setup`` accepts all of Mooncake's arguments.  A
``master_server_addr`` or ``metadata_server`` of the form ``beluga:SPEC``
names the pool (``beluga:shm:/dev/shm/beluga``); otherwise ``$BELUGA_POOL``
does; otherwise ``shm:/dev/shm/beluga``, as the CLI.  The pool's metadata
server (``beluga serve``) must be running.  The segment and buffer sizes,
protocol, devices, engine, SSD offload and HTTP options are accepted and
ignored: the pool is the storage, and every host reaches it with loads and
stores.  A ``tenant_id`` other than ``"default"`` is refused (one pool per
tenant).

**Keys.** A Mooncake key (``str``, or ``bytes`` as its bindings accept) is
stored under its UTF-8 bytes when they fit Beluga's 256-byte limit, and under
``b"\\xff" + sha256(bytes)`` when longer (``0xff`` never occurs in UTF-8, so
the two forms cannot collide).  So a key written here is the same key for
Beluga's own ``KVStore``.  An empty key is refused by writes (``-600``) and
missing for reads, as in Mooncake.

**Frameworks that import Mooncake themselves** (the Mooncake backends of
vLLM, SGLang and LMCache do ``from mooncake.store import
MooncakeDistributedStore`` inside their own code): call :func:`install`
before they load it, and ``mooncake.store`` is this package in that process.

**Where it differs from Mooncake, and why.**

- ``put`` of an existing key returns 0 and keeps the stored value, as
  Mooncake's does; the existence check and the write are two steps, so two
  first puts of one key racing may leave either value.  ``upsert`` replaces.
- ``remove`` is never refused for a lease (Mooncake's ``-706``): readers in
  Beluga validate every copy, so removing under them is safe.
- ``remove_all`` and ``remove_by_regex`` remove the keys put through this
  handle since its ``setup`` (Beluga's public API cannot enumerate a pool)
  and return how many were still there.  To do so the handle remembers each
  key it put until it removes it (the key's bytes and its name: a few hundred
  bytes per key, so millions of keys cost hundreds of MB).
- Registering a buffer is bookkeeping only: Beluga copies with the CPU, so
  ``put_from`` / ``get_into`` work on any readable / writable address of
  host memory (Mooncake over TCP stored zeros from an unregistered buffer).
  Registering one address twice and unregistering an unknown one are
  ``-600``.  Addresses must be host memory: a GPU address is not supported
  (Mooncake moves GPU memory with GPUDirect RDMA).
- Values outlive the handle that wrote them: ``close`` deletes nothing (the
  pool holds them; Mooncake's vanish with the segment of a client that
  closes, when that client contributed the segment).
- ``get_batch([])`` is ``[]`` (Mooncake 0.3.13 returns ``[b""]``);
  ``put_from`` of 0 bytes is ``-600``, like ``put`` of an empty value.
- Put sessions assemble an object in the caller's process from the ranges
  given, and store it at ``batch_put_session_end`` with one write (the data
  path's ``save``), so it is unreadable until then, as in Mooncake; a key
  written by another client meanwhile is refused at the end, not at the
  start.
- Only the names defined here exist.  Absent so far, each an
  ``AttributeError`` (or ``ImportError``): CUDA-tensor reads and
  ``init_all``; and the module's buffer pools and leases, ``EngramStore``,
  ``MooncakeHostMemAllocator``, ``MooncakeDistributedNoFRegister``,
  ``bind_to_numa_node`` and the allocator addresses.
- Segments, replicas and copy/move tasks have no meaning on a pool; their
  methods give Mooncake's answers (checked side by side): a mounted segment
  is ``ret`` 0 with an id and adds nothing to the pool, a value has one
  COMPLETE memory replica, a copy or move of a present value is ``-600``
  and every task is ``TASK_NOT_FOUND``.  Mooncake's enums (``ObjectDataType``,
  ``ReplicaStatus``, ``TaskStatus``, ``TaskType`` and
  their module-level values) and request classes (``TensorParallelism``,
  ``ParallelAxis``, ``ReadTarget``) exist with Mooncake's values.
- The ``*_with_parallelism`` forms store and read whole tensors; given a
  ``TensorParallelism``, ``ReadTarget`` or ``writer_partition`` request they
  log why and return ``-600`` (or None): the pool does not split tensors by
  those requests yet (the ``*_with_tp`` forms split as Mooncake does).
- ``batch_replica_clear`` honours Mooncake's lease only for puts and reads
  made through this handle (:data:`LEASE_TTL_MS`, or ``$BELUGA_MOONCAKE_LEASE_TTL_MS``
  where Mooncake's master would be given ``--default_kv_lease_ttl``); a key
  leased by another client is cleared.
- ``put`` with a zero ``local_buffer_size`` succeeds (no staging buffer).
- Tensors are stored with Beluga's own small header (magic, dtype, shape),
  not Mooncake's; ``get_tensor`` of a 0-d tensor returns a 0-d tensor
  (Mooncake returns shape ``(1,)``).  CUDA tensors are copied to the CPU.

**The differences, machine-readable.** :data:`DIFFERENCES` maps each of
Mooncake's own store tests (``mooncake-wheel/tests``, ``file::Class::test``)
that Beluga answers differently to the reason; the comparison test reads it,
so the list and the behaviour cannot drift apart.

**Thread-safety and fork-safety.** Thread-safe: threads may share one store
(the underlying ``KVStore`` is thread-safe; this class's own tables are
guarded by a lock, and ``close`` waits for calls in flight before it
disconnects).  Not fork-safe: a forked child must make and ``setup`` its own
store; in the child, the parent's returns ``-600`` (or ``b""`` / ``None``)
from every call, and its ``close`` leaves the parent connected.

**Where each part lives.** This package is the drop-in's public face
(every name Mooncake's ``mooncake.store`` users import, :data:`DIFFERENCES`
and :func:`install`); its modules, one duty each:
``codes`` (Mooncake's status codes and enums), ``records`` (its request,
descriptor and settings classes), ``checks`` (arguments, keys, the pool,
failures as codes), ``tensor_format`` (tensors' stored form), ``core`` (a
handle's tables, life cycle and batch steps), ``objects`` (byte values),
``tensors``, ``parallel`` (``*_with_tp``, ``*_with_parallelism``),
``ranges`` (sessions, multi-buffer values, ranged reads), ``segments``
(segments, replicas, tasks), ``store`` (the composed
``MooncakeDistributedStore``) and ``chaos`` (the drop-in as a chaos
writer's client).
"""

from __future__ import annotations

import importlib.util
import sys
import types

from beluga.compat.mooncake.checks import POOL_PREFIX, beluga_key, pool_spec_for
from beluga.compat.mooncake.codes import (
    ACTIVATION,
    COMPLETE,
    FAILED,
    FILE_NOT_FOUND,
    FILE_WRITE_FAIL,
    GENERAL,
    GRADIENT,
    INITIALIZED,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    KVCACHE,
    METADATA,
    NO_AVAILABLE_HANDLE,
    OBJECT_NOT_FOUND,
    OK,
    OPTIMIZER_STATE,
    PENDING,
    PROCESSING,
    REMOVED,
    REPLICA_COPY,
    REPLICA_MOVE,
    RPC_FAIL,
    SAMPLE,
    SUCCESS,
    TASK_NOT_FOUND,
    TENSOR,
    UNDEFINED,
    UNKNOWN,
    WEIGHT,
    ErrorCode,
    ObjectDataType,
    ReplicaStatus,
    SoftPinAction,
    TaskStatus,
    TaskType,
)
from beluga.compat.mooncake.core import LEASE_ENV, LEASE_TTL_MS, TEARDOWN_ENV
from beluga.compat.mooncake.records import (
    BufferHandle,
    Descriptor,
    MemoryDescriptor,
    ParallelAxis,
    ReadTarget,
    ReplicaDescriptor,
    ReplicateConfig,
    TensorParallelism,
    parse_size,
)
from beluga.compat.mooncake.store import MooncakeDistributedStore
from beluga.pool import DEFAULT_POOL

__all__ = [
    "ACTIVATION",
    "COMPLETE",
    "DEFAULT_POOL",
    "DIFFERENCES",
    "FAILED",
    "FILE_NOT_FOUND",
    "FILE_WRITE_FAIL",
    "GENERAL",
    "GRADIENT",
    "INITIALIZED",
    "INTERNAL_ERROR",
    "INVALID_PARAMS",
    "KVCACHE",
    "LEASE_ENV",
    "LEASE_TTL_MS",
    "METADATA",
    "NO_AVAILABLE_HANDLE",
    "OBJECT_NOT_FOUND",
    "OK",
    "OPTIMIZER_STATE",
    "PENDING",
    "POOL_PREFIX",
    "PROCESSING",
    "REMOVED",
    "REPLICA_COPY",
    "REPLICA_MOVE",
    "RPC_FAIL",
    "SAMPLE",
    "SUCCESS",
    "TASK_NOT_FOUND",
    "TEARDOWN_ENV",
    "TENSOR",
    "UNDEFINED",
    "UNKNOWN",
    "WEIGHT",
    "BufferHandle",
    "Descriptor",
    "ErrorCode",
    "MemoryDescriptor",
    "MooncakeDistributedStore",
    "ObjectDataType",
    "ParallelAxis",
    "ReadTarget",
    "ReplicaDescriptor",
    "ReplicaStatus",
    "ReplicateConfig",
    "SoftPinAction",
    "TaskStatus",
    "TaskType",
    "TensorParallelism",
    "beluga_key",
    "install",
    "parse_size",
    "pool_spec_for",
]

_DOS = "test_distributed_object_store.py::"
#: Mooncake's own store tests that Beluga answers differently, each with the reason.
DIFFERENCES: dict[str, str] = {
    _DOS + "TestDistributedObjectStoreSingleStore::test_client_tear_down": (
        "values outlive the client that wrote them: Mooncake drops them with the closing "
        "client's segment, a reported defect (kvcache-ai/Mooncake #607); "
        "BELUGA_MOONCAKE_TEARDOWN=drop gives Mooncake's behaviour"
    ),
    _DOS + "TestZeroLocalBufferSize::test_zero_local_buffer_size": (
        "Beluga copies straight into the pool and needs no local staging buffer, "
        "so a put with local_buffer_size=0 succeeds"
    ),
    "test_batch_replica_clear.py::TestBatchReplicaClearReplication::"
    "test_clear_specific_segment_replica": (
        "the pool holds one copy of a value, so clearing the replica on one named segment "
        "removes the value; Mooncake keeps the replicas on other segments"
    ),
}


def install() -> None:
    """Make ``mooncake.store`` this package in this process, for code that imports Mooncake itself.

    Call it before the framework imports ``mooncake.store``.  Where Mooncake
    is installed, its other modules (``mooncake.engine`` ...) stay importable;
    where it is not, an empty ``mooncake`` package stands in for it.
    """
    if "mooncake" not in sys.modules and importlib.util.find_spec("mooncake") is None:
        package = types.ModuleType("mooncake")
        package.__path__ = []
        sys.modules["mooncake"] = package
    sys.modules["mooncake.store"] = sys.modules[__name__]
    if "mooncake" in sys.modules:
        sys.modules["mooncake"].store = sys.modules[__name__]  # type: ignore[attr-defined]
