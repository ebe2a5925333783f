"""The client processes of a chaos run: writers, in-place writers, readers, the auditor.

Each role is a forked process and one host of the pool (its own ``KVStore``).
It reports every step to the driver over a pipe of its own and takes commands
from a second one.  A pipe per role, not a shared queue: a role may be
SIGKILLed at any instant, and a shared queue's lock could die with it, while a
pipe loses only the killed role's unsent message.  Messages are small tuples
(a few hundred bytes pickled, below PIPE_BUF, so a kill never leaves half of
one).  Timestamps are ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for
every process of the machine), so the driver can order a reader's read
against a writer's acknowledgement.

Messages to the driver (``t`` is the sender's monotonic clock):

``("hello", t, pid)``                        connected, working
``("try", t, [(key, serial, kind)])``        about to put (kind "put") or remove
``("done", t, [(key, serial)], outcome)``    "ack", "lease" (the server refused the
                                             commit: lost write lease), "skipped" (a save
                                             without ``replace`` wrote nothing for it: the
                                             key was present, or in flight elsewhere) or
                                             "error:Type"
``("mid", t, key, serial, block, nblocks, version)``
                                             an in-place writer has written half a
                                             payload and stops itself (SIGSTOP)
``("read", t0, t1, path, [(key, result)])``  result: ``("miss", why)`` (see
                                             :func:`diagnose`), ``(writer, serial,
                                             nbytes)``, or ``("wrong", reason, detail,
                                             writer, serial)``
``("retired", t0, t1, [key], gap)``          a reader following ``KVStore.retired``:
                                             the keys that left the pool since its last
                                             answer, and whether the answer says some
                                             may be missing (a first answer: always)
``("error", t, type, message)``              a call failed (the role carries on)
``("stats", t, epoch, counters)``            the server's counters (evictions, use)
``("audited", t)``                           the auditor read every key by every path

Commands from the driver: ``"stop"`` (finish the current step and exit),
``"pause-mid"`` (stop yourself halfway through the next in-place payload; see
:class:`~beluga.chaos.injector.FaultInjector` for who resumes it and when) and
``"no-pause"`` (forget a pause asked for and not yet taken).

A writer's serials are ``incarnation << 32 | counter``: a key belongs to one
writer slot, and a replacement writer of that slot starts a new incarnation,
so serials of a key only grow.

Writer slots write three ways, by slot number: ``put``/``put_batch`` (slot 0,
3, ...); ``save`` without ``replace`` and with ``wait_s`` (slot 1, 4, ...;
half its saves run beside a second save of overlapping keys on a helper
thread, so a key is in flight elsewhere and waited for); and, when the run
names a client of a layer above in :data:`CLIENTS` (``beluga.compat.mooncake.chaos``:
the Mooncake drop-in), through that client (slot 2, 5, ...).  Readers load the
in-place path with ``drop_corrupt``, and reader 0 follows ``retired``.
"""

from __future__ import annotations

import faulthandler
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

import numpy as np

from beluga.chaos.values import HEADER_BYTES, make_value, verify
from beluga.coherence import Miss, digest
from beluga.errors import RpcError, WriteLeaseLost
from beluga.kv import protocol as p
from beluga.kv.store import BlockRef, KVStore, key_bytes
from beluga.transfer import Buffers

READ_PATHS = ("get", "get_into", "batch_get_into", "get_batch", "inplace")
_COUNTERS = (
    "evictions",
    "blocks_used",
    "keys",
    "writes_in_flight",
    "retiring_extents",
    "corrupt_dropped",
    "duplicate_writes_skipped",
    "puts_while_recovering",
)
_MAX_REPORT = 8  # read results per message: keeps a message below PIPE_BUF (4 KiB)
_LOOKUP_TIMEOUT_S = 0.5  # a miss asks the server for its view; a server away is noted
SAVE_WAIT_S = 0.2  # how long a save waits for another write of its keys
RETIRED_EVERY = 8  # reader 0 asks for the keys that left the pool every this many steps


class WriterClient(Protocol):
    """A writer's way into the pool from a layer above chaos (see :data:`CLIENTS`).

    Each call answers one outcome per key, as a ``done`` message names it:
    "ack" (stored), "lease" (its commit was refused), "error:WHAT" (unknown).
    """

    def put(self, keys: Sequence[str], values: Sequence[bytes]) -> list[str]: ...

    def remove(self, key: str) -> str: ...

    def close(self) -> None: ...


#: writer clients of layers above chaos, by name, each made from a role's spec in the role's
#: own process; ``beluga.compat.mooncake.chaos`` registers "mooncake" (the Mooncake drop-in), and a
#: run whose ``ChaosConfig.writer_client`` names it gives it writer slots 2, 5, ...
CLIENTS: dict[str, Callable[[RoleSpec], WriterClient]] = {}


@dataclass(frozen=True)
class RoleSpec:
    """What one role process does; built by the driver, inherited through fork.

    Immutable: thread-safe and fork-safe (that is how it reaches the role).
    """

    name: str
    kind: str  # "writer" | "inplace" | "reader" | "auditor"
    slot: int
    incarnation: int
    seed: int
    pool: str
    coherence: str
    keys: tuple[str, ...]  # every key of the run, by id
    own: tuple[int, ...]  # ids of the keys this writer slot owns
    block_bytes: int  # a pool block's
    max_value: int
    rpc_timeout_s: float
    connect_timeout_s: float
    pause_s: float
    client: str | None = None  # a writer client of :data:`CLIENTS` for writer slots 2, 5, ...


def value_size(rng: random.Random, block_bytes: int, max_value: int) -> int:
    """A value length: small, one pool block, exact block multiples, or several blocks."""
    r = rng.random()
    if r < 0.25:
        n = rng.randrange(HEADER_BYTES, 1024)
    elif r < 0.6:
        n = rng.randrange(1024, block_bytes + 1)
    elif r < 0.8:
        n = block_bytes * rng.randrange(1, max(2, max_value // block_bytes + 1))
    else:
        n = rng.randrange(block_bytes + 1, max_value + 1)
    return min(max(n, HEADER_BYTES), max_value)


def _now() -> float:
    return time.monotonic()


class _Role:
    """The common loop of every role: a store that reconnects, reports, commands."""

    def __init__(self, spec: RoleSpec, out: Connection, ctl: Connection) -> None:
        self.spec = spec
        self.out = out
        self.ctl = ctl
        self.rng = random.Random(spec.seed)
        self.digests = [digest(k.encode()) for k in spec.keys]
        self.store: KVStore | None = None
        self.stopping = False
        self.pause_requested = False
        self.said_hello = False
        self.sending = threading.Lock()  # a writer's helper thread reports too

    def send(self, *msg: Any) -> None:
        with self.sending:
            self.out.send(msg)

    def error(self, e: BaseException) -> None:
        self.send("error", _now(), type(e).__name__, str(e)[:240])

    def commands(self) -> None:
        while self.ctl.poll():
            try:
                cmd = self.ctl.recv()
            except EOFError:  # the driver is gone: nothing left to do
                self.stopping = True
                return
            if cmd == "stop":
                self.stopping = True
            elif cmd == "pause-mid":
                self.pause_requested = True
            elif cmd == "no-pause":
                self.pause_requested = False

    def connect(self) -> KVStore | None:
        if self.store is None:
            s = self.spec
            try:
                self.store = KVStore(
                    s.pool,
                    coherence=s.coherence,
                    depth=8,
                    timeout=s.rpc_timeout_s,
                    connect_timeout=s.connect_timeout_s,
                )
            except Exception as e:  # no server right now: report, and try again
                self.error(e)
                time.sleep(0.05)
                return None
            if not self.said_hello:
                self.send("hello", _now(), os.getpid())
                self.said_hello = True
        return self.store

    def disconnect(self) -> None:
        if self.store is not None:
            try:
                self.store.close()
            except Exception as e:
                self.error(e)
            self.store = None

    def failed(self, e: BaseException) -> None:
        """A call raised: report it; a broken connection is replaced."""
        self.error(e)
        if isinstance(e, RpcError) and not isinstance(e, WriteLeaseLost):
            self.disconnect()

    def run(self) -> None:
        try:
            while not self.stopping:
                self.commands()
                if self.stopping:
                    break
                store = self.connect()
                if store is None:
                    continue
                try:
                    self.step(store)
                except Exception as e:
                    self.failed(e)
                if self.spec.pause_s:
                    time.sleep(self.spec.pause_s)
        finally:
            self.disconnect()

    def step(self, store: KVStore) -> None:
        raise NotImplementedError


def _report_failure(role: _Role, done: list[tuple[int, int]], e: BaseException) -> None:
    """Report each write of a failed call: refused by the server (a definite no), committed
    (the server answered yes for the rest of a call that lost some leases), or unknown."""
    if isinstance(e, WriteLeaseLost):
        lost = set(e.lost)
        role.send("done", _now(), [w for i, w in enumerate(done) if i in lost], "lease")
        kept = [w for i, w in enumerate(done) if i not in lost]
        if kept:
            role.send("done", _now(), kept, "ack")
        return
    role.send("done", _now(), done, f"error:{type(e).__name__}")


class _Writer(_Role):
    """Puts (single and batched) and removes of the keys of its slot, out of place."""

    def __init__(self, spec: RoleSpec, out: Connection, ctl: Connection) -> None:
        super().__init__(spec, out, ctl)
        self.counter = 0
        self.counting = threading.Lock()  # a save writer's helper thread draws serials too
        self.next_stats = 0.0

    def serial(self) -> int:
        with self.counting:
            self.counter += 1
            return self.spec.incarnation << 32 | self.counter

    def value(self, key: int, serial: int) -> bytes:
        n = value_size(self.rng, self.spec.block_bytes, self.spec.max_value)
        return make_value(self.digests[key], self.spec.slot, serial, n)

    def stats(self, store: KVStore) -> None:
        if _now() >= self.next_stats:
            self.next_stats = _now() + 0.25
            st = store.stats()
            self.send("stats", _now(), store.rpc.server.epoch, {k: st[k] for k in _COUNTERS})

    def step(self, store: KVStore) -> None:
        self.stats(store)
        r = self.rng.random()
        if r < 0.06:
            key = self.rng.choice(self.spec.own)
            self.write([key], "remove", lambda ks, vs: store.remove(self.spec.keys[ks[0]]))
        elif r < 0.3:
            keys = self.rng.sample(self.spec.own, self.rng.randint(2, 4))
            self.write(
                keys, "put", lambda ks, vs: store.put_batch([self.spec.keys[k] for k in ks], vs)
            )
        else:
            key = self.rng.choice(self.spec.own)
            self.write([key], "put", lambda ks, vs: store.put(self.spec.keys[ks[0]], vs[0]))

    def write(
        self, keys: Sequence[int], kind: str, call: Callable[[Sequence[int], list[bytes]], object]
    ) -> None:
        """Report, make and report one call's writes.  ``call`` returns an outcome per key
        (see :class:`WriterClient`), or anything else when every key is acknowledged."""
        serials = [self.serial() for _ in keys]
        values = [self.value(k, s) for k, s in zip(keys, serials, strict=True)]
        self.send("try", _now(), [(k, s, kind) for k, s in zip(keys, serials, strict=True)])
        done = list(zip(keys, serials, strict=True))
        try:
            got = call(keys, values)
        except Exception as e:
            _report_failure(self, done, e)
            raise
        outcomes = got if isinstance(got, list) else ["ack"] * len(done)
        for outcome in dict.fromkeys(outcomes):
            self.send(
                "done",
                _now(),
                [w for w, o in zip(done, outcomes, strict=True) if o == outcome],
                outcome,
            )


class _SaveWriter(_Writer):
    """Saves without ``replace`` (a present key keeps its value) and with ``wait_s``; half
    of them beside a second save of overlapping keys on a helper thread, so that one waits
    for the other's writes in flight.  A skipped key's value was never written."""

    def step(self, store: KVStore) -> None:
        self.stats(store)
        r = self.rng.random()
        if r < 0.25:
            key = self.rng.choice(self.spec.own)
            self.write([key], "remove", lambda ks, vs: store.remove(self.spec.keys[ks[0]]))
            return
        keys = self.rng.sample(self.spec.own, self.rng.randint(1, 4))
        helper = None
        if r < 0.6:
            both = [*self.rng.sample(keys, 1), *self.rng.sample(self.spec.own, 1)]
            helper = threading.Thread(target=self.save, args=(store, both), daemon=True)
            helper.start()
        try:
            self.save(store, keys)
        finally:
            if helper is not None:
                helper.join(4 * self.spec.rpc_timeout_s + SAVE_WAIT_S)

    def save(self, store: KVStore, keys: Sequence[int]) -> None:
        def call(ks: Sequence[int], vs: list[bytes]) -> list[str]:
            saved = store.save([self.spec.keys[k] for k in ks], Buffers(vs), wait_s=SAVE_WAIT_S)
            out = ["skipped"] * len(ks)
            for i in saved.stored:
                out[i] = "ack"
            for i in saved.lost:
                out[i] = "lease"
            return out

        if threading.current_thread() is threading.main_thread():
            self.write(keys, "save", call)
            return
        try:  # the helper thread: its failure is reported (the main thread reconnects)
            self.write(keys, "save", call)
        except Exception as e:
            self.error(e)


class _ClientWriter(_Writer):
    """Puts (one or a batch, replacing) and removes through a client of a layer above
    chaos (:data:`CLIENTS`); the role's own store only asks for the server's counters."""

    def __init__(self, spec: RoleSpec, out: Connection, ctl: Connection, client: str) -> None:
        super().__init__(spec, out, ctl)
        self.make = CLIENTS[client]
        self.client: WriterClient | None = None

    def disconnect(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception as e:
                self.error(e)
            self.client = None
        super().disconnect()

    def step(self, store: KVStore) -> None:
        self.stats(store)
        if self.client is None:
            self.client = self.make(self.spec)
        c = self.client
        r = self.rng.random()
        if r < 0.06:
            key = self.rng.choice(self.spec.own)
            self.write([key], "remove", lambda ks, vs: [c.remove(self.spec.keys[ks[0]])])
        else:
            n = self.rng.randint(2, 4) if r < 0.4 else 1
            keys = self.rng.sample(self.spec.own, n)
            self.write(keys, "upsert", lambda ks, vs: c.put([self.spec.keys[k] for k in ks], vs))


class _InPlaceWriter(_Writer):
    """The engine's write path: one ``KVStore.save`` (reserve, move with the checksum
    fused, seal, commit) through one table, replacing what the keys held."""

    def step(self, store: KVStore) -> None:
        self.stats(store)
        keys = self.rng.sample(self.spec.own, self.rng.randint(1, 3))
        serials = [self.serial() for _ in keys]
        values = [self.value(k, s) for k, s in zip(keys, serials, strict=True)]
        self.send("try", _now(), [(k, s, "put") for k, s in zip(keys, serials, strict=True)])
        done = list(zip(keys, serials, strict=True))
        stall = None
        if self.pause_requested:
            self.pause_requested = False

            def stall(mem: Any, places: Sequence[Any]) -> None:
                self.stall_midway(mem, places[0], values[0], keys[0], serials[0])

        try:
            saved = store.save(
                [self.spec.keys[k] for k in keys], Midway(values, stall), replace=True
            )
            if saved.lost:
                raise WriteLeaseLost(saved.lost, len(keys))
        except Exception as e:
            _report_failure(self, done, e)
            raise
        self.send("done", _now(), done, "ack")

    def stall_midway(self, mem: Any, ref: BlockRef, value: bytes, key: int, serial: int) -> None:
        """Stop with half a payload stored, as a writer stopped inside its copy would be."""
        half = len(value) // 2
        table = np.array([[0, 0, ref.payload_offset, half]], dtype=np.uint64)
        mem.gather_write([value], table)  # the stores that landed before the stop
        nblocks = ref.capacity // self.spec.block_bytes
        self.send("mid", _now(), key, serial, ref.block, nblocks, ref.version)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(0.005)  # resumed: the copy goes on (the whole payload is stored again)


class Midway(Buffers):
    """Values whose save runs ``hook(mem, places)`` between its reservation and its copy.

    Whatever happens to a writer there happens to this one: the chaos writer
    stops itself with half a payload stored; tests let its lease run out,
    kill it, or take its extents from it.  The hook runs once, on the first
    attempt (None: a plain :class:`~beluga.transfer.Buffers`).  Not
    thread-safe; the hook runs on the saving thread.
    """

    def __init__(
        self, values: Sequence[Any], hook: Callable[[Any, Sequence[Any]], None] | None
    ) -> None:
        super().__init__(values)
        self.hook = hook

    def moves(
        self, mem: Any, chosen: Sequence[int], places: Sequence[Any], *, write: bool
    ) -> tuple[list[Any], np.ndarray]:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook(mem, places)
        return super().moves(mem, chosen, places, write=write)


def read_in_place(
    store: KVStore, keys: Sequence[str], why: list[str] | None = None, drop_corrupt: bool = False
) -> list[bytes | None]:
    """The serving engine's read path: locate, then one validated ``KVStore.load`` (with
    ``drop_corrupt``, as a KV cache's reader: a corrupt value is removed).

    ``why`` (when given) gets, per key, what a miss was: ``index`` (the pool
    index named no block), or the :class:`Miss` code of the located block's
    header checked again after the load refused it; "" for a hit.
    """
    refs = store.locate(keys, prefix=False)
    bufs = [bytearray(r.length if r is not None else 0) for r in refs]
    intact = store.load(refs, Buffers(bufs), drop_corrupt=drop_corrupt)
    if why is not None:
        why[:] = [
            "" if ok else "index" if r is None else _header_miss(store, r)
            for r, ok in zip(refs, intact, strict=True)
        ]
    return [bytes(b) if ok else None for b, ok in zip(bufs, intact, strict=True)]


def _header_miss(store: KVStore, r: BlockRef) -> str:
    """The located block as checked now: its Miss code, or that it reads whole again."""
    code = store.mem.check_header(
        r.header_offset, r.payload_offset, r.capacity, r.digest, r.version
    )
    if code >= 0:
        return f"load refused block {r.block} v{r.version:#x}; its header checks whole now"
    return f"load refused block {r.block} v{r.version:#x}: {Miss(code).name}"


def diagnose(store: KVStore, name: str, path_why: str) -> dict[str, str]:
    """What a miss of ``name`` was, right after it: the reader's, the index's, the server's.

    ``path``: why the read path missed (the in-place path knows: ``index``,
    nothing located, or the located header's Miss code; the others say
    "miss"); ``index_now``: the pool index probed again; ``server``: the
    server's own view by an RPC LOOKUP (no lease), or why it gave none; and
    ``header``: the header of the block the server names, checked now (a
    Miss code, or "whole": then the miss was a race of the read path, not a
    value gone).
    """
    d = digest(key_bytes(name))
    again = store.locate([name], prefix=False)[0]
    out = {
        "path": path_why or "miss",
        "index_now": "no entry" if again is None else f"block {again.block} v{again.version:#x}",
    }
    try:
        data = store.rpc.call(p.StoreOp.LOOKUP, p.encode_digests([d]), _LOOKUP_TIMEOUT_S)
    except RpcError as e:
        out["server"] = f"no answer ({str(e)[:80]})"
        return out
    loc = p.decode_locations(data)[0]
    out["server"] = "not indexed" if loc is None else f"block {loc.block} v{loc.version:#x}"
    if loc is not None:
        sb = store.sb
        extent = -(-loc.length // sb.block_size) * sb.block_size
        code = store.mem.check_header(
            sb.block_header_offset(loc.block),
            sb.block_payload_offset(loc.block),
            max(extent, sb.block_size),
            d,
            loc.version,
        )
        out["header"] = "whole" if code >= 0 else Miss(code).name
    return out


class _Reader(_Role):
    """Reads random keys through every read path and judges every byte."""

    def __init__(self, spec: RoleSpec, out: Connection, ctl: Connection) -> None:
        super().__init__(spec, out, ctl)
        self.bufs = [bytearray(spec.max_value) for _ in range(8)]
        self.by_digest = {d: i for i, d in enumerate(self.digests)}
        self.steps = 0
        self.cursor: tuple[int, int] | None = None  # of the last RETIRED answer

    def step(self, store: KVStore) -> None:
        self.steps += 1
        if self.spec.kind == "reader" and self.spec.slot == 0 and self.steps % RETIRED_EVERY == 0:
            self.follow_retired(store)
        path = self.rng.choice(READ_PATHS)
        n = 1 if path in ("get", "get_into") else self.rng.randint(2, 6)
        keys = self.rng.sample(range(len(self.spec.keys)), n)
        self.read(store, path, keys)

    def follow_retired(self, store: KVStore) -> None:
        """The keys that left the pool since the last answer.  A first call (this role's, or
        its first since it reconnected) only starts following, and is reported as an
        answer with a gap: what left before it is not known."""
        t0 = _now()
        got = store.retired(self.cursor)
        t1 = _now()
        keys = [self.by_digest.get(bytes(d), -1) for d in got.digests]
        gap = got.gap or self.cursor is None
        for start in range(0, max(1, len(keys)), 4 * _MAX_REPORT):
            self.send("retired", t0, t1, keys[start : start + 4 * _MAX_REPORT], gap)
        self.cursor = got.cursor

    def disconnect(self) -> None:
        super().disconnect()
        self.cursor = None  # a new connection starts following afresh

    def read(self, store: KVStore, path: str, keys: Sequence[int]) -> None:
        names = [self.spec.keys[k] for k in keys]
        why: list[str] = []
        t0 = _now()
        values = self.fetch(store, path, names, why)
        t1 = _now()
        results = [
            (k, self.judge(k, v) if v is not None else ("miss", diagnose(store, n, w)))
            for k, n, v, w in zip(keys, names, values, why or [""] * len(keys), strict=True)
        ]
        for start in range(0, len(results), _MAX_REPORT):
            self.send("read", t0, t1, path, results[start : start + _MAX_REPORT])

    def fetch(
        self, store: KVStore, path: str, names: list[str], why: list[str]
    ) -> list[bytes | None]:
        if path == "get":
            return [store.get(names[0])]
        if path == "get_batch":
            return store.get_batch(names)
        if path == "inplace":
            return read_in_place(store, names, why, drop_corrupt=True)
        bufs = self.bufs[: len(names)]
        if path == "get_into":
            lengths = [store.get_into(names[0], bufs[0])]
        else:
            lengths = store.batch_get_into(names, bufs)
        return [None if n < 0 else bytes(b[:n]) for b, n in zip(bufs, lengths, strict=True)]

    def judge(self, key: int, value: bytes | None) -> Any:
        if value is None:
            return None
        v = verify(self.digests[key], value)
        if v.ok:
            return (v.writer, v.serial, len(value))
        return ("wrong", v.reason, v.detail, v.writer, v.serial)


class _Auditor(_Reader):
    """After the writers stop: every key, once through every read path, then exit."""

    def step(self, store: KVStore) -> None:
        every = list(range(len(self.spec.keys)))
        for path in READ_PATHS:
            batch = 1 if path in ("get", "get_into") else 6
            for start in range(0, len(every), batch):
                self.read(store, path, every[start : start + batch])
        self.send("audited", _now())
        self.stopping = True


_ROLES: dict[str, type[_Role]] = {
    "writer": _Writer,
    "inplace": _InPlaceWriter,
    "reader": _Reader,
    "auditor": _Auditor,
}


def _stacks_on_sigusr1() -> None:
    """Dump every thread's stack on SIGUSR1 (the driver's hang report) to a real stderr."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
            return
        except (AttributeError, OSError, ValueError):  # a captured stream has no descriptor
            continue


def _make(spec: RoleSpec, out: Connection, ctl: Connection) -> _Role:
    """The role of a spec: a writer slot writes one of three ways (see the module doc)."""
    if spec.kind == "writer" and spec.slot % 3 == 1:
        return _SaveWriter(spec, out, ctl)
    if spec.kind == "writer" and spec.slot % 3 == 2 and spec.client is not None:
        return _ClientWriter(spec, out, ctl, spec.client)
    return _ROLES[spec.kind](spec, out, ctl)


def role_main(spec: RoleSpec, out: Connection, ctl: Connection) -> None:
    """Entry point of a role process (the target of a forked ``Process``)."""
    _stacks_on_sigusr1()
    if spec.coherence == "model":
        os.environ["BELUGA_MODEL_SEED"] = str(spec.seed & 0xFFFFFFFF)
    _make(spec, out, ctl).run()
