"""The litmus area: its lines, and the control channel through which the roles step.

An area is a few cache lines of one pool: control lines (each written by one
role only), the flag and data words the line patterns race on, and one
block's header and payload for the block patterns.  The harness talks
through the control lines with the correct recipe (``write_line`` /
``read_line``), so the harness itself is immune to the bugs it tests for.
Every wait has a timeout.
"""

from __future__ import annotations

import struct

from beluga.child import wait_until
from beluga.coherence import LINE, Memory, read_line, write_line
from beluga.errors import CoherenceError

_U64 = struct.Struct("<Q")
_CONTROL = struct.Struct("<QQ")  # trial, flags

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
#: a control line's flag: the observer has finished (or stopped at a violation)
STOP = 1


def value(trial: int, salt: int = 0) -> int:
    """A distinct nonzero 64-bit value per trial (and per writer)."""
    return ((trial + 1) * 0x9E3779B97F4A7C15 + salt * 0xC2B2AE3D27D4EB4F) & (2**64 - 1) | 1


def word_bytes(word: int) -> bytes:
    """One 64-bit word as stored (little-endian)."""
    return _U64.pack(word)


def store_word(mem: Memory, offset: int, word: int) -> None:
    """A plain (cached) store of one 64-bit word: no flush, no fence."""
    mem.store(offset, _U64.pack(word))


def load_word(mem: Memory, offset: int) -> int:
    """A plain load of one 64-bit word: whatever this host's cache holds."""
    return _U64.unpack(mem.load(offset, 8))[0]


def fresh_word(mem: Memory, offset: int) -> int:
    """Load one word the correct way: invalidate its line, MFENCE, load."""
    mem.invalidate(offset, 8)
    mem.mfence()
    return load_word(mem, offset)


def first_word(line: bytes) -> int:
    """The 64-bit word a flag line carries."""
    return _U64.unpack_from(line)[0]


def word_line(word: int) -> bytes:
    """A whole line carrying one word (a flag written with ``write_line``)."""
    return _U64.pack(word).ljust(LINE, b"\0")


def reset_area(mem: Memory, base: int) -> None:
    """Zero a litmus area; do it before any role of a run starts."""
    mem.nt_store(base, bytes(AREA_BYTES))
    mem.sfence()


class Channel:
    """The control lines of one litmus area, seen from one role.

    Not thread-safe (one role's loop owns it); not fork-safe (it holds the
    role's Memory: a forked role attaches its own).
    """

    def __init__(
        self, mem: Memory, base: int, timeout: float, pause: float = 0.0005, trials: int = 0
    ) -> None:
        self.mem, self.base, self.timeout, self.pause = mem, base, timeout, pause
        self.trials = trials

    def post(self, line: int, trial: int, flags: int = 0) -> None:
        write_line(self.mem, self.base + line, _CONTROL.pack(trial, flags).ljust(LINE, b"\0"))

    def peek(self, line: int) -> tuple[int, int]:
        trial, flags = _CONTROL.unpack_from(read_line(self.mem, self.base + line))
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
