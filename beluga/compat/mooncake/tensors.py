"""The drop-in's tensor forms: Mooncake's tensor puts and gets, publishing, safetensors.

:class:`TensorStore` adds to :class:`~beluga.compat.mooncake.objects.ObjectStore`
the forms that store and read torch tensors (dtype and shape kept, in the
stored form of :mod:`beluga.compat.mooncake.tensor_format`), from and into
buffers, the ``pub_*`` forms (a put with a replica config) and safetensors
files.
"""

from __future__ import annotations

from functools import partialmethod
from typing import Any

from beluga.compat.mooncake.checks import check_keys, check_list, check_ranges, raw_view
from beluga.compat.mooncake.codes import (
    FILE_NOT_FOUND,
    FILE_WRITE_FAIL,
    INVALID_PARAMS,
    OK,
)
from beluga.compat.mooncake.core import log
from beluga.compat.mooncake.objects import ObjectStore
from beluga.compat.mooncake.records import config_code
from beluga.compat.mooncake.tensor_format import decode_tensor, encode_tensor, is_tensor


class TensorStore(ObjectStore):
    """Mooncake's tensor forms, over the core's batch steps and the byte forms.

    Uses from :class:`StoreCore`: ``_put_many`` and ``_values``; from
    :class:`ObjectStore`: ``batch_get_into`` and ``put_from``.  Thread- and
    fork-safety: the core's.
    """

    def _put_tensors(self, keys: object, tensors: object, replace: bool) -> list[int]:
        names = check_list(keys, "keys")
        ks = check_keys(names)
        items = check_list(tensors, "tensors_list")
        if len(ks) != len(items):
            return [INVALID_PARAMS] * len(ks)
        values: list[bytes | None] = []
        for t in items:
            try:
                values.append(encode_tensor(t) if is_tensor(t) else None)
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
        return [None if v is None else decode_tensor(v) for v in self._values(check_keys(keys))]

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
            None if n < 0 else decode_tensor(bytes(raw_view(a, n)))
            for a, n in zip(buffer_ptrs, codes, strict=True)
        ]

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Store a tensor's stored form found at ``buffer_ptr``; ``-600`` if it is not one."""
        (address,), (length,) = check_ranges([buffer_ptr], [size])
        if not address or decode_tensor(bytes(raw_view(address, length))) is None:
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
        names = check_list(keys, "keys")
        addresses, lengths = check_ranges(ptrs, sizes)
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
        return None if not address else decode_tensor(bytes(raw_view(address, length)))

    # -- publishing: a put with a replica config, which names no placement here --

    def _publish(self, replace: bool, key: str, tensor: Any, config: Any = None) -> int:
        """``pub_tensor`` (``replace`` False): as :meth:`put_tensor`, with ``config`` checked
        as :meth:`put` checks it.  ``upsert_pub_tensor`` (``replace`` True): as
        :meth:`upsert_tensor`, likewise."""
        return config_code(config) or self._put_tensors([key], [tensor], replace)[0]

    def _publish_batch(
        self, replace: bool, keys: list[str], tensors_list: list[Any], config: Any = None
    ) -> list[int]:
        """``batch_pub_tensor`` (``replace`` False): as :meth:`batch_put_tensor`, with a
        replica config.  ``batch_upsert_pub_tensor`` (``replace`` True): as
        :meth:`batch_upsert_tensor`, likewise."""
        code = config_code(config)
        return [code] * len(keys) if code else self._put_tensors(keys, tensors_list, replace)

    # Mooncake's put and upsert forms of one signature: one body each, told apart by its
    # first argument, replace (bound here, so a caller passing it gets a TypeError)
    pub_tensor = partialmethod(_publish, False)
    upsert_pub_tensor = partialmethod(_publish, True)
    batch_pub_tensor = partialmethod(_publish_batch, False)
    batch_upsert_pub_tensor = partialmethod(_publish_batch, True)

    # -- safetensors files ----------------------------------------------------

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
