"""The drop-in's values in pieces: put and get sessions, multi-buffer values, ranged reads.

:class:`RangedAccess` adds to :class:`~beluga.compat.mooncake.objects.ObjectStore`
Mooncake's forms that assemble one value from several buffers or ranges (put
sessions, ``batch_put_from_multi_buffers``, ``put_from_with_metadata``) and
that read a value into several buffers or in ranges (get sessions,
``batch_get_into_multi_buffers``, ``get_into_ranges``).
"""

from __future__ import annotations

import ctypes
from typing import Any

from beluga.compat.mooncake.checks import (
    check_count,
    check_keys,
    check_list,
    check_ranges,
    raw_view,
)
from beluga.compat.mooncake.codes import INVALID_PARAMS, OBJECT_NOT_FOUND, OK
from beluga.compat.mooncake.objects import ObjectStore
from beluga.compat.mooncake.records import config_code


class RangedAccess(ObjectStore):
    """Mooncake's session, multi-buffer and ranged forms.

    Uses from :class:`StoreCore`: ``_put_many``, ``_values`` and the tables
    ``_lock``, ``_store``, ``_put_sessions``, ``_get_sessions`` and
    ``_registered``; from :class:`ObjectStore`: ``batch_is_exist``.  Thread-
    and fork-safety: the core's.
    """

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
        names = check_list(keys, "keys")
        lengths = [check_count(n, "a size") for n in check_list(sizes, "sizes")]
        if len(names) != len(lengths) or config_code(config):
            return [INVALID_PARAMS] * len(names)
        ks = check_keys(names)
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
        names = check_list(keys, "keys")
        shaped = [check_list(x, "a range list") for x in (all_buffer_ptrs, all_sizes,
                                                           all_dst_offsets)]  # fmt: skip
        if any(len(x) != len(names) for x in shaped):
            return [INVALID_PARAMS] * len(names)
        codes = []
        for name, ptrs, sizes, offsets in zip(names, *shaped, strict=True):
            with self._lock:
                target = self._put_sessions.get(name)
            addresses, lengths = check_ranges(ptrs, sizes)
            starts = [check_count(o, "an offset") for o in check_list(offsets, "offsets")]
            if (
                target is None
                or not len(addresses) == len(lengths) == len(starts)
                or not all(addresses)
                or any(o + n > len(target) for o, n in zip(starts, lengths, strict=True))
            ):
                codes.append(INVALID_PARAMS)
                continue
            for a, n, o in zip(addresses, lengths, starts, strict=True):
                target[o : o + n] = raw_view(a, n)
            codes.append(sum(lengths))
        return codes

    def batch_put_session_end(self, keys: list[str]) -> list[int]:
        """Store each session's object (one write for the batch) and close the session; a
        code per key (``-600`` without a session)."""
        names = check_list(keys, "keys")
        with self._lock:
            objects = [self._put_sessions.pop(n, None) for n in names]
        done = [(n, o) for n, o in zip(names, objects, strict=True) if o is not None]
        stored = iter(
            self._put_many(
                [n for n, _ in done],
                check_keys([n for n, _ in done]),
                [bytes(o) for _, o in done],
                replace=False,
            )
            if done
            else []
        )
        return [INVALID_PARAMS if o is None else next(stored) for o in objects]

    def batch_put_session_revoke(self, keys: list[str]) -> list[int]:
        """Close put sessions storing nothing; 0 per key, ``-600`` without a session."""
        names = check_list(keys, "keys")
        with self._lock:
            return [OK if self._put_sessions.pop(n, None) is not None else INVALID_PARAMS
                    for n in names]  # fmt: skip

    def batch_get_session_start(self, keys: list[str]) -> list[int]:
        """Open a get session per stored key; 0, or ``-704`` for a missing key."""
        names = check_list(keys, "keys")
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
        names = check_list(keys, "keys")
        shaped = [check_list(x, "a range list") for x in (all_buffer_ptrs, all_sizes,
                                                           all_src_offsets)]  # fmt: skip
        if any(len(x) != len(names) for x in shaped):
            return [INVALID_PARAMS] * len(names)
        with self._lock:
            open_ = [n in self._get_sessions for n in names]
        values = self._values(check_keys([n for n, o in zip(names, open_, strict=True) if o]))
        found = iter(values)
        codes = []
        for is_open, ptrs, sizes, offsets in zip(open_, *shaped, strict=True):
            value = next(found) if is_open else None
            addresses, lengths = check_ranges(ptrs, sizes)
            starts = [check_count(o, "an offset") for o in check_list(offsets, "offsets")]
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
                    raw_view(a, n)[:] = value[o : o + n]
                codes.append(sum(lengths))
        return codes

    def batch_get_session_end(self, keys: list[str]) -> int:
        """Close get sessions; 0."""
        with self._lock:
            self._get_sessions.difference_update(check_list(keys, "keys"))
        return OK

    # -- multi-buffer values: one value gathered from (scattered into) buffers --

    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        config: Any = None,
    ) -> list[int]:
        """Store each key's value gathered from its buffers, in order; one code per key."""
        names = check_list(keys, "keys")
        ranges = self._multi(names, all_buffer_ptrs, all_sizes)
        if ranges is None or config_code(config):
            return [INVALID_PARAMS] * len(names)
        values = [
            None if r is None else b"".join(bytes(raw_view(a, n)) for a, n in r) for r in ranges
        ]
        return self._put_many(names, check_keys(names), values, replace=False)

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
        names = check_list(keys, "keys")
        ranges = self._multi(names, all_buffer_ptrs, all_sizes)
        if ranges is None:
            return [INVALID_PARAMS] * len(names)
        values = self._values(check_keys(names))
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
                raw_view(a, n)[:] = value[at : at + n]
                at += n
            codes.append(len(value))
        return codes

    @staticmethod
    def _multi(
        names: list[Any], all_ptrs: object, all_sizes: object
    ) -> list[list[tuple[int, int]] | None] | None:
        """Each key's (address, size) buffers (None for a key with a null or unequal list);
        None when the lists do not match the keys."""
        ptrs, sizes = check_list(all_ptrs, "all_buffer_ptrs"), check_list(all_sizes, "all_sizes")
        if not len(names) == len(ptrs) == len(sizes):
            return None
        out: list[list[tuple[int, int]] | None] = []
        for p, n in zip(ptrs, sizes, strict=True):
            addresses, lengths = check_ranges(p, n)
            ok = len(addresses) == len(lengths) and addresses and all(addresses)
            out.append(list(zip(addresses, lengths, strict=True)) if ok else None)
        return out

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
        (data, meta), (n, m) = check_ranges(
            [buffer_ptr, metadata_buffer_ptr], [size, metadata_size]
        )
        if not data or not meta or config_code(config):
            return INVALID_PARAMS
        value = bytes(raw_view(meta, m)) + bytes(raw_view(data, n))
        names = [key]
        return self._put_many(names, check_keys(names), [value], replace=False)[0]

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
        check_list(buffer_ptrs, "buffer_ptrs")
        shaped = [all_keys, all_dst_offsets, all_src_offsets, all_sizes]
        if any(len(check_list(x, "a range list")) != len(buffer_ptrs) for x in shaped):
            return [[[INVALID_PARAMS]] for _ in buffer_ptrs]
        values = self._values(check_keys([k for keys in all_keys for k in keys]))
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
