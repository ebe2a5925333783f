"""``MooncakeDistributedStore`` over a Beluga pool: Mooncake Store's Python API, one import away.

Code written against Mooncake Store (``from mooncake.store import
MooncakeDistributedStore``), including the Mooncake backends of vLLM, SGLang
and LMCache, runs on Beluga by importing this module instead::

    from beluga.compat.mooncake import MooncakeDistributedStore, ReplicateConfig

Every method has Mooncake's signature and returns what Mooncake returns: 0 or
a negative :class:`ErrorCode` for writes, the value or ``b""`` for ``get``,
1 / 0 / a negative code for ``is_exist``, byte counts or negative codes for
``get_into`` and ``get_size``.  Arguments of the wrong type raise
``TypeError``, as Mooncake's bindings do; nothing else raises.  The codes and
the edge cases were taken from Mooncake 0.3.13 run side by side (see
``tests/test_compat_mooncake.py``).

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
before they load it, and ``mooncake.store`` is this module in that process.

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
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import importlib.util
import logging
import os
import random
import re
import struct
import sys
import threading
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from beluga.errors import BelugaError, CapacityError, RpcError, WriteLeaseLost
from beluga.kv import MAX_KEY_BYTES, KVStore
from beluga.pool import DEFAULT_POOL, resolve_pool

__all__ = [
    "DEFAULT_POOL",
    "DIFFERENCES",
    "LEASE_ENV",
    "LEASE_TTL_MS",
    "POOL_PREFIX",
    "TEARDOWN_ENV",
    "BufferHandle",
    "ErrorCode",
    "MooncakeDistributedStore",
    "ObjectDataType",
    "ParallelAxis",
    "ReadTarget",
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

log = logging.getLogger("beluga.compat.mooncake")

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

#: an address argument of ``setup`` that starts with this names a Beluga pool spec
POOL_PREFIX = "beluga:"
_LONG_KEY_TAG = b"\xff"
#: set to "drop" for Mooncake's teardown: ``close`` removes what this handle wrote
TEARDOWN_ENV = "BELUGA_MOONCAKE_TEARDOWN"
#: Mooncake's range for the port of a ``local_hostname`` given without one
_AUTO_PORTS = (12300, 14300)
#: Mooncake's default lease on a key after a put or get (ms), which batch_replica_clear honours
LEASE_TTL_MS = 5000
#: seconds ``close`` waits for calls in flight before it closes the store under them
CLOSE_WAIT_S = 30.0
#: the lease in ms instead of :data:`LEASE_TTL_MS`: what ``mooncake_master --default_kv_lease_ttl``
#: sets for a Mooncake cluster (read at ``setup``)
LEASE_ENV = "BELUGA_MOONCAKE_LEASE_TTL_MS"


class ErrorCode(enum.IntEnum):
    """Mooncake Store's status codes (its ``ErrorCode`` enum), those this module returns."""

    OK = 0
    INTERNAL_ERROR = -1
    NO_AVAILABLE_HANDLE = -200  # no room for the value
    INVALID_PARAMS = -600  # bad argument, or the client is not set up
    OBJECT_NOT_FOUND = -704
    RPC_FAIL = -900
    FILE_NOT_FOUND = -1100  # also Mooncake's answer to saving a key that is missing
    FILE_WRITE_FAIL = -1103
    TASK_NOT_FOUND = -1400


OK = ErrorCode.OK.value
INTERNAL_ERROR = ErrorCode.INTERNAL_ERROR.value
NO_AVAILABLE_HANDLE = ErrorCode.NO_AVAILABLE_HANDLE.value
INVALID_PARAMS = ErrorCode.INVALID_PARAMS.value
OBJECT_NOT_FOUND = ErrorCode.OBJECT_NOT_FOUND.value
FILE_NOT_FOUND = ErrorCode.FILE_NOT_FOUND.value
FILE_WRITE_FAIL = ErrorCode.FILE_WRITE_FAIL.value
TASK_NOT_FOUND = ErrorCode.TASK_NOT_FOUND.value
RPC_FAIL = ErrorCode.RPC_FAIL.value


class SoftPinAction(enum.IntEnum):
    """Mooncake's soft-pin action of a write (``ReplicateConfig.soft_pin_action``)."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    """Mooncake's label of what a value holds (accepted; the pool does not act on it)."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class ReplicaStatus(enum.IntEnum):
    """Mooncake's replica states (a pool value has one copy: COMPLETE once committed)."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class TaskStatus(enum.IntEnum):
    """Mooncake's replica-task states (named so that code importing them runs)."""

    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


class TaskType(enum.IntEnum):
    """Mooncake's replica-task kinds (named so that code importing them runs)."""

    REPLICA_COPY = 0
    REPLICA_MOVE = 1


# Mooncake exports the enums' values at module level too; where two enums share a name
# (FAILED, PROCESSING) the module's is TaskStatus's, as in Mooncake.
UNKNOWN, KVCACHE, TENSOR, WEIGHT, SAMPLE = list(ObjectDataType)[:5]
ACTIVATION, GRADIENT, OPTIMIZER_STATE, METADATA, GENERAL = list(ObjectDataType)[5:]
UNDEFINED, INITIALIZED, COMPLETE, REMOVED = (
    ReplicaStatus.UNDEFINED, ReplicaStatus.INITIALIZED, ReplicaStatus.COMPLETE,
    ReplicaStatus.REMOVED,
)  # fmt: skip
PENDING, PROCESSING, FAILED, SUCCESS = list(TaskStatus)
REPLICA_COPY, REPLICA_MOVE = list(TaskType)


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


def _config_code(config: object) -> int:
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


def beluga_key(key: str | bytes) -> bytes:
    """The Beluga key a Mooncake key is stored under (see the module docstring)."""
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if len(raw) > MAX_KEY_BYTES:
        return _LONG_KEY_TAG + hashlib.sha256(raw).digest()
    return raw


def pool_spec_for(metadata_server: str = "", master_server_addr: str = "") -> str:
    """The pool ``setup`` attaches: a ``beluga:SPEC`` argument, else $BELUGA_POOL, else default."""
    named = (
        address.removeprefix(POOL_PREFIX)
        for address in (master_server_addr, metadata_server)
        if address.startswith(POOL_PREFIX)
    )
    return resolve_pool(
        next(filter(None, named), None),  # a bare "beluga:" names nothing
        setting=f"setup's master_server_addr or metadata_server ({POOL_PREFIX}SPEC)",
        default=DEFAULT_POOL,
    )


def install() -> None:
    """Make ``mooncake.store`` this module in this process, for code that imports Mooncake itself.

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


def _code_of(exc: BaseException) -> int:
    """The Mooncake status code closest to a Beluga failure."""
    if isinstance(exc, CapacityError):
        return NO_AVAILABLE_HANDLE
    if isinstance(exc, ValueError):  # also the server refusing an argument
        return INVALID_PARAMS
    if isinstance(exc, RpcError):
        return RPC_FAIL
    return INTERNAL_ERROR


_FAILURES = (BelugaError, ValueError, OSError)


# -- argument checks (TypeError where Mooncake's bindings raise it) ------------


def _check_key(key: object) -> bytes | None:
    """A key's Beluga form; None for the empty key."""
    if not isinstance(key, str | bytes):
        raise TypeError(f"a key is a str, not {type(key).__name__}")
    return beluga_key(key) if key else None


def _check_keys(keys: object) -> list[bytes | None]:
    return [_check_key(k) for k in _check_list(keys, "keys")]


def _check_list(items: object, what: str) -> Sequence[Any]:
    if isinstance(items, str | bytes) or not isinstance(items, Sequence):
        raise TypeError(f"{what} is a list, not {type(items).__name__}")
    return items


def _check_value(value: object) -> memoryview:
    try:
        view = memoryview(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"a value supports the buffer protocol (bytes, bytearray, numpy), "
            f"not {type(value).__name__}"
        ) from None
    if not view.c_contiguous:
        raise TypeError("a value buffer must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _check_count(n: object, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise TypeError(f"{what} is a non-negative int, not {n!r}")
    return n


def _check_ranges(ptrs: object, sizes: object) -> tuple[list[int], list[int]]:
    return (
        [_check_count(p, "a buffer pointer") for p in _check_list(ptrs, "buffer_ptrs")],
        [_check_count(s, "a size") for s in _check_list(sizes, "sizes")],
    )


# -- tensors: a small self-describing header, then the bytes -------------------

_TENSOR_MAGIC = b"BLGT"
_TENSOR_HEAD = struct.Struct("<4sBBH")  # magic, format version, dtype code, ndim
_TENSOR_VERSION = 1
_DIM = struct.Struct("<q")
# codes are positions in this tuple: append only
_DTYPE_NAMES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "uint16",
    "uint32",
    "uint64",
)


def _encode_tensor(tensor: Any) -> bytes:
    """A tensor as header + contiguous bytes; ValueError for an unsupported dtype."""
    import torch

    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise ValueError(f"tensors of dtype {tensor.dtype} are not supported")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    head = _TENSOR_HEAD.pack(
        _TENSOR_MAGIC, _TENSOR_VERSION, _DTYPE_NAMES.index(name), tensor.dim()
    ) + b"".join(_DIM.pack(d) for d in tensor.shape)
    payload = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return head + payload


def _decode_tensor(data: bytes) -> Any:
    """The tensor a value holds, or None when it is not one of ours."""
    import torch

    if len(data) < _TENSOR_HEAD.size:
        return None
    magic, version, code, ndim = _TENSOR_HEAD.unpack_from(data)
    start = _TENSOR_HEAD.size + ndim * _DIM.size
    if magic != _TENSOR_MAGIC or version != _TENSOR_VERSION or code >= len(_DTYPE_NAMES):
        return None
    dtype = getattr(torch, _DTYPE_NAMES[code], None)
    if dtype is None or len(data) < start:
        return None
    shape = [_DIM.unpack_from(data, _TENSOR_HEAD.size + i * _DIM.size)[0] for i in range(ndim)]
    out = torch.empty(shape, dtype=dtype)
    if len(data) - start != out.numel() * out.element_size():
        return None
    if out.numel():
        out.reshape(-1).view(torch.uint8).numpy()[:] = memoryview(data)[start:]
    return out


def _is_tensor(obj: object) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "dtype")


# -- the store -------------------------------------------------------------------


class MooncakeDistributedStore:
    """Mooncake Store's client class, backed by a Beluga pool (see the module docstring).

    Thread-safe: threads may share one store; ``close`` waits for calls in
    flight.  Not fork-safe: a forked child makes and sets up its own (the
    parent's answers ``-600`` / ``b""`` / ``None`` in the child, and closing it
    there leaves the parent connected).
    """

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._store: KVStore | None = None
        self._pid = 0
        self._active = 0
        self._hostname = ""
        self._registered: dict[int, int] = {}
        self._written: dict[bytes, str] = {}  # Beluga key -> Mooncake key, for remove_all
        self._leases: dict[bytes, float] = {}  # key -> monotonic time of its last put or get here
        self._lease_s = LEASE_TTL_MS / 1000
        self._segments: set[str] = set()  # segment ids this handle "mounted"
        self._put_sessions: dict[str, bytearray] = {}  # key -> the object being assembled
        self._get_sessions: set[str] = set()
        self._allocated: list[ctypes.Array[ctypes.c_ubyte]] = []  # alloc_from_mem_pool's memory

    # -- life cycle ----------------------------------------------------------

    def setup(
        self,
        local_hostname: str | Mapping[str, Any],
        metadata_server: str = "",
        global_segment_size: int = 16 << 20,
        local_buffer_size: int = 16 << 20,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "127.0.0.1:50051",
        engine: object = None,
        enable_ssd_offload: bool = False,
        ssd_offload_path: str = "",
        tenant_id: str = "default",
        enable_client_http_server: bool = False,
        client_http_port: int = 9300,
    ) -> int:
        """Attach the pool named by the arguments or $BELUGA_POOL; 0 or a negative code.

        Also takes Mooncake's configuration-dictionary form, ``setup(config)``.
        Setting up again closes the previous connection first.
        """
        if isinstance(local_hostname, Mapping):
            config = {str(k): str(v) for k, v in local_hostname.items()}
            if "local_hostname" not in config or "metadata_server" not in config:
                log.error("setup(config) needs 'local_hostname' and 'metadata_server'")
                return INVALID_PARAMS
            sizes = [
                parse_size(config.get(name, "0"))
                for name in ("global_segment_size", "local_buffer_size")
            ]
            if None in sizes:
                log.error("setup(config): a size is a byte count or N[KB|MB|GB|TB], not %s", config)
                return INVALID_PARAMS
            local_hostname = config["local_hostname"]
            metadata_server = config["metadata_server"]
            master_server_addr = config.get("master_server_addr", master_server_addr)
            tenant_id = config.get("tenant_id", tenant_id)
        for name, text in (
            ("local_hostname", local_hostname),
            ("metadata_server", metadata_server),
            ("master_server_addr", master_server_addr),
            ("tenant_id", tenant_id),
        ):
            if not isinstance(text, str):
                raise TypeError(f"{name} is a str, not {type(text).__name__}")
        if tenant_id != "default":
            log.error("tenant %r: Beluga has no tenants; give each tenant its own pool", tenant_id)
            return INVALID_PARAMS
        lease_ms = os.environ.get(LEASE_ENV, str(LEASE_TTL_MS))
        if not lease_ms.isdigit() or int(lease_ms) == 0:
            log.error(
                "%s=%r: give a whole number of milliseconds > 0 (a Mooncake master's "
                "--default_kv_lease_ttl), or unset it for %d",
                LEASE_ENV, lease_ms, LEASE_TTL_MS,
            )  # fmt: skip
            return INVALID_PARAMS
        self.close()
        spec = pool_spec_for(metadata_server, master_server_addr)
        try:
            store = KVStore(spec)
        except _FAILURES as exc:
            log.error("setup: cannot attach pool %s: %s", spec, exc)
            return _code_of(exc)
        if ":" not in local_hostname:  # Mooncake picks a port for a bare host name
            local_hostname = f"{local_hostname}:{random.randint(*_AUTO_PORTS)}"
        with self._lock:
            self._store, self._pid, self._hostname = store, os.getpid(), local_hostname
            self._lease_s = int(lease_ms) / 1000
        return OK

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Attach the pool as Mooncake's dummy client does its real client's; 0 or a code.

        A pool is shared memory, so a rank's process attaches the same pool
        itself ($BELUGA_POOL, or ``beluga:SPEC`` as ``server_address``); no
        forwarding client is needed.  The sizes are accepted and ignored.
        """
        _check_count(mem_pool_size, "mem_pool_size")
        _check_count(local_buffer_size, "local_buffer_size")
        if not isinstance(server_address, str):
            raise TypeError(f"server_address is a str, not {type(server_address).__name__}")
        return self.setup(
            "localhost",
            server_address if server_address.startswith(POOL_PREFIX) else "",
            master_server_addr=server_address,
        )

    def close(self) -> int:
        """Disconnect (after calls in flight finish, or :data:`CLOSE_WAIT_S`); always 0, and
        safe to call twice.

        Calls in flight end by their own deadlines; one still running after
        :data:`CLOSE_WAIT_S` is logged and the store closed under it, which
        the store survives (the call fails with a clear error, never a crash).

        With ``BELUGA_MOONCAKE_TEARDOWN=drop`` (Mooncake's behaviour, see
        ``DIFFERENCES``), the keys written through this handle are removed first.
        """
        if os.environ.get(TEARDOWN_ENV, "keep") == "drop" and self._store is not None:
            self._remove_written(None)
        with self._lock:
            store, self._store = self._store, None
            self._registered.clear()
            self._written.clear()
            self._leases.clear()
            self._put_sessions.clear()
            self._get_sessions.clear()
            self._segments.clear()
            self._allocated.clear()
            if store is None:
                return OK
            if self._pid != os.getpid():
                return OK  # the parent's connection: not ours to close
            deadline = time.monotonic() + CLOSE_WAIT_S
            while self._active and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(left)
            if self._active:
                log.warning(
                    "close: %d calls still running after %.0f s; closing under them",
                    self._active, CLOSE_WAIT_S,
                )  # fmt: skip
        store.close()
        return OK

    def health_check(self) -> int:
        """0 if the metadata server answers, 1 if not set up or closed, 2 if it does not."""
        with self._client() as store:
            if store is None:
                return 1
            try:
                store.stats()
            except _FAILURES:
                return 2
            return 0

    # -- put and get sessions: an object assembled from ranges, read in ranges --------

    def batch_put_session_start(
        self, keys: list[str], sizes: list[int], config: Any = None
    ) -> list[int]:
        """Open a put session per key for an object of ``sizes[i]`` bytes; one code per key.

        The object is assembled in this process's memory from the ranges
        :meth:`batch_put_from_multi_buffer_ranges` brings and stored at
        :meth:`batch_put_session_end` by one write (the data path's ``save``),
        so nobody reads it before then.  ``-600`` for a key with a session
        open already; a key that is stored already is refused at the end.
        """
        names = _check_list(keys, "keys")
        lengths = [_check_count(n, "a size") for n in _check_list(sizes, "sizes")]
        if len(names) != len(lengths) or _config_code(config):
            return [INVALID_PARAMS] * len(names)
        ks = _check_keys(names)
        codes = []
        with self._lock:
            if self._store is None:
                return [INVALID_PARAMS] * len(names)
            for name, k, n in zip(names, ks, lengths, strict=True):
                if k is None or not n or name in self._put_sessions:
                    codes.append(INVALID_PARAMS)
                    continue
                self._put_sessions[name] = bytearray(n)
                codes.append(OK)
        return codes

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        all_dst_offsets: list[list[int]],
    ) -> list[int]:
        """Copy each key's buffers into its open session's object at ``all_dst_offsets``;
        bytes copied per key, ``-600`` without a session or for a range past the object's
        end."""
        names = _check_list(keys, "keys")
        shaped = [_check_list(x, "a range list") for x in (all_buffer_ptrs, all_sizes,
                                                           all_dst_offsets)]  # fmt: skip
        if any(len(x) != len(names) for x in shaped):
            return [INVALID_PARAMS] * len(names)
        codes = []
        for name, ptrs, sizes, offsets in zip(names, *shaped, strict=True):
            with self._lock:
                target = self._put_sessions.get(name)
            addresses, lengths = _check_ranges(ptrs, sizes)
            starts = [_check_count(o, "an offset") for o in _check_list(offsets, "offsets")]
            if (
                target is None
                or not len(addresses) == len(lengths) == len(starts)
                or not all(addresses)
                or any(o + n > len(target) for o, n in zip(starts, lengths, strict=True))
            ):
                codes.append(INVALID_PARAMS)
                continue
            for a, n, o in zip(addresses, lengths, starts, strict=True):
                target[o : o + n] = _raw_view(a, n)
            codes.append(sum(lengths))
        return codes

    def batch_put_session_end(self, keys: list[str]) -> list[int]:
        """Store each session's object (one write for the batch) and close the session; a
        code per key (``-600`` without a session)."""
        names = _check_list(keys, "keys")
        with self._lock:
            objects = [self._put_sessions.pop(n, None) for n in names]
        done = [(n, o) for n, o in zip(names, objects, strict=True) if o is not None]
        stored = iter(
            self._put_many(
                [n for n, _ in done],
                _check_keys([n for n, _ in done]),
                [bytes(o) for _, o in done],
                replace=False,
            )
            if done
            else []
        )
        return [INVALID_PARAMS if o is None else next(stored) for o in objects]

    def batch_put_session_revoke(self, keys: list[str]) -> list[int]:
        """Close put sessions storing nothing; 0 per key, ``-600`` without a session."""
        names = _check_list(keys, "keys")
        with self._lock:
            return [OK if self._put_sessions.pop(n, None) is not None else INVALID_PARAMS
                    for n in names]  # fmt: skip

    def batch_get_session_start(self, keys: list[str]) -> list[int]:
        """Open a get session per stored key; 0, or ``-704`` for a missing key."""
        names = _check_list(keys, "keys")
        if not names:
            return []
        exists = self.batch_is_exist(names)
        with self._lock:
            for name, e in zip(names, exists, strict=True):
                if e == 1:
                    self._get_sessions.add(name)
                else:
                    self._get_sessions.discard(name)
        return [OK if e == 1 else OBJECT_NOT_FOUND if e == 0 else e for e in exists]

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        all_src_offsets: list[list[int]],
    ) -> list[int]:
        """Copy ranges of each session's value, from ``all_src_offsets``, into its buffers;
        bytes copied per key, ``-600`` without a session or for a range past the value,
        ``-704`` for a value gone since the session opened."""
        names = _check_list(keys, "keys")
        shaped = [_check_list(x, "a range list") for x in (all_buffer_ptrs, all_sizes,
                                                           all_src_offsets)]  # fmt: skip
        if any(len(x) != len(names) for x in shaped):
            return [INVALID_PARAMS] * len(names)
        with self._lock:
            open_ = [n in self._get_sessions for n in names]
        values = self._values(_check_keys([n for n, o in zip(names, open_, strict=True) if o]))
        found = iter(values)
        codes = []
        for is_open, ptrs, sizes, offsets in zip(open_, *shaped, strict=True):
            value = next(found) if is_open else None
            addresses, lengths = _check_ranges(ptrs, sizes)
            starts = [_check_count(o, "an offset") for o in _check_list(offsets, "offsets")]
            if not is_open or not len(addresses) == len(lengths) == len(starts):
                codes.append(INVALID_PARAMS)
            elif value is None:
                codes.append(OBJECT_NOT_FOUND)
            elif not all(addresses) or any(
                o + n > len(value) for o, n in zip(starts, lengths, strict=True)
            ):
                codes.append(INVALID_PARAMS)
            else:
                for a, n, o in zip(addresses, lengths, starts, strict=True):
                    _raw_view(a, n)[:] = value[o : o + n]
                codes.append(sum(lengths))
        return codes

    def batch_get_session_end(self, keys: list[str]) -> int:
        """Close get sessions; 0."""
        with self._lock:
            self._get_sessions.difference_update(_check_list(keys, "keys"))
        return OK

    # -- segments, replicas and tasks: no meaning on a pool, Mooncake's answers -----

    def allocate_and_mount_segment(
        self, size: int, protocol: str = "tcp", location: str = ""
    ) -> dict[str, Any]:
        """Mooncake's answer to mounting memory; the pool's capacity is its own, so the
        segment adds nothing to it (``ret`` -600 before ``setup`` or for size 0)."""
        _check_count(size, "size")
        return self._mount(size) if size else {"ret": INVALID_PARAMS, "segment_ids": []}

    def mount_segment(
        self, path: str, size: int, offset: int = 0, protocol: str = "tcp", location: str = ""
    ) -> dict[str, Any]:
        """As :meth:`allocate_and_mount_segment` for a file's memory (``ret`` -1 if it is
        not there, as Mooncake's)."""
        _check_count(size, "size")
        _check_count(offset, "offset")
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
        ids = [str(i) for i in _check_list(segment_ids, "segment_ids")]
        _check_count(grace_period_seconds, "grace_period_seconds")
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
        _check_count(grace_period_seconds, "grace_period_seconds")
        return OK

    def get_offload_rpc_read_count(self) -> int:
        """0: a pool offloads nothing to disk."""
        return 0

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The value's one replica, or ``[]`` for a missing key."""
        return self.batch_get_replica_desc([key]).get(key, [])

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        """Replicas of each present key (missing keys are left out, as in Mooncake)."""
        names = _check_list(keys, "keys")
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
        _check_list(targets, "targets")
        return (0, 0), OBJECT_NOT_FOUND if self.is_exist(key) != 1 else INVALID_PARAMS

    def create_move_task(self, key: str, source: str, target: str) -> tuple[tuple[int, int], int]:
        """As :meth:`create_copy_task`: there is no segment to move a value between."""
        return (0, 0), OBJECT_NOT_FOUND if self.is_exist(key) != 1 else INVALID_PARAMS

    def query_task(self, task_id: tuple[int, int]) -> tuple[None, int]:
        """No task exists on a pool: ``(None, -1400)``."""
        return None, TASK_NOT_FOUND

    # -- metadata-prefixed values and safetensors files -------------------------

    def put_from_with_metadata(
        self,
        key: str,
        buffer_ptr: int,
        metadata_buffer_ptr: int,
        size: int,
        metadata_size: int,
        config: Any = None,
    ) -> int:
        """Store ``metadata_size`` bytes at ``metadata_buffer_ptr`` followed by ``size`` bytes
        at ``buffer_ptr`` as one value, unless the key exists."""
        (data, meta), (n, m) = _check_ranges(
            [buffer_ptr, metadata_buffer_ptr], [size, metadata_size]
        )
        if not data or not meta or _config_code(config):
            return INVALID_PARAMS
        value = bytes(_raw_view(meta, m)) + bytes(_raw_view(data, n))
        names = [key]
        return self._put_many(names, _check_keys(names), [value], replace=False)[0]

    def save_tensor_to_safetensor(self, key: str, file_name: str | None = None) -> int:
        """Write the tensor stored under ``key`` to a safetensors file (named ``key`` unless
        ``file_name``); 0, ``-1100`` for a missing key (Mooncake's code), ``-1103``."""
        tensor = self.get_tensor(key)
        if tensor is None:
            return FILE_NOT_FOUND
        try:
            from safetensors.torch import save_file

            save_file({key: tensor.contiguous()}, file_name or key)
        except Exception as exc:  # safetensors raises its own error types for a bad path
            log.error("save_tensor_to_safetensor(%r): %s", key, exc)
            return FILE_WRITE_FAIL
        return OK

    def load_tensor_from_safetensor(self, key: str | None = None, file_name: str = "") -> Any:
        """Read a safetensors file's tensor named ``key`` (else its first, with a warning),
        store it under ``key`` (else ``file_name``) and return it; None if unreadable."""
        try:
            from safetensors.torch import load_file

            tensors = load_file(file_name)
        except Exception as exc:  # safetensors raises its own error types for a bad file
            log.error("load_tensor_from_safetensor(%r): %s", file_name, exc)
            return None
        if not tensors:
            return None
        name = file_name if key is None else key
        if name not in tensors:
            log.warning("%s holds no tensor %r: storing its first one", file_name, name)
        tensor = tensors.get(name, next(iter(tensors.values())))
        code = self.put_tensor(name, tensor)
        return tensor if code == OK else None

    def get_hostname(self) -> str:
        """The ``local_hostname`` given to ``setup`` ("" before it)."""
        return self._hostname

    @contextmanager
    def _client(self) -> Iterator[KVStore | None]:
        """The connected store for one call (None if not set up here); close waits for it."""
        with self._lock:
            store = self._store if self._pid == os.getpid() else None
            if store is not None:
                self._active += 1
        try:
            yield store
        finally:
            if store is not None:
                with self._lock:
                    self._active -= 1
                    self._lock.notify_all()

    def _lease(self, keys: Sequence[bytes]) -> None:
        """Note Mooncake's lease on keys just put or read (dropping leases long expired)."""
        now = time.monotonic()
        with self._lock:
            if len(self._leases) > 4 * len(keys) + 4096:
                ttl = self._lease_s
                self._leases = {k: t for k, t in self._leases.items() if now - t < ttl}
            self._leases.update(dict.fromkeys(keys, now))

    def _remember(self, keys: Sequence[bytes], names: Sequence[str | bytes]) -> None:
        self._lease(keys)
        with self._lock:
            for k, name in zip(keys, names, strict=True):
                self._written[k] = (
                    name if isinstance(name, str) else name.decode(errors="surrogateescape")
                )

    def _forget(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._written.pop(k, None)

    # -- writes --------------------------------------------------------------

    def _put_many(
        self,
        names: Sequence[str | bytes],
        keys: Sequence[bytes | None],
        values: Sequence[Any | None],
        replace: bool,
    ) -> list[int]:
        """Per-item codes of storing ``values`` (None: a refused item) under ``keys``."""
        codes = [
            INVALID_PARAMS if k is None or v is None or not len(v) else OK
            for k, v in zip(keys, values, strict=True)
        ]
        todo = [i for i, c in enumerate(codes) if c == OK]
        if not todo:
            return codes
        with self._client() as store:
            if store is None:
                return [INVALID_PARAMS] * len(codes)
            try:
                chosen: dict[bytes, int] = {}
                for i in todo:  # put keeps the first of a repeated key, upsert the last
                    key = bytes(keys[i] or b"")
                    if replace or key not in chosen:
                        chosen[key] = i
                named = dict(chosen)
                if not replace:
                    present = store.batch_is_exist(list(chosen))
                    chosen = {
                        k: i for (k, i), p in zip(chosen.items(), present, strict=True) if not p
                    }
                store.batch_put_from(list(chosen), [values[i] for i in chosen.values()])
            except WriteLeaseLost as exc:  # the server answered: the rest are committed
                log.warning("put of %d values: %s", len(todo), exc)
                refused = set(exc.lost)
                lost = {k for n, k in enumerate(chosen) if n in refused}
                codes = [
                    RPC_FAIL if c == OK and bytes(keys[i] or b"") in lost else c
                    for i, c in enumerate(codes)
                ]
                named = {k: i for k, i in named.items() if k not in lost}
            except _FAILURES as exc:
                log.warning("put of %d values failed: %s", len(todo), exc)
                code = _code_of(exc)
                return [code if c == OK else c for c in codes]
            self._remember(list(named), [names[i] for i in named.values()])
        return codes

    def _put_values(self, key: object, value: object, replace: bool) -> int:
        k = _check_key(key)
        view = _check_value(value)
        return self._put_many([key], [k], [view], replace)[0]  # type: ignore[list-item]

    def put(self, key: str, value: Any, config: Any = None) -> int:
        """Store bytes-like ``value`` under ``key`` unless the key exists; 0 or a negative code."""
        return _config_code(config) or self._put_values(key, value, replace=False)

    def upsert(self, key: str, value: Any, config: Any = None) -> int:
        """Store ``value`` under ``key``, replacing any value; 0 or a negative code."""
        return _config_code(config) or self._put_values(key, value, replace=True)

    def _parts(self, key: object, parts: Sequence[object], replace: bool) -> int:
        k = _check_key(key)
        joined = b"".join(bytes(_check_value(p)) for p in parts)
        return self._put_many([key], [k], [joined], replace)[0]  # type: ignore[list-item]

    def put_parts(self, key: str, *parts: Any, config: Any = None) -> int:
        """Store the concatenation of ``parts`` as one value (put semantics)."""
        return self._parts(key, parts, replace=False)

    def upsert_parts(self, key: str, *parts: Any, config: Any = None) -> int:
        """Store the concatenation of ``parts`` as one value, replacing any."""
        return self._parts(key, parts, replace=True)

    def _batch(self, keys: object, values: object, replace: bool) -> int:
        names = _check_list(keys, "keys")
        ks = _check_keys(names)
        views = [_check_value(v) for v in _check_list(values, "values")]
        if len(ks) != len(views):
            return INVALID_PARAMS
        if any(k is None or not len(v) for k, v in zip(ks, views, strict=True)):
            return INVALID_PARAMS
        codes = self._put_many(names, ks, views, replace)
        return next((c for c in codes if c != OK), OK)

    def put_batch(self, keys: list[str], values: list[Any], config: Any = None) -> int:
        """Store many values (existing keys keep theirs); 0, or the first failure's code."""
        return self._batch(keys, values, replace=False)

    def upsert_batch(self, keys: list[str], values: list[Any], config: Any = None) -> int:
        """Store many values, replacing existing ones; 0, or the first failure's code."""
        return self._batch(keys, values, replace=True)

    def _from(self, keys: object, ptrs: object, sizes: object, replace: bool) -> list[int]:
        names = _check_list(keys, "keys")
        ks = _check_keys(names)
        addresses, lengths = _check_ranges(ptrs, sizes)
        if not len(ks) == len(addresses) == len(lengths):
            return [INVALID_PARAMS] * len(ks)
        raw = [(a, n) if a else None for a, n in zip(addresses, lengths, strict=True)]
        views = [None if r is None else _raw_view(*r) for r in raw]
        return self._put_many(names, ks, views, replace)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int:
        """Store ``size`` bytes at address ``buffer_ptr`` unless the key exists."""
        return self._from([key], [buffer_ptr], [size], replace=False)[0]

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int:
        """Store ``size`` bytes at address ``buffer_ptr``, replacing any value."""
        return self._from([key], [buffer_ptr], [size], replace=True)[0]

    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: Any = None
    ) -> list[int]:
        """Store many (address, size) ranges; one code per key (one ALLOC and COMMIT RPC)."""
        return self._from(keys, buffer_ptrs, sizes, replace=False)

    def batch_upsert_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: Any = None
    ) -> list[int]:
        """As :meth:`batch_put_from`, replacing existing values."""
        return self._from(keys, buffer_ptrs, sizes, replace=True)

    # -- reads ---------------------------------------------------------------

    def _values(self, keys: Sequence[bytes | None]) -> list[bytes | None]:
        """Values of keys (None: a miss, the empty key, or a failure)."""
        found = [k for k in keys if k is not None]
        with self._client() as store:
            if store is None or not found:
                return [None] * len(keys)
            try:
                got = iter(store.get_batch(found))
            except _FAILURES as exc:
                log.warning("get of %d keys failed: %s", len(found), exc)
                return [None] * len(keys)
        values = [None if k is None else next(got) for k in keys]
        self._lease([k for k, v in zip(keys, values, strict=True) if k and v is not None])
        return values

    def get(self, key: str) -> bytes:
        """The value of ``key``; ``b""`` for a miss."""
        return self._values([_check_key(key)])[0] or b""

    def get_batch(self, keys: list[str]) -> list[bytes]:
        """Values of many keys (``b""`` for each miss); one lookup RPC per batch."""
        return [v or b"" for v in self._values(_check_keys(keys))]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value of ``key`` as a :class:`BufferHandle`; None for a miss."""
        (value,) = self._values([_check_key(key)])
        return None if value is None else BufferHandle(value)

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        """As :meth:`get_buffer` for many keys."""
        return [None if v is None else BufferHandle(v) for v in self._values(_check_keys(keys))]

    def _into(self, keys: Sequence[bytes | None], ranges: Sequence[tuple[int, int]]) -> list[int]:
        """Bytes read into each (address, capacity), or a negative code."""
        codes = [
            OBJECT_NOT_FOUND if k is None else INVALID_PARAMS if not a else OK
            for k, (a, _) in zip(keys, ranges, strict=True)
        ]
        todo = [i for i, c in enumerate(codes) if c == OK]
        if not todo:
            return codes
        with self._client() as store:
            if store is None:
                return [INVALID_PARAMS] * len(codes)
            batch = [keys[i] for i in todo]
            views = [_raw_view(*ranges[i]) for i in todo]
            try:
                got = store.batch_get_into(batch, views)  # type: ignore[arg-type]
            except ValueError:  # a buffer too small: find which, one by one
                got = [self._into_one(store, k, v) for k, v in zip(batch, views, strict=True)]
            except _FAILURES as exc:
                log.warning("get_into of %d keys failed: %s", len(todo), exc)
                got = [_code_of(exc)] * len(todo)
        for i, n in zip(todo, got, strict=True):
            codes[i] = OBJECT_NOT_FOUND if n == -1 else n
        return codes

    @staticmethod
    def _into_one(store: KVStore, key: bytes | None, view: memoryview) -> int:
        try:
            return store.get_into(key, view)  # type: ignore[arg-type]
        except _FAILURES as exc:
            return _code_of(exc)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Copy the value into ``size`` bytes at ``buffer_ptr``; its length, or a negative code.

        ``-704`` for a miss, ``-600`` when the value is longer than ``size``.
        """
        (k,) = _check_keys([key])
        addresses, sizes = _check_ranges([buffer_ptr], [size])
        return self._into([k], [(addresses[0], sizes[0])])[0]

    def batch_get_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        """As :meth:`get_into` for many keys; one lookup RPC per batch."""
        ks = _check_keys(keys)
        addresses, lengths = _check_ranges(buffer_ptrs, sizes)
        if not len(ks) == len(addresses) == len(lengths):
            return [INVALID_PARAMS] * len(ks)
        return self._into(ks, list(zip(addresses, lengths, strict=True)))

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """1 where a key exists, 0 where not, a negative code on failure."""
        ks = _check_keys(keys)
        found = [k for k in ks if k is not None]
        with self._client() as store:
            if store is None:
                return [INVALID_PARAMS] * len(ks)
            try:
                exists = iter(store.batch_is_exist(found) if found else [])
            except _FAILURES as exc:
                log.warning("is_exist of %d keys failed: %s", len(found), exc)
                return [_code_of(exc)] * len(ks)
        return [0 if k is None else int(next(exists)) for k in ks]

    def is_exist(self, key: str) -> int:
        """1 if ``key`` exists, 0 if not, a negative code on failure."""
        return self.batch_is_exist([key])[0]

    def get_size(self, key: str) -> int:
        """The value's length in bytes; ``-704`` for a miss."""
        k = _check_key(key)
        if k is None:
            return OBJECT_NOT_FOUND
        with self._client() as store:
            if store is None:
                return INVALID_PARAMS
            try:
                (ref,) = store.locate([k], prefix=False)
            except _FAILURES as exc:
                return _code_of(exc)
        return OBJECT_NOT_FOUND if ref is None else ref.length

    # -- removal -------------------------------------------------------------

    def _remove(self, keys: Sequence[bytes | None]) -> list[int]:
        codes = [OBJECT_NOT_FOUND] * len(keys)
        with self._client() as store:
            if store is None:
                return [INVALID_PARAMS] * len(keys)
            for i, k in enumerate(keys):
                if k is None:
                    continue
                try:
                    codes[i] = OK if store.remove(k) else OBJECT_NOT_FOUND
                except _FAILURES as exc:
                    codes[i] = _code_of(exc)
        gone = (OK, OBJECT_NOT_FOUND)
        self._forget([k for k, c in zip(keys, codes, strict=True) if k is not None and c in gone])
        return codes

    def remove(self, key: str, force: bool = False) -> int:
        """Delete ``key``; 0, or ``-704`` if it was not there."""
        return self._remove([_check_key(key)])[0]

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        """Delete many keys; one code per key."""
        return self._remove(_check_keys(keys))

    def _remove_written(self, match: re.Pattern[str] | None) -> int:
        with self._lock:
            keys = [k for k, name in self._written.items() if match is None or match.search(name)]
        codes = self._remove(keys)
        failed = next((c for c in codes if c not in (OK, OBJECT_NOT_FOUND)), None)
        return failed if failed is not None else codes.count(OK)

    def remove_all(self, force: bool = False) -> int:
        """Delete every key written through this store; how many there were, or a negative code."""
        if self._store is None:
            return INVALID_PARAMS
        return self._remove_written(None)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Delete the keys written through this store that ``re.search`` matches; how many."""
        if not isinstance(regex_pattern, str):
            raise TypeError(f"regex_pattern is a str, not {type(regex_pattern).__name__}")
        try:
            match = re.compile(regex_pattern)
        except re.error:
            return INVALID_PARAMS
        if self._store is None:
            return INVALID_PARAMS
        return self._remove_written(match)

    # -- buffers -------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Note a buffer for zero-copy calls; 0, or ``-600`` if already registered."""
        _check_count(buffer_ptr, "buffer_ptr")
        _check_count(size, "size")
        with self._lock:
            if self._store is None or not buffer_ptr or buffer_ptr in self._registered:
                return INVALID_PARAMS
            self._registered[buffer_ptr] = size
        return OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Forget a registered buffer; 0, or ``-600`` if it was not registered."""
        _check_count(buffer_ptr, "buffer_ptr")
        with self._lock:
            return OK if self._registered.pop(buffer_ptr, None) is not None else INVALID_PARAMS

    def alloc_from_mem_pool(self, size: int) -> int:
        """The address of ``size`` new zeroed bytes of host memory (0 if not set up).

        Mooncake's dummy client hands out memory shared with its real client;
        on a pool every copy is the CPU's, so any host memory serves.  The
        memory lives until this store is closed.
        """
        _check_count(size, "size")
        with self._lock:
            if self._store is None or not size:
                return 0
            block = (ctypes.c_ubyte * size)()
            self._allocated.append(block)
            return ctypes.addressof(block)

    # -- tensors -------------------------------------------------------------

    def _put_tensors(self, keys: object, tensors: object, replace: bool) -> list[int]:
        names = _check_list(keys, "keys")
        ks = _check_keys(names)
        items = _check_list(tensors, "tensors_list")
        if len(ks) != len(items):
            return [INVALID_PARAMS] * len(ks)
        values: list[bytes | None] = []
        for t in items:
            try:
                values.append(_encode_tensor(t) if _is_tensor(t) else None)
            except ValueError as exc:
                log.error("put_tensor: %s", exc)
                values.append(None)
        return self._put_many(names, ks, values, replace)

    def put_tensor(self, key: str, tensor: Any) -> int:
        """Store a torch tensor (dtype and shape kept) unless the key exists; 0 or a code."""
        return self._put_tensors([key], [tensor], replace=False)[0]

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        """Store a torch tensor, replacing any value; 0 or a negative code."""
        return self._put_tensors([key], [tensor], replace=True)[0]

    def batch_put_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        """Store many tensors; one code per key."""
        return self._put_tensors(keys, tensors_list, replace=False)

    def batch_upsert_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        """Store many tensors, replacing existing values; one code per key."""
        return self._put_tensors(keys, tensors_list, replace=True)

    def get_tensor(self, key: str) -> Any:
        """The tensor stored under ``key``; None for a miss or a value that is not a tensor."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: list[str]) -> list[Any]:
        """As :meth:`get_tensor` for many keys; one lookup RPC per batch."""
        return [None if v is None else _decode_tensor(v) for v in self._values(_check_keys(keys))]

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Read a stored tensor into ``size`` bytes at ``buffer_ptr``; the tensor, or None.

        The buffer then holds the value's stored form, which
        :meth:`put_tensor_from` takes back.
        """
        return self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]

    def batch_get_tensor_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[Any]:
        """As :meth:`get_tensor_into` for many keys; ``-600`` each for lists of unequal length."""
        codes = self.batch_get_into(keys, buffer_ptrs, sizes)
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return codes
        return [
            None if n < 0 else _decode_tensor(bytes(_raw_view(a, n)))
            for a, n in zip(buffer_ptrs, codes, strict=True)
        ]

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Store a tensor's stored form found at ``buffer_ptr``; ``-600`` if it is not one."""
        (address,), (length,) = _check_ranges([buffer_ptr], [size])
        if not address or _decode_tensor(bytes(_raw_view(address, length))) is None:
            return INVALID_PARAMS
        return self.put_from(key, address, length)

    def batch_put_tensor_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        """As :meth:`put_tensor_from` for many buffers; one code per key."""
        return self._tensors_from(keys, buffer_ptrs, sizes, replace=False)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """As :meth:`put_tensor_from`, replacing any value."""
        return self._tensors_from([key], [buffer_ptr], [size], replace=True)[0]

    def batch_upsert_tensor_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        """As :meth:`batch_put_tensor_from`, replacing existing values."""
        return self._tensors_from(keys, buffer_ptrs, sizes, replace=True)

    def _tensors_from(self, keys: object, ptrs: object, sizes: object, replace: bool) -> list[int]:
        """Store tensors' stored forms from buffers; ``-600`` for a buffer that holds none."""
        names = _check_list(keys, "keys")
        addresses, lengths = _check_ranges(ptrs, sizes)
        if not len(names) == len(addresses) == len(lengths):
            return [INVALID_PARAMS] * len(names)
        tensors = [self._tensor_at(a, n) for a, n in zip(addresses, lengths, strict=True)]
        codes = self._put_tensors(
            [k for k, t in zip(names, tensors, strict=True) if t is not None],
            [t for t in tensors if t is not None],
            replace,
        )
        done = iter(codes)
        return [INVALID_PARAMS if t is None else next(done) for t in tensors]

    @staticmethod
    def _tensor_at(address: int, length: int) -> Any:
        """The tensor whose stored form is at ``address`` (a copy), or None."""
        return None if not address else _decode_tensor(bytes(_raw_view(address, length)))

    # -- publishing: a put with a replica config, which names no placement here --

    def pub_tensor(self, key: str, tensor: Any, config: Any = None) -> int:
        """As :meth:`put_tensor`; ``config`` is checked as :meth:`put` checks it."""
        return _config_code(config) or self.put_tensor(key, tensor)

    def batch_pub_tensor(
        self, keys: list[str], tensors_list: list[Any], config: Any = None
    ) -> list[int]:
        """As :meth:`batch_put_tensor`, with a replica config."""
        code = _config_code(config)
        return [code] * len(keys) if code else self.batch_put_tensor(keys, tensors_list)

    def upsert_pub_tensor(self, key: str, tensor: Any, config: Any = None) -> int:
        """As :meth:`upsert_tensor`, with a replica config."""
        return _config_code(config) or self.upsert_tensor(key, tensor)

    def batch_upsert_pub_tensor(
        self, keys: list[str], tensors_list: list[Any], config: Any = None
    ) -> list[int]:
        """As :meth:`batch_upsert_tensor`, with a replica config."""
        code = _config_code(config)
        return [code] * len(keys) if code else self.batch_upsert_tensor(keys, tensors_list)

    def pub_tensor_with_tp(
        self,
        key: str,
        tensor: Any,
        config: Any = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> int:
        """As :meth:`put_tensor_with_tp`, with a replica config."""
        return _config_code(config) or self.put_tensor_with_tp(
            key, tensor, tp_rank, tp_size, split_dim
        )

    def batch_pub_tensor_with_tp(
        self,
        base_keys: list[str],
        tensors_list: list[Any],
        config: Any = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        """As :meth:`batch_put_tensor_with_tp`, with a replica config."""
        code = _config_code(config)
        if code:
            return [code] * len(base_keys)
        return self.batch_put_tensor_with_tp(base_keys, tensors_list, tp_rank, tp_size, split_dim)

    # -- multi-buffer values: one value gathered from (scattered into) buffers --

    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: Any = None,
    ) -> list[int]:
        """Store each key's value gathered from its buffers, in order; one code per key."""
        names = _check_list(keys, "keys")
        ranges = self._multi(names, all_buffer_ptrs, all_sizes)
        if ranges is None or _config_code(config):
            return [INVALID_PARAMS] * len(names)
        values = [
            None if r is None else b"".join(bytes(_raw_view(a, n)) for a, n in r) for r in ranges
        ]
        return self._put_many(names, _check_keys(names), values, replace=False)

    def batch_get_into_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        """Scatter each key's value over its buffers, in order; bytes read or a code.

        A value that does not fill the buffers exactly is ``-600`` (Mooncake
        reads a value into buffers of its stored layout only).
        """
        names = _check_list(keys, "keys")
        ranges = self._multi(names, all_buffer_ptrs, all_sizes)
        if ranges is None:
            return [INVALID_PARAMS] * len(names)
        values = self._values(_check_keys(names))
        codes = []
        for value, r in zip(values, ranges, strict=True):
            if value is None or r is None:
                codes.append(OBJECT_NOT_FOUND if r is not None else INVALID_PARAMS)
                continue
            if len(value) != sum(n for _, n in r):
                codes.append(INVALID_PARAMS)
                continue
            at = 0
            for a, n in r:
                _raw_view(a, n)[:] = value[at : at + n]
                at += n
            codes.append(len(value))
        return codes

    @staticmethod
    def _multi(
        names: list[Any], all_ptrs: object, all_sizes: object
    ) -> list[list[tuple[int, int]] | None] | None:
        """Each key's (address, size) buffers (None for a key with a null or unequal list);
        None when the lists do not match the keys."""
        ptrs, sizes = _check_list(all_ptrs, "all_buffer_ptrs"), _check_list(all_sizes, "all_sizes")
        if not len(names) == len(ptrs) == len(sizes):
            return None
        out: list[list[tuple[int, int]] | None] = []
        for p, n in zip(ptrs, sizes, strict=True):
            addresses, lengths = _check_ranges(p, n)
            ok = len(addresses) == len(lengths) and addresses and all(addresses)
            out.append(list(zip(addresses, lengths, strict=True)) if ok else None)
        return out

    # -- tensor parallelism: Mooncake's split, one key per rank -----------------

    @staticmethod
    def _shards(tensor: Any, tp_size: int, split_dim: int) -> list[Any] | None:
        """The tensor split as Mooncake splits it: equal parts along ``split_dim``, else None."""
        if not _is_tensor(tensor) or tp_size < 1 or not -tensor.dim() <= split_dim < tensor.dim():
            return None
        if tensor.shape[split_dim] % tp_size:
            return None  # Mooncake refuses a dimension that tp_size does not divide (-600)
        return list(tensor.chunk(tp_size, split_dim))

    @staticmethod
    def _tp_key(key: str, rank: int, tp_size: int) -> str:
        return key if tp_size <= 1 else f"{key}_tp_{rank}"

    def _put_tp(
        self, keys: list[str], tensors: list[Any], tp_size: int, split_dim: int, replace: bool
    ) -> list[int]:
        _check_list(keys, "base_keys")
        if len(keys) != len(_check_list(tensors, "tensors_list")):
            return [INVALID_PARAMS] * len(keys)
        codes = []
        for key, tensor in zip(keys, tensors, strict=True):
            shards = self._shards(tensor, tp_size, split_dim)
            if shards is None or len(shards) != tp_size:
                codes.append(INVALID_PARAMS)
                continue
            names = [self._tp_key(key, r, tp_size) for r in range(tp_size)]
            got = self._put_tensors(names, shards, replace)
            codes.append(next((c for c in got if c != OK), OK))
        return codes

    def put_tensor_with_tp(
        self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> int:
        """Store each rank's shard of ``tensor`` as ``{key}_tp_{rank}`` (``key`` if tp_size 1)."""
        return self._put_tp([key], [tensor], tp_size, split_dim, replace=False)[0]

    def upsert_tensor_with_tp(
        self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> int:
        """As :meth:`put_tensor_with_tp`, replacing existing shards."""
        return self._put_tp([key], [tensor], tp_size, split_dim, replace=True)[0]

    def batch_put_tensor_with_tp(
        self,
        base_keys: list[str],
        tensors_list: list[Any],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        """As :meth:`put_tensor_with_tp` for many tensors; one code per base key."""
        return self._put_tp(base_keys, tensors_list, tp_size, split_dim, replace=False)

    def batch_upsert_tensor_with_tp(
        self,
        base_keys: list[str],
        tensors_list: list[Any],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        """As :meth:`batch_put_tensor_with_tp`, replacing existing shards."""
        return self._put_tp(base_keys, tensors_list, tp_size, split_dim, replace=True)

    def get_tensor_with_tp(
        self, key: str, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> Any:
        """Rank ``tp_rank``'s shard stored by :meth:`put_tensor_with_tp`; None for a miss."""
        return self.batch_get_tensor_with_tp([key], tp_rank, tp_size)[0]

    def batch_get_tensor_with_tp(
        self, base_keys: list[str], tp_rank: int = 0, tp_size: int = 1
    ) -> list[Any]:
        """As :meth:`get_tensor_with_tp` for many base keys."""
        names = [self._tp_key(k, tp_rank, tp_size) for k in _check_list(base_keys, "base_keys")]
        return self.batch_get_tensor(names)

    def put_tensor_with_tp_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> int:
        """As :meth:`put_tensor_with_tp` of the tensor whose stored form is at ``buffer_ptr``."""
        return self.batch_put_tensor_with_tp_from(
            [key], [buffer_ptr], [size], tp_rank, tp_size, split_dim
        )[0]

    def batch_put_tensor_with_tp_from(
        self,
        base_keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        """As :meth:`put_tensor_with_tp_from` for many buffers; one code per base key."""
        names = _check_list(base_keys, "base_keys")
        addresses, lengths = _check_ranges(buffer_ptrs, sizes)
        if not len(names) == len(addresses) == len(lengths):
            return [INVALID_PARAMS] * len(names)
        tensors = [self._tensor_at(a, n) for a, n in zip(addresses, lengths, strict=True)]
        return self._put_tp(names, tensors, tp_size, split_dim, replace=False)

    def get_tensor_with_tp_into(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> Any:
        """Rank ``tp_rank``'s shard read into the buffer, as :meth:`get_tensor_into`."""
        return self.get_tensor_into(self._tp_key(key, tp_rank, tp_size), buffer_ptr, size)

    def batch_get_tensor_with_tp_into(
        self,
        base_keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> list[Any]:
        """As :meth:`get_tensor_with_tp_into` for many base keys."""
        names = [self._tp_key(k, tp_rank, tp_size) for k in _check_list(base_keys, "base_keys")]
        return self.batch_get_tensor_into(names, buffer_ptrs, sizes)

    # -- *_with_parallelism: the whole tensor; a parallelism request is refused --

    @staticmethod
    def _whole(form: str, *requests: object) -> bool:
        """Whether no TensorParallelism / ReadTarget / writer_partition request was given
        (logged when one was: the pool stores whole tensors only, so far)."""
        if all(r is None for r in requests):
            return True
        log.error("%s: parallelism requests are not supported by the Beluga drop-in", form)
        return False

    def put_tensor_with_parallelism(
        self,
        key: str,
        tensor: Any,
        parallelism: object = None,
        config: Any = None,
        writer_partition: object = None,
    ) -> int:
        """As :meth:`pub_tensor` when no parallelism request is given; else ``-600``."""
        if not self._whole("put_tensor_with_parallelism", parallelism, writer_partition):
            return INVALID_PARAMS
        return self.pub_tensor(key, tensor, config)

    def upsert_tensor_with_parallelism(
        self,
        key: str,
        tensor: Any,
        parallelism: object = None,
        config: Any = None,
        writer_partition: object = None,
    ) -> int:
        """As :meth:`upsert_pub_tensor` when no parallelism request is given; else ``-600``."""
        if not self._whole("upsert_tensor_with_parallelism", parallelism, writer_partition):
            return INVALID_PARAMS
        return self.upsert_pub_tensor(key, tensor, config)

    def batch_put_tensor_with_parallelism(
        self,
        keys: list[str],
        tensors_list: list[Any],
        parallelisms: object = None,
        config: Any = None,
        writer_partitions: object = None,
    ) -> list[int]:
        """As :meth:`batch_pub_tensor` when no parallelism requests are given; else ``-600``."""
        if not self._whole("batch_put_tensor_with_parallelism", parallelisms, writer_partitions):
            return [INVALID_PARAMS] * len(keys)
        return self.batch_pub_tensor(keys, tensors_list, config)

    def batch_upsert_tensor_with_parallelism(
        self,
        keys: list[str],
        tensors_list: list[Any],
        parallelisms: object = None,
        config: Any = None,
        writer_partitions: object = None,
    ) -> list[int]:
        """As :meth:`batch_upsert_pub_tensor` when no parallelism requests are given."""
        if not self._whole("batch_upsert_tensor_with_parallelism", parallelisms, writer_partitions):
            return [INVALID_PARAMS] * len(keys)
        return self.batch_upsert_pub_tensor(keys, tensors_list, config)

    def put_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: object = None,
        config: Any = None,
        writer_partition: object = None,
    ) -> int:
        """As :meth:`put_tensor_from` when no parallelism request is given; else ``-600``."""
        requests = (parallelism, writer_partition)
        form = "put_tensor_with_parallelism_from"
        return self._whole_from(form, [key], [buffer_ptr], [size], requests, config, False)[0]

    def batch_put_tensor_with_parallelism_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        parallelisms: object = None,
        config: Any = None,
        writer_partitions: object = None,
    ) -> list[int]:
        """As :meth:`batch_put_tensor_from` when no parallelism requests are given."""
        requests = (parallelisms, writer_partitions)
        form = "batch_put_tensor_with_parallelism_from"
        return self._whole_from(form, keys, buffer_ptrs, sizes, requests, config, False)

    def upsert_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: object = None,
        config: Any = None,
        writer_partition: object = None,
    ) -> int:
        """As :meth:`upsert_tensor_from` when no parallelism request is given; else ``-600``."""
        requests = (parallelism, writer_partition)
        form = "upsert_tensor_with_parallelism_from"
        return self._whole_from(form, [key], [buffer_ptr], [size], requests, config, True)[0]

    def batch_upsert_tensor_with_parallelism_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        parallelisms: object = None,
        config: Any = None,
        writer_partitions: object = None,
    ) -> list[int]:
        """As :meth:`batch_upsert_tensor_from` when no parallelism requests are given."""
        requests = (parallelisms, writer_partitions)
        form = "batch_upsert_tensor_with_parallelism_from"
        return self._whole_from(form, keys, buffer_ptrs, sizes, requests, config, True)

    def _whole_from(
        self,
        form: str,
        keys: list[str],
        ptrs: list[int],
        sizes: list[int],
        requests: tuple[object, object],
        config: Any,
        replace: bool,
    ) -> list[int]:
        """The ``*_with_parallelism_from`` forms: whole tensors from buffers, or ``-600``."""
        if not self._whole(form, *requests) or _config_code(config):
            return [INVALID_PARAMS] * len(keys)
        return self._tensors_from(keys, ptrs, sizes, replace=replace)

    def get_tensor_with_parallelism(self, key: str, target: object = None) -> Any:
        """As :meth:`get_tensor` when no ReadTarget is given; else None."""
        return self.get_tensor(key) if self._whole("get_tensor_with_parallelism", target) else None

    def batch_get_tensor_with_parallelism(
        self, keys: list[str], targets: object = None
    ) -> list[Any]:
        """As :meth:`batch_get_tensor` when no ReadTargets are given; else None each."""
        if not self._whole("batch_get_tensor_with_parallelism", targets):
            return [None] * len(keys)
        return self.batch_get_tensor(keys)

    def get_tensor_with_parallelism_into(
        self, key: str, buffer_ptr: int, size: int, target: object = None
    ) -> Any:
        """As :meth:`get_tensor_into` when no ReadTarget is given; else None."""
        if not self._whole("get_tensor_with_parallelism_into", target):
            return None
        return self.get_tensor_into(key, buffer_ptr, size)

    def batch_get_tensor_with_parallelism_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], targets: object = None
    ) -> list[Any]:
        """As :meth:`batch_get_tensor_into` when no ReadTargets are given; else None each."""
        if not self._whole("batch_get_tensor_with_parallelism_into", targets):
            return [None] * len(keys)
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    # -- ranged reads ----------------------------------------------------------

    def get_into_ranges(
        self,
        buffer_ptrs: list[int],
        all_keys: list[list[str]],
        all_dst_offsets: list[list[list[int]]],
        all_src_offsets: list[list[list[int]]],
        all_sizes: list[list[list[int]]],
    ) -> list[list[list[int]]]:
        """Copy byte ranges of values into buffers; per buffer, key and range: bytes or a code.

        Buffer-major, as Mooncake's: ``buffer_ptrs[b]`` receives, for each key
        ``all_keys[b][k]``, ``sizes[b][k][r]`` bytes from value offset
        ``src[b][k][r]`` at buffer offset ``dst[b][k][r]``.  A key whose three
        lists differ in length is ``[-600]``; a missing key ``-704`` per range;
        a range past the value's end, or past a registered buffer's size, ``-600``.
        """
        _check_list(buffer_ptrs, "buffer_ptrs")
        shaped = [all_keys, all_dst_offsets, all_src_offsets, all_sizes]
        if any(len(_check_list(x, "a range list")) != len(buffer_ptrs) for x in shaped):
            return [[[INVALID_PARAMS]] for _ in buffer_ptrs]
        values = self._values(_check_keys([k for keys in all_keys for k in keys]))
        found = iter(values)
        with self._lock:
            registered = dict(self._registered)
        results: list[list[list[int]]] = []
        for b, ptr in enumerate(buffer_ptrs):
            capacity = registered.get(ptr)
            rows: list[list[int]] = []
            for k in range(len(all_keys[b])):
                value = next(found)
                dst, src, sizes = all_dst_offsets[b][k], all_src_offsets[b][k], all_sizes[b][k]
                if not len(dst) == len(src) == len(sizes):
                    rows.append([INVALID_PARAMS])
                    continue
                rows.append(
                    [
                        self._copy_range(value, ptr, capacity, d, s_, n)
                        for d, s_, n in zip(dst, src, sizes, strict=True)
                    ]
                )
            results.append(rows)
        return results

    @staticmethod
    def _copy_range(
        value: bytes | None, ptr: int, capacity: int | None, dst: int, src: int, size: int
    ) -> int:
        if value is None:
            return OBJECT_NOT_FOUND
        if not ptr or min(dst, src, size) < 0 or src + size > len(value):
            return INVALID_PARAMS
        if capacity is not None and dst + size > capacity:
            return INVALID_PARAMS
        ctypes.memmove(ptr + dst, memoryview(value)[src : src + size].tobytes(), size)
        return size

    # -- replicas --------------------------------------------------------------

    def batch_replica_clear(self, keys: list[str], segment_name: str = "") -> list[str]:
        """Remove keys whose lease has expired; the keys removed.

        The pool holds one copy, so clearing a key's replicas removes it.  As
        in Mooncake a key put or read through this handle less than
        :data:`LEASE_TTL_MS` ago is skipped, and so is a missing key.  A
        ``segment_name`` other than "" or this handle's host name names no
        replica here and clears nothing.
        """
        names = list(_check_list(keys, "keys"))
        if not isinstance(segment_name, str):
            raise TypeError(f"segment_name is a str, not {type(segment_name).__name__}")
        if segment_name not in ("", self._hostname) or not names:
            return []
        now = time.monotonic()
        with self._lock:
            leased = {k for k, t in self._leases.items() if now - t < self._lease_s}
        ks = _check_keys(names)
        todo = [(n, k) for n, k in zip(names, ks, strict=True) if k is not None and k not in leased]
        codes = self._remove([k for _, k in todo])
        return [n for (n, _), c in zip(todo, codes, strict=True) if c == OK]


def _raw_view(address: int, size: int) -> memoryview:
    """A view of ``size`` bytes at a caller's address (as Mooncake, the caller vouches for it)."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")
