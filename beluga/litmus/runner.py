"""Running a litmus pattern: one role on this host, or every role in its own process.

:func:`run_role` plays one role ("writer", "writer_b" or "observer") over an
area, stepping with its peers through the area's control lines; a host of
the cross-host run calls it directly.  :func:`run_local` starts each role in
a forked process of its own (its own emulated host under the model) and
returns what the observer saw.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time

from beluga.child import stop_process
from beluga.coherence import LINE, Memory, ModelConfig
from beluga.errors import CoherenceError
from beluga.litmus.area import (
    AREA_BYTES,
    CTRL_OBSERVER,
    CTRL_WRITER,
    CTRL_WRITER_B,
    LOOKS,
    STOP,
    Channel,
    reset_area,
)
from beluga.litmus.outcome import LitmusResult, Tally
from beluga.litmus.patterns import PATTERNS, Pattern
from beluga.pool import Pool

#: a concurrent writer looks for the observer's STOP once every this many trials
_STOP_CHECK_EVERY = 64


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
    chosen = PATTERNS[pattern]
    channel = Channel(mem, base, timeout, pause, trials)
    if role == "observer":
        if chosen.concurrent:
            return _observe_concurrently(mem, base, pattern, chosen, channel, trials)
        return _observe_stepwise(mem, base, pattern, chosen, channel, trials, stop_on_violation)
    write = {"writer": chosen.writer, "writer_b": chosen.writer_b}.get(role)
    if write is None:
        raise ValueError(f"pattern {pattern!r} has no role {role!r}")
    own_line = CTRL_WRITER if role == "writer" else CTRL_WRITER_B
    for trial in range(trials):
        if (trial == 0 or not chosen.concurrent) and channel.wait(CTRL_OBSERVER, trial + 1) & STOP:
            return LitmusResult(pattern, trial, 0, None)
        write(mem, base, trial, channel)
        if not chosen.concurrent:
            channel.post(own_line, trial + 1)
        elif trial % _STOP_CHECK_EVERY == 0 and channel.peek(CTRL_OBSERVER)[1] & STOP:
            return LitmusResult(pattern, trial, 0, None)
    channel.post(own_line, trials)
    return LitmusResult(pattern, trials, 0, None)


def _observe_stepwise(
    mem: Memory,
    base: int,
    pattern: str,
    chosen: Pattern,
    channel: Channel,
    trials: int,
    stop_on_violation: bool,
) -> LitmusResult:
    """One look per trial: release the writers, look, wait until they finished the trial."""
    tally = Tally(pattern)
    for trial in range(trials):
        channel.post(CTRL_OBSERVER, trial + 1)
        if tally.add(chosen.observer(mem, base, trial, channel)) and stop_on_violation:
            channel.post(CTRL_OBSERVER, trial + 1, STOP)
            return tally.result()
        channel.wait(CTRL_WRITER, trial + 1)
        if chosen.writer_b is not None:
            channel.wait(CTRL_WRITER_B, trial + 1)
    channel.post(CTRL_OBSERVER, trials, STOP)
    return tally.result()


def _observe_concurrently(
    mem: Memory,
    base: int,
    pattern: str,
    chosen: Pattern,
    channel: Channel,
    trials: int,
) -> LitmusResult:
    """Observe for the writer's whole run (so it always writes its trials), then once more."""
    tally = Tally(pattern)
    channel.post(CTRL_OBSERVER, 1)
    deadline = time.monotonic() + channel.timeout
    while True:
        done = channel.peek(CTRL_WRITER)[0] >= trials
        tally.add(chosen.observer(mem, base, tally.looks, channel))
        channel.post(LOOKS, tally.looks)
        if done:
            break
        if time.monotonic() > deadline:
            raise CoherenceError(
                f"litmus writer of {pattern!r} did not finish in {channel.timeout} s"
            )
    channel.post(CTRL_OBSERVER, 1, STOP)
    return tally.result()


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
    """A forked role: attach the pool as its own host, play the role, put (role, result)."""
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
    chosen = PATTERNS[pattern]
    roles = ["observer", "writer"] + (["writer_b"] if chosen.writer_b else [])
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
