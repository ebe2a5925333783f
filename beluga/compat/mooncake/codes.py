"""Mooncake's status codes and enums, with Mooncake's names and values.

Mooncake exports its enums' values at module level too; so does this module,
and the package re-exports them (``from mooncake.store import KVCACHE`` works
on the drop-in).  Where two enums share a name (FAILED, PROCESSING) the
module-level value is TaskStatus's, as in Mooncake.
"""

from __future__ import annotations

import enum


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


UNKNOWN, KVCACHE, TENSOR, WEIGHT, SAMPLE = list(ObjectDataType)[:5]
ACTIVATION, GRADIENT, OPTIMIZER_STATE, METADATA, GENERAL = list(ObjectDataType)[5:]
UNDEFINED, INITIALIZED, COMPLETE, REMOVED = (
    ReplicaStatus.UNDEFINED, ReplicaStatus.INITIALIZED, ReplicaStatus.COMPLETE,
    ReplicaStatus.REMOVED,
)  # fmt: skip
PENDING, PROCESSING, FAILED, SUCCESS = list(TaskStatus)
REPLICA_COPY, REPLICA_MOVE = list(TaskType)
