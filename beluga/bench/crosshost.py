"""Cross-host litmus: ``beluga certify --role observer|writer`` on two hosts sharing memory.

The observer host creates a certification pool on the shared device, the
writer host attaches it (waiting until it appears), and then every litmus
pattern runs with its observer on one host and its writer on the other
(:func:`beluga.litmus.run_role`), talking only through the pool.
Patterns with a second writer run it on the observer's host, in a thread,
so that the two writers of one cache line sit on different hosts: that is
where a shared line loses data.

The two hosts first shake hands through two lines at the start of the data
area, each written by one side only (``write_line``/``read_line``)::

    writer:   write back its cached copies of the litmus areas; post (w, ack 0)
    observer: post (o, ack 0, trials); wait for the writer to ack o
    writer:   ack o
    observer: reset the litmus areas; post (o, ack w, trials); start
    writer:   on seeing its own nonce w acked: start, with the observer's trials

Nonces are fresh random numbers, so lines left by an earlier run are never
mistaken for a live peer, and the areas are reset only after the writer has
written back whatever an earlier run (a bug pattern that never flushes)
left dirty in its cache.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from typing import Any

from beluga import litmus
from beluga.bench.certify import (
    LABEL,
    LITMUS_STRIDE,
    Log,
    Settings,
    certify_pool,
    document,
    litmus_row,
)
from beluga.child import wait_until
from beluga.coherence import LINE, Memory, read_line, write_line
from beluga.errors import CoherenceError, PoolError
from beluga.pool import Pool, parse_spec

ROLES = ("observer", "writer")
_HELLO = struct.Struct("<QQQQ")  # magic, nonce, ack, trials
_MAGIC = int.from_bytes(b"BLGCERT1", "little")
_HANDSHAKE_PAUSE_S = 0.0002  # between looks at the peer's hello line
OBSERVER_LINE, WRITER_LINE = 0, LINE
AREAS_AT = 4096
AREAS_BYTES = len(litmus.PATTERNS) * LITMUS_STRIDE


def _post(mem: Memory, off: int, nonce: int, ack: int, trials: int = 0) -> None:
    write_line(mem, off, _HELLO.pack(_MAGIC, nonce, ack, trials).ljust(LINE, b"\0"))


def _peek(mem: Memory, off: int) -> tuple[int, int, int] | None:
    """(nonce, ack, trials) of a hello line, or None if no peer wrote one."""
    magic, nonce, ack, trials = _HELLO.unpack_from(read_line(mem, off))
    return (nonce, ack, trials) if magic == _MAGIC else None


def _nonce() -> int:
    return int.from_bytes(os.urandom(8), "little") or 1


def _no_answer(what: str) -> str:
    return (
        f"no answer from the other host while waiting for {what}; start "
        "'beluga certify --role observer' on one host and '--role writer' on the other, "
        "both on the same device"
    )


def _observer_handshake(mem: Memory, base: int, trials: int, timeout: float) -> None:
    o = _nonce()
    _post(mem, base + OBSERVER_LINE, o, 0, trials)

    def answered() -> tuple[int, int, int] | None:
        hello = _peek(mem, base + WRITER_LINE)
        return hello if hello and hello[1] == o else None

    hello = wait_until(
        answered,
        timeout,
        _no_answer("the writer host to answer"),
        error=CoherenceError,
        pause=_HANDSHAKE_PAUSE_S,
    )
    mem.flush(base + AREAS_AT, AREAS_BYTES)  # drop our own stale lines before the reset
    mem.sfence()
    for i in range(len(litmus.PATTERNS)):
        litmus.reset_area(mem, base + AREAS_AT + i * LITMUS_STRIDE)
    _post(mem, base + OBSERVER_LINE, o, hello[0], trials)


def _writer_handshake(mem: Memory, base: int, timeout: float) -> int:
    """Returns the observer's trial count."""
    mem.flush(base + AREAS_AT, AREAS_BYTES)
    mem.sfence()
    w, acked = _nonce(), 0
    _post(mem, base + WRITER_LINE, w, 0)

    def answered() -> tuple[int, int, int] | None:
        nonlocal acked
        hello = _peek(mem, base + OBSERVER_LINE)
        if hello and hello[1] == w:
            return hello
        if hello and hello[0] != acked:
            acked = hello[0]
            _post(mem, base + WRITER_LINE, w, acked)
        return None

    hello = wait_until(
        answered,
        timeout,
        _no_answer("the observer host to start"),
        error=CoherenceError,
        pause=_HANDSHAKE_PAUSE_S,
    )
    return hello[2]


def _attach_when_ready(spec: str, timeout: float) -> Pool:
    """The observer's certification pool, once it exists (the observer creates it)."""
    seen = "nothing"

    def attached() -> Pool | None:
        nonlocal seen
        try:
            pool = Pool.attach(spec, coherence="native")
        except PoolError as e:
            seen = str(e)
            return None
        if pool.superblock.label == LABEL:
            return pool
        seen = f"a pool labelled {pool.superblock.label!r}, not a certification pool"
        pool.close()
        return None

    return wait_until(
        attached,
        timeout,
        lambda: (
            f"no certification pool appeared on {spec} within {timeout} s (last seen: "
            f"{seen}); start 'beluga certify --role observer' on the other host first"
        ),
        error=PoolError,
        pause=0.05,
    )


def _observe(mem: Memory, base: int, trials: int, timeout: float) -> list[dict[str, Any]]:
    rows = []
    for i, (name, pattern) in enumerate(litmus.PATTERNS.items()):
        area = base + AREAS_AT + i * LITMUS_STRIDE
        second: list[BaseException] = []

        def writer_b(area: int = area, name: str = name, second: list = second) -> None:
            try:
                litmus.run_role(mem, area, name, "writer_b", trials, timeout=timeout)
            except BaseException as e:  # reported by the observer's thread below
                second.append(e)

        helper = threading.Thread(target=writer_b, daemon=True) if pattern.writer_b else None
        if helper:
            helper.start()
        result = litmus.run_role(mem, area, name, "observer", trials, timeout=timeout)
        if helper:
            helper.join(timeout)
            if helper.is_alive() or second:
                raise CoherenceError(
                    f"the second writer of {name!r} on this host failed: "
                    f"{second[0] if second else 'it did not finish'}"
                )
        rows.append(litmus_row(result, pattern.is_bug))
    return rows


def _write(mem: Memory, base: int, trials: int, timeout: float) -> list[dict[str, Any]]:
    rows = []
    for i, name in enumerate(litmus.PATTERNS):
        r = litmus.run_role(
            mem, base + AREAS_AT + i * LITMUS_STRIDE, name, "writer", trials, timeout=timeout
        )
        rows.append({"pattern": name, "trials_written": r.trials})
    mem.flush(base + AREAS_AT, AREAS_BYTES)  # leave nothing dirty for the next run
    mem.sfence()
    return rows


def run_role(
    spec: str,
    role: str,
    settings: Settings,
    *,
    force: bool = False,
    timeout: float = 120.0,
    log: Log = lambda line: None,
) -> dict[str, Any]:
    """Play one host's part of the cross-host litmus run; the report's document."""
    if role not in ROLES:
        raise ValueError(f"--role must be one of {ROLES}, not {role!r}")
    began = time.time()
    backend = parse_spec(spec)
    log(f"litmus_cross_host ({role}) ...")
    if role == "observer":
        with certify_pool(backend, AREAS_AT + AREAS_BYTES, force) as pool:
            target = {**backend.info(), "pool_bytes": pool.superblock.pool_size}
            base = pool.superblock.payloads.offset
            _observer_handshake(pool.memory, base, settings.litmus_trials, timeout)
            rows = _observe(pool.memory, base, settings.litmus_trials, timeout)
    else:
        with _attach_when_ready(backend.spec, timeout) as pool:
            target = {**backend.info(), "pool_bytes": pool.superblock.pool_size}
            base = pool.superblock.payloads.offset
            trials = _writer_handshake(pool.memory, base, timeout)
            rows = _write(pool.memory, base, trials, timeout)
    section = {
        "status": "ok",
        "role": role,
        "mode": "native",
        "hosts": "two (this one and the peer)",
        "rows": rows,
        "seconds": round(time.time() - began, 3),
    }
    log(f"litmus_cross_host ({role}): ok ({section['seconds']:.1f} s)")
    return document(backend.spec, target, settings, {"litmus_cross_host": section}, began)
