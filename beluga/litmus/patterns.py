"""Coherence litmus tests: small programs that either catch a bug or prove a recipe.

Each pattern is a writer and an observer running on different hosts (processes
here; machines in the lab) over a few lines of one pool.  The *buggy* patterns
each leave out one step of the recipe and must be caught (a stale, lost or
foreign value observed) within a bounded number of trials whenever the hosts
are not hardware-coherent: always under the ``model`` coherence mode, and on
real CXL.  The *correct* patterns must never be caught.  On one coherent
machine in ``native`` mode nothing is ever caught, which is exactly why CI runs
these under the model.

Patterns (``bug`` ones first), by what the writer and the observer do:

``no_flush``            writer stores the data and never flushes it
``no_invalidate``       reader loads the data without invalidating its copy
``flag_before_data``    writer publishes the flag, then flushes the data
``shared_line``         two writers each own half of one cache line
``nt_no_fence``         writer streams data and flag with no SFENCE between
``flush_no_fence``      writer flushes the data, no SFENCE before the flag
``poll_no_invalidate``  reader polls the flag with plain loads: a hot line
                        stays cached, so it never sees the flag
``invalidate_no_fence`` reader invalidates the data and loads it, no MFENCE
``invalidate_early``    reader invalidates the data before the flag says it
                        is there (a speculative refill brings back old data)
``dekker_no_mfence``    two hosts each raise a flag, then read the other's
                        with SFENCE where MFENCE belongs: both get in
``twins_header_first``  block with two payloads of one CRC32C: header
                        PUBLISHED before the payload is written
``twins_no_writing``    ... payload rewritten in place without the WRITING header
``twins_no_recheck``    ... reader does not re-check the header after its copy
``flush``               store + flush + fence, then the flag          (correct)
``invalidate``          reader invalidates and MFENCEs before loading (correct)
``separate_lines``      two writers, each in its own line             (correct)
``poll_invalidate``     reader polls with invalidate + MFENCE         (correct)
``dekker``              raise own flag, MFENCE, read the other's      (correct)
``publish``             the block protocol: publish / read_validated  (correct)
``crc_twins``           the block protocol over two equal-CRC payloads (correct)
``twins_recheck``       a reader that re-checks the header             (correct)

The equal-CRC ("twins") payloads differ only inside one cache line, so any
mixture of the two that a reader could copy is one of them and its checksum
matches: there only the seqlock of the block header stands between a reader
and another version's bytes.

Crash sweeps (``SWEEPS``, :func:`run_sweep`) look at the states *inside* one
call instead, which no handshake can hold open: a writer replaces one
published twin by the other while its host is set to crash (the model's
``crash_after``) once k of its writes have landed, for every k, and a second
host reads the block left behind.  Any state a concurrent reader could catch
is one of those, so a write whose payload can land after its PUBLISHED
header is caught by the seqlock alone, whatever the timing:

``publish``        ``Memory.publish`` (WRITING, payload, PUBLISHED)
``in_place``       ``begin_write``, the payload's own unfenced stores, ``seal``
``write_blocks``   ``begin_write``, then ``write_blocks`` (payload and seal in one call)

:func:`sweep_crashes` is the same loop for any write and any look.

The harness synchronises trials through control lines, each written by one
role only, with the correct recipe (``write_line`` / ``read_line``), so the
harness itself is immune to the bugs it tests for.  Every wait has a timeout.
An observation says whether it saw a wrong value, a right one, and whether it
hit the racy window (the writer caught mid-way), so a test can check that the
window it is about really occurred.
"""

from __future__ import annotations

import dataclasses
import enum
import multiprocessing as mp
import random
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from beluga.child import stop_process, wait_until
from beluga.coherence import (
    LINE,
    BlockState,
    Memory,
    ModelConfig,
    attach,
    crc32c,
    digest,
    parse_header,
    read_line,
    write_line,
)
from beluga.errors import CoherenceError
from beluga.pool import Pool

_U64 = struct.Struct("<Q")
_CTRL = struct.Struct("<QQ")  # trial, flags

# Line offsets inside the litmus area (relative to its base).
CTRL_OBSERVER, CTRL_WRITER, CTRL_WRITER_B, FLAG, DATA, FLAG_B, SEEN_A, SEEN_B = (
    i * LINE for i in range(8)
)
BLOCK_HDR, BLOCK_PAYLOAD = 8 * LINE, 16 * LINE
# Handshakes of the concurrent patterns, so that a racy window is always hit:
LOOKS = 12 * LINE  # observer: how many looks it has finished
WINDOW = 13 * LINE  # observer: the last window it opened and waits in
WINDOW_DONE = 14 * LINE  # writer: the last window it has written in
BLOCK_BYTES = 4096
AREA_BYTES = BLOCK_PAYLOAD + 4 * BLOCK_BYTES
STOP = 1
#: plain polls of a flag after its writer said it is out, before the reader is judged stale
POLL_BOUND = 2000


class Seen(enum.IntFlag):
    """What one observation found."""

    NOTHING = 0
    WRONG = 1  # a stale, lost or foreign value: the violation a bug pattern must show
    RIGHT = 2  # a value observed and correct
    RACED = 4  # the writer was caught mid-way (a reader refusing a torn block, two flags crossing)


def value(trial: int, salt: int = 0) -> int:
    """A distinct nonzero 64-bit value per trial (and per writer)."""
    return ((trial + 1) * 0x9E3779B97F4A7C15 + salt * 0xC2B2AE3D27D4EB4F) & (2**64 - 1) | 1


def _judge(ok: bool) -> Seen:
    return Seen.RIGHT if ok else Seen.WRONG


class Channel:
    """The control lines of one litmus area, seen from one role."""

    def __init__(
        self, mem: Memory, base: int, timeout: float, pause: float = 0.0005, trials: int = 0
    ) -> None:
        self.mem, self.base, self.timeout, self.pause = mem, base, timeout, pause
        self.trials = trials

    def post(self, line: int, trial: int, flags: int = 0) -> None:
        write_line(self.mem, self.base + line, _CTRL.pack(trial, flags).ljust(LINE, b"\0"))

    def peek(self, line: int) -> tuple[int, int]:
        trial, flags = _CTRL.unpack_from(read_line(self.mem, self.base + line))
        return trial, flags

    def wait(self, line: int, trial: int) -> int:
        """Wait until a control line reaches ``trial`` (or STOP); returns its flags."""
        last = (0, 0)

        def reached() -> bool:
            nonlocal last
            last = self.peek(line)
            return last[0] >= trial or bool(last[1] & STOP)

        wait_until(
            reached,
            self.timeout,
            lambda: (
                f"litmus peer did not reach trial {trial} within {self.timeout} s "
                f"(control line {line // LINE} at trial {last[0]}); is the other host running?"
            ),
            error=CoherenceError,
        )
        return last[1]

    def hold_window(self) -> None:
        """Writer: keep the current state until the observer has made a whole look at it."""
        start = self.peek(LOOKS)[0]
        self.wait(LOOKS, start + 2)

    def written_in(self, window: int) -> None:
        """Observer: open a window and wait until the writer wrote in it (or has finished)."""
        self.post(WINDOW, window)
        wait_until(
            lambda: self.peek(WINDOW_DONE)[0] >= window or self.peek(CTRL_WRITER)[0] >= self.trials,
            self.timeout,
            f"litmus writer never wrote in window {window}",
            error=CoherenceError,
        )


def _store_word(mem: Memory, off: int, v: int) -> None:
    mem.store(off, _U64.pack(v))


def _load_word(mem: Memory, off: int) -> int:
    return _U64.unpack(mem.load(off, 8))[0]


def _fresh_word(mem: Memory, off: int) -> int:
    mem.invalidate(off, 8)
    mem.mfence()
    return _load_word(mem, off)


def _word_line(v: int) -> bytes:
    return _U64.pack(v).ljust(LINE, b"\0")


# --- writers: (mem, base, trial, channel) ----------------------------------


def _w_no_flush(mem: Memory, b: int, t: int, ch: Channel) -> None:
    _store_word(mem, b + DATA, value(t))
    mem.sfence()
    write_line(mem, b + FLAG, _word_line(t + 1))


def _w_flush(mem: Memory, b: int, t: int, ch: Channel) -> None:
    _store_word(mem, b + DATA, value(t))
    mem.flush(b + DATA, 8)
    mem.sfence()
    time.sleep(ch.pause)
    write_line(mem, b + FLAG, _word_line(t + 1))


def _w_nt(mem: Memory, b: int, t: int, ch: Channel) -> None:
    mem.nt_store(b + DATA, _U64.pack(value(t)))
    mem.sfence()
    write_line(mem, b + FLAG, _word_line(t + 1))


def _w_nt_late(mem: Memory, b: int, t: int, ch: Channel) -> None:
    time.sleep(ch.pause)  # the reader gets ahead of the data
    _w_nt(mem, b, t, ch)


def _w_flag_first(mem: Memory, b: int, t: int, ch: Channel) -> None:
    _store_word(mem, b + DATA, value(t))
    write_line(mem, b + FLAG, _word_line(t + 1))
    time.sleep(ch.pause)
    mem.flush(b + DATA, 8)
    mem.sfence()


def _w_nt_no_fence(mem: Memory, b: int, t: int, ch: Channel) -> None:
    mem.nt_store(b + DATA, _U64.pack(value(t)))
    mem.nt_store(b + FLAG, _word_line(t + 1))  # no SFENCE between data and flag
    time.sleep(ch.pause)
    mem.sfence()


def _w_flush_no_fence(mem: Memory, b: int, t: int, ch: Channel) -> None:
    _store_word(mem, b + DATA, value(t))
    mem.flush(b + DATA, 8)
    mem.nt_store(b + FLAG, _word_line(t + 1))  # the flush has not completed: no SFENCE
    time.sleep(ch.pause)
    mem.sfence()


def _half_writer(offset: int, salt: int) -> Callable[[Memory, int, int, Channel], None]:
    def write(mem: Memory, b: int, t: int, ch: Channel) -> None:
        _store_word(mem, b + offset, value(t, salt))
        time.sleep(ch.pause)
        mem.flush(b + offset, 8)
        mem.sfence()

    return write


def _dekker_host(
    mine: int, theirs: int, seen: int, fence: Callable[[Memory], None]
) -> Callable[[Memory, int, int, Channel], None]:
    """One side of a Dekker handshake: raise my flag, then look at the other's."""

    def write(mem: Memory, b: int, t: int, ch: Channel) -> None:
        write_line(mem, b + mine, _word_line(t + 1))
        time.sleep(ch.pause)  # let the other host raise its flag meanwhile
        mem.invalidate(b + theirs, 8)
        fence(mem)
        write_line(mem, b + seen, _word_line(_load_word(mem, b + theirs)))

    return write


# --- observers: (mem, base, trial, channel) -> Seen -------------------------


def _wait_flag(mem: Memory, b: int, t: int, ch: Channel) -> None:
    deadline = time.monotonic() + ch.timeout
    while _U64.unpack_from(read_line(mem, b + FLAG))[0] < t + 1:
        if time.monotonic() > deadline:
            raise CoherenceError(f"litmus writer never raised the flag for trial {t}")


def _o_invalidate(mem: Memory, b: int, t: int, ch: Channel) -> Seen:
    _wait_flag(mem, b, t, ch)
    return _judge(_fresh_word(mem, b + DATA) == value(t))


def _o_no_invalidate(mem: Memory, b: int, t: int, ch: Channel) -> Seen:
    _wait_flag(mem, b, t, ch)
    return _judge(_load_word(mem, b + DATA) == value(t))


def _o_invalidate_no_fence(mem: Memory, b: int, t: int, ch: Channel) -> Seen:
    _wait_flag(mem, b, t, ch)
    mem.invalidate(b + DATA, 8)  # no MFENCE: the load may pass the invalidation
    return _judge(_load_word(mem, b + DATA) == value(t))


def _o_invalidate_early(mem: Memory, b: int, t: int, ch: Channel) -> Seen:
    mem.invalidate(b + DATA, 8)  # before the flag says the data is there
    mem.mfence()
    _wait_flag(mem, b, t, ch)
    return _judge(_load_word(mem, b + DATA) == value(t))


def _o_poll(fresh: bool) -> Callable[[Memory, int, int, Channel], Seen]:
    """Poll the flag; once its writer said it is out, POLL_BOUND more polls must see it."""

    def observe(mem: Memory, b: int, t: int, ch: Channel) -> Seen:
        deadline = time.monotonic() + ch.timeout
        polls_since_out: int | None = None
        while True:
            line = read_line(mem, b + FLAG) if fresh else mem.load(b + FLAG, LINE)
            if _U64.unpack_from(line)[0] >= t + 1:
                return Seen.RIGHT
            if polls_since_out is not None:
                polls_since_out += 1
                if polls_since_out >= POLL_BOUND:
                    return Seen.WRONG  # stale for as long as it was polled
            elif ch.peek(CTRL_WRITER)[0] >= t + 1:
                polls_since_out = 0
            if time.monotonic() > deadline:
                raise CoherenceError(f"litmus writer never raised the flag for trial {t}")

    return observe


def _line_checker(off_a: int, off_b: int) -> Callable[[Memory, int, int, Channel], Seen]:
    def check(mem: Memory, b: int, t: int, ch: Channel) -> Seen:
        ch.wait(CTRL_WRITER, t + 1)
        ch.wait(CTRL_WRITER_B, t + 1)
        first = _fresh_word(mem, b + off_a) == value(t, 1)
        return _judge(first and _fresh_word(mem, b + off_b) == value(t, 2))

    return check


def _o_dekker(mem: Memory, b: int, t: int, ch: Channel) -> Seen:
    ch.wait(CTRL_WRITER, t + 1)
    ch.wait(CTRL_WRITER_B, t + 1)
    a_saw_b = _fresh_word(mem, b + SEEN_A) >= t + 1
    b_saw_a = _fresh_word(mem, b + SEEN_B) >= t + 1
    if not (a_saw_b or b_saw_a):
        return Seen.WRONG  # both went in
    return Seen.RIGHT | Seen.RACED if a_saw_b and b_saw_a else Seen.RIGHT


def _block_bytes(t: int) -> bytes:
    return random.Random(t).randbytes(random.Random(~t).randrange(1, BLOCK_BYTES))


def _w_publish(mem: Memory, b: int, t: int, ch: Channel) -> None:
    slot = t % 2  # two blocks, republished in turn while the reader races
    mem.publish(
        b + BLOCK_HDR + slot * LINE,
        b + BLOCK_PAYLOAD + slot * BLOCK_BYTES,
        digest(b"litmus"),
        t + 1,
        _block_bytes(t),
    )
    write_line(mem, b + FLAG, _word_line(t + 1))


def _o_publish(mem: Memory, b: int, t: int, ch: Channel) -> Seen:
    latest = _U64.unpack_from(read_line(mem, b + FLAG))[0]
    out = bytearray(BLOCK_BYTES)
    seen = Seen.NOTHING
    # the newest block, and the older one that the writer is overwriting right now
    for trial in (latest - 1, latest - 2):
        if trial < 0:
            continue
        slot = trial % 2
        n = mem.read_validated(
            b + BLOCK_HDR + slot * LINE,
            b + BLOCK_PAYLOAD + slot * BLOCK_BYTES,
            BLOCK_BYTES,
            digest(b"litmus"),
            trial + 1,
            out,
        )
        if n >= 0:
            seen |= _judge(bytes(out[:n]) == _block_bytes(trial))
        elif trial == latest - 2:
            seen |= Seen.RACED
    return seen


# --- twins: one block, two payloads with one CRC32C -------------------------


def _crc_twins(size: int = BLOCK_BYTES) -> tuple[bytes, bytes]:
    """Two ``size``-byte payloads with the same CRC32C that differ in one cache line only.

    Each is a common head, then LINE - 4 bytes of its own followed by the
    CRC32C of everything before them (little-endian), then a common tail.  A
    CRC register that has just taken in a message and its own CRC holds a
    constant, whatever the message, so the common tail ends both at the same
    checksum.
    """
    rng = random.Random(0xB1061A)
    line = size // LINE // 2
    head, tail = rng.randbytes(line * LINE), rng.randbytes(size - (line + 1) * LINE)

    def twin() -> bytes:
        body = head + rng.randbytes(LINE - 4)
        return body + struct.pack("<I", crc32c(body)) + tail

    return twin(), twin()


TWINS = _crc_twins()
_TWIN_KEY = digest(b"litmus twins")


def _twin(version: int) -> bytes:
    return TWINS[version % 2]


def _twin_block(b: int) -> tuple[int, int]:
    return b + BLOCK_HDR, b + BLOCK_PAYLOAD


def _w_twins_in_place(mem: Memory, b: int, t: int, ch: Channel) -> None:
    """The in-place recipe (WRITING, payload, PUBLISHED), each state held for a look."""
    hdr, payload = _twin_block(b)
    mem.begin_write(hdr, payload, _TWIN_KEY, t + 1, BLOCK_BYTES)
    mem.nt_store(payload, _twin(t + 1))
    mem.sfence()
    ch.hold_window()
    mem.seal(hdr, payload, _TWIN_KEY, t + 1, BLOCK_BYTES)
    ch.hold_window()


def _w_twins_header_first(mem: Memory, b: int, t: int, ch: Channel) -> None:
    hdr, payload = _twin_block(b)
    mem.seal(hdr, payload, _TWIN_KEY, t + 1, BLOCK_BYTES)  # PUBLISHED, over the old payload
    ch.hold_window()
    mem.nt_store(payload, _twin(t + 1))
    mem.sfence()


def _w_twins_no_writing(mem: Memory, b: int, t: int, ch: Channel) -> None:
    hdr, payload = _twin_block(b)
    mem.nt_store(payload, _twin(t + 1))  # over a published payload, with no WRITING first
    mem.sfence()
    ch.hold_window()
    mem.seal(hdr, payload, _TWIN_KEY, t + 1, BLOCK_BYTES)


def _w_twins_in_window(mem: Memory, b: int, t: int, ch: Channel) -> None:
    """Publish the first version at once, each later one inside a window the reader opened."""
    if t:
        ch.wait(WINDOW, ch.peek(WINDOW_DONE)[0] + 1)
    window = ch.peek(WINDOW)[0]
    mem.publish(*_twin_block(b), _TWIN_KEY, t + 1, _twin(t + 1))
    if t:
        ch.post(WINDOW_DONE, window)


def _published(mem: Memory, b: int) -> tuple[bytes, int] | Seen:
    """The header line and version of the published twin block, or what was seen instead."""
    line = read_line(mem, b + BLOCK_HDR)
    h = parse_header(line)
    if h is not None and h.state == BlockState.PUBLISHED and h.length == BLOCK_BYTES:
        return line, h.version
    return Seen.NOTHING if line == bytes(LINE) else Seen.RACED  # not yet written / mid-write


def _o_twins(mem: Memory, b: int, t: int, ch: Channel) -> Seen:
    found = _published(mem, b)
    if isinstance(found, Seen):
        return found
    version = found[1]
    out = bytearray(BLOCK_BYTES)
    n = mem.read_validated(*_twin_block(b), BLOCK_BYTES, _TWIN_KEY, version, out)
    if n < 0:
        return Seen.RACED
    return _judge(bytes(out[:n]) == _twin(version))


def _o_twins_python(recheck: bool) -> Callable[[Memory, int, int, Channel], Seen]:
    """read_validated spelled out step by step, with or without its re-check."""

    def observe(mem: Memory, b: int, t: int, ch: Channel) -> Seen:
        found = _published(mem, b)
        if isinstance(found, Seen):
            return found
        line, version = found
        if t % 2:  # every other look, a new version is published between check and copy
            ch.written_in(t)
        payload = b + BLOCK_PAYLOAD
        mem.invalidate(payload, BLOCK_BYTES)
        mem.mfence()
        data = mem.load(payload, BLOCK_BYTES)
        h = parse_header(line)
        assert h is not None
        if crc32c(data) != h.payload_crc:
            return Seen.RACED
        if recheck and read_line(mem, b + BLOCK_HDR) != line:
            return Seen.RACED
        return _judge(data == _twin(version))

    return observe


# --- crash sweeps: every state inside one write ------------------------------

#: twins that fit the model's write-combining queue, so that every order of their lines can land
SWEEP_TWINS = _crc_twins(1024)


def _sweep_version(version: int) -> bytes:
    return SWEEP_TWINS[version % 2]


def _sw_publish(mem: Memory, b: int, version: int) -> None:
    mem.publish(*_twin_block(b), _TWIN_KEY, version, _sweep_version(version))


def _sw_in_place(mem: Memory, b: int, version: int) -> None:
    hdr, payload = _twin_block(b)
    data = _sweep_version(version)
    mem.begin_write(hdr, payload, _TWIN_KEY, version, len(data))
    mem.nt_store(payload, data)  # the caller's own stores, unfenced: seal orders them
    mem.seal(hdr, payload, _TWIN_KEY, version, len(data))


def _sw_write_blocks(mem: Memory, b: int, version: int) -> None:
    hdr, payload = _twin_block(b)
    data = _sweep_version(version)
    mem.begin_write(hdr, payload, _TWIN_KEY, version, len(data))
    rows = memoryview(struct.pack("<4Q", 0, 0, payload, len(data))).cast("Q")
    mem.write_blocks([data], rows, [(hdr, payload, _TWIN_KEY, version, len(data), 0, 0, 0)])


SWEEPS: dict[str, Callable[[Memory, int, int], None]] = {
    "publish": _sw_publish,
    "in_place": _sw_in_place,
    "write_blocks": _sw_write_blocks,
}


def sweep_crashes(
    attempt: Callable[[int | None], tuple[Seen, int]], *, last: int | None = None, name: str = ""
) -> LitmusResult:
    """Look at every state a write passes through: ``attempt(k)`` rebuilds the scene,
    lets the writer's host crash once ``k`` of its writes landed (``None``: never),
    looks from another host and returns what it saw and how many writes landed.

    The same seed replays the same write, so state k is a prefix of state k + 1;
    ``last`` limits the sweep to the final states of a long write.
    """
    tally = _Tally(name)
    _sweep_into(tally, attempt, last)
    return tally.result()


def _sweep_into(
    tally: _Tally, attempt: Callable[[int | None], tuple[Seen, int]], last: int | None
) -> None:
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
    write, tally = SWEEPS[name], _Tally(name)
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
            n = reader.read_validated(*_twin_block(0), BLOCK_BYTES, _TWIN_KEY, 0, out)
            if n < 0 or h is None:
                return Seen.RACED, landed
            return _judge(bytes(out[:n]) == _sweep_version(h.version)), landed

        _sweep_into(tally, attempt, None)
    return tally.result()


@dataclass(frozen=True)
class Pattern:
    writer: Callable[[Memory, int, int, Channel], None]
    observer: Callable[[Memory, int, int, Channel], Seen]
    is_bug: bool
    writer_b: Callable[[Memory, int, int, Channel], None] | None = None
    #: writer and observer race freely instead of stepping trial by trial
    concurrent: bool = False


def _sfence(mem: Memory) -> None:
    mem.sfence()


def _mfence(mem: Memory) -> None:
    mem.mfence()


PATTERNS: dict[str, Pattern] = {
    "no_flush": Pattern(_w_no_flush, _o_invalidate, True),
    "no_invalidate": Pattern(_w_nt, _o_no_invalidate, True),
    "flag_before_data": Pattern(_w_flag_first, _o_invalidate, True),
    "shared_line": Pattern(
        _half_writer(DATA, 1), _line_checker(DATA, DATA + 8), True, _half_writer(DATA + 8, 2)
    ),
    "nt_no_fence": Pattern(_w_nt_no_fence, _o_invalidate, True),
    "flush_no_fence": Pattern(_w_flush_no_fence, _o_invalidate, True),
    "poll_no_invalidate": Pattern(_w_nt_late, _o_poll(fresh=False), True),
    "invalidate_no_fence": Pattern(_w_nt, _o_invalidate_no_fence, True),
    "invalidate_early": Pattern(_w_nt_late, _o_invalidate_early, True),
    "dekker_no_mfence": Pattern(
        _dekker_host(FLAG, FLAG_B, SEEN_A, _sfence),
        _o_dekker,
        True,
        _dekker_host(FLAG_B, FLAG, SEEN_B, _sfence),
    ),
    "twins_header_first": Pattern(_w_twins_header_first, _o_twins, True, concurrent=True),
    "twins_no_writing": Pattern(_w_twins_no_writing, _o_twins, True, concurrent=True),
    "twins_no_recheck": Pattern(
        _w_twins_in_window, _o_twins_python(recheck=False), True, concurrent=True
    ),
    "flush": Pattern(_w_flush, _o_invalidate, False),
    "invalidate": Pattern(_w_nt, _o_invalidate, False),
    "separate_lines": Pattern(
        _half_writer(DATA, 1), _line_checker(DATA, DATA + LINE), False, _half_writer(DATA + LINE, 2)
    ),
    "poll_invalidate": Pattern(_w_nt_late, _o_poll(fresh=True), False),
    "dekker": Pattern(
        _dekker_host(FLAG, FLAG_B, SEEN_A, _mfence),
        _o_dekker,
        False,
        _dekker_host(FLAG_B, FLAG, SEEN_B, _mfence),
    ),
    "publish": Pattern(_w_publish, _o_publish, False, concurrent=True),
    "crc_twins": Pattern(_w_twins_in_place, _o_twins, False, concurrent=True),
    "twins_recheck": Pattern(
        _w_twins_in_window, _o_twins_python(recheck=True), False, concurrent=True
    ),
}


@dataclass(frozen=True)
class LitmusResult:
    pattern: str
    trials: int
    violations: int
    first_violation: int | None
    confirmed: int = 0  # observations that saw a value and found it right
    raced: int = 0  # observations that caught the writer mid-way (the racy window occurred)

    @property
    def caught(self) -> bool:
        return self.violations > 0


def run_role(
    mem: Memory,
    base: int,
    pattern: str,
    role: str,
    trials: int,
    *,
    pause: float = 0.0005,
    timeout: float = 30.0,
    stop_on_violation: bool = True,
) -> LitmusResult:
    """Play one role ("writer", "writer_b" or "observer") of a pattern on this host.

    The observer paces the trials, stopping at the first violation when
    ``stop_on_violation`` (or, for a concurrent pattern, observes until the
    writer is done) and reports what it saw; writers return a result with
    zero violations.
    """
    if pattern not in PATTERNS:
        raise ValueError(f"unknown litmus pattern {pattern!r}; choose from {sorted(PATTERNS)}")
    if base % LINE or base < 0 or base + AREA_BYTES > mem.size:
        raise ValueError(f"a litmus area needs {AREA_BYTES} line-aligned bytes at {base}")
    p = PATTERNS[pattern]
    ch = Channel(mem, base, timeout, pause, trials)
    if role == "observer":
        if p.concurrent:
            return _observe_concurrent(mem, base, pattern, p, ch, trials)
        return _observe_stepped(mem, base, pattern, p, ch, trials, stop_on_violation)
    write = {"writer": p.writer, "writer_b": p.writer_b}.get(role)
    if write is None:
        raise ValueError(f"pattern {pattern!r} has no role {role!r}")
    own = CTRL_WRITER if role == "writer" else CTRL_WRITER_B
    for t in range(trials):
        if (t == 0 or not p.concurrent) and ch.wait(CTRL_OBSERVER, t + 1) & STOP:
            return LitmusResult(pattern, t, 0, None)
        write(mem, base, t, ch)
        if not p.concurrent:
            ch.post(own, t + 1)
        elif t % 64 == 0 and ch.peek(CTRL_OBSERVER)[1] & STOP:
            return LitmusResult(pattern, t, 0, None)
    ch.post(own, trials)
    return LitmusResult(pattern, trials, 0, None)


class _Tally:
    """Counts observations as a LitmusResult."""

    def __init__(self, pattern: str) -> None:
        self.pattern, self.looks, self.violations, self.confirmed, self.raced = pattern, 0, 0, 0, 0
        self.first: int | None = None

    def add(self, seen: Seen) -> bool:
        """Count one observation; True when it was a violation."""
        self.confirmed += bool(seen & Seen.RIGHT)
        self.raced += bool(seen & Seen.RACED)
        wrong = bool(seen & Seen.WRONG)
        if wrong:
            self.violations += 1
            self.first = self.looks if self.first is None else self.first
        self.looks += 1
        return wrong

    def result(self) -> LitmusResult:
        return LitmusResult(
            self.pattern, self.looks, self.violations, self.first, self.confirmed, self.raced
        )


def _observe_stepped(
    mem: Memory,
    base: int,
    pattern: str,
    p: Pattern,
    ch: Channel,
    trials: int,
    stop_on_violation: bool,
) -> LitmusResult:
    tally = _Tally(pattern)
    for t in range(trials):
        ch.post(CTRL_OBSERVER, t + 1)
        if tally.add(p.observer(mem, base, t, ch)) and stop_on_violation:
            ch.post(CTRL_OBSERVER, t + 1, STOP)
            return tally.result()
        ch.wait(CTRL_WRITER, t + 1)
        if p.writer_b is not None:
            ch.wait(CTRL_WRITER_B, t + 1)
    ch.post(CTRL_OBSERVER, trials, STOP)
    return tally.result()


def _observe_concurrent(
    mem: Memory,
    base: int,
    pattern: str,
    p: Pattern,
    ch: Channel,
    trials: int,
) -> LitmusResult:
    """Observe for the writer's whole run (so it always writes its trials), then once more."""
    tally = _Tally(pattern)
    ch.post(CTRL_OBSERVER, 1)
    deadline = time.monotonic() + ch.timeout
    while True:
        done = ch.peek(CTRL_WRITER)[0] >= trials
        tally.add(p.observer(mem, base, tally.looks, ch))
        ch.post(LOOKS, tally.looks)
        if done:
            break
        if time.monotonic() > deadline:
            raise CoherenceError(f"litmus writer of {pattern!r} did not finish in {ch.timeout} s")
    ch.post(CTRL_OBSERVER, 1, STOP)
    return tally.result()


def reset_area(mem: Memory, base: int) -> None:
    """Zero a litmus area; do it before any role of a run starts."""
    mem.nt_store(base, bytes(AREA_BYTES))
    mem.sfence()


def _role_process(
    spec: str,
    base: int,
    pattern: str,
    role: str,
    trials: int,
    mode: str,
    model: ModelConfig,
    pause: float,
    timeout: float,
    out: mp.Queue,
) -> None:
    try:
        with Pool.attach(spec, coherence=mode, model=model) as pool:
            out.put(
                (
                    role,
                    run_role(
                        pool.memory, base, pattern, role, trials, pause=pause, timeout=timeout
                    ),
                )
            )
    except BaseException as e:  # report, do not hang the parent
        out.put((role, e))


def run_local(
    spec: str,
    base: int,
    pattern: str,
    trials: int,
    *,
    mode: str = "model",
    seed: int = 1,
    model: ModelConfig | None = None,
    pause: float = 0.0005,
    timeout: float = 60.0,
) -> LitmusResult:
    """Run a pattern with each role in its own process (its own emulated host).

    Each role's model is ``model`` (default: from the environment) with a
    seed of its own derived from ``seed``.
    """
    base_model = model or ModelConfig.from_env()
    with Pool.attach(spec, coherence="native") as pool:
        reset_area(pool.memory, base)
    p = PATTERNS[pattern]
    roles = ["observer", "writer"] + (["writer_b"] if p.writer_b else [])
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_role_process,
            daemon=True,
            args=(
                spec,
                base,
                pattern,
                role,
                trials,
                mode,
                dataclasses.replace(base_model, seed=seed * 7 + i),
                pause,
                timeout,
                out,
            ),
        )
        for i, role in enumerate(roles)
    ]
    for proc in procs:
        proc.start()
    results: dict[str, object] = {}
    try:
        deadline = time.monotonic() + timeout * 2
        while len(results) < len(roles):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CoherenceError(f"litmus pattern {pattern!r} did not finish in time")
            role, res = out.get(timeout=remaining)
            results[role] = res
    finally:
        for proc in procs:
            stop_process(proc, 5, terminate=False)
        out.close()
        out.join_thread()
    for role, res in results.items():
        if isinstance(res, BaseException):
            raise CoherenceError(f"litmus {role} of {pattern!r} failed: {res}") from res
    observed = results["observer"]
    assert isinstance(observed, LitmusResult)
    return observed
