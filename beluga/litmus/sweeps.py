"""Crash sweeps: every state one write passes through, read from another host.

A sweep looks at the states *inside* one call, which no handshake can hold
open: a writer replaces one published twin by the other while its host is
set to crash (the model's ``crash_after``) once k of its writes have landed,
for every k, and a second host reads the block left behind.  Any state a
concurrent reader could catch is one of those, so a write whose payload can
land after its PUBLISHED header is caught by the seqlock alone, whatever the
timing (``SWEEPS``, :func:`run_sweep`):

``publish``        ``Memory.publish`` (WRITING, payload, PUBLISHED)
``in_place``       ``begin_write``, the payload's own unfenced stores, ``seal``
``write_blocks``   ``begin_write``, then ``write_blocks`` (payload and seal in one call)

:func:`sweep_crashes` is the same loop for any write and any look.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable

from beluga.coherence import Memory, ModelConfig, attach, parse_header, read_line
from beluga.litmus.area import AREA_BYTES, BLOCK_BYTES, BLOCK_HDR
from beluga.litmus.outcome import LitmusResult, Seen, Tally, judge
from beluga.litmus.twins import TWIN_KEY, crc_twins, twin_block

#: twins that fit the model's write-combining queue, so that every order of their lines can land
SWEEP_TWINS = crc_twins(1024)

#: one write of a sweep: (mem, base, version) replaces the twin block by ``version``
SweepWrite = Callable[[Memory, int, int], None]
#: one look at a sweep's state: attempt(k) -> (what was seen, writes that landed)
Attempt = Callable[[int | None], tuple[Seen, int]]


def _sweep_twin_of(version: int) -> bytes:
    return SWEEP_TWINS[version % 2]


def replace_by_publish(mem: Memory, base: int, version: int) -> None:
    mem.publish(*twin_block(base), TWIN_KEY, version, _sweep_twin_of(version))


def replace_in_place(mem: Memory, base: int, version: int) -> None:
    hdr, payload = twin_block(base)
    data = _sweep_twin_of(version)
    mem.begin_write(hdr, payload, TWIN_KEY, version, len(data))
    mem.nt_store(payload, data)  # the caller's own stores, unfenced: seal orders them
    mem.seal(hdr, payload, TWIN_KEY, version, len(data))


def replace_by_write_blocks(mem: Memory, base: int, version: int) -> None:
    hdr, payload = twin_block(base)
    data = _sweep_twin_of(version)
    mem.begin_write(hdr, payload, TWIN_KEY, version, len(data))
    rows = memoryview(struct.pack("<4Q", 0, 0, payload, len(data))).cast("Q")
    mem.write_blocks([data], rows, [(hdr, payload, TWIN_KEY, version, len(data), 0, 0, 0)])


SWEEPS: dict[str, SweepWrite] = {
    "publish": replace_by_publish,
    "in_place": replace_in_place,
    "write_blocks": replace_by_write_blocks,
}


def sweep_crashes(attempt: Attempt, *, last: int | None = None, name: str = "") -> LitmusResult:
    """Look at every state a write passes through: ``attempt(k)`` rebuilds the scene,
    lets the writer's host crash once ``k`` of its writes landed (``None``: never),
    looks from another host and returns what it saw and how many writes landed.

    The same seed replays the same write, so state k is a prefix of state k + 1;
    ``last`` limits the sweep to the final states of a long write.
    """
    tally = Tally(name)
    _sweep_into(tally, attempt, last)
    return tally.result()


def _sweep_into(tally: Tally, attempt: Attempt, last: int | None) -> None:
    seen, total = attempt(None)
    tally.add(seen)
    for k in range(0 if last is None else max(0, total - last), total):
        tally.add(attempt(k)[0])


def run_sweep(name: str, model: ModelConfig, seeds: range = range(8)) -> LitmusResult:
    """Sweep ``SWEEPS[name]`` over every crash point, for each writer seed.

    Every state must read as a miss (``raced``) or as the whole twin of the
    version its header names (``confirmed``); anything else is a violation.
    """
    if name not in SWEEPS:
        raise ValueError(f"unknown sweep {name!r}; choose from {sorted(SWEEPS)}")
    write, tally = SWEEPS[name], Tally(name)
    for seed in seeds:

        def attempt(k: int | None, seed: int = seed) -> tuple[Seen, int]:
            shared = bytearray(AREA_BYTES)
            writer = attach(shared, "model", dataclasses.replace(model, seed=seed))
            write(writer, 0, 1)  # the published version the next write replaces
            landed = writer.model_stats()["landed"]
            if k is not None:
                writer.crash_after(k)
            write(writer, 0, 2)
            landed = writer.model_stats()["landed"] - landed
            reader = attach(shared, "model", dataclasses.replace(model, seed=seed + 1000))
            h = parse_header(read_line(reader, BLOCK_HDR))
            out = bytearray(BLOCK_BYTES)
            n = reader.read_validated(*twin_block(0), BLOCK_BYTES, TWIN_KEY, 0, out)
            if n < 0 or h is None:
                return Seen.RACED, landed
            return judge(bytes(out[:n]) == _sweep_twin_of(h.version)), landed

        _sweep_into(tally, attempt, None)
    return tally.result()
