"""Many engines, one pool: engine processes, the metadata server process, and a driver.

Every process is an emulated host with its own mapping of the pool:

metadata server (a process)
    ``beluga.server.server.serve`` on the pool: the index and the allocator.
engine ``i`` (a process each)
    a :class:`~beluga.serving.model.ModelEngine` with its own
    :class:`~beluga.kv.store.KVStore` (its own ``Pool.attach`` and RPC ring),
    wrapped in a :class:`~beluga.serving.engine.ServingEngine` in its role
    (``kv_both``; for prefill/decode disaggregation ``kv_producer`` or
    ``kv_consumer``); it serves the jobs it is sent, one at a time, in order.
driver (the caller's process)
    :class:`Cluster` routes each arriving request with a scheduler
    (:mod:`beluga.serving.scheduler`) and keeps one job in flight per engine,
    queueing the rest, so a reply never waits behind a full pipe.
    :meth:`Cluster.run` sends each request to one engine;
    :meth:`Cluster.run_disaggregated` sends it to a prefill engine, and once
    that engine has committed the prompt's blocks, to a decode engine (each
    chosen by its own scheduler, by load alone), as ``beluga proxy`` does.

The pipes carry token ids out and timings back (and logits when asked for);
KV never goes through them, only through the pool.  Times cross processes
as ``time.monotonic()`` readings, one clock for the whole machine.

Engines on a GPU share it: each process holds its own model (weights made on
the GPU, :class:`~beluga.serving.model.ModelEngine`) and its own KV, so every
engine is given a budget (``EngineConfig.memory_bytes``, by default
:func:`~beluga.serving.model.engine_memory_bytes` of its longest prompt) that
its allocator may not exceed, and a cluster whose budgets do not fit on the
GPU is refused before anything starts (:func:`check_gpu_budget`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from beluga.child import stop_process, wait_ready
from beluga.errors import ServingError
from beluga.kv.identity import ModelIdentity
from beluga.serving.engine import ROLES, Served
from beluga.serving.model import ModelShape
from beluga.serving.scheduler import Scheduler
from beluga.serving.trace import poisson_arrivals
from beluga.signals import raise_if_interrupted

#: the longest a driver waits on engines before it looks whether a signal interrupted it
#: (beluga.signals.interrupt_on_signals: ``beluga bench e2e`` stops on SIGTERM)
LOOK_S = 0.1


@dataclass(frozen=True)
class EngineConfig:
    """What every engine process builds: the same seeded model, so any engine may serve any.

    ``identity`` overrides the identity the engines key blocks by (by default
    each fingerprints its weights, which agree because the seed does).
    """

    shape: ModelShape
    seed: int = 0
    coherence: str | None = None
    threads: int = 1  # torch threads per engine: one core per emulated host
    rpc_timeout: float = 30.0
    device: str = "cpu"  # or a CUDA device: KV then moves through the GPU path
    identity: ModelIdentity | None = None
    role: str = "kv_both"  # one of beluga.serving.engine.ROLES; a Cluster sets it per engine
    dtype: str = "float32"  # of the weights and the KV cache (beluga.serving.model.DTYPES)
    memory_bytes: int | None = None  # on a GPU: what each engine may allocate there (None: any)


def check_gpu_budget(memory_bytes: int, engines: int, total_bytes: int, device: str) -> None:
    """Refuse ``engines`` engines of ``memory_bytes`` each on a GPU of ``total_bytes``."""
    need = memory_bytes * engines
    if need > total_bytes:
        raise ServingError(
            f"{engines} engines of {memory_bytes / 2**30:.1f} GiB each need "
            f"{need / 2**30:.1f} GiB, but {device} has {total_bytes / 2**30:.1f} GiB: run "
            "fewer engines, a smaller model or shorter prompts"
        )


def gpu_bytes(device: str) -> int:
    """The memory of a CUDA device (this process then holds a CUDA context)."""
    import torch

    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)


def build_model(config: EngineConfig) -> Any:
    """An engine process's model, after its torch threads and its GPU memory budget are set."""
    import torch

    from beluga.serving.model import ModelEngine

    torch.set_num_threads(config.threads)
    if config.memory_bytes is not None and torch.device(config.device).type == "cuda":
        device = torch.device(config.device)
        fraction = min(1.0, config.memory_bytes / gpu_bytes(config.device))
        torch.cuda.set_per_process_memory_fraction(fraction, device)
    return ModelEngine(config.shape, seed=config.seed, device=config.device, dtype=config.dtype)


@dataclass(frozen=True)
class Job:
    index: int
    token_ids: Sequence[int]
    salt: str | None
    want_logits: bool
    max_tokens: int = 0


@dataclass(frozen=True)
class Reply:
    index: int
    started: float  # time.monotonic() when the engine took the job
    served: Served | None
    error: BaseException | None


@dataclass(frozen=True)
class Record:
    """One request as the driver saw it; times in seconds from the start of the run."""

    index: int
    engine: int
    arrival: float
    start: float
    served: Served

    @property
    def queue(self) -> float:
        return self.start - self.arrival

    @property
    def ttft(self) -> float:
        """Arrival to first token: waiting for the engine, then lookup, load and compute."""
        return self.queue + self.served.timings.ttft

    @property
    def end(self) -> float:
        """When the engine was done with the request."""
        return self.start + self.served.timings.busy


@dataclass(frozen=True)
class Handoff:
    """One request served disaggregated: prefilled on one engine, decoded on another.

    ``decode.arrival`` is when the driver learnt that the prefill was
    committed (it routes the request to a decode engine then).  Frozen data:
    safe to share between threads and processes.
    """

    prefill: Record
    decode: Record

    @property
    def committed(self) -> float:
        """When the prefill engine had every full block of the prompt committed."""
        return self.prefill.end

    @property
    def first_token(self) -> float:
        """When the decode engine had the first output token."""
        return self.decode.start + self.decode.served.timings.ttft

    @property
    def handoff(self) -> float:
        """Prefill committed to the decode engine's first token: telling the driver,
        waiting for a decode engine, its lookup, load and the prompt's last tokens."""
        return self.first_token - self.committed

    @property
    def ttft(self) -> float:
        """Arrival to the first output token: prefill, then the handoff."""
        return self.first_token - self.prefill.arrival


EngineBuilder = Callable[[str, EngineConfig], tuple[Any, Any]]
"""Builds an engine process's KV store and engine: ``(store, engine)``, each with ``close()``.

The engine (in ``config.role``) has ``serve(token_ids, salt=, want_logits=,
max_tokens=)``, which returns a :class:`~beluga.serving.engine.Served`.  The
builder crosses to the engine process, so it must pickle (a module-level
function, or an instance of a module-level class).
"""


def _engine_main(
    conn: Connection, pool: str, config: EngineConfig, build: EngineBuilder | None = None
) -> None:
    """An engine process: build, say ready (or why not), then serve jobs until told to stop."""
    try:
        store, engine = (build or _build_engine)(pool, config)
    except BaseException as e:  # the driver re-raises it, with its message
        conn.send(("failed", _portable(e)))
        return
    try:
        conn.send(("ready", os.getpid()))
        while (job := conn.recv()) is not None:
            started = time.monotonic()
            try:
                served = engine.serve(
                    job.token_ids,
                    salt=job.salt,
                    want_logits=job.want_logits,
                    max_tokens=job.max_tokens,
                )
            except Exception as e:
                conn.send(Reply(job.index, started, None, _portable(e)))
            else:
                conn.send(Reply(job.index, started, served, None))
    except (EOFError, BrokenPipeError):
        pass  # the driver went away: stop quietly
    finally:
        engine.close()
        store.close()


def _build_engine(pool: str, config: EngineConfig) -> tuple[Any, Any]:
    from beluga.kv.store import KVStore
    from beluga.serving.engine import ServingEngine

    model = build_model(config)
    store = KVStore(pool, coherence=config.coherence, timeout=config.rpc_timeout)
    try:
        return store, ServingEngine(model, store, role=config.role, identity=config.identity)
    except BaseException:
        store.close()
        raise


def _portable(error: BaseException) -> BaseException:
    """The error itself if it pickles, else a RuntimeError with its text."""
    try:
        pickle.dumps(error)
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT while children start, so that they inherit the disposition.

    A terminal's Ctrl-C goes to the whole process group; an engine that got
    it while importing torch would die with a traceback.  Ignoring it, the
    engines leave shutting down to the driver (``Cluster.close``).  Only the
    main thread may change signal handlers; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _serve_quietly(pool: str, coherence: str | None, ready: Any) -> None:
    """The metadata server process, without its start-up banner on the driver's terminal."""
    from beluga.server.server import serve

    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    serve(pool, coherence=coherence, ready=ready)


class Cluster:
    """A metadata server and ``engines`` engine processes on one pool, driven from here.

    Not thread-safe (one thread drives it); not fork-safe (a child would share
    its pipes).
    """

    def __init__(
        self,
        pool: str,
        config: EngineConfig,
        *,
        engines: int = 2,
        roles: Sequence[str] | None = None,
        start_timeout: float = 300.0,
        reply_timeout: float = 600.0,
        start_method: str = "spawn",
        build: EngineBuilder | None = None,
    ) -> None:
        """``start_method`` "spawn" (the default) gives every process a fresh interpreter
        that imports torch itself; "fork" starts in a second instead of the ~7 s
        that importing transformers takes, and is for parents that have not
        touched CUDA (tests).

        ``build`` gives the engines a KV store other than the pool (a baseline
        store that runs on its own): then no metadata server is started and
        ``pool`` only names the store in messages.

        ``roles`` gives each engine its role (:data:`beluga.serving.engine.ROLES`);
        by default every engine is ``config.role``.
        """
        if engines < 1:
            raise ValueError(f"a cluster needs at least one engine, not {engines}")
        self.roles = list(roles) if roles is not None else [config.role] * engines
        if len(self.roles) != engines or not set(self.roles) <= set(ROLES):
            raise ValueError(f"roles must be {engines} of {ROLES}, not {self.roles}")
        self.pool = pool
        self.config = config
        self.num_engines = engines
        self.start_timeout = start_timeout
        self.reply_timeout = reply_timeout
        self.ctx = mp.get_context(start_method)
        self.build = build
        self.server: Any = None
        self.engines: list[Any] = []
        self.conns: list[Connection] = []
        self.pids: list[int] = []

    # -- life cycle ----------------------------------------------------------

    def start(self) -> Cluster:
        """Start the server, then the engines; on any failure stop what started and raise.

        Engines on a GPU with a memory budget are refused first when their
        budgets together exceed the GPU's memory.
        """
        if self.config.memory_bytes is not None and self.config.device.startswith("cuda"):
            device = self.config.device
            check_gpu_budget(self.config.memory_bytes, self.num_engines, gpu_bytes(device), device)
        try:
            if self.build is None:
                self._start_server()
            self._start_engines()
        except BaseException:
            self.close()
            raise
        return self

    def _start_server(self) -> None:
        ready = self.ctx.Event()
        server = self.ctx.Process(
            target=_serve_quietly,
            args=(self.pool, self.config.coherence, ready),
            name="beluga-metadata-server",
        )
        with _sigint_ignored():  # serve() installs its own handlers once it runs
            server.start()
        self.server = server  # only a started process is ever joined
        what = f"the metadata server for {self.pool}"
        wait_ready(server, ready, self.start_timeout, what, error=ServingError)

    def _start_engines(self) -> None:
        with _sigint_ignored():  # Ctrl-C reaches the driver alone; it stops the engines
            self._spawn_engines()
        deadline = time.monotonic() + self.start_timeout
        for i in range(len(self.conns)):
            message = self._receive(i, deadline, "starting")
            if message[0] == "failed":
                raise message[1]
            self.pids.append(message[1])

    def _spawn_engines(self) -> None:
        for i, role in enumerate(self.roles):
            parent, child = self.ctx.Pipe()
            config = dataclasses.replace(self.config, role=role)
            proc = self.ctx.Process(
                target=_engine_main,
                args=(child, self.pool, config, self.build),
                name=f"beluga-engine-{i}",
            )
            self.conns.append(parent)  # closed by close(), whatever happens next
            try:
                proc.start()
            finally:
                child.close()
            self.engines.append(proc)

    def close(self) -> None:
        """Stop the engines (after their current job), then the server; safe to call twice."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.engines:
            stop_process(proc, 10.0, terminate=False)  # told through its pipe
        for conn in self.conns:
            conn.close()
        if self.server is not None:
            stop_process(self.server, 10.0)  # SIGTERM: serve() shuts down cleanly
        self.engines, self.conns, self.server = [], [], None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- driving -------------------------------------------------------------

    def _receive(self, engine: int, deadline: float, doing: str) -> Any:
        """The next message from an engine, or a ServingError if it dies or the deadline passes."""
        conn, proc = self.conns[engine], self.engines[engine]
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServingError(
                    f"engine {engine} did not answer in time while {doing}; "
                    "raise the timeout for bigger models or slower machines"
                )
            try:
                if wait([conn, proc.sentinel], min(left, LOOK_S)) and conn.poll():
                    return conn.recv()
            except (EOFError, OSError):
                raise self._gone(engine, doing) from None
            if not proc.is_alive():
                raise self._gone(engine, doing)
            raise_if_interrupted()

    def _send(self, engine: int, job: Job) -> None:
        try:
            self.conns[engine].send(job)
        except OSError:
            raise self._gone(engine, "a job") from None

    def _gone(self, engine: int, doing: str) -> ServingError:
        """The error for an engine whose pipe broke: it exited (or is about to)."""
        proc = self.engines[engine]
        proc.join(5.0)
        return ServingError(
            f"engine {engine} (pid {proc.pid}) exited with code {proc.exitcode} while "
            f"{doing}; its error, if any, is printed above; start the cluster again"
        )

    def run(
        self,
        requests: Sequence[Sequence[int]],
        scheduler: Scheduler,
        *,
        salt: str | None = None,
        want_logits: bool = False,
        max_tokens: int = 0,
        rate: float = 0.0,
        seed: int = 0,
        arrivals: Sequence[float] | None = None,
        on_record: Callable[[Record], None] | None = None,
    ) -> list[Record]:
        """Serve every request once, each on one engine; records in request order.

        Arrivals (seconds from the start) are ``arrivals`` if given, else a
        Poisson process of ``rate`` requests/s (:func:`poisson_arrivals`;
        with ``rate`` 0 every request arrives at once: a trace replayed as
        fast as the engines go).
        """
        stage = _Stage(list(range(self.num_engines)), scheduler, max_tokens)
        runs = self._drive(requests, [stage], salt, want_logits, rate, seed, arrivals, on_record)
        return [only for (only,) in runs]

    def run_disaggregated(
        self,
        requests: Sequence[Sequence[int]],
        prefill: Scheduler,
        decode: Scheduler,
        *,
        max_tokens: int,
        salt: str | None = None,
        want_logits: bool = False,
        rate: float = 0.0,
        seed: int = 0,
        arrivals: Sequence[float] | None = None,
        on_record: Callable[[Record], None] | None = None,
    ) -> list[Handoff]:
        """Serve every request on a ``kv_producer`` engine, then on a ``kv_consumer`` one.

        ``prefill`` routes among the producers, ``decode`` among the
        consumers (engine indices within each group, in engine order).  A
        request goes to decode when its prefill engine answers, that is once
        the prompt's blocks are committed; the decode engine generates
        ``max_tokens`` tokens.  ``on_record`` sees each decode record.
        """
        groups = [[i for i, r in enumerate(self.roles) if r == role] for role in _PD_ROLES]
        if not all(groups):
            raise ServingError(
                f"a disaggregated run needs kv_producer and kv_consumer engines, not {self.roles}"
            )
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, not {max_tokens}")
        stages = [_Stage(groups[0], prefill, 0), _Stage(groups[1], decode, max_tokens)]
        runs = self._drive(requests, stages, salt, want_logits, rate, seed, arrivals, on_record)
        return [Handoff(*pair) for pair in runs]

    def _drive(
        self,
        requests: Sequence[Sequence[int]],
        stages: list[_Stage],
        salt: str | None,
        want_logits: bool,
        rate: float,
        seed: int,
        arrivals: Sequence[float] | None,
        on_record: Callable[[Record], None] | None,
    ) -> list[list[Record]]:
        if not self.conns:
            raise ServingError("the cluster is not started; call start() or use it in a with")
        if arrivals is None:
            times = poisson_arrivals(len(requests), rate, seed)
        elif rate:
            raise ValueError("give arrivals or a rate, not both")
        else:
            times = list(arrivals)
        if len(times) != len(requests) or any(b < a for a, b in itertools.pairwise(times)):
            raise ValueError("arrivals must be one per request, in order")
        return _Run(self, requests, stages, salt, want_logits, times, on_record).drive()


_PD_ROLES = ("kv_producer", "kv_consumer")


@dataclass(frozen=True)
class _Stage:
    """One step of every request: the engines that serve it and how to choose among them."""

    engines: list[int]
    scheduler: Scheduler
    max_tokens: int


class _Run:
    """The driver's state for one run: each request passes through the stages in order."""

    def __init__(
        self,
        cluster: Cluster,
        requests: Sequence[Sequence[int]],
        stages: list[_Stage],
        salt: str | None,
        want_logits: bool,
        arrivals: list[float],
        on_record: Callable[[Record], None] | None,
    ) -> None:
        self.c = cluster
        self.requests = requests
        self.stages = stages
        self.salt = salt
        self.want_logits = want_logits
        self.arrivals = arrivals
        self.on_record = on_record
        n = cluster.num_engines
        self.queues: list[deque[int]] = [deque() for _ in range(n)]
        self.in_flight: list[int | None] = [None] * n
        self.outstanding = [0] * n
        self.stage_of = [0] * n  # which stage each engine serves
        for s, stage in enumerate(stages):
            for engine in stage.engines:
                self.stage_of[engine] = s
        self.records: list[list[Record]] = [[] for _ in requests]
        self.arrived_at: list[float] = list(arrivals)  # arrival at the request's current stage
        self.done = 0

    def drive(self) -> list[list[Record]]:
        t0 = time.monotonic()
        arrived = 0
        last_progress = t0
        while self.done < len(self.requests):
            now = time.monotonic()
            while arrived < len(self.requests) and t0 + self.arrivals[arrived] <= now:
                self._route(arrived, 0)
                arrived += 1
            if self._dispatch():
                last_progress = now
            next_arrival = t0 + self.arrivals[arrived] if arrived < len(self.requests) else None
            deadline = last_progress + self.c.reply_timeout
            until = deadline if next_arrival is None else min(deadline, next_arrival)
            waiting = [*self.c.conns, *(p.sentinel for p in self.c.engines)]
            ready = wait(waiting, min(max(0, until - now), LOOK_S))
            raise_if_interrupted()
            if not ready and next_arrival is None and time.monotonic() >= deadline:
                raise ServingError(
                    f"no engine answered within {self.c.reply_timeout:.0f} s; raise the reply "
                    "timeout for bigger models or slower machines"
                )
            for engine, conn in enumerate(self.c.conns):
                if conn in ready or self.c.engines[engine].sentinel in ready:
                    self._collect(engine, t0)
                    last_progress = time.monotonic()
        return self.records

    def _route(self, index: int, stage: int) -> None:
        tokens = self.requests[index]
        group, scheduler = self.stages[stage].engines, self.stages[stage].scheduler
        chosen = scheduler.route(tokens, [self.outstanding[e] for e in group])
        if not 0 <= chosen < len(group):
            raise ValueError(
                f"scheduler {scheduler.name} chose engine {chosen}, not one of 0..{len(group) - 1}"
            )
        engine = group[chosen]
        self.outstanding[engine] += len(tokens)
        self.queues[engine].append(index)

    def _dispatch(self) -> bool:
        """Send the next queued job to every idle engine; whether any was sent."""
        sent = False
        for engine, queue in enumerate(self.queues):
            if self.in_flight[engine] is None and queue:
                index = queue.popleft()
                tokens = list(self.requests[index])
                stage = self.stages[self.stage_of[engine]]
                job = Job(index, tokens, self.salt, self.want_logits, stage.max_tokens)
                self.c._send(engine, job)
                self.in_flight[engine] = index
                sent = True
        return sent

    def _collect(self, engine: int, t0: float) -> None:
        reply: Reply = self.c._receive(
            engine, time.monotonic() + self.c.reply_timeout, "serving a job"
        )
        if reply.error is not None:
            raise ServingError(
                f"engine {engine} failed request {reply.index}: "
                f"{type(reply.error).__name__}: {reply.error}"
            ) from reply.error
        if reply.served is None or reply.index != self.in_flight[engine]:
            raise ServingError(
                f"engine {engine} answered request {reply.index}, but it was sent request "
                f"{self.in_flight[engine]}; the engine and the driver disagree: restart both"
            )
        self.in_flight[engine] = None
        self.outstanding[engine] -= len(self.requests[reply.index])
        index = reply.index
        record = Record(index, engine, self.arrived_at[index], reply.started - t0, reply.served)
        self.records[index].append(record)
        stage = self.stage_of[engine] + 1
        if stage < len(self.stages):
            self.arrived_at[index] = time.monotonic() - t0
            self._route(index, stage)
            return
        self.done += 1
        if self.on_record is not None:
            self.on_record(record)
