"""The host table: which process holds which host id, exactly, across hosts.

Host ids are *granted by the metadata server*, the one writer of grants, so a
claim is exact with loads, stores and fences alone: no two live processes
ever hold one id, whatever the timing, among forked children of one
attachment as across machines that share nothing but the pool.  (A protocol
without an arbiter cannot be: with claimants unknown in advance, reads and
writes over bounded memory give no mutual exclusion, so claim-then-verify
always leaves a window for a claimant stalled between its write and its
read-back.)

The host region, in 64-byte lines (``H`` hosts, ``L`` lobby lines)::

    hosts    [0, H)          one per id, written only by its holder: state, pid,
                             process start time, boot id, heartbeat, generation, nonce
    grants   [H, 2H)         one per id, written only by the server: who holds it
    lobby    [2H, 2H+L)      claim requests; a claimant writes one at random
    answers  [2H+L, 2H+2L)   one per lobby line, written only by the server
    seat     2H+2L           the serving server: identity and heartbeat

Claim
    A claimant posts a request (a fresh nonce, its identity, the id it wants
    or any) in a lobby line picked at random.  At its next refresh the server
    picks an id that is free or whose holder is dead, writes the grant (the
    generation grows with every grant of an id), then the answer.  The
    claimant reads its answer and writes its own host line, which confirms the
    grant.  A request torn or overwritten by another claimant's (the lobby is
    the only place two hosts may write one line) is simply posted again in
    another line: a collision costs a retry, never a wrong grant.

Liveness of a holder
    On the same boot (one kernel: CI, one machine) by the pid *and* its start
    time: exact, a stopped process is alive and a reused pid is not the old
    process.  Across hosts by its heartbeat having changed within ``stale_s``
    of the *observer's* clock (no synchronised clocks needed).  A host stalled
    past ``stale_s`` is taken for dead: that is the definition of liveness
    where nothing else is shared, and a resumed holder finds its grant gone.
    The observer is the serving server, and what it has watched outlives it:
    it writes each holder's :class:`Watch` (the heartbeat value it last saw,
    and for how long of its clock that value has stood still) into the
    status line of that id's RPC ring every refresh, and a successor starts
    from there (``HostRegistry.inherit``).  So a dead holder's id comes back
    once the servers *together* have watched it for ``stale_s``: with a
    takeover every few seconds no single server would ever watch that long,
    and ids ran out.  Only the time between two servers is not counted.

The lines' formats and who a process is are :mod:`beluga.pool.host_records`;
the seat's protocol (taking, keeping and leaving it) is :mod:`beluga.pool.seat`.

Time is an input: :class:`HostTable` takes the monotonic ``clock`` that
staleness is judged by and the ``wall`` clock of heartbeat stamps, so tests
drive both; only real waits (a claimant waiting for its answer) read the
system's monotonic clock.

Thread-safe: yes (every method is a few whole-line loads or stores; the
server's :class:`HostRegistry` is used by its one thread).  Fork-safe: a
forked child may claim its own id through an inherited table (each claimant
is identified by its own pid), and never inherits its parent's.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from beluga import _native
from beluga.coherence import LINE, Memory, line_reader, line_writer, write_line
from beluga.errors import PoolError, RpcError
from beluga.pool.host_records import (
    ClaimAnswer,
    ClaimRequest,
    Grant,
    HostEntry,
    HostState,
    Identity,
    Seat,
)
from beluga.pool.layout import Region, lobby_lines

# Every line read here is written by another host: invalidate, MFENCE, load.  The
# steps are sabotage points (beluga_native.h), the server's and the claimants' apart.
_server_read = line_reader("HOSTS_SERVER_READ_INVALIDATE", "HOSTS_SERVER_READ_MFENCE")
_server_invalidate = _native.step("HOSTS_SERVER_READ_INVALIDATE", Memory.invalidate)
_server_mfence = _native.step("HOSTS_SERVER_READ_MFENCE", Memory.mfence)
_holder_read = line_reader("HOSTS_HOLDER_READ_INVALIDATE", "HOSTS_HOLDER_READ_MFENCE")
# The grant is fenced before the answer that announces it is written.  The other
# writes here need no point: the writer's next read (an MFENCE) drains them within
# a poll, and nothing is ordered after them.
_write_grant = line_writer("HOSTS_GRANT_FENCE")

DEFAULT_STALE_S = 10.0
CLAIM_POLL_S = 0.0005  # how often a claimant looks for its answer
REPOST_S = 0.05  # how often a claimant checks its request is still in its lobby line
ANY_HOST = -1
REFUSED_FULL = -1  # answer: every id is held by a live process
REFUSED_HELD = -2  # answer: the wanted id is held by a live process
REFUSED_RANGE = -3  # answer: the wanted id does not exist


class Staleness:
    """Whether a value another host keeps changing (a heartbeat) still changes.

    The observer's own ``clock`` times it: a value unchanged for ``stale_s``
    of that clock is stale.  Nothing is assumed about the other host's clock.
    A value first seen counts as fresh from that moment.  Not thread-safe
    (one observer thread).
    """

    def __init__(self, stale_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_s = stale_s
        self.clock = clock
        self._seen: dict[object, tuple[object, float]] = {}

    def fresh(self, key: object, value: object) -> bool:
        now = self.clock()
        last = self._seen.get(key)
        if last is None or last[0] != value:
            self._seen[key] = (value, now)
            return True
        return now - last[1] < self.stale_s

    def forget(self, key: object) -> None:
        self._seen.pop(key, None)

    def still_for(self, key: object) -> tuple[object, float] | None:
        """The value last seen under ``key`` and how long (of our clock) it has stood still."""
        last = self._seen.get(key)
        return None if last is None else (last[0], self.clock() - last[1])

    def inherit(self, key: object, value: object, still_s: float) -> None:
        """Take ``value`` as standing still for ``still_s`` already (another observer saw
        it so), unless we have seen ``key`` ourselves."""
        if key not in self._seen:
            self._seen[key] = (value, self.clock() - max(0.0, still_s))


@dataclass(frozen=True)
class Watch:
    """What a server has seen of an id's holder, for the server after it (module doc).

    ``beat``: the heartbeat value watched (0: a grant not yet confirmed, which
    has none); ``still_s``: how long of that server's clock it stood still.
    """

    generation: int
    beat: int
    still_s: float


class HostTable:
    """Claims, heartbeats and liveness over the pool's host region (see the module doc)."""

    def __init__(
        self,
        mem: Memory,
        region: Region,
        max_hosts: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], int] = time.time_ns,
    ) -> None:
        self.mem = mem
        self.region = region
        self.max_hosts = max_hosts
        self.lobby_lines = lobby_lines(max_hosts)
        self.clock = clock
        self.wall = wall

    # -- offsets ---------------------------------------------------------------

    def _check_id(self, host_id: int) -> None:
        if not 0 <= host_id < self.max_hosts:
            raise ValueError(f"host id must be in 0..{self.max_hosts - 1}, not {host_id}")

    def _host_off(self, host_id: int) -> int:
        self._check_id(host_id)
        return self.region.offset + host_id * LINE

    def _grant_off(self, host_id: int) -> int:
        self._check_id(host_id)
        return self.region.offset + (self.max_hosts + host_id) * LINE

    def _lobby_off(self, line: int) -> int:
        return self.region.offset + (2 * self.max_hosts + line) * LINE

    def _answer_off(self, line: int) -> int:
        return self._lobby_off(self.lobby_lines + line)

    @property
    def _seat_off(self) -> int:
        return self._lobby_off(2 * self.lobby_lines)

    # -- reading -----------------------------------------------------------------

    def read(self, host_id: int) -> HostEntry | None:
        """The current host line of an id, or None when the line is free or garbage."""
        entry = HostEntry.unpack(_server_read(self.mem, self._host_off(host_id)))
        return entry if entry and entry.host_id == host_id else None

    def grant(self, host_id: int) -> Grant | None:
        """Who the server granted an id to (None: never granted)."""
        g = Grant.unpack(_holder_read(self.mem, self._grant_off(host_id)))
        return g if g and g.host_id == host_id else None

    def entries(self) -> list[HostEntry]:
        """Every claimed (alive or not) host line."""
        return [
            e for i in range(self.max_hosts) if (e := self.read(i)) and e.state != HostState.FREE
        ]

    def seat(self) -> Seat | None:
        return Seat.unpack(_server_read(self.mem, self._seat_off))

    def is_alive(self, entry: HostEntry | None, stale_s: float = DEFAULT_STALE_S) -> bool:
        """A quick judgement of one host line, for display (``beluga pool info``).

        Exact on this boot (pid and start time); for another boot it compares
        the heartbeat's wall-clock stamp with ours, which assumes roughly
        synchronised clocks.  The server decides with :class:`HostRegistry`,
        which does not.
        """
        if entry is None or entry.state != HostState.ALIVE:
            return False
        if entry.identity.same_kernel():
            return entry.identity.running()
        return self.wall() - entry.heartbeat_ns < stale_s * 1e9

    # -- the holder's side -------------------------------------------------------

    def claim(
        self,
        host_id: int | None = None,
        *,
        timeout: float = 10.0,
        step: Callable[[str], None] | None = None,
    ) -> HostEntry:
        """Ask the pool's server for a host id (the given one, or any) for this process.

        Raises ``PoolError`` when the id is held by a live process or every id
        is; ``RpcError`` when no server answers within ``timeout`` s.  ``step``
        (tests) is called between the steps of the protocol, by name.
        """
        if host_id is not None:
            self._check_id(host_id)
        me = Identity.mine()
        request = ClaimRequest(
            ANY_HOST if host_id is None else host_id, me, int.from_bytes(os.urandom(8), "little")
        )
        rng = random.Random(request.nonce)
        deadline = time.monotonic() + timeout
        line = self._post(request, rng, step)
        next_check = time.monotonic() + REPOST_S
        while True:
            answer = ClaimAnswer.unpack(_holder_read(self.mem, self._answer_off(line)))
            if answer is not None and answer.nonce == request.nonce:
                break
            now = time.monotonic()
            if now > deadline:
                self._withdraw(line, request)
                raise RpcError(
                    f"no Beluga server granted a host id within {timeout} s; start one "
                    "with 'beluga serve --pool SPEC' (one serves each pool)"
                )
            if now >= next_check:  # torn or overwritten by another claimant: post again
                if ClaimRequest.unpack(_holder_read(self.mem, self._lobby_off(line))) != request:
                    line = self._post(request, rng, step)
                next_check = now + REPOST_S
            time.sleep(CLAIM_POLL_S)
        if step:
            step("answered")
        if answer.result == REFUSED_HELD:
            raise PoolError(
                f"host id {host_id} is held by live pid {answer.holder_pid}; pick another "
                "--host-id or let Beluga choose one"
            )
        if answer.result < 0:
            raise PoolError(
                f"all {self.max_hosts} host ids of this pool are held by live processes; "
                "stop one, or create the pool with a larger --max-hosts"
            )
        entry = HostEntry(
            answer.result,
            HostState.ALIVE,
            me.pid,
            me.start_ms,
            me.boot_id,
            self.wall(),
            answer.generation,
            request.nonce,
        )
        write_line(self.mem, self._host_off(entry.host_id), entry.pack())
        if step:
            step("confirmed")
        return entry

    def _withdraw(self, line: int, request: ClaimRequest) -> None:
        """Take back a request nobody answered, so a server started later does not grant it."""
        if ClaimRequest.unpack(_holder_read(self.mem, self._lobby_off(line))) == request:
            write_line(self.mem, self._lobby_off(line), bytes(LINE))

    def _lobby_line(self, rng: random.Random) -> int:
        """Where to post a request: anywhere in the lobby, at random."""
        return rng.randrange(self.lobby_lines)

    def _post(
        self, request: ClaimRequest, rng: random.Random, step: Callable[[str], None] | None
    ) -> int:
        line = self._lobby_line(rng)
        if step:
            step("post")
        write_line(self.mem, self._lobby_off(line), request.pack())
        if step:
            step("posted")
        return line

    def holds(self, entry: HostEntry) -> bool:
        """Whether the server's grant of this id is still this entry's."""
        g = self.grant(entry.host_id)
        return g is not None and g.generation == entry.generation and g.nonce == entry.nonce

    def heartbeat(self, entry: HostEntry) -> HostEntry:
        """Refresh this host's heartbeat; returns the new entry."""
        fresh = replace(entry, heartbeat_ns=max(self.wall(), entry.heartbeat_ns + 1))
        write_line(self.mem, self._host_off(entry.host_id), fresh.pack())
        return fresh

    def release(self, entry: HostEntry) -> None:
        """Give a host id back (only its holder calls this); a no-op once it was regranted."""
        if self.holds(entry):
            left = replace(entry, state=HostState.LEFT, heartbeat_ns=self.wall())
            write_line(self.mem, self._host_off(entry.host_id), left.pack())


class HostRegistry:
    """The server's side of the host table: it grants ids and judges liveness.

    Only the server (one thread) uses it.  It writes grant and answer lines,
    and nothing else of the host region but the seat.  ``before_grant(host_id,
    old_grant)`` runs before an id that was held (by a holder now dead or gone)
    is granted again, so the caller drops what the old holder had: its ring,
    its writes in flight.
    """

    def __init__(
        self,
        table: HostTable,
        stale_s: float = DEFAULT_STALE_S,
        before_grant: Callable[[int, Grant], None] | None = None,
    ) -> None:
        self.table = table
        self.before_grant = before_grant
        self.stale = Staleness(stale_s, table.clock)
        #: host id -> what alive() last judged of it (watch() reports it, never a guess)
        self._judged: dict[int, Watch] = {}
        self.granted = 0
        self.refused = 0

    def alive(self, host_id: int) -> Grant | None:
        """The grant of an id if its holder is alive (see the module doc), else None."""
        t = self.table
        g = t.grant(host_id)
        if g is None:
            return None
        entry = t.read(host_id)
        confirmed = (
            entry is not None and entry.generation == g.generation and entry.nonce == g.nonce
        )
        if confirmed and entry.state != HostState.ALIVE:
            return None  # released
        # unconfirmed (its claimant gave up, or has not written its line yet): it counts
        # from when we first saw the grant, and lapses after stale_s
        beat = entry.heartbeat_ns if confirmed else None
        fresh = self.stale.fresh((host_id, g.generation), beat)
        seen = self.stale.still_for((host_id, g.generation))
        self._judged[host_id] = Watch(g.generation, beat or 0, seen[1] if seen else 0.0)
        if g.identity.same_kernel():
            return g if g.identity.running() and (confirmed or fresh) else None
        return g if fresh else None

    def watch(self, host_id: int) -> Watch | None:
        """What this server saw of the holder of ``host_id`` when it last judged it (None:
        never): the heartbeat value then, and how long it had stood still by then."""
        return self._judged.get(host_id)

    def inherit(self, host_id: int, watch: Watch) -> None:
        """Start from what the server before this one watched (module doc, Liveness)."""
        self.stale.inherit((host_id, watch.generation), watch.beat or None, watch.still_s)

    def _free_id(self, wanted: int) -> tuple[int, Grant | None]:
        """An id for a request (or a REFUSED_* code), and the live grant that refused it."""
        t = self.table
        if wanted != ANY_HOST:
            if not 0 <= wanted < t.max_hosts:
                return REFUSED_RANGE, None
            live = self.alive(wanted)
            return (REFUSED_HELD, live) if live is not None else (wanted, None)
        for h in range(t.max_hosts):
            if self.alive(h) is None:
                return h, None
        return REFUSED_FULL, None

    def serve_lobby(self) -> int:
        """Answer every new claim request in the lobby; returns how many ids were granted."""
        t = self.table
        n = t.lobby_lines
        first = t._lobby_off(0)  # the lobby, then the answers: one read of both
        _server_invalidate(t.mem, first, 2 * n * LINE)
        _server_mfence(t.mem)
        raw = t.mem.load(first, 2 * n * LINE)
        granted = 0
        for line in range(n):
            chunk = raw[line * LINE : (line + 1) * LINE]
            if not any(chunk):
                continue
            req = ClaimRequest.unpack(chunk)
            if req is None:
                continue  # torn by two claimants: both post again elsewhere
            done = ClaimAnswer.unpack(raw[(n + line) * LINE : (n + line + 1) * LINE])
            if done is not None and done.nonce == req.nonce:
                continue  # answered already, by this server or one before it
            answer = self._answer(req)
            write_line(t.mem, t._answer_off(line), answer.pack())
            granted += answer.result >= 0
        return granted

    def _answer(self, req: ClaimRequest) -> ClaimAnswer:
        t = self.table
        for h in range(t.max_hosts):  # answered before (e.g. by a server since restarted)?
            g = t.grant(h)
            if g is not None and g.nonce == req.nonce and g.identity == req.identity:
                return ClaimAnswer(h, g.generation, 0, req.nonce)
        result, holder = self._free_id(req.wanted)
        if result < 0:
            self.refused += 1
            return ClaimAnswer(result, 0, holder.identity.pid if holder else 0, req.nonce)
        old = t.grant(result)
        if old is not None and self.before_grant is not None:
            self.before_grant(result, old)
        g = Grant(result, (old.generation if old else 0) + 1, req.identity, req.nonce)
        _write_grant(t.mem, t._grant_off(result), g.pack())  # the grant first, then the answer
        self.stale.forget((result, g.generation))
        self.granted += 1
        return ClaimAnswer(result, g.generation, 0, req.nonce)
