"""The chaos tier's CI rounds: hundreds of faults, every read checked.

Each round runs a real metadata server process, writers, in-place writers
and readers in their own processes, and injects at least 200 faults of every
kind (SIGKILL and SIGSTOP of each role, an in-place writer stalled
mid-payload past its write lease, hostile bytes in RPC slots, block headers
and payloads).  It must end with no wrong bytes, no lost acknowledged write,
no uncommitted value read and no hang.  Writers write three ways (put and
put_batch; save without ``replace``, with ``wait_s``, beside a second save of
overlapping keys; the Mooncake drop-in's upserts), readers drop corrupt values
on the in-place path, and one follows RETIRED: a round must reach each.

The seed is drawn once per session unless ``BELUGA_CHAOS_SEED`` is set.
Each round prints it to the terminal as it starts (past pytest's capture,
so it is in every CI log whatever then happens to the round), and every
assertion message carries it with the two ways to replay it:
``BELUGA_CHAOS_SEED=N python -m pytest tests/chaos/test_chaos.py`` (both
rounds), or ``beluga chaos --seed N --faults 200 [--coherence mixed]`` (one
round's faults).
"""

from __future__ import annotations

import os
import random

import pytest

import beluga.compat.mooncake.chaos  # noqa: F401  (registers the Mooncake drop-in as a writer client)
from beluga.chaos import KINDS, ChaosConfig, ChaosError, ChaosReport, run_chaos
from beluga.chaos.roles import READ_PATHS

FAULTS = 200
#: the rounds of test_a_chaos_round_breaks_no_promise: (coherence, standbys).  CI runs the
#: model's round (every killed server restarted, half the clients non-coherent) and the
#: standbys' (every killed server taken over); BELUGA_STRESS=full adds the native round
#: without standbys.
ROUNDS = [("mixed", 0), ("native", 2)]
if os.environ.get("BELUGA_STRESS") == "full":
    ROUNDS.insert(0, ("native", 0))
#: the seed of this session's rounds: $BELUGA_CHAOS_SEED, else a fresh one
SEED = int(os.environ.get("BELUGA_CHAOS_SEED") or random.SystemRandom().getrandbits(32))
REPLAY = f"BELUGA_CHAOS_SEED={SEED} python -m pytest tests/chaos/test_chaos.py"


def _round(
    name: str, config: ChaosConfig, capsys: pytest.CaptureFixture[str]
) -> tuple[ChaosReport, str]:
    """Run one round, its seed printed past pytest's capture first; the report and the text
    every assertion message carries (its summary and both ways to replay it)."""
    with capsys.disabled():
        print(f"\nchaos {name}: seed {SEED}; replay: {REPLAY}", flush=True)
    try:
        report = run_chaos(config, log=print)
    except ChaosError as e:  # the round could not proceed: still say how to replay it
        pytest.fail(f"{e}\nreplay: {REPLAY}")
    print(report.summary())
    return report, f"\n{report.summary()}\nreplay: {report.replay_command()}, or {REPLAY}"


def _check(report: ChaosReport) -> None:
    why = f"\n{report.summary()}\nreplay: {report.replay_command()}, or {REPLAY}"
    assert report.faults_total >= FAULTS, f"too few faults injected{why}"
    kinds = [k for k in KINDS if k != "stall_server" or report.config.standbys]
    missing = [k for k in kinds if not report.faults.get(k)]
    assert not missing, f"fault kinds never injected: {missing}{why}"
    paths = report.findings.reads_by_path
    assert all(paths[p] >= 100 for p in READ_PATHS), f"a read path was barely exercised{why}"
    assert report.findings.values_verified >= 2000, f"too few values read{why}"
    writes = report.findings.writes
    reached = {
        "saves without replace that stored": writes["save:ack"],
        "saves that skipped a key": writes["save:skipped"],
        "upserts through the Mooncake drop-in": writes["upsert:ack"],
        "answers of RETIRED followed": paths["retired"],
    }
    missing_roles = [what for what, n in reached.items() if not n]
    assert not missing_roles, f"the roles never made {missing_roles}{why}"
    assert report.evictions_seen == 0, (
        f"the pool evicted values, so lost-write accounting is not exact: make it bigger{why}"
    )
    assert report.wrong_bytes == 0, f"reads returned wrong bytes{why}"
    assert report.lost_acked_writes == 0, f"acknowledged writes were lost{why}"
    assert report.uncommitted_reads == 0, f"values whose commit was refused were read{why}"
    assert not report.hangs, f"processes hung{why}"


@pytest.mark.leaves("keys", "writes")  # writers are killed and stalled mid-write on purpose
@pytest.mark.parametrize(("coherence", "standbys"), ROUNDS, ids=str)
def test_a_chaos_round_breaks_no_promise(
    shm_path: str,
    coherence: str,
    standbys: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``mixed``: every odd-numbered writer, in-place writer and reader runs under the
    non-coherent model (``coherence="model"``), the others natively.  With standbys, every
    killed server is replaced by a standby's takeover, and a stopped one must keep its seat."""
    config = ChaosConfig(
        faults=FAULTS, seed=SEED, coherence=coherence, pool_path=shm_path, standbys=standbys,
        writer_client="mooncake",
    )  # fmt: skip
    report, why = _round(f"round ({coherence}, {standbys} standbys)", config, capsys)
    _check(report)
    if standbys:
        assert report.seat_violations == 0, f"a standby took a live server's seat{why}"
        kills = [k for k in report.takeovers if k["kind"] == "kill" and k["during"] == "run"]
        assert kills and all("by" in k for k in kills), f"a kill was not taken over{why}"
        assert report.outage()["n"] >= 1, f"no write followed a takeover{why}"
        fenced = [k for k in report.takeovers if "fenced_s" in k]
        assert all("by" in k for k in fenced), f"a fenced server's seat was not taken{why}"


@pytest.mark.leaves("keys", "writes")
def test_a_round_recovering_while_serving_breaks_no_promise(
    shm_path: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The standby round with every server recovering while it serves
    (``BELUGA_RECOVER_WHILE_SERVING=1``, recovery regions of 64 blocks: the round's pool is
    some fifty regions).  It must see writes acknowledged during a recovery.  It has failed:
    on 2026-12-05 it lost an acknowledged write in one round of about 20 (a key read as "no
    entry" in the pool index shortly after a takeover), cause not found, and again in one
    of 216 rounds after the fixes tests/test_recovery_interleavings.py drove (the last 164
    clean, run with ``-s`` to keep a loss's details).  Its rich histories then found a
    stale read under hostile bytes, which this round's verifier counts as a lost write
    (fixed; whether it was the loss is not known); 38 rounds since, all clean.  After the
    fix for headers nobody can read (2026-12-06), one of 39 rounds lost a write again with
    the same symptom (seed 3349616984: "no entry" for 70 ms after an acknowledgement
    during a recovery that followed two kills 50 ms apart; docs/protocol.md has the
    details); 11 replays of that seed were clean.  On 2026-12-07 histories whose server's
    host dies inside operations (tests/test_dying_servers.py) found a path with exactly
    that symptom (a COMMIT sent again to a recovering server, acknowledged without
    naming the copy its scan had indexed) and others, all fixed; this round then ran
    clean repeatedly (docs/protocol.md has the count), the mode became the default for
    pools above one recovery region, and the round runs in CI."""
    monkeypatch.setenv("BELUGA_RECOVER_WHILE_SERVING", "1")  # inherited by every server
    monkeypatch.setenv("BELUGA_RECOVERY_REGION", "64")
    config = ChaosConfig(
        faults=FAULTS, seed=SEED, pool_path=shm_path, standbys=2, writer_client="mooncake",
    )  # fmt: skip
    report, why = _round("round recovering while serving (2 standbys)", config, capsys)
    _check(report)
    assert report.server_peaks.get("puts_while_recovering", 0) > 0, (
        f"no server acknowledged a write while it recovered{why}"
    )


@pytest.mark.leaves("keys", "writes")
def test_a_server_stalled_past_takeover_after_is_fenced_and_replaced(
    shm_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGSTOP the serving server for 1-2 s past the standbys' takeover_after: a standby
    SIGKILLs it, takes the seat and serves, with every read and acknowledged write checked;
    the driver's SIGCONT then reaches no one.  A stall the server outlived (a standby slower
    than the hold) is counted, and the round must still fence most of them."""
    weights = {"stall_server": 6, "corrupt_payload": 2, "kill_writer": 1, "stop_reader": 1}
    config = ChaosConfig(
        faults=16, seed=SEED, pool_path=shm_path, standbys=1, takeover_after_s=0.5,
        weights=weights, writer_client="mooncake",
    )  # fmt: skip
    report, why = _round("stall round", config, capsys)
    assert report.ok, f"a promise was broken{why}"
    stalls = report.stalls_fenced
    assert stalls["stalls"] >= 3, f"too few stalls injected{why}"
    assert stalls["fenced"] * 2 > stalls["stalls"], f"stalled servers were not fenced{why}"
    fenced = [k for k in report.takeovers if "fenced_s" in k]
    assert all("by" in k for k in fenced) and report.seat_violations == 0, why
    assert report.outage("stall")["n"] >= 1, f"no write followed a fenced stall{why}"


@pytest.mark.leaves("keys", "writes")
def test_across_emulated_hosts_a_standby_fences_by_command_and_takes_over(
    shm_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every server and standby a host of its own: a standby cannot see a killed or stopped
    server's process, only its heartbeat, so it waits takeover_after, runs its --fence
    command and takes the seat with the line it saw (beluga.pool.seat.take_seat(fenced=...))."""
    weights = {"kill_server": 3, "stall_server": 2, "corrupt_payload": 2, "kill_writer": 1}
    config = ChaosConfig(
        faults=24, seed=SEED, pool_path=shm_path, standbys=1, takeover_after_s=0.5,
        emulated_hosts=True, weights=weights, writer_client="mooncake",
    )  # fmt: skip
    report, why = _round("emulated-hosts round", config, capsys)
    assert report.ok and report.seat_violations == 0, f"a promise was broken{why}"
    assert report.ids_refused == 0, f"connects refused for lack of host ids{why}"
    kills = [k for k in report.takeovers if k["kind"] == "kill" and k["during"] == "run"]
    assert kills and all("by" in k for k in kills), f"a kill was not taken over{why}"
    assert report.outage()["n"] >= 1, f"no write followed a takeover{why}"
