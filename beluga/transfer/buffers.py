"""Caller memory on one side of the data path: what ``KVStore.save`` reads and ``load`` fills.

The store runs the block protocol (reserve, move, seal, commit; locate,
check, move with the checksum fused, check again) and asks the caller's
side only one thing: for the values it is about to move, the buffers and
the scatter-gather table (rows of buffer index, buffer offset, pool offset,
length) that join caller memory to their pool payloads.  Anything that
answers that is a :class:`Values`:

:class:`Buffers`
    one buffer per value (bytes, numpy arrays, CPU tensors, ``(address,
    size)`` pairs): the put / get of plain values.
:class:`Pieces`
    each value the concatenation of several buffers, in order: pages made
    of scattered pieces (SGLang's host pages), a header beside its payload
    (LMCache's chunks).
``beluga.transfer.datapath.EngineBlocks``
    whole engine blocks of a paged KV cache (vLLM's, a Hugging Face
    model's), on the CPU or, through a ``GpuPool``, on a GPU.

A value's length is part of what it promises: a save stores exactly
``lengths()[i]`` bytes under key ``i``, and a load accepts a pool value only
if its length is exactly that (anything else is a miss, as a torn read is).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from beluga.coherence import Memory


def as_buffer(obj: Any, writable: bool = False) -> memoryview:
    """A flat byte view of a value without copying it.

    Takes anything with the buffer protocol (bytes, bytearray, memoryview,
    numpy arrays), contiguous CPU torch tensors of any dtype, and raw
    ``(address, size)`` pairs.
    """
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(x, int) for x in obj):
        address, size = obj
        if address <= 0 or size < 0:
            raise ValueError(f"a raw buffer is (address > 0, size >= 0), not {obj}")
        return memoryview((ctypes.c_char * size).from_address(address)).cast("B")
    if type(obj).__module__.startswith("torch"):
        if obj.device.type != "cpu" or not obj.is_contiguous():
            raise ValueError("a torch tensor value must be a contiguous CPU tensor")
        import torch

        obj = obj.reshape(-1).view(torch.uint8).numpy()
    try:
        view = memoryview(obj)
    except TypeError:
        raise ValueError(
            f"a value must support the buffer protocol, not {type(obj).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError("a value buffer must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("reading into a buffer needs a writable one, not a read-only view")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class Place(Protocol):
    """Where one value goes in the pool, or comes from (``KVStore``'s ``BlockRef``)."""

    @property
    def payload_offset(self) -> int: ...

    @property
    def capacity(self) -> int:
        """Bytes of its extent (whole pool blocks)."""
        ...


class Values(Protocol):
    """A batch of values in caller memory, one per key: a save's source or a load's sink.

    ``mover`` is None when the memory is host memory (the pool's ``Memory``
    moves it with one C call), or the ``GpuPool`` whose kernel moves it.
    """

    mover: Any

    def lengths(self) -> Sequence[int]:
        """Each value's bytes, in key order."""
        ...

    def moves(
        self, mem: Memory, chosen: Sequence[int], places: Sequence[Place], *, write: bool
    ) -> tuple[list[Any], np.ndarray]:
        """Buffers and table moving values ``chosen`` (positions) to or from their pool
        blocks (``places``, one per chosen value) in the pool mapped by ``mem``; checked,
        so the table moves nothing but what was asked."""
        ...


class Pieces:
    """Values made of pieces: value ``i`` is ``pieces[i][0] + pieces[i][1] + ...``.

    Each piece is anything :func:`as_buffer` takes.  As a sink the pieces
    must be writable.  Not thread-safe while a save or load uses it (the
    caller's memory is being moved); nothing to say about fork.
    """

    mover: Any = None

    def __init__(self, pieces: Sequence[Sequence[Any]]) -> None:
        self._pieces = [list(p) for p in pieces]
        self._views: list[list[memoryview]] | None = None
        self._writable = False

    def _buffers(self, writable: bool) -> list[list[memoryview]]:
        if self._views is None or (writable and not self._writable):
            self._views = [[as_buffer(b, writable) for b in p] for p in self._pieces]
            self._writable = writable
        return self._views

    def lengths(self) -> list[int]:
        return [sum(len(v) for v in value) for value in self._buffers(False)]

    def moves(
        self, mem: Memory, chosen: Sequence[int], places: Sequence[Place], *, write: bool
    ) -> tuple[list[Any], np.ndarray]:
        size = mem.size
        views = self._buffers(not write)
        if len(chosen) != len(places):
            raise ValueError(f"{len(chosen)} values but {len(places)} pool blocks")
        buffers: list[Any] = []
        rows: list[tuple[int, int, int, int]] = []
        for i, place in zip(chosen, places, strict=True):
            offset = place.payload_offset
            total = sum(len(v) for v in views[i])
            if offset < 0 or offset + total > size:
                raise ValueError(
                    f"pool offset {offset} + {total} bytes is outside the {size}-byte pool"
                )
            for view in views[i]:
                if len(view):
                    rows.append((len(buffers), 0, offset, len(view)))
                    buffers.append(view)
                offset += len(view)
        return buffers, np.array(rows, dtype=np.uint64).reshape(-1, 4)


class Buffers(Pieces):
    """One buffer per value (anything :func:`as_buffer` takes); see :class:`Pieces`."""

    def __init__(self, values: Sequence[Any]) -> None:
        super().__init__([[v] for v in values])
