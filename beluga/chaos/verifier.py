"""The history of a chaos run and the checks over it.

Writers report each put or remove twice: ``try`` before the call and
``done`` after it returned (``ack``), failed definitely (``lease``: the server
refused the commit) or failed otherwise (``error:...``, which may or may not
have taken effect).  An operation whose writer was killed before it reported
has an unknown outcome.  Readers report each key they read with the time the
read started and ended and what came back, already judged byte by byte
(:mod:`beluga.chaos.values`).

The checks, per read of key ``k`` over ``[t0, t1]``, where the *floor* is
the acknowledged operation of ``k`` with the highest serial whose ``done``
came before ``t0`` (what linearizability obliges the read to see):

wrong bytes
    the reader judged the bytes wrong (another key's value, torn, garbage), or
    they name a serial nobody wrote for ``k`` (a phantom), or a write that
    started only after the read ended.
lost acknowledged write
    a value older than the floor, or a miss when the floor is a put, unless a
    later operation of ``k`` explains the miss: a remove that may have landed
    (tried before ``t1``; not a loss), a put in flight during the read (the
    value was replaced twice under the read: excused as ``concurrent write``),
    or a deliberate corruption of ``k``'s block after the floor's write began
    (excused as ``corrupted``; a corrupted block must read as a miss, and that
    miss is not a loss we count).
Every lost write found carries what tells a lost write from a verifier gap:
``history``, the key's operations around the read (serial, kind, role,
tried, done, outcome); ``reader``, for a miss, why the read path missed (the
in-place path's index miss or header Miss code), the pool index probed again
right after, and the server's own view of the key then (an RPC LOOKUP); and
the faults that touched the key.

uncommitted value
    a value whose put the server refused (``lease``), with no server restart
    during that put (a restart can replay a commit the old server had done).

Writes that took no effect by design are ``skipped`` (a save without
``replace`` whose key was present, or in flight elsewhere): their value was
never written, so reading it is wrong bytes (reason ``skipped``).

A reader following ``KVStore.retired`` reports each answer (``retired``):
every key it names must have had a way out of the pool since the follower's
last answer (a remove tried before this answer ended that had not ended before
the last one began; or its block corrupted, which a reader that drops corrupt
values removes), and an answer after a server restart must say it has a gap
(the new server's life knows nothing of the old one's retirements).  A failure of
either is wrong bytes on the ``retired`` path.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

#: seconds after a writer died or gave up during which its requests may still land
LATE_EFFECT_S = 3.0
_DETAILS = 200  # findings kept with full detail per category
_HISTORY = 8  # operations of a key shown around a lost write


@dataclass
class WriteOp:
    """One put or remove as its writer reported it (History's own record; not shared)."""

    key: int
    serial: int
    kind: str  # "remove", or a put: "put", "save" (without replace), "upsert" (a drop-in's)
    role: str
    t_try: float
    t_done: float = math.inf
    outcome: str = "pending"  # ack | lease | error:Type | unknown
    t_end: float = math.inf  # when its effects can no longer land


@dataclass
class Read:
    """One key read as its reader reported it (History's own record; not shared)."""

    role: str
    path: str
    key: int
    t0: float
    t1: float
    # None or ("miss", why) | (writer, serial, nbytes) | ("wrong", reason, detail, writer, serial)
    result: Any


@dataclass
class RetiredAnswer:
    """One answer of RETIRED as its follower reported it (History's own record)."""

    role: str
    t0: float
    t1: float
    keys: list[int]  # -1: a digest of no key of the run
    gap: bool


@dataclass
class Findings:
    """What the checks found over a whole history.

    A plain value built by :meth:`History.check`: not thread-safe while it is
    filled, safe to read and to pickle afterwards.
    """

    values_verified: int = 0
    bytes_verified: int = 0
    misses: int = 0
    reads_by_path: Counter[str] = field(default_factory=Counter)
    wrong: list[dict[str, Any]] = field(default_factory=list)
    wrong_count: int = 0
    lost: list[dict[str, Any]] = field(default_factory=list)
    lost_count: int = 0
    uncommitted: list[dict[str, Any]] = field(default_factory=list)
    uncommitted_count: int = 0
    excused: Counter[str] = field(default_factory=Counter)
    writes: Counter[str] = field(default_factory=Counter)
    #: findings by kind and phase: "run" (during the faults), "audit", "audit after restart"
    by_phase: Counter[str] = field(default_factory=Counter)
    #: wrong bytes by read path, reason, and whether the key's block was deliberately corrupted
    wrong_by_cause: Counter[str] = field(default_factory=Counter)

    def add(self, kind: str, item: dict[str, Any]) -> None:
        setattr(self, f"{kind}_count", getattr(self, f"{kind}_count") + 1)
        self.by_phase[f"{kind}/{item['phase']}"] += 1
        if kind == "wrong":
            hit = "corrupted key" if item["key_was_corrupted"] else "intact key"
            self.wrong_by_cause[f"{item['path']}/{item['reason']}/{hit}"] += 1
        details = getattr(self, kind)
        if len(details) < _DETAILS:
            details.append(item)


class History:
    """Everything the roles reported, and the checks over it.

    Not thread-safe (the driver's one thread feeds it); not fork-safe (no
    meaning in a child).
    """

    def __init__(self, keys: list[str], owner: list[int], origin: float = 0.0) -> None:
        self.keys = keys
        self.owner = owner  # writer slot of each key
        self.origin = origin  # reported times are seconds since this monotonic instant
        self.phases: dict[str, str] = {}  # role name -> phase label, for auditors
        self.ops: dict[tuple[int, int], WriteOp] = {}
        self.pending: dict[str, list[WriteOp]] = defaultdict(list)
        self.reads: list[Read] = []
        self.retirements: list[RetiredAnswer] = []
        self.corruptions: dict[int, list[float]] = defaultdict(list)
        #: each server death: (before its signal was sent, after it surely answered no more)
        self.server_kills: list[tuple[float, float]] = []
        self.evictions: dict[int, int] = {}
        self.peaks: dict[str, int] = {}  # the highest of each server counter seen
        self.live_wrong = 0

    # -- what the roles and the driver report --------------------------------

    def tried(self, role: str, t: float, items: list[tuple[int, int, str]]) -> None:
        for key, serial, kind in items:
            op = WriteOp(key, serial, kind, role, t)
            self.ops[key, serial] = op
            self.pending[role].append(op)

    def done(self, role: str, t: float, items: list[tuple[int, int]], outcome: str) -> None:
        for key, serial in items:
            op = self.ops.get((key, serial))
            if op is None:
                continue
            op.t_done, op.outcome = t, outcome
            definite = outcome in ("ack", "lease", "skipped")
            op.t_end = t if definite else t + LATE_EFFECT_S
            if op in self.pending[role]:
                self.pending[role].remove(op)

    def role_died(self, role: str, t: float) -> None:
        """A role was killed: what it had in flight has an unknown outcome."""
        for op in self.pending.pop(role, []):
            op.outcome = "unknown"
            op.t_end = t + LATE_EFFECT_S

    def read(self, role: str, t0: float, t1: float, path: str, results: list) -> None:
        for key, result in results:
            self.reads.append(Read(role, path, key, t0, t1, result))
            if isinstance(result, tuple) and result and result[0] == "wrong":
                self.live_wrong += 1

    def retired(self, role: str, t0: float, t1: float, keys: list[int], gap: bool) -> None:
        """One message of a RETIRED answer (a long answer comes in several, with one t0, t1)."""
        mine = [a for a in self.retirements[-8:] if a.role == role]
        if mine and (mine[-1].t0, mine[-1].t1) == (t0, t1):
            mine[-1].keys += keys
            mine[-1].gap |= gap
            return
        self.retirements.append(RetiredAnswer(role, t0, t1, list(keys), gap))

    def corrupted(self, key: int, t: float) -> None:
        self.corruptions[key].append(t)

    def server_killed(self, t: float, dead: float | None = None) -> None:
        """The serving server died (or stopped for good): it may have answered until ``t``
        (taken before the signal was sent) and answered nothing after ``dead`` (default
        ``t``).  A signal lands some time after it is sent: on 2026-12-05 a RETIRED answer
        0.2 ms after a kill's ``t`` still came from the killed server (its epoch)."""
        self.server_kills.append((t, t if dead is None else dead))

    def stats(self, epoch: int, counters: dict[str, int]) -> None:
        """A server's counters as a writer saw them (they restart with every server)."""
        self.evictions[epoch] = max(self.evictions.get(epoch, 0), counters["evictions"])
        for name, value in counters.items():
            if name != "evictions":
                self.peaks[name] = max(self.peaks.get(name, 0), value)

    def first_acks_after(self, times: list[float]) -> list[float | None]:
        """For each instant, when the first put tried at or after it was acknowledged."""
        acked = sorted(
            (o.t_try, o.t_done)
            for o in self.ops.values()
            if o.kind != "remove" and o.outcome == "ack"
        )
        suffix: list[float] = [math.inf] * (len(acked) + 1)
        for i in range(len(acked) - 1, -1, -1):
            suffix[i] = min(suffix[i + 1], acked[i][1])
        tries = [t for t, _ in acked]
        out: list[float | None] = []
        for t in times:
            first = suffix[bisect.bisect_left(tries, t)]
            out.append(None if first == math.inf else first)
        return out

    @property
    def evictions_seen(self) -> int:
        return sum(self.evictions.values())

    # -- the checks ----------------------------------------------------------

    def check(self) -> Findings:
        f = Findings()
        by_key: dict[int, list[WriteOp]] = defaultdict(list)
        for op in self.ops.values():
            by_key[op.key].append(op)
            f.writes[f"{op.kind}:{op.outcome.split(':')[0]}"] += 1
        # per key, acknowledgements in time order and the highest-serial one so far
        acked: dict[int, tuple[list[float], list[WriteOp]]] = {}
        for key, ops in by_key.items():
            ops.sort(key=lambda o: o.serial)
            done = sorted((o for o in ops if o.outcome == "ack"), key=lambda o: o.t_done)
            highest: list[WriteOp] = []
            for o in done:
                highest.append(o if not highest or o.serial > highest[-1].serial else highest[-1])
            acked[key] = ([o.t_done for o in done], highest)
        for r in self.reads:
            f.reads_by_path[r.path] += 1
            times, highest = acked.get(r.key, ([], []))
            n = bisect.bisect_left(times, r.t0)
            floor = highest[n - 1] if n else None
            if r.result is None or r.result[0] == "miss":
                f.misses += 1
                self._check_miss(f, r, floor, by_key.get(r.key, []))
            elif r.result[0] == "wrong":
                f.add("wrong", self._describe(r, reason=r.result[1], detail=r.result[2]))
            else:
                self._check_value(f, r, floor)
        self._check_retired(f, by_key)
        return f

    def _check_retired(self, f: Findings, by_key: dict[int, list[WriteOp]]) -> None:
        """Each RETIRED answer names only keys that had a way out, and says when a server
        restart since the follower's last answer may have hidden some (a gap)."""
        last: dict[str, RetiredAnswer] = {}
        unreported = self._unreported_gaps()
        for a in sorted(self.retirements, key=lambda a: (a.role, a.t0)):
            prev = last.get(a.role)
            last[a.role] = a
            f.reads_by_path["retired"] += 1
            if id(a) in unreported:
                killed, ended = unreported[id(a)]
                f.add(
                    "wrong",
                    self._retired_item(
                        a,
                        -1,
                        "unreported gap",
                        f"the server restarted at {self._at(killed)}, after an answer that "
                        f"ended {self._at(ended)}, and no answer since says there is a gap",
                    ),
                )
            # a key left between the server's last answer and this one (from its oldest kept,
            # after a gap): a remove that took effect then was tried before this answer ended
            # and had not ended before the last one began
            after = prev.t0 if prev is not None and not a.gap else -math.inf
            for key in a.keys:
                if key >= 0 and self.evictions_seen:  # evictions name no key in the history
                    f.excused["retired: evictions"] += 1
                    continue
                removes = [
                    o
                    for o in by_key.get(key, [])
                    if o.kind == "remove" and o.t_try <= a.t1 and o.t_end >= after
                ]
                hit = [t for t in self.corruptions.get(key, []) if t <= a.t1]
                if key < 0 or not (removes or hit):
                    f.add(
                        "wrong",
                        self._retired_item(
                            a,
                            key,
                            "unexplained retirement",
                            "reported as gone, with no remove tried and no corruption of its "
                            "block before the answer"
                            if key >= 0
                            else "a digest of no key of this run",
                        ),
                    )

    def _unreported_gaps(self) -> dict[int, tuple[float, float]]:
        """The answers (by ``id``) that a follower got with no gap said across a server death:
        of its answers from the last one surely the dead server's (ended before the signal
        was sent) to the first one surely another's (begun once it was dead), none says
        there is a gap.  Answers in between may have been either server's."""
        by_role: dict[str, list[RetiredAnswer]] = defaultdict(list)
        for a in sorted(self.retirements, key=lambda a: a.t0):
            by_role[a.role].append(a)
        found: dict[int, tuple[float, float]] = {}
        for answers in by_role.values():
            for killed, dead in self.server_kills:
                before = [i for i, a in enumerate(answers) if a.t1 < killed]
                after = next((i for i, a in enumerate(answers) if a.t0 > dead), None)
                if not before or after is None:
                    continue
                if not any(a.gap for a in answers[before[-1] + 1 : after + 1]):
                    found.setdefault(id(answers[after]), (killed, answers[before[-1]].t1))
        return found

    def _retired_item(self, a: RetiredAnswer, key: int, reason: str, detail: str) -> dict[str, Any]:
        return {
            "key": self.keys[key] if key >= 0 else None,
            "path": "retired",
            "role": a.role,
            "phase": self.phases.get(a.role, "run"),
            "t0": round(a.t0 - self.origin, 4),
            "t1": round(a.t1 - self.origin, 4),
            "key_was_corrupted": key >= 0 and bool(self.corruptions.get(key)),
            "reason": reason,
            "detail": detail,
        }

    def _describe(self, r: Read, **extra: Any) -> dict[str, Any]:
        hits = [t for t in self.corruptions.get(r.key, []) if t <= r.t1]
        return {
            "key": self.keys[r.key],
            "path": r.path,
            "role": r.role,
            "phase": self.phases.get(r.role, "run"),
            "t0": round(r.t0 - self.origin, 4),
            "t1": round(r.t1 - self.origin, 4),
            "key_was_corrupted": bool(hits),
            **extra,
        }

    def _at(self, t: float) -> str:
        return f"{t - self.origin:.4f}"

    def _check_value(self, f: Findings, r: Read, floor: WriteOp | None) -> None:
        writer, serial, nbytes = r.result
        op = self.ops.get((r.key, serial))
        if op is None or writer != self.owner[r.key]:
            f.add(
                "wrong",
                self._describe(
                    r,
                    reason="phantom",
                    detail=f"serial {serial:#x} of writer {writer} was never written to this key",
                ),
            )
            return
        if op.t_try > r.t1:
            f.add(
                "wrong",
                self._describe(
                    r, reason="future", detail=f"serial {serial:#x} was read before its write began"
                ),
            )
            return
        if op.outcome == "skipped":
            f.add(
                "wrong",
                self._describe(
                    r,
                    reason="skipped",
                    detail=f"serial {serial:#x}: its save skipped the key (present, or in flight "
                    "elsewhere) and wrote nothing, yet a read returned it",
                ),
            )
            return
        f.values_verified += 1
        f.bytes_verified += nbytes
        # stale: the write read had ended (acknowledged) before the newer acknowledged one
        # began; two writes of a key that overlap in time may take effect in either order
        # (both acknowledged, the one committed last is what reads return)
        if floor is not None and serial < floor.serial and op.t_done < floor.t_try:
            what = "an acknowledged remove was undone" if floor.kind == "remove" else "older"
            f.add(
                "lost",
                self._describe(
                    r,
                    history=self._history(list(self._ops_of(r.key)), r),
                    reason="stale",
                    detail=f"{what}: serial {serial:#x} "
                    f"returned after {floor.kind} {floor.serial:#x} was "
                    f"acknowledged at {self._at(floor.t_done)}",
                ),
            )
        if op.outcome == "lease" and not self._restart_during(op):
            f.add(
                "uncommitted",
                self._describe(
                    r,
                    reason="uncommitted",
                    detail=f"serial "
                    f"{serial:#x}: its commit was refused "
                    f"(lost write lease; {op.kind} by {op.role} tried at {self._at(op.t_try)}, "
                    f"refused at {self._at(op.t_done)}) yet a read returned it",
                ),
            )

    def _check_miss(self, f: Findings, r: Read, floor: WriteOp | None, ops: list[WriteOp]) -> None:
        if floor is None or floor.kind == "remove":
            return
        later = [o for o in ops if o.serial > floor.serial and o.t_try < r.t1]
        if any(o.kind == "remove" for o in later):
            return
        if any(o.t_end > r.t0 for o in later):
            f.excused["concurrent write"] += 1
            return
        if any(floor.t_try <= t <= r.t1 for t in self.corruptions.get(r.key, [])):
            f.excused["corrupted"] += 1
            return
        f.add(
            "lost",
            self._describe(
                r,
                reason="miss",
                detail=f"put {floor.serial:#x} was acknowledged at "
                f"{self._at(floor.t_done)}, the read began at {self._at(r.t0)}",
                reader=r.result[1] if r.result is not None else None,
                history=self._history(ops, r),
                corrupted_at=[self._at(t) for t in self.corruptions.get(r.key, [])],
                server_killed_at=[self._at(t) for t, _ in self.server_kills if t <= r.t1],
            ),
        )

    def _history(self, ops: list[WriteOp], r: Read) -> list[str]:
        """The key's operations nearest the read, one line each, in serial order."""
        ops = sorted(ops, key=lambda o: o.serial)
        before = [o for o in ops if o.t_try <= r.t1][-_HISTORY:]
        after = [o for o in ops if o.t_try > r.t1][:2]
        return [
            f"{o.kind} {o.serial:#x} by {o.role}: tried {self._at(o.t_try)}, "
            f"{o.outcome} at {self._at(o.t_done) if o.t_done != math.inf else '-'}"
            for o in before + after
        ]

    def _ops_of(self, key: int) -> list[WriteOp]:
        return [o for (k, _), o in self.ops.items() if k == key]

    def _restart_during(self, op: WriteOp) -> bool:
        return any(op.t_try <= dead and t <= op.t_done for t, dead in self.server_kills)
