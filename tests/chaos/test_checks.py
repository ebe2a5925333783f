"""The chaos tier's own checks, and the defects it found, as short deterministic tests.

A harness that cannot fail proves nothing, so these tests show each check
firing on a made-up history or a sabotaged run: self-describing values
catch other keys, tears and mixtures; the history catches lost, stale,
phantom and uncommitted reads and excuses only what it documents; a role
that stops making progress is reported as a hang.

The last tests replay, without randomness, two defects the chaos rounds
found (see the README's chaos section): a payload corrupted in the pool
reaches the in-place read path as data, and a writer stalled past its write
lease lands its payload and its seal on an extent another writer reused.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from beluga import KVStore, chaos
from beluga.chaos import ChaosDriver, driver, faults
from beluga.chaos.injector import FaultInjector
from beluga.chaos.roles import Midway, _report_failure, diagnose, read_in_place
from beluga.chaos.values import HEADER_BYTES, make_value, verify
from beluga.chaos.verifier import History
from beluga.child import server_process
from beluga.cli import main
from beluga.coherence import digest, parse_header, read_line
from beluga.errors import RpcError, WriteLeaseLost
from beluga.pool import Geometry, Pool
from beluga.server.server import serve

GEOMETRY = Geometry(max_hosts=8, rpc_bytes_per_host=128 << 10, block_size=16 << 10)
A, B = digest(b"a"), digest(b"b")


# -- values ----------------------------------------------------------------


def test_a_value_names_its_key_writer_and_serial() -> None:
    v = make_value(A, 3, 7 << 32 | 5, 40_000)
    assert len(v) == 40_000
    got = verify(A, v)
    assert got.ok and (got.writer, got.serial) == (3, 7 << 32 | 5)
    assert verify(A, make_value(A, 0, 1, HEADER_BYTES)).ok
    with pytest.raises(ValueError, match="at least 48"):
        make_value(A, 0, 1, 47)


def test_values_betray_other_keys_tears_mixtures_and_garbage() -> None:
    v, w = make_value(A, 1, 5, 5000), make_value(A, 1, 6, 5000)
    assert verify(B, v).reason == "other-key"
    assert verify(A, v[:4000]).reason == "length"
    assert verify(A, v[:20]).reason == "short"
    flipped = bytearray(v)
    flipped[4321] ^= 1
    assert verify(A, flipped).reason == "torn"
    assert verify(A, v[:2500] + w[2500:]).reason == "torn"  # two extents mixed
    assert verify(A, os.urandom(5000)).reason == "garbage"
    assert verify(A, bytes(5000)).reason == "garbage"


# -- the history -----------------------------------------------------------


def history() -> History:
    return History(["k0", "k1"], owner=[0, 0])


def put(h: History, key: int, serial: int, t_try: float, t_done: float, outcome: str = "ack"):
    h.tried("w", t_try, [(key, serial, "put")])
    h.done("w", t_done, [(key, serial)], outcome)


def test_a_miss_after_an_acknowledged_put_is_a_lost_write() -> None:
    h = history()
    put(h, 0, 1, 1.0, 1.1)
    h.read("r", 0.5, 0.6, "get", [(0, None)])  # before the put: fine
    h.read("r", 1.05, 1.2, "get", [(0, None)])  # overlaps the ack: fine
    h.read("r", 2.0, 2.1, "get", [(0, None)])  # after it: lost
    f = h.check()
    assert f.lost_count == 1 and f.lost[0]["reason"] == "miss" and f.misses == 3


def test_a_lost_write_carries_the_keys_history_and_the_readers_view() -> None:
    h = history()
    put(h, 0, 1, 1.0, 1.1)
    put(h, 0, 2, 1.5, 1.6)
    why = {"path": "index", "index_now": "no entry", "server": "block 3 v0x9", "header": "whole"}
    h.read("r", 2.0, 2.1, "inplace", [(0, ("miss", why))])
    f = h.check()
    assert f.lost_count == 1 and f.misses == 1
    (lost,) = f.lost
    assert lost["reader"] == why
    assert lost["history"] == [
        "put 0x1 by w: tried 1.0000, ack at 1.1000",
        "put 0x2 by w: tried 1.5000, ack at 1.6000",
    ]
    assert lost["corrupted_at"] == [] and lost["server_killed_at"] == []


def test_misses_are_excused_only_by_a_concurrent_write_a_remove_or_a_corruption() -> None:
    h = history()
    put(h, 0, 1, 1.0, 1.1)
    put(h, 0, 2, 2.0, 3.0)  # in flight during the read below
    h.read("r", 2.5, 2.6, "get", [(0, None)])
    put(h, 1, 1, 1.0, 1.1)
    h.tried("w", 4.0, [(1, 2, "remove")])  # a remove that may have landed
    h.read("r", 4.5, 4.6, "get", [(1, None)])
    put(h, 1, 3, 5.0, 5.1)
    h.corrupted(1, 5.5)  # its block was deliberately corrupted
    h.read("r", 6.0, 6.1, "inplace", [(1, None)])
    put(h, 1, 4, 7.0, 7.1)  # a new write after the corruption: checked again
    h.read("r", 8.0, 8.1, "inplace", [(1, None)])
    f = h.check()
    assert f.excused == {"concurrent write": 1, "corrupted": 1}
    assert f.lost_count == 1 and f.lost[0]["t0"] == 8.0


def test_stale_phantom_future_and_uncommitted_values_are_caught() -> None:
    h = history()
    put(h, 0, 1, 1.0, 1.1)
    put(h, 0, 2, 2.0, 2.1)
    put(h, 0, 3, 3.0, 3.1, outcome="lease")  # the server refused its commit
    h.tried("w", 4.0, [(0, 4, "remove")])
    h.done("w", 4.1, [(0, 4)], "ack")
    h.read("r", 2.5, 2.6, "get", [(0, (0, 1, 100))])  # older than the ack of 2
    h.read("r", 2.5, 2.6, "get", [(0, (0, 9, 100))])  # never written
    h.read("r", 2.5, 2.6, "get", [(0, (1, 2, 100))])  # another writer's serial
    h.read("r", 0.1, 0.2, "get", [(0, (0, 2, 100))])  # before its write began
    h.read("r", 3.5, 3.6, "get", [(0, (0, 3, 100))])  # refused, yet visible
    h.read("r", 5.0, 5.1, "get", [(0, (0, 2, 100))])  # the acknowledged remove undone
    h.read("r", 5.0, 5.1, "get", [(0, None)])  # removed: a miss is right
    h.read("r", 2.5, 2.6, "get", [(0, ("wrong", "torn", "7 bytes differ", 0, 2))])
    f = h.check()
    assert [w["reason"] for w in f.wrong] == ["phantom", "phantom", "future", "torn"]
    assert [x["reason"] for x in f.lost] == ["stale", "stale"]
    assert "remove was undone" in f.lost[1]["detail"]
    assert f.uncommitted_count == 1 and f.values_verified == 3


def test_of_two_overlapping_writes_either_may_be_the_one_read_after_both() -> None:
    """Saves of one key that overlap in time (both waiting on a takeover, say) may commit
    in either order: serial 1 acknowledged after serial 2 is what later reads return."""
    h = history()
    put(h, 0, 1, 1.0, 2.5)
    put(h, 0, 2, 1.1, 2.0)
    h.read("r", 3.0, 3.1, "get", [(0, (0, 1, 100))])
    h.read("r", 3.0, 3.1, "get", [(0, (0, 2, 100))])
    f = h.check()
    assert not f.lost and not f.wrong and f.values_verified == 2


def test_a_refused_commit_replayed_across_a_restart_is_not_called_uncommitted() -> None:
    h = history()
    put(h, 0, 1, 1.0, 2.0, outcome="lease")
    h.server_killed(1.5)  # the old server may have committed it before dying
    h.read("r", 3.0, 3.1, "get", [(0, (0, 1, 100))])
    put(h, 0, 2, 4.0, 4.1)
    h.role_died("w", 4.2)
    assert h.check().uncommitted_count == 0


def test_a_call_that_lost_some_leases_reports_the_rest_as_committed() -> None:
    # Found by a 1000-fault round (seed 3559505579): a put_batch whose commit lost one
    # lease raised for the whole batch, so a committed key read later was called
    # "uncommitted". The store now names the refused positions; the role reports each.
    sent: list[tuple[Any, ...]] = []

    class Role:
        def send(self, *msg: Any) -> None:
            sent.append(msg)

    done = [(0, 1), (1, 2)]
    _report_failure(Role(), done, WriteLeaseLost([1], 2))  # type: ignore[arg-type]
    assert [(m[2], m[3]) for m in sent] == [([(1, 2)], "lease"), ([(0, 1)], "ack")]
    h = history()
    h.tried("w", 1.0, [(k, s, "put") for k, s in done])
    for _, _, items, outcome in sent:
        h.done("w", 2.0, items, outcome)
    h.read("r", 3.0, 3.1, "get", [(0, (0, 1, 100))])  # committed
    assert h.check().uncommitted_count == 0
    h.read("r", 3.0, 3.1, "get", [(1, (0, 2, 100))])  # refused, yet visible
    assert h.check().uncommitted_count == 1
    sent.clear()
    _report_failure(Role(), done, RpcError("server gone"))  # type: ignore[arg-type]
    assert [(m[2], m[3]) for m in sent] == [(done, "error:RpcError")]


def test_a_value_its_save_skipped_is_wrong_bytes_when_read() -> None:
    """A save without ``replace`` skipped the key (present, or in flight elsewhere): the
    serial it would have written never reached the pool."""
    h = history()
    put(h, 0, 1, 1.0, 1.1)
    h.tried("w", 2.0, [(0, 2, "save")])
    h.done("w", 2.1, [(0, 2)], "skipped")
    h.read("r", 3.0, 3.1, "get", [(0, (0, 1, 100))])  # the value kept: right
    h.read("r", 3.0, 3.1, "get", [(0, (0, 2, 100))])  # the skipped one
    f = h.check()
    assert [w["reason"] for w in f.wrong] == ["skipped"] and f.lost_count == 0


def test_a_retirement_needs_a_way_out_and_a_restart_needs_a_gap() -> None:
    """RETIRED answers, as reader 0 reports them: a key named gone with no remove tried and
    no corruption of its block, a digest of no key of the run, and an answer after a server
    restart that claims no gap are each wrong, as is a key named again whose last remove
    ended before the previous answer; a removed or a corrupted (then dropped) key is not,
    nor is the first answer after a restart that says it has a gap."""
    h = history()
    put(h, 0, 1, 1.0, 1.1)
    put(h, 1, 1, 1.0, 1.1)
    h.tried("w", 2.0, [(0, 2, "remove")])
    h.done("w", 2.1, [(0, 2)], "ack")
    h.corrupted(1, 2.5)
    h.retired("r", 1.5, 1.6, [], False)
    h.retired("r", 3.0, 3.1, [1], False)  # dropped as corrupt, and (a second message of
    h.retired("r", 3.0, 3.1, [0], False)  # the same answer) removed: right
    assert h.check().wrong_count == 0
    h.retired("r", 4.0, 4.1, [-1], False)  # no key of the run
    h.server_killed(4.5)
    h.retired("r", 5.0, 5.1, [], True)  # says so: right
    h.server_killed(5.5)
    h.retired("r", 6.0, 6.1, [], False)  # a restart since, no gap: wrong
    # signalled before an answer began, dead only after: the killed server may have given
    # it (seen 2026-12-05: an answer 0.2 ms after the kill's signal, in the old epoch), so
    # the gap may come with the next answer: right
    h.server_killed(6.5, 7.05)
    h.retired("r", 7.0, 7.01, [], False)
    h.retired("r", 7.5, 7.6, [], True)
    put(h, 0, 3, 7.0, 7.1)
    h.retired("r", 8.0, 8.1, [0], False)  # put again, not removed since the last answer
    h.server_killed(8.5, 9.05)
    h.retired("r", 9.0, 9.01, [], False)  # either server's
    h.retired("r", 10.0, 10.1, [], False)  # surely the new one's, and no gap yet: wrong
    f = h.check()
    assert [(w["path"], w["reason"], w["t0"]) for w in f.wrong] == [
        ("retired", "unexplained retirement", 4.0),
        ("retired", "unreported gap", 6.0),
        ("retired", "unexplained retirement", 8.0),
        ("retired", "unreported gap", 10.0),
    ]
    assert f.reads_by_path["retired"] == 10
    h2 = History(["k0"], owner=[0])
    h2.retired("r", 1.0, 1.1, [], False)
    h2.retired("r", 2.0, 2.1, [0], False)  # nothing ever removed or corrupted it
    assert [w["reason"] for w in h2.check().wrong] == ["unexplained retirement"]


# -- hostile bytes and the defects the rounds found --------------------------


def _serve(spec: str, options: dict[str, Any], ready: Any) -> None:
    serve(spec, ready=ready, **options)


@pytest.fixture
def chaos_pool(shm_path: str) -> Iterator[Pool]:
    p = Pool.create(shm_path, 14 << 20, geometry=GEOMETRY)
    yield p
    p.close()
    Pool.destroy(shm_path)


def test_a_round_of_as_many_faults_as_kinds_injects_every_kind_whatever_the_weights() -> None:
    """The draw favours the kinds not injected yet once the faults left are no more than
    they are: a rare kind (weight 1 of 1,000) still comes, in every seed's round."""
    from collections import Counter
    from random import Random
    from types import SimpleNamespace

    kinds = ["common", "rare", "other"]
    weights = [998, 1, 1]
    for seed in range(50):
        for n in (3, 10):
            stub = SimpleNamespace(
                run=SimpleNamespace(cfg=SimpleNamespace(faults=n), rng=Random(seed)),
                faults=Counter(),
            )
            for _ in range(n):
                stub.faults[FaultInjector._draw(stub, kinds, weights)] += 1  # type: ignore[arg-type]
            assert set(stub.faults) == set(kinds), (seed, n, stub.faults)
    # by weight while there is room: a long round is mostly the common kind
    stub = SimpleNamespace(
        run=SimpleNamespace(cfg=SimpleNamespace(faults=1000), rng=Random(1)), faults=Counter()
    )
    for _ in range(1000):
        stub.faults[FaultInjector._draw(stub, kinds, weights)] += 1  # type: ignore[arg-type]
    assert stub.faults["common"] > 950 and set(stub.faults) == set(kinds)


@pytest.mark.leaves("keys")
def test_a_corrupted_block_reads_as_a_miss_through_the_store(chaos_pool: Pool) -> None:
    import random

    rng = random.Random(1)
    with server_process(_serve, chaos_pool.spec, {"refresh_s": 0.02}), KVStore(chaos_pool) as s:
        for name in ("h", "p"):
            s.put(name, make_value(digest(name.encode()), 0, 1, 20_000))
        for block, header in faults.published_blocks(chaos_pool.memory, chaos_pool.superblock):
            target = "h" if header.digest == digest(b"h") else "p"
            offset = (
                chaos_pool.superblock.block_header_offset(block)
                if target == "h"
                else chaos_pool.superblock.block_payload_offset(block) + 10_000
            )
            chaos_pool.memory.nt_store(offset, rng.randbytes(16))
            chaos_pool.memory.sfence()
        buf = bytearray(40_000)
        for name in ("h", "p"):
            assert s.get(name) is None and s.get_batch([name]) == [None]
            assert s.get_into(name, buf) == -1 and s.batch_get_into([name], [buf]) == [-1]
        why: list[str] = []
        assert read_in_place(s, ["h"], why) == [None] and why == ["index"]
        seen = diagnose(s, "h", why[0])  # the server still indexes it; its header is garbage
        assert seen["path"] == "index" and seen["index_now"] == "no entry"
        assert seen["server"].startswith("block ") and seen["header"] in {"MAGIC", "KEY"}
        assert diagnose(s, "never-written", "miss") == {
            "path": "miss",
            "index_now": "no entry",
            "server": "not indexed",
        }


@pytest.mark.leaves("keys")
def test_in_place_read_of_a_corrupted_payload_is_a_miss(chaos_pool: Pool) -> None:
    """Once a defect: the engine's read path checked headers only and returned a payload
    that hostile bytes changed; KVStore.load checksums what it copies."""
    with server_process(_serve, chaos_pool.spec, {"refresh_s": 0.02}), KVStore(chaos_pool) as s:
        value = make_value(digest(b"k"), 0, 1, 20_000)
        s.put("k", value)
        ((block, _),) = faults.published_blocks(chaos_pool.memory, chaos_pool.superblock)
        chaos_pool.memory.nt_store(chaos_pool.superblock.block_payload_offset(block) + 64, b"!")
        chaos_pool.memory.sfence()
        assert s.get("k") is None  # the checksum catches it on the store's paths
        (got,) = read_in_place(s, ["k"])
        verdict = None if got is None else verify(digest(b"k"), got)
        intact = verdict is None or verdict.ok
        assert intact, f"the in-place read path returned other bytes: {verdict}"


def _serial(key: bytes, value: bytes | None) -> Any:
    """What a read returned, in short: None, the serial of a value of ``key``, or why not."""
    if value is None:
        return None
    v = verify(digest(key), value)
    return v.serial if v.ok else f"other bytes ({v.reason})"


def _header_at(pool: Pool, block: int) -> Any:
    return parse_header(read_line(pool.memory, pool.superblock.block_header_offset(block)))


def _land(mem: Any, ref: Any, value: bytes, end: int) -> None:
    """The first ``end`` bytes of a copy into the block: stores that landed before a stall."""
    table = np.array([[0, 0, ref.payload_offset, end]], dtype=np.uint64)
    mem.gather_write([value], table)


def _wait_expired(store: KVStore, count: int) -> None:
    deadline = time.monotonic() + 30
    while store.stats()["lease_expiries"] < count:
        assert time.monotonic() < deadline, "the write lease never ran out"
        time.sleep(0.02)


@pytest.mark.leaves("keys")
def test_a_writer_stalled_past_its_lease_never_lands_on_a_reused_extent(chaos_pool: Pool) -> None:
    """An in-place writer stalls mid-payload past its write lease while others write;
    its extent is not reused while it lives, so when it resumes, finishes its copy and
    seals, nothing acknowledged is touched, its commit is refused, and a restarted
    server serves neither its bytes nor anything else's mixed with them."""
    problems = []
    options = {"refresh_s": 0.02, "write_lease_s": 1.0}
    with server_process(_serve, chaos_pool.spec, options) as first:
        with KVStore(chaos_pool) as stalled, KVStore(chaos_pool) as other:
            mine = make_value(digest(b"stalled"), 9, 1, 8_000)
            victims: dict[str, bytes] = {}

            def stall(mem: Any, places: Any) -> None:
                (ref,) = places
                _land(mem, ref, mine, len(mine) // 2)
                _wait_expired(other, 1)  # past the lease: the write is cancelled, not reusable
                for i in range(chaos_pool.superblock.nblocks // 2):
                    victim = f"victim-{i}"
                    victims[victim] = make_value(digest(victim.encode()), 1, i + 1, 8_000)
                    other.put(victim, victims[victim])
                    h = _header_at(chaos_pool, ref.block)
                    if h is not None and h.digest != digest(b"stalled"):
                        problems.append(f"the stalled writer's extent was reused by {victim}")
                        break
                assert other.stats()["quarantined_extents"] == 1

            # it resumes, copies, seals: refused
            saved = stalled.save(["stalled"], Midway([mine], stall), replace=True)
            assert saved.lost == [0] and victims
            for victim, value in victims.items():
                (got,) = read_in_place(other, [victim])
                if got != value or other.get(victim) != value:
                    problems.append(f"acknowledged {victim} changed by the stalled writer")
            assert other.stats()["quarantined_extents"] == 0  # refused: free for reuse now
        os.kill(first.pid, signal.SIGKILL)
        first.join(10)
    with server_process(_serve, chaos_pool.spec, {"refresh_s": 0.02}), KVStore(chaos_pool) as s:
        for victim, value in victims.items():
            if s.get(victim) != value:
                problems.append(f"acknowledged {victim} lost after a server restart")
        stale = _serial(b"stalled", s.get("stalled"))
        if stale is not None:
            problems.append(f"after a restart 'stalled', whose commit was refused, reads {stale}")
    assert not problems, problems


@pytest.mark.leaves("keys")
def test_a_refused_write_is_never_served_not_even_after_a_restart(chaos_pool: Pool) -> None:
    """Defect: a seal after the write lease expired leaves a published header that the
    server does not know; a restarted server recovers it as the key's newest value,
    over the acknowledged one, and brings back a key whose removal was acknowledged."""
    problems = []
    acked = {k: make_value(digest(k.encode()), 1, 1, 5_000) for k in ("kept", "gone")}
    options = {"refresh_s": 0.02, "write_lease_s": 1.0}
    with server_process(_serve, chaos_pool.spec, options) as first:
        with KVStore(chaos_pool) as s:
            for key, value in acked.items():
                s.put(key, value)
                late = make_value(digest(key.encode()), 1, 2, 5_000)
                expiries = 1 if key == "kept" else 2

                def stall(mem: Any, places: Any, expiries: int = expiries) -> None:
                    _wait_expired(s, expiries)  # stalled past the write lease

                saved = s.save([key], Midway([late], stall), replace=True)
                assert saved.lost == [0]
            assert s.remove("gone")
            assert s.get("kept") == acked["kept"] and s.get("gone") is None
        os.kill(first.pid, signal.SIGKILL)
        first.join(10)
    with server_process(_serve, chaos_pool.spec, {"refresh_s": 0.02}), KVStore(chaos_pool) as s:
        kept, gone = _serial(b"kept", s.get("kept")), _serial(b"gone", s.get("gone"))
    if kept != 1:
        problems.append(f"after a restart 'kept' reads serial {kept}, not the acknowledged 1")
    if gone is not None:
        problems.append(f"after a restart the removed 'gone' is back with serial {gone}")
    assert not problems, problems


# -- hangs and the command ---------------------------------------------------


class _ForgetfulInjector(FaultInjector):
    """Stops a reader and forgets it did: to the hang check, a reader that hangs."""

    def _fault_stop_reader(self) -> bool:
        victim = self.roles.alive(("reader",))[0]
        os.kill(victim.pid, signal.SIGSTOP)
        self.record("stop_reader", victim.name)
        return True


@pytest.mark.leaves("keys")
def test_a_role_without_progress_is_reported_as_a_hang_and_fails_the_command(
    shm_path: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forgetful injector makes a hang by construction, so the command must exit 1."""
    monkeypatch.setattr(driver, "FaultInjector", _ForgetfulInjector)
    monkeypatch.setattr(
        chaos, "run_chaos", lambda config: ChaosDriver(replace(config, settle_s=4.0)).run()
    )
    out = tmp_path / "chaos.json"
    args = ["chaos", "--faults", "1", "--seed", "1", "--writers", "1", "--inplace-writers", "0"]
    args += ["--readers", "1", "--hang-bound", "3", "--only", "stop_reader"]
    code = main([*args, "--pool", shm_path, "--json", str(out)])
    report = json.loads(out.read_text())
    assert [h["role"] for h in report["details"]["hangs"]] == ["reader-0#1"], report["hangs"]
    assert code == 1 and not report["ok"]


@pytest.mark.leaves("keys")
def test_beluga_chaos_command(shm_path: str, tmp_path: Any, capsys: Any) -> None:
    """Killed and stopped readers break no promise: the command must exit 0."""
    out = tmp_path / "chaos.json"
    args = ["chaos", "--faults", "12", "--seed", "3", "--only", "kill_reader,stop_reader"]
    code = main([*args, "--pool", shm_path, "--json", str(out), "--hang-bound", "60"])
    report = json.loads(out.read_text())
    broken = ("wrong_bytes", "lost_acked_writes", "uncommitted_reads", "hangs")
    assert {k: report[k] for k in broken} == dict.fromkeys(broken, 0), report["details"]
    assert code == 0 and report["ok"]
    assert report["seed"] == 3 and report["faults_total"] == 12
    assert set(report["faults"]) == {"kill_reader", "stop_reader"}
    assert "seed 3" in capsys.readouterr().out
    assert main(["chaos", "--only", "kill_everything"]) == 2
