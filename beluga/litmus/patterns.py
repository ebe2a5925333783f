"""The litmus patterns: each a writer and an observer over a few lines of one pool.

The *buggy* patterns each leave out one step of the recipe and must be
caught (a stale, lost or foreign value observed) within a bounded number of
trials whenever the hosts are not hardware-coherent: always under the
``model`` coherence mode, and on real CXL.  The *correct* patterns must never
be caught.  On one coherent machine in ``native`` mode nothing is ever
caught, which is exactly why CI runs these under the model.

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

Every writer and observer is called as ``(mem, base, trial, channel)``: the
role's Memory, the area's base offset, the trial number and the area's
control channel.  An observation says whether it saw a wrong value, a right
one, and whether it hit the racy window (the writer caught mid-way), so a
test can check that the window it is about really occurred.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from beluga.coherence import (
    LINE,
    BlockState,
    Memory,
    crc32c,
    digest,
    parse_header,
    read_line,
    write_line,
)
from beluga.errors import CoherenceError
from beluga.litmus.area import (
    BLOCK_BYTES,
    BLOCK_HDR,
    BLOCK_PAYLOAD,
    CTRL_WRITER,
    CTRL_WRITER_B,
    DATA,
    FLAG,
    FLAG_B,
    SEEN_A,
    SEEN_B,
    WINDOW,
    WINDOW_DONE,
    Channel,
    first_word,
    fresh_word,
    load_word,
    store_word,
    value,
    word_bytes,
    word_line,
)
from beluga.litmus.outcome import Seen, judge
from beluga.litmus.twins import TWIN_KEY, twin_block, twin_of

#: a writer's one trial: (mem, base, trial, channel)
Writer = Callable[[Memory, int, int, Channel], None]
#: an observer's one look: (mem, base, trial, channel) -> what it saw
Observer = Callable[[Memory, int, int, Channel], Seen]

#: plain polls of a flag after its writer said it is out, before the reader is judged stale
POLL_BOUND = 2000


# --- writers of a data word and its flag --------------------------------------


def store_data_then_flag_without_flush(
    mem: Memory, base: int, trial: int, channel: Channel
) -> None:
    store_word(mem, base + DATA, value(trial))
    mem.sfence()
    write_line(mem, base + FLAG, word_line(trial + 1))


def store_flush_fence_then_flag(mem: Memory, base: int, trial: int, channel: Channel) -> None:
    store_word(mem, base + DATA, value(trial))
    mem.flush(base + DATA, 8)
    mem.sfence()
    time.sleep(channel.pause)
    write_line(mem, base + FLAG, word_line(trial + 1))


def stream_fence_then_flag(mem: Memory, base: int, trial: int, channel: Channel) -> None:
    mem.nt_store(base + DATA, word_bytes(value(trial)))
    mem.sfence()
    write_line(mem, base + FLAG, word_line(trial + 1))


def pause_then_stream_fence_flag(mem: Memory, base: int, trial: int, channel: Channel) -> None:
    time.sleep(channel.pause)  # the reader gets ahead of the data
    stream_fence_then_flag(mem, base, trial, channel)


def flag_before_flushing_data(mem: Memory, base: int, trial: int, channel: Channel) -> None:
    store_word(mem, base + DATA, value(trial))
    write_line(mem, base + FLAG, word_line(trial + 1))
    time.sleep(channel.pause)
    mem.flush(base + DATA, 8)
    mem.sfence()


def stream_data_and_flag_without_fence(
    mem: Memory, base: int, trial: int, channel: Channel
) -> None:
    mem.nt_store(base + DATA, word_bytes(value(trial)))
    mem.nt_store(base + FLAG, word_line(trial + 1))  # no SFENCE between data and flag
    time.sleep(channel.pause)
    mem.sfence()


def flush_data_then_flag_without_fence(
    mem: Memory, base: int, trial: int, channel: Channel
) -> None:
    store_word(mem, base + DATA, value(trial))
    mem.flush(base + DATA, 8)
    mem.nt_store(base + FLAG, word_line(trial + 1))  # the flush has not completed: no SFENCE
    time.sleep(channel.pause)
    mem.sfence()


def own_word_writer(offset: int, salt: int) -> Writer:
    """A writer that owns the word at ``offset``: store, pause, flush, SFENCE."""

    def write(mem: Memory, base: int, trial: int, channel: Channel) -> None:
        store_word(mem, base + offset, value(trial, salt))
        time.sleep(channel.pause)
        mem.flush(base + offset, 8)
        mem.sfence()

    return write


def dekker_side(
    own_flag: int, other_flag: int, saw_other: int, fence: Callable[[Memory], None]
) -> Writer:
    """One side of a Dekker handshake: raise my flag, ``fence``, then look at the other's."""

    def write(mem: Memory, base: int, trial: int, channel: Channel) -> None:
        write_line(mem, base + own_flag, word_line(trial + 1))
        time.sleep(channel.pause)  # let the other host raise its flag meanwhile
        mem.invalidate(base + other_flag, 8)
        fence(mem)
        write_line(mem, base + saw_other, word_line(load_word(mem, base + other_flag)))

    return write


def _sfence(mem: Memory) -> None:
    mem.sfence()


def _mfence(mem: Memory) -> None:
    mem.mfence()


# --- observers of a data word and its flag ------------------------------------


def _await_flag(mem: Memory, base: int, trial: int, channel: Channel) -> None:
    deadline = time.monotonic() + channel.timeout
    while first_word(read_line(mem, base + FLAG)) < trial + 1:
        if time.monotonic() > deadline:
            raise CoherenceError(f"litmus writer never raised the flag for trial {trial}")


def await_flag_then_load_fresh(mem: Memory, base: int, trial: int, channel: Channel) -> Seen:
    _await_flag(mem, base, trial, channel)
    return judge(fresh_word(mem, base + DATA) == value(trial))


def await_flag_then_load_cached(mem: Memory, base: int, trial: int, channel: Channel) -> Seen:
    _await_flag(mem, base, trial, channel)
    return judge(load_word(mem, base + DATA) == value(trial))


def await_flag_then_invalidate_without_fence(
    mem: Memory, base: int, trial: int, channel: Channel
) -> Seen:
    _await_flag(mem, base, trial, channel)
    mem.invalidate(base + DATA, 8)  # no MFENCE: the load may pass the invalidation
    return judge(load_word(mem, base + DATA) == value(trial))


def invalidate_before_the_flag(mem: Memory, base: int, trial: int, channel: Channel) -> Seen:
    mem.invalidate(base + DATA, 8)  # before the flag says the data is there
    mem.mfence()
    _await_flag(mem, base, trial, channel)
    return judge(load_word(mem, base + DATA) == value(trial))


def poll_flag(invalidating: bool) -> Observer:
    """Poll the flag (with invalidate + MFENCE, or plain loads); once its writer said
    it is out, POLL_BOUND more polls must see it."""

    def observe(mem: Memory, base: int, trial: int, channel: Channel) -> Seen:
        deadline = time.monotonic() + channel.timeout
        polls_since_out: int | None = None
        while True:
            line = read_line(mem, base + FLAG) if invalidating else mem.load(base + FLAG, LINE)
            if first_word(line) >= trial + 1:
                return Seen.RIGHT
            if polls_since_out is not None:
                polls_since_out += 1
                if polls_since_out >= POLL_BOUND:
                    return Seen.WRONG  # stale for as long as it was polled
            elif channel.peek(CTRL_WRITER)[0] >= trial + 1:
                polls_since_out = 0
            if time.monotonic() > deadline:
                raise CoherenceError(f"litmus writer never raised the flag for trial {trial}")

    return observe


def check_both_words(first: int, second: int) -> Observer:
    """After both writers are done, each of their words (at ``first``, ``second``) must hold."""

    def check(mem: Memory, base: int, trial: int, channel: Channel) -> Seen:
        channel.wait(CTRL_WRITER, trial + 1)
        channel.wait(CTRL_WRITER_B, trial + 1)
        first_ok = fresh_word(mem, base + first) == value(trial, 1)
        return judge(first_ok and fresh_word(mem, base + second) == value(trial, 2))

    return check


def check_dekker_exclusion(mem: Memory, base: int, trial: int, channel: Channel) -> Seen:
    """At least one side must have seen the other's flag: both going in is the violation."""
    channel.wait(CTRL_WRITER, trial + 1)
    channel.wait(CTRL_WRITER_B, trial + 1)
    a_saw_b = fresh_word(mem, base + SEEN_A) >= trial + 1
    b_saw_a = fresh_word(mem, base + SEEN_B) >= trial + 1
    if not (a_saw_b or b_saw_a):
        return Seen.WRONG  # both went in
    return Seen.RIGHT | Seen.RACED if a_saw_b and b_saw_a else Seen.RIGHT


# --- the block protocol: publish / read_validated -----------------------------


def _block_bytes(trial: int) -> bytes:
    return random.Random(trial).randbytes(random.Random(~trial).randrange(1, BLOCK_BYTES))


def publish_blocks_in_turn(mem: Memory, base: int, trial: int, channel: Channel) -> None:
    """Publish trial's payload into one of two blocks in turn, then raise the flag."""
    slot = trial % 2  # two blocks, republished in turn while the reader races
    mem.publish(
        base + BLOCK_HDR + slot * LINE,
        base + BLOCK_PAYLOAD + slot * BLOCK_BYTES,
        digest(b"litmus"),
        trial + 1,
        _block_bytes(trial),
    )
    write_line(mem, base + FLAG, word_line(trial + 1))


def read_newest_two_blocks(mem: Memory, base: int, trial: int, channel: Channel) -> Seen:
    """read_validated the newest block and the older one the writer is overwriting now."""
    latest = first_word(read_line(mem, base + FLAG))
    out = bytearray(BLOCK_BYTES)
    seen = Seen.NOTHING
    for published in (latest - 1, latest - 2):
        if published < 0:
            continue
        slot = published % 2
        n = mem.read_validated(
            base + BLOCK_HDR + slot * LINE,
            base + BLOCK_PAYLOAD + slot * BLOCK_BYTES,
            BLOCK_BYTES,
            digest(b"litmus"),
            published + 1,
            out,
        )
        if n >= 0:
            seen |= judge(bytes(out[:n]) == _block_bytes(published))
        elif published == latest - 2:
            seen |= Seen.RACED
    return seen


# --- twins: one block, two payloads with one CRC32C ---------------------------


def write_twin_in_place(mem: Memory, base: int, trial: int, channel: Channel) -> None:
    """The in-place recipe (WRITING, payload, PUBLISHED), each state held for a look."""
    hdr, payload = twin_block(base)
    mem.begin_write(hdr, payload, TWIN_KEY, trial + 1, BLOCK_BYTES)
    mem.nt_store(payload, twin_of(trial + 1))
    mem.sfence()
    channel.hold_window()
    mem.seal(hdr, payload, TWIN_KEY, trial + 1, BLOCK_BYTES)
    channel.hold_window()


def publish_header_before_payload(mem: Memory, base: int, trial: int, channel: Channel) -> None:
    hdr, payload = twin_block(base)
    mem.seal(hdr, payload, TWIN_KEY, trial + 1, BLOCK_BYTES)  # PUBLISHED, over the old payload
    channel.hold_window()
    mem.nt_store(payload, twin_of(trial + 1))
    mem.sfence()


def rewrite_payload_without_writing_state(
    mem: Memory, base: int, trial: int, channel: Channel
) -> None:
    hdr, payload = twin_block(base)
    mem.nt_store(payload, twin_of(trial + 1))  # over a published payload, with no WRITING first
    mem.sfence()
    channel.hold_window()
    mem.seal(hdr, payload, TWIN_KEY, trial + 1, BLOCK_BYTES)


def publish_twin_in_readers_window(mem: Memory, base: int, trial: int, channel: Channel) -> None:
    """Publish the first version at once, each later one inside a window the reader opened."""
    if trial:
        channel.wait(WINDOW, channel.peek(WINDOW_DONE)[0] + 1)
    window = channel.peek(WINDOW)[0]
    mem.publish(*twin_block(base), TWIN_KEY, trial + 1, twin_of(trial + 1))
    if trial:
        channel.post(WINDOW_DONE, window)


def _published_twin(mem: Memory, base: int) -> tuple[bytes, int] | Seen:
    """The header line and version of the published twin block, or what was seen instead."""
    line = read_line(mem, base + BLOCK_HDR)
    h = parse_header(line)
    if h is not None and h.state == BlockState.PUBLISHED and h.length == BLOCK_BYTES:
        return line, h.version
    return Seen.NOTHING if line == bytes(LINE) else Seen.RACED  # not yet written / mid-write


def read_twin_validated(mem: Memory, base: int, trial: int, channel: Channel) -> Seen:
    """read_validated the published twin: a miss is a race, a copy must be its version's."""
    found = _published_twin(mem, base)
    if isinstance(found, Seen):
        return found
    version = found[1]
    out = bytearray(BLOCK_BYTES)
    n = mem.read_validated(*twin_block(base), BLOCK_BYTES, TWIN_KEY, version, out)
    if n < 0:
        return Seen.RACED
    return judge(bytes(out[:n]) == twin_of(version))


def read_twin_step_by_step(recheck_header: bool) -> Observer:
    """read_validated spelled out step by step, with or without its re-check of the header."""

    def observe(mem: Memory, base: int, trial: int, channel: Channel) -> Seen:
        found = _published_twin(mem, base)
        if isinstance(found, Seen):
            return found
        line, version = found
        if trial % 2:  # every other look, a new version is published between check and copy
            channel.written_in(trial)
        payload = base + BLOCK_PAYLOAD
        mem.invalidate(payload, BLOCK_BYTES)
        mem.mfence()
        data = mem.load(payload, BLOCK_BYTES)
        h = parse_header(line)
        assert h is not None
        if crc32c(data) != h.payload_crc:
            return Seen.RACED
        if recheck_header and read_line(mem, base + BLOCK_HDR) != line:
            return Seen.RACED
        return judge(data == twin_of(version))

    return observe


# --- the table ----------------------------------------------------------------


@dataclass(frozen=True)
class Pattern:
    """One litmus pattern: who writes, who observes, and whether it must be caught."""

    writer: Writer
    observer: Observer
    is_bug: bool
    #: the second writer of the two-writer patterns (role "writer_b")
    writer_b: Writer | None = None
    #: writer and observer race freely instead of stepping trial by trial
    concurrent: bool = False


PATTERNS: dict[str, Pattern] = {
    "no_flush": Pattern(store_data_then_flag_without_flush, await_flag_then_load_fresh, True),
    "no_invalidate": Pattern(stream_fence_then_flag, await_flag_then_load_cached, True),
    "flag_before_data": Pattern(flag_before_flushing_data, await_flag_then_load_fresh, True),
    "shared_line": Pattern(
        own_word_writer(DATA, 1),
        check_both_words(DATA, DATA + 8),
        True,
        own_word_writer(DATA + 8, 2),
    ),
    "nt_no_fence": Pattern(stream_data_and_flag_without_fence, await_flag_then_load_fresh, True),
    "flush_no_fence": Pattern(flush_data_then_flag_without_fence, await_flag_then_load_fresh, True),
    "poll_no_invalidate": Pattern(
        pause_then_stream_fence_flag, poll_flag(invalidating=False), True
    ),
    "invalidate_no_fence": Pattern(
        stream_fence_then_flag, await_flag_then_invalidate_without_fence, True
    ),
    "invalidate_early": Pattern(pause_then_stream_fence_flag, invalidate_before_the_flag, True),
    "dekker_no_mfence": Pattern(
        dekker_side(FLAG, FLAG_B, SEEN_A, _sfence),
        check_dekker_exclusion,
        True,
        dekker_side(FLAG_B, FLAG, SEEN_B, _sfence),
    ),
    "twins_header_first": Pattern(
        publish_header_before_payload, read_twin_validated, True, concurrent=True
    ),
    "twins_no_writing": Pattern(
        rewrite_payload_without_writing_state, read_twin_validated, True, concurrent=True
    ),
    "twins_no_recheck": Pattern(
        publish_twin_in_readers_window,
        read_twin_step_by_step(recheck_header=False),
        True,
        concurrent=True,
    ),
    "flush": Pattern(store_flush_fence_then_flag, await_flag_then_load_fresh, False),
    "invalidate": Pattern(stream_fence_then_flag, await_flag_then_load_fresh, False),
    "separate_lines": Pattern(
        own_word_writer(DATA, 1),
        check_both_words(DATA, DATA + LINE),
        False,
        own_word_writer(DATA + LINE, 2),
    ),
    "poll_invalidate": Pattern(pause_then_stream_fence_flag, poll_flag(invalidating=True), False),
    "dekker": Pattern(
        dekker_side(FLAG, FLAG_B, SEEN_A, _mfence),
        check_dekker_exclusion,
        False,
        dekker_side(FLAG_B, FLAG, SEEN_B, _mfence),
    ),
    "publish": Pattern(publish_blocks_in_turn, read_newest_two_blocks, False, concurrent=True),
    "crc_twins": Pattern(write_twin_in_place, read_twin_validated, False, concurrent=True),
    "twins_recheck": Pattern(
        publish_twin_in_readers_window,
        read_twin_step_by_step(recheck_header=True),
        False,
        concurrent=True,
    ),
}
