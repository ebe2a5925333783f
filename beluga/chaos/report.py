"""The outcome of a chaos run: figures, findings, and the seed that replays it."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from beluga.chaos.config import ChaosConfig, replay_command
from beluga.chaos.verifier import Findings


@dataclass
class ChaosReport:
    """Everything a run measured.  A plain value: thread-safe to read, picklable."""

    seed: int
    config: ChaosConfig
    wall_s: float
    faults: dict[str, int]
    fault_log: list[dict[str, Any]]
    mid_payload_reused: int
    findings: Findings
    hangs: list[dict[str, Any]]
    errors: dict[str, int]
    error_samples: dict[str, Counter[str]]
    corrupted_keys: list[str]
    evictions_seen: int
    server_peaks: dict[str, int]
    server_restarts: int
    #: per server kill or stall (``kind``): pid killed or stalled, the standby that took the
    #: seat (by, seat_s), fenced_s (a stall's fence), outage_s
    takeovers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: standbys that stored the seat line at the moment another did, and went back to waiting
    seat_races_lost: int = 0
    #: connects (KVStore opens) refused because every host id was held, by the dead or alive
    ids_refused: int = 0

    @property
    def faults_total(self) -> int:
        return sum(self.faults.values())

    @property
    def wrong_bytes(self) -> int:
        return self.findings.wrong_count

    @property
    def lost_acked_writes(self) -> int:
        return self.findings.lost_count

    @property
    def uncommitted_reads(self) -> int:
        return self.findings.uncommitted_count

    @property
    def reads_verified(self) -> int:
        """Reads judged: values checked byte by byte, plus misses checked against the acks."""
        return self.findings.values_verified + self.findings.misses

    @property
    def stalls_fenced(self) -> dict[str, int]:
        """Stalls past takeover_after (``stall_server``): how many, and how many a standby
        fenced (killed) before it took the seat; the rest the server outlived."""
        stalls = [t for t in self.takeovers if t.get("kind") == "stall"]
        return {"stalls": len(stalls), "fenced": sum("fenced_s" in t for t in stalls)}

    @property
    def seat_violations(self) -> int:
        """Standbys seen in the seat of a server that was not gone (never allowed)."""
        return self.errors.get("StandbyTookALiveSeat", 0)

    def outage(self, kind: str = "kill") -> dict[str, Any]:
        """The write outage per server kill (``kind`` "stall": per stall past the standbys'
        takeover_after) while writers run: the fault to the first put tried after it and
        acknowledged (p50, p99, max in s; ``unmeasured``: faults no put followed)."""
        run = [
            t for t in self.takeovers
            if t.get("during") != "audit" and t.get("kind", "kill") == kind
        ]  # fmt: skip
        xs = sorted(t["outage_s"] for t in run if t["outage_s"] is not None)
        unmeasured = len(run) - len(xs)
        if not xs:
            return {"n": 0, "unmeasured": unmeasured}

        def pct(q: float) -> float:
            return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]

        return {
            "n": len(xs),
            "p50": pct(0.5),
            "p99": pct(0.99),
            "max": xs[-1],
            "unmeasured": unmeasured,
        }

    @property
    def ok(self) -> bool:
        """Whether Beluga kept every promise in this run."""
        return not (
            self.wrong_bytes
            or self.lost_acked_writes
            or self.uncommitted_reads
            or self.hangs
            or self.seat_violations
        )

    def replay_command(self) -> str:
        return replay_command(self.seed, self.config)

    def to_json(self) -> dict[str, Any]:
        f = self.findings
        config = dataclasses.asdict(self.config)
        return {
            "seed": self.seed,
            "replay": self.replay_command(),
            "ok": self.ok,
            "wall_s": self.wall_s,
            "config": config,
            "faults_total": self.faults_total,
            "faults": dict(sorted(self.faults.items())),
            "mid_payload_extent_reused": self.mid_payload_reused,
            "server_restarts": self.server_restarts,
            "standbys": self.config.standbys,
            "write_outage_s": self.outage(),
            "stall_outage_s": self.outage("stall"),
            "stalls_fenced": self.stalls_fenced,
            "seat_violations": self.seat_violations,
            "seat_races_lost": self.seat_races_lost,
            "connects_refused_for_host_ids": self.ids_refused,
            "reads_verified": self.reads_verified,
            "values_verified": f.values_verified,
            "bytes_verified": f.bytes_verified,
            "misses": f.misses,
            "reads_by_path": dict(sorted(f.reads_by_path.items())),
            "writes": dict(sorted(f.writes.items())),
            "wrong_bytes": self.wrong_bytes,
            "lost_acked_writes": self.lost_acked_writes,
            "uncommitted_reads": self.uncommitted_reads,
            "hangs": len(self.hangs),
            "excused_misses": dict(f.excused),
            "findings_by_phase": dict(sorted(f.by_phase.items())),
            "wrong_bytes_by_cause": dict(sorted(f.wrong_by_cause.items())),
            "corrupted_keys": self.corrupted_keys,
            "evictions_seen": self.evictions_seen,
            "server_peaks": self.server_peaks,
            "errors": dict(sorted(self.errors.items())),
            "error_messages": {k: dict(v.most_common()) for k, v in self.error_samples.items()},
            "details": {
                "wrong_bytes": f.wrong,
                "lost_acked_writes": f.lost,
                "uncommitted_reads": f.uncommitted,
                "hangs": self.hangs,
                "takeovers": self.takeovers,
            },
            "fault_log": self.fault_log,
        }

    def summary(self) -> str:
        """A few lines for a terminal."""
        f = self.findings
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))
        paths = ", ".join(f"{k} {v}" for k, v in sorted(f.reads_by_path.items()))
        errors = ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "none"
        phases = ", ".join(f"{k} {v}" for k, v in sorted(f.by_phase.items())) or "none"
        causes = ", ".join(f"{k} {v}" for k, v in sorted(f.wrong_by_cause.items())) or "none"
        excused = ", ".join(f"{k} {v}" for k, v in sorted(f.excused.items())) or "none"
        lines = [
            f"seed {self.seed}: {'OK' if self.ok else 'PROMISES BROKEN'} in {self.wall_s:.1f} s "
            f"(replay: {self.replay_command()})",
            f"faults injected: {self.faults_total} ({faults}); mid-payload stops whose extent "
            f"was reused: {self.mid_payload_reused}",
            f"reads verified: {self.reads_verified} ({f.values_verified} values, "
            f"{f.bytes_verified} bytes, {f.misses} misses; {paths})",
            f"wrong bytes: {self.wrong_bytes}; lost acknowledged writes: "
            f"{self.lost_acked_writes}; uncommitted values read: {self.uncommitted_reads}; "
            f"hangs: {len(self.hangs)}",
            f"misses excused: {excused}; keys deliberately corrupted: "
            f"{len(self.corrupted_keys)}; evictions seen: {self.evictions_seen}; server peaks: "
            f"{self.server_peaks}",
            f"findings by phase: {phases}",
            f"wrong bytes by path/reason/key: {causes}",
            f"errors by type: {errors}; connects refused for lack of host ids: {self.ids_refused}",
        ]
        kills = [t for t in self.takeovers if t.get("kind", "kill") == "kill"]
        if kills:
            o = self.outage()
            who = "standby takeovers" if self.config.standbys else "server restarts"
            lines.append(
                f"write outage per server kill ({who}, {len(kills)} kills): "
                + (
                    f"p50 {o['p50']:.3f} s, p99 {o['p99']:.3f} s, max {o['max']:.3f} s"
                    if o["n"]
                    else "no put followed a kill"
                )
                + (f"; {o['unmeasured']} kills with no put after them" if o["unmeasured"] else "")
                + f"; standbys in a live server's seat: {self.seat_violations}"
                + (
                    f"; seat races a standby lost (and waited again): {self.seat_races_lost}"
                    if self.seat_races_lost
                    else ""
                )
            )
        fenced = self.stalls_fenced
        if fenced["stalls"]:
            o = self.outage("stall")
            lines.append(
                f"servers stalled past takeover_after ({self.config.takeover_after_s:g} s): "
                f"{fenced['stalls']}, fenced by a standby {fenced['fenced']}; write outage per "
                "stall: "
                + (
                    f"p50 {o['p50']:.3f} s, p99 {o['p99']:.3f} s, max {o['max']:.3f} s"
                    if o["n"]
                    else "no put followed a stall"
                )
            )
        for kind, items in (
            ("wrong bytes", f.wrong),
            ("lost acknowledged write", f.lost),
            ("uncommitted value", f.uncommitted),
            ("hang", self.hangs),
        ):
            for item in items[:5]:
                lines.append(f"  {kind}: {item}")
        return "\n".join(lines)
