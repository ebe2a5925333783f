"""Coherence litmus tests: small programs that either catch a bug or prove a recipe.

Each pattern is a writer and an observer running on different hosts (processes
here; machines in the lab) over a few lines of one pool.  The *buggy* patterns
each leave out one step of the recipe and must be caught (a stale or lost
value observed) within a bounded number of trials whenever the hosts are not
hardware-coherent: always under the ``model`` coherence mode, and on real CXL.
The *correct* patterns must never be caught.  On one coherent machine in
``native`` mode nothing is ever caught, which is exactly why CI runs these
under the model.

Patterns (``bug`` ones first):

``no_flush``            writer stores the data and never flushes it
``no_invalidate``       reader loads the data without invalidating its copy
``flag_before_data``    writer publishes the flag, then flushes the data
``shared_line``         two writers each own half of one cache line
``flush``               store + flush + fence, then the flag          (correct)
``invalidate``          reader invalidates before loading             (correct)
``separate_lines``      two writers, each in its own line             (correct)
``publish``             the block protocol: publish / read_validated  (correct)

The harness synchronises trials through control lines, each written by one
role only, with the correct recipe (``write_line`` / ``read_line``), so the
harness itself is immune to the bugs it tests for.  Every wait has a timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from beluga.coherence import LINE, Memory, ModelConfig, digest, read_line, write_line
from beluga.errors import CoherenceError

_U64 = struct.Struct("<Q")
_CTRL = struct.Struct("<QQ")  # trial, flags

# Line offsets inside the litmus area (relative to its base).
CTRL_OBSERVER, CTRL_WRITER, CTRL_WRITER_B, FLAG, DATA = (i * LINE for i in range(5))
BLOCK_HDR, BLOCK_PAYLOAD = 8 * LINE, 16 * LINE
BLOCK_BYTES = 4096
AREA_BYTES = BLOCK_PAYLOAD + 4 * BLOCK_BYTES
STOP = 1


def value(trial: int, salt: int = 0) -> int:
    """A distinct nonzero 64-bit value per trial (and per writer)."""
    return ((trial + 1) * 0x9E3779B97F4A7C15 + salt * 0xC2B2AE3D27D4EB4F) & (2**64 - 1) | 1


class Channel:
    """The control lines of one litmus area, seen from one role."""

    def __init__(self, mem: Memory, base: int, timeout: float) -> None:
        self.mem, self.base, self.timeout = mem, base, timeout

    def post(self, line: int, trial: int, flags: int = 0) -> None:
        write_line(self.mem, self.base + line, _CTRL.pack(trial, flags).ljust(LINE, b"\0"))

    def peek(self, line: int) -> tuple[int, int]:
        trial, flags = _CTRL.unpack_from(read_line(self.mem, self.base + line))
        return trial, flags

    def wait(self, line: int, trial: int) -> int:
        """Wait until a control line reaches ``trial`` (or STOP); returns its flags."""
        deadline = time.monotonic() + self.timeout
        while True:
            seen, flags = self.peek(line)
            if seen >= trial or flags & STOP:
                return flags
            if time.monotonic() > deadline:
                raise CoherenceError(
                    f"litmus peer did not reach trial {trial} within {self.timeout} s "
                    f"(control line {line // LINE} at trial {seen}); is the other host running?"
                )


def _store_word(mem: Memory, off: int, v: int) -> None:
    mem.store(off, _U64.pack(v))


def _load_word(mem: Memory, off: int) -> int:
    return _U64.unpack(mem.load(off, 8))[0]


def _fresh_word(mem: Memory, off: int) -> int:
    mem.invalidate(off, 8)
    mem.mfence()
    return _load_word(mem, off)


# --- writers: (mem, base, trial, pause) ------------------------------------


def _w_no_flush(mem: Memory, b: int, t: int, pause: float) -> None:
    _store_word(mem, b + DATA, value(t))
    mem.sfence()
    write_line(mem, b + FLAG, _U64.pack(t + 1).ljust(LINE, b"\0"))


def _w_flush(mem: Memory, b: int, t: int, pause: float) -> None:
    _store_word(mem, b + DATA, value(t))
    mem.flush(b + DATA, 8)
    mem.sfence()
    time.sleep(pause)
    write_line(mem, b + FLAG, _U64.pack(t + 1).ljust(LINE, b"\0"))


def _w_nt(mem: Memory, b: int, t: int, pause: float) -> None:
    mem.nt_store(b + DATA, _U64.pack(value(t)))
    mem.sfence()
    write_line(mem, b + FLAG, _U64.pack(t + 1).ljust(LINE, b"\0"))


def _w_flag_first(mem: Memory, b: int, t: int, pause: float) -> None:
    _store_word(mem, b + DATA, value(t))
    write_line(mem, b + FLAG, _U64.pack(t + 1).ljust(LINE, b"\0"))
    time.sleep(pause)
    mem.flush(b + DATA, 8)
    mem.sfence()


def _half_writer(offset: int, salt: int) -> Callable[[Memory, int, int, float], None]:
    def write(mem: Memory, b: int, t: int, pause: float) -> None:
        _store_word(mem, b + offset, value(t, salt))
        time.sleep(pause)
        mem.flush(b + offset, 8)
        mem.sfence()

    return write


# --- observers: (mem, base, trial, channel) -> violation? ------------------


def _wait_flag(mem: Memory, b: int, t: int, ch: Channel) -> None:
    deadline = time.monotonic() + ch.timeout
    while _U64.unpack_from(read_line(mem, b + FLAG))[0] < t + 1:
        if time.monotonic() > deadline:
            raise CoherenceError(f"litmus writer never raised the flag for trial {t}")


def _o_invalidate(mem: Memory, b: int, t: int, ch: Channel) -> bool:
    _wait_flag(mem, b, t, ch)
    return _fresh_word(mem, b + DATA) != value(t)


def _o_no_invalidate(mem: Memory, b: int, t: int, ch: Channel) -> bool:
    _wait_flag(mem, b, t, ch)
    return _load_word(mem, b + DATA) != value(t)


def _line_checker(off_a: int, off_b: int) -> Callable[[Memory, int, int, Channel], bool]:
    def check(mem: Memory, b: int, t: int, ch: Channel) -> bool:
        ch.wait(CTRL_WRITER, t + 1)
        ch.wait(CTRL_WRITER_B, t + 1)
        return _fresh_word(mem, b + off_a) != value(t, 1) or _fresh_word(mem, b + off_b) != value(
            t, 2
        )

    return check


def _block_bytes(t: int) -> bytes:
    return random.Random(t).randbytes(random.Random(~t).randrange(1, BLOCK_BYTES))


def _w_publish(mem: Memory, b: int, t: int, pause: float) -> None:
    slot = t % 2  # two blocks, republished in turn while the reader races
    mem.publish(
        b + BLOCK_HDR + slot * LINE,
        b + BLOCK_PAYLOAD + slot * BLOCK_BYTES,
        digest(b"litmus"),
        t + 1,
        _block_bytes(t),
    )
    write_line(mem, b + FLAG, _U64.pack(t + 1).ljust(LINE, b"\0"))


def _o_publish(mem: Memory, b: int, t: int, ch: Channel) -> bool | None:
    latest = _U64.unpack_from(read_line(mem, b + FLAG))[0]
    out = bytearray(BLOCK_BYTES)
    bad: bool | None = None
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
            bad = bool(bad) or bytes(out[:n]) != _block_bytes(trial)
    return bad


@dataclass(frozen=True)
class Pattern:
    writer: Callable[[Memory, int, int, float], None]
    #: True: a violation; False: a value observed and correct; None: nothing to judge
    observer: Callable[[Memory, int, int, Channel], bool | None]
    is_bug: bool
    writer_b: Callable[[Memory, int, int, float], None] | None = None
    #: writer and observer race freely instead of stepping trial by trial
    concurrent: bool = False


PATTERNS: dict[str, Pattern] = {
    "no_flush": Pattern(_w_no_flush, _o_invalidate, True),
    "no_invalidate": Pattern(_w_nt, _o_no_invalidate, True),
    "flag_before_data": Pattern(_w_flag_first, _o_invalidate, True),
    "shared_line": Pattern(
        _half_writer(DATA, 1), _line_checker(DATA, DATA + 8), True, _half_writer(DATA + 8, 2)
    ),
    "flush": Pattern(_w_flush, _o_invalidate, False),
    "invalidate": Pattern(_w_nt, _o_invalidate, False),
    "separate_lines": Pattern(
        _half_writer(DATA, 1), _line_checker(DATA, DATA + LINE), False, _half_writer(DATA + LINE, 2)
    ),
    "publish": Pattern(_w_publish, _o_publish, False, concurrent=True),
}


@dataclass(frozen=True)
class LitmusResult:
    pattern: str
    trials: int
    violations: int
    first_violation: int | None
    confirmed: int = 0  # observations that saw a value and found it right

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

    The observer paces the trials (or, for a concurrent pattern, observes
    until the writer is done) and reports the violations it saw; writers
    return a result with zero violations.
    """
    if pattern not in PATTERNS:
        raise ValueError(f"unknown litmus pattern {pattern!r}; choose from {sorted(PATTERNS)}")
    if base % LINE or base < 0 or base + AREA_BYTES > mem.size:
        raise ValueError(f"a litmus area needs {AREA_BYTES} line-aligned bytes at {base}")
    p = PATTERNS[pattern]
    ch = Channel(mem, base, timeout)
    if role == "observer":
        return (_observe_concurrent if p.concurrent else _observe_stepped)(
            mem, base, pattern, p, ch, trials, stop_on_violation
        )
    write = {"writer": p.writer, "writer_b": p.writer_b}.get(role)
    if write is None:
        raise ValueError(f"pattern {pattern!r} has no role {role!r}")
    own = CTRL_WRITER if role == "writer" else CTRL_WRITER_B
    for t in range(trials):
        if (t == 0 or not p.concurrent) and ch.wait(CTRL_OBSERVER, t + 1) & STOP:
            return LitmusResult(pattern, t, 0, None)
        write(mem, base, t, pause)
        if not p.concurrent:
            ch.post(own, t + 1)
        elif t % 64 == 0 and ch.peek(CTRL_OBSERVER)[1] & STOP:
            return LitmusResult(pattern, t, 0, None)
    ch.post(own, trials)
    return LitmusResult(pattern, trials, 0, None)


def _observe_stepped(
    mem: Memory,
    base: int,
    pattern: str,
    p: Pattern,
    ch: Channel,
    trials: int,
    stop_on_violation: bool,
) -> LitmusResult:
    violations, first, confirmed = 0, None, 0
    for t in range(trials):
        ch.post(CTRL_OBSERVER, t + 1)
        verdict = p.observer(mem, base, t, ch)
        confirmed += verdict is False
        if verdict:
            violations += 1
            first = t if first is None else first
            if stop_on_violation:
                ch.post(CTRL_OBSERVER, t + 1, STOP)
                return LitmusResult(pattern, t + 1, violations, first, confirmed)
        ch.wait(CTRL_WRITER, t + 1)
        if p.writer_b is not None:
            ch.wait(CTRL_WRITER_B, t + 1)
    ch.post(CTRL_OBSERVER, trials, STOP)
    return LitmusResult(pattern, trials, violations, first, confirmed)


def _observe_concurrent(
    mem: Memory,
    base: int,
    pattern: str,
    p: Pattern,
    ch: Channel,
    trials: int,
    stop_on_violation: bool,
) -> LitmusResult:
    violations, first, looks, confirmed = 0, None, 0, 0
    ch.post(CTRL_OBSERVER, 1)
    deadline = time.monotonic() + ch.timeout
    while True:
        done = ch.peek(CTRL_WRITER)[0] >= trials
        verdict = p.observer(mem, base, looks, ch)
        confirmed += verdict is False
        if verdict:
            violations += 1
            first = looks if first is None else first
            if stop_on_violation:
                break
        looks += 1
        if done:
            break
        if time.monotonic() > deadline:
            raise CoherenceError(f"litmus writer of {pattern!r} did not finish in {ch.timeout} s")
    ch.post(CTRL_OBSERVER, 1, STOP)
    return LitmusResult(pattern, looks, violations, first, confirmed)


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
    seed: int,
    pause: float,
    timeout: float,
    out: mp.Queue,
) -> None:
    from beluga.pool import Pool

    try:
        with Pool.attach(spec, coherence=mode, model=ModelConfig.from_env(seed)) as pool:
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
    pause: float = 0.0005,
    timeout: float = 60.0,
) -> LitmusResult:
    """Run a pattern with each role in its own process (its own emulated host)."""
    from beluga.pool import Pool

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
            args=(spec, base, pattern, role, trials, mode, seed * 7 + i, pause, timeout, out),
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
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        out.close()
        out.join_thread()
    for role, res in results.items():
        if isinstance(res, BaseException):
            raise CoherenceError(f"litmus {role} of {pattern!r} failed: {res}") from res
    observed = results["observer"]
    assert isinstance(observed, LitmusResult)
    return observed
