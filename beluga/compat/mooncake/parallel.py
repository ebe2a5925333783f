"""The drop-in's tensor-parallel forms: ``*_with_tp`` shards, ``*_with_parallelism`` wholes.

:class:`ParallelTensors` adds to :class:`~beluga.compat.mooncake.tensors.TensorStore`
Mooncake's ``*_with_tp`` forms, which split a tensor as Mooncake does (equal
parts along ``split_dim``, one key per rank), and the ``*_with_parallelism``
forms, which store and read whole tensors and refuse a parallelism request
(see the package docstring).
"""

from __future__ import annotations

from functools import partialmethod
from typing import Any

from beluga.compat.mooncake.checks import check_list, check_ranges
from beluga.compat.mooncake.codes import INVALID_PARAMS, OK
from beluga.compat.mooncake.core import log
from beluga.compat.mooncake.records import config_code
from beluga.compat.mooncake.tensor_format import is_tensor
from beluga.compat.mooncake.tensors import TensorStore


class ParallelTensors(TensorStore):
    """Mooncake's ``*_with_tp`` and ``*_with_parallelism`` forms, over the tensor forms.

    Uses from :class:`TensorStore`: ``_put_tensors``, ``_tensors_from``,
    ``_tensor_at`` and the public tensor forms.  Thread- and fork-safety: the
    core's.
    """

    # -- publishing shards: a tensor-parallel put with a replica config ---------

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
        return config_code(config) or self.put_tensor_with_tp(
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
        code = config_code(config)
        if code:
            return [code] * len(base_keys)
        return self.batch_put_tensor_with_tp(base_keys, tensors_list, tp_rank, tp_size, split_dim)

    # -- tensor parallelism: Mooncake's split, one key per rank -----------------

    @staticmethod
    def _shards(tensor: Any, tp_size: int, split_dim: int) -> list[Any] | None:
        """The tensor split as Mooncake splits it: equal parts along ``split_dim``, else None."""
        if not is_tensor(tensor) or tp_size < 1 or not -tensor.dim() <= split_dim < tensor.dim():
            return None
        if tensor.shape[split_dim] % tp_size:
            return None  # Mooncake refuses a dimension that tp_size does not divide (-600)
        return list(tensor.chunk(tp_size, split_dim))

    @staticmethod
    def _tp_key(key: str, rank: int, tp_size: int) -> str:
        return key if tp_size <= 1 else f"{key}_tp_{rank}"

    def _put_tp(
        self,
        replace: bool,
        base_keys: list[str],
        tensors_list: list[Any],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        """``batch_put_tensor_with_tp`` (``replace`` False): store each tensor's shards as
        :meth:`put_tensor_with_tp` does; one code per base key.  ``batch_upsert_tensor_with_tp``
        (``replace`` True): the same, replacing existing shards."""
        check_list(base_keys, "base_keys")
        if len(base_keys) != len(check_list(tensors_list, "tensors_list")):
            return [INVALID_PARAMS] * len(base_keys)
        codes = []
        for key, tensor in zip(base_keys, tensors_list, strict=True):
            shards = self._shards(tensor, tp_size, split_dim)
            if shards is None or len(shards) != tp_size:
                codes.append(INVALID_PARAMS)
                continue
            names = [self._tp_key(key, r, tp_size) for r in range(tp_size)]
            got = self._put_tensors(names, shards, replace)
            codes.append(next((c for c in got if c != OK), OK))
        return codes

    def _put_one_tp(
        self,
        replace: bool,
        key: str,
        tensor: Any,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> int:
        """``put_tensor_with_tp`` (``replace`` False): store each rank's shard of ``tensor``
        as ``{key}_tp_{rank}`` (``key`` if tp_size 1).  ``upsert_tensor_with_tp`` (``replace``
        True): the same, replacing existing shards."""
        return self._put_tp(replace, [key], [tensor], tp_rank, tp_size, split_dim)[0]

    # Mooncake's put and upsert forms of one signature: one body each, told apart by its
    # first argument, replace (bound here, so a caller passing it gets a TypeError)
    put_tensor_with_tp = partialmethod(_put_one_tp, False)
    upsert_tensor_with_tp = partialmethod(_put_one_tp, True)
    batch_put_tensor_with_tp = partialmethod(_put_tp, False)
    batch_upsert_tensor_with_tp = partialmethod(_put_tp, True)

    def get_tensor_with_tp(
        self, key: str, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> Any:
        """Rank ``tp_rank``'s shard stored by :meth:`put_tensor_with_tp`; None for a miss."""
        return self.batch_get_tensor_with_tp([key], tp_rank, tp_size)[0]

    def batch_get_tensor_with_tp(
        self, base_keys: list[str], tp_rank: int = 0, tp_size: int = 1
    ) -> list[Any]:
        """As :meth:`get_tensor_with_tp` for many base keys."""
        names = [self._tp_key(k, tp_rank, tp_size) for k in check_list(base_keys, "base_keys")]
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
        names = check_list(base_keys, "base_keys")
        addresses, lengths = check_ranges(buffer_ptrs, sizes)
        if not len(names) == len(addresses) == len(lengths):
            return [INVALID_PARAMS] * len(names)
        tensors = [self._tensor_at(a, n) for a, n in zip(addresses, lengths, strict=True)]
        return self._put_tp(False, names, tensors, tp_rank, tp_size, split_dim)

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
        names = [self._tp_key(k, tp_rank, tp_size) for k in check_list(base_keys, "base_keys")]
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

    def _put_whole(
        self,
        replace: bool,
        key: str,
        tensor: Any,
        parallelism: object = None,
        config: Any = None,
        writer_partition: object = None,
    ) -> int:
        """``put_tensor_with_parallelism`` (``replace`` False): as :meth:`pub_tensor` when no
        parallelism request is given; else ``-600``.  ``upsert_tensor_with_parallelism``
        (``replace`` True): as :meth:`upsert_pub_tensor`, likewise."""
        form = f"{'upsert' if replace else 'put'}_tensor_with_parallelism"
        if not self._whole(form, parallelism, writer_partition):
            return INVALID_PARAMS
        return (self.upsert_pub_tensor if replace else self.pub_tensor)(key, tensor, config)

    def _put_wholes(
        self,
        replace: bool,
        keys: list[str],
        tensors_list: list[Any],
        parallelisms: object = None,
        config: Any = None,
        writer_partitions: object = None,
    ) -> list[int]:
        """``batch_put_tensor_with_parallelism`` (``replace`` False): as
        :meth:`batch_pub_tensor` when no parallelism requests are given; else ``-600`` each.
        ``batch_upsert_tensor_with_parallelism`` (``replace`` True): as
        :meth:`batch_upsert_pub_tensor`, likewise."""
        form = f"batch_{'upsert' if replace else 'put'}_tensor_with_parallelism"
        if not self._whole(form, parallelisms, writer_partitions):
            return [INVALID_PARAMS] * len(keys)
        publish = self.batch_upsert_pub_tensor if replace else self.batch_pub_tensor
        return publish(keys, tensors_list, config)

    def _put_whole_from(
        self,
        replace: bool,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: object = None,
        config: Any = None,
        writer_partition: object = None,
    ) -> int:
        """``put_tensor_with_parallelism_from`` (``replace`` False): as
        :meth:`put_tensor_from` when no parallelism request is given; else ``-600``.
        ``upsert_tensor_with_parallelism_from`` (``replace`` True): as
        :meth:`upsert_tensor_from`, likewise."""
        form = f"{'upsert' if replace else 'put'}_tensor_with_parallelism_from"
        requests = (parallelism, writer_partition)
        return self._whole_from(form, [key], [buffer_ptr], [size], requests, config, replace)[0]

    def _put_wholes_from(
        self,
        replace: bool,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        parallelisms: object = None,
        config: Any = None,
        writer_partitions: object = None,
    ) -> list[int]:
        """``batch_put_tensor_with_parallelism_from`` (``replace`` False): as
        :meth:`batch_put_tensor_from` when no parallelism requests are given.
        ``batch_upsert_tensor_with_parallelism_from`` (``replace`` True): as
        :meth:`batch_upsert_tensor_from`, likewise."""
        form = f"batch_{'upsert' if replace else 'put'}_tensor_with_parallelism_from"
        requests = (parallelisms, writer_partitions)
        return self._whole_from(form, keys, buffer_ptrs, sizes, requests, config, replace)

    # Mooncake's put and upsert forms of one signature: one body each, told apart by its
    # first argument, replace (bound here, so a caller passing it gets a TypeError)
    put_tensor_with_parallelism = partialmethod(_put_whole, False)
    upsert_tensor_with_parallelism = partialmethod(_put_whole, True)
    batch_put_tensor_with_parallelism = partialmethod(_put_wholes, False)
    batch_upsert_tensor_with_parallelism = partialmethod(_put_wholes, True)
    put_tensor_with_parallelism_from = partialmethod(_put_whole_from, False)
    upsert_tensor_with_parallelism_from = partialmethod(_put_whole_from, True)
    batch_put_tensor_with_parallelism_from = partialmethod(_put_wholes_from, False)
    batch_upsert_tensor_with_parallelism_from = partialmethod(_put_wholes_from, True)

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
        if not self._whole(form, *requests) or config_code(config):
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
