"""Logic mutants of hosts and seats: host liveness and grants, RPC client and server,
standby fencing, taking a seat, and requests and host ids across server restarts.
"""

from __future__ import annotations

from tests.logic_mutants.base import CX, HOSTS, RESTARTS, Mutant

# -- host liveness on one kernel
LIVENESS: list[Mutant] = [
    Mutant(
        "one-kernel-liveness-by-heartbeat",
        "host liveness",
        "beluga/pool/hosts.py",
        "return g if g.identity.running() and (confirmed or fresh) else None",
        "return g if g.identity.running() and fresh else None",
        (
            CX + "test_a_stalled_heartbeat_of_a_live_process_on_one_kernel_keeps_its_id",
            HOSTS + "test_a_stopped_holder_is_alive",
        ),
        "a live holder whose heartbeat stalls (stopped, busy) would lose its id on one kernel",
        cheap=True,
    ),
    Mutant(
        "one-kernel-liveness-ignores-the-process",
        "host liveness",
        "beluga/pool/hosts.py",
        "return g if g.identity.running() and (confirmed or fresh) else None",
        "return g if (confirmed or fresh) else None",
        (HOSTS + "test_a_dead_holders_id_is_granted_again",),
        "a dead holder's id would stay held: its heir is refused",
    ),
    Mutant(
        "staleness-never-sees-a-move",
        "hosts and grants",
        "beluga/pool/hosts.py",
        "if last is None or last[0] != value:",
        "if last is None:",
        (HOSTS + "test_staleness_is_judged_by_the_observers_clock",),
        "a heartbeat that moves would still go stale: live hosts of other kernels die",
    ),
    Mutant(
        "grant-generation-does-not-grow",
        "hosts and grants",
        "beluga/pool/hosts.py",
        "g = Grant(result, (old.generation if old else 0) + 1, req.identity, req.nonce)",
        "g = Grant(result, 1, req.identity, req.nonce)",
        (HOSTS + "test_a_dead_holders_id_is_granted_again",),
        "a regranted id keeps generation 1: the old holder's writes pass for the heir's",
    ),
    Mutant(
        "released-id-stays-held",
        "hosts and grants",
        "beluga/pool/hosts.py",
        "        if confirmed and entry.state != HostState.ALIVE:\n            return None",
        "        if False:\n            return None",
        (HOSTS + "test_claim_heartbeat_release",),
        "an id its holder released would be refused to the next claimant",
    ),
]


# -- RPC client and server
RPC: list[Mutant] = [
    Mutant(
        "server-answers-in-the-wrong-order",
        "rpc server",
        "beluga/rpc/server.py",
        "for i, r in zip(idx, out, strict=True):",
        "for i, r in zip(idx[::-1], out, strict=True):",
        ("tests/test_rpc.py::test_pipelined_calls_keep_order",),
        "two requests of one op in a batch would get each other's answers",
        cheap=True,
    ),
    Mutant(
        "store-batches-overflow-the-slot-buffer",
        "store batching",
        "beluga/kv/store.py",
        "per = max(1, (self.rpc.max_payload - p.HEADER_BYTES) // p.RECORD_BYTES[op])",
        "per = max(1, (self.rpc.max_payload - p.HEADER_BYTES) // p.RECORD_BYTES[op] + 1)",
        (CX + "test_a_lease_lost_in_the_second_batch_is_named_at_its_position",),
        "a full batch one record over the slot buffer is refused by the client or server",
    ),
    Mutant(
        "holder-alive-ignores-the-generation",
        "rpc server",
        "beluga/rpc/server.py",
        "return grant is not None and grant.generation == generation",
        "return grant is not None",
        (CX + "test_a_writer_of_an_older_generation_is_gone",),
        "a write of the id's previous holder would stay quarantined as if its writer lived",
    ),
    Mutant(
        "client-takes-a-dead-server-for-alive",
        "rpc client",
        "beluga/rpc/client.py",
        "            return process_start_ms(st.pid) == st.start_ms\n",
        "            return True\n",
        ("tests/test_rpc.py::test_server_stop_and_death_are_detected",),
        "a client would wait out its timeout on a dead server instead of naming it",
    ),
]


# -- standby fencing
STANDBY: list[Mutant] = [
    Mutant(
        "standby-trusts-another-host-unfenced",
        "standby",
        "beluga/server/standby.py",
        "if not here and fence_command is None:",
        "if False:",
        (
            "tests/test_standby.py::"
            "test_a_server_on_another_host_is_never_taken_over_unfenced[None]",
        ),
        "a standby would try to take a stalled server's seat on another host with no fence "
        "(only fence()'s own refusal still stops it): the test sees no 'without --fence'",
    ),
    Mutant(
        "seat-taken-from-another-host-unsettled",
        "standby",
        "beluga/pool/seat.py",
        "        mine = _settle(t, mine, stopping)",
        "        pass",
        (HOSTS + "test_a_rival_standby_that_stores_the_seat_at_once_wins_and_the_other_waits",),
        "two standbys on two hosts that stored the seat line at once would both serve: the "
        "test's rival overwrites the seat and take_seat returns instead of raising",
        cheap=True,
    ),
]


# -- taking a seat: an empty one last held on another host, and seat_free's judgement
SEAT: list[Mutant] = [
    Mutant(
        "seat-left-elsewhere-taken-unsettled",
        "taking a seat",
        "beluga/pool/seat.py",
        "if fenced is not None or empty_elsewhere:",
        "if fenced is not None:",
        (HOSTS + "test_an_empty_seat_last_held_on_another_host_is_taken_through_the_settle",),
        "two standbys on two hosts that both saw an empty seat left by a server elsewhere "
        "would both serve: the later store wins the line, the earlier server never looks",
        cheap=True,
    ),
    Mutant(
        "seat-free-trusts-a-pid-of-another-host",
        "taking a seat",
        "beluga/server/standby.py",
        "return seat.identity.same_kernel() and not seat.identity.running()",
        "return not seat.identity.running()",
        (
            HOSTS + "test_a_seat_is_free_unfenced_only_when_empty_or_its_server_is_gone_from_"
            "this_kernel",
        ),
        "a server on another host would count as gone because its pid runs nowhere here: a "
        "standby takes its seat unfenced while it still serves",
    ),
]


# -- no request outlives its server (issue 36)
RESTARTS: list[Mutant] = [
    Mutant(
        "adoption-frees-answered-grants",
        "requests and restarts",
        "beluga/server/service.py",
        "                and header.version == pend.version\n                and unanswered(",
        "                and header.version == pend.version\n                and bool(",
        (RESTARTS + "test_a_grant_answered_before_its_server_died_is_kept_for_its_writer",),
        "a grant whose answer reached its writer would be freed as the next server adopts the "
        "ring: the writer, stopped before its first store, resumes into a reused extent",
        cheap=True,
    ),
    Mutant(
        "adoption-keeps-unanswered-grants",
        "requests and restarts",
        "beluga/_native/rpc.c",
        "    return !line_of(&resp, r->gen) || resp.seq != seq || resp.code == BL_RPC_RESTARTED;",
        "    return 0;",
        (
            RESTARTS
            + "test_a_grant_whose_server_died_before_answering_is_freed_when_the_ring_is_adopted",
        ),
        "a grant made by a server killed before its answer would wait for a COMMIT that never "
        "comes, quarantined while its writer lives: capacity lost at every such restart",
    ),
    Mutant(
        "successor-ignores-the-watch",
        "host ids under takeovers",
        "beluga/pool/hosts.py",
        "(host_id, watch.generation), watch.beat or None, watch.still_s)",
        "(host_id, watch.generation), None, watch.still_s)",
        (HOSTS + "test_a_successor_judges_a_dead_holder_by_what_its_predecessor_watched",),
        "each server would judge a dead client's staleness from its own first look: with a "
        "takeover every few seconds no id of a dead client comes back, and connects are refused",
        cheap=True,
    ),
    Mutant(
        "status-line-without-the-watch",
        "host ids under takeovers",
        "beluga/rpc/server.py",
        "            self.registry.watch(host_id),",
        "            None,",
        (HOSTS + "test_the_watch_travels_in_the_status_lines_to_the_next_server",),
        "what a server watched would die with it: the next server starts every dead client's "
        "staleness over",
    ),
]
