"""Tensors' stored form in the drop-in: a small self-describing header, then the bytes.

The header is Beluga's own (magic, format version, dtype code, shape), not
Mooncake's; :func:`decode_tensor` returns None for a value that is not one.
"""

from __future__ import annotations

import struct
from typing import Any

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


def encode_tensor(tensor: Any) -> bytes:
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


def decode_tensor(data: bytes) -> Any:
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


def is_tensor(obj: object) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "dtype")
