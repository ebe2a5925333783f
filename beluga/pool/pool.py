"""A pool: a backend's mapping, its validated superblock, and this host's view of it.

Like ``multiprocessing.shared_memory``: :meth:`Pool.close` lets go of this
handle, :meth:`Pool.destroy` removes the shared object, both are always safe
to call, and a handle pickles by spec so another process re-attaches.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from beluga._native import _core, step
from beluga.coherence import LINE, Memory, ModelConfig, attach, resolve_mode
from beluga.errors import PoolChangedError, PoolError
from beluga.pool.backends import Backend, Mapping, parse_spec
from beluga.pool.host_records import HostEntry, Identity
from beluga.pool.hosts import DEFAULT_STALE_S, HostTable
from beluga.pool.layout import (
    MAGIC,
    REGION_ALIGN,
    SUPERBLOCK_BYTES,
    Geometry,
    Superblock,
    plan,
    unpack,
)

_ZERO_CHUNK = bytes(REGION_ALIGN)
_clear_fence = step("FORMAT_CLEAR_FENCE", Memory.sfence)
_format_fence = step("FORMAT_FENCE", Memory.sfence)


def _has_superblock(mapping: Mapping) -> bool:
    return mapping.size >= SUPERBLOCK_BYTES and bytes(mapping.buffer[: len(MAGIC)]) == MAGIC


def _not_a_pool(spec: str) -> PoolError:
    return PoolError(
        f"{spec} is not a Beluga pool (no Beluga superblock at its start); it was left "
        f"untouched: create a pool elsewhere, e.g. 'beluga pool create --pool shm:/dev/shm/NAME'"
    )


def _zero(mem: Memory, offset: int, length: int) -> None:
    """Clear a region with non-temporal stores (the caller fences)."""
    for off in range(offset, offset + length, len(_ZERO_CHUNK)):
        mem.nt_store(off, _ZERO_CHUNK[: min(len(_ZERO_CHUNK), offset + length - off)])


def format_pool(mem: Memory, sb: Superblock, *, clear: bool) -> None:
    """Write a new pool's format through one host's view of its mapping.

    The old superblock goes first, and with ``clear`` (a device keeps old
    bytes) the host table, the RPC area and the block header and commit
    tables; one SFENCE, so that none of the old pool's lines can outlive the
    new superblock; then the new superblock, fenced, so that the pool is
    there for every host when this returns.  Only the superblock's lines
    that hold data are written (the clear zeroed the rest): its checksum
    covers all of it, so a superblock torn by a crash is refused, never
    half-trusted, and needs no fence of its own between body and magic.
    """
    mem.nt_store(0, bytes(SUPERBLOCK_BYTES))
    if clear:
        for region in (sb.hosts, sb.rpc, sb.index, sb.headers):
            _zero(mem, region.offset, region.length)
    _clear_fence(mem)
    packed = sb.pack()
    for off in range(0, SUPERBLOCK_BYTES, LINE):
        if any(packed[off : off + LINE]):
            mem.nt_store(off, packed[off : off + LINE])
    _format_fence(mem)


class Pool:
    """An attached pool.  Build one with :meth:`create` or :meth:`attach`."""

    def __init__(
        self,
        backend: Backend,
        mapping: Mapping,
        superblock: Superblock,
        memory: Memory,
        raw_superblock: bytes = b"",
    ) -> None:
        self.backend = backend
        self.mapping = mapping
        self.superblock = superblock
        self.memory = memory
        self.hosts = HostTable(memory, superblock.hosts, superblock.max_hosts)
        self._raw_superblock = raw_superblock or superblock.pack()

    # -- lifecycle ---------------------------------------------------------

    @classmethod
    def create(
        cls,
        spec: str | Backend,
        size: int,
        *,
        geometry: Geometry | None = None,
        label: str = "",
        force: bool = False,
        coherence: str | None = None,
        model: ModelConfig | None = None,
    ) -> Pool:
        """Format a new pool and attach to it.

        Refuses to overwrite an existing pool unless ``force``.  On any
        failure nothing is left behind: a file is built aside and renamed into
        place only when complete; a device gets its superblock only once the
        old one and its regions are cleared (:func:`format_pool`).  The
        format is written by a host in the given coherence mode, like any
        other store to the pool.
        """
        backend = parse_spec(spec)
        sb = plan(size, geometry or Geometry(), label)
        unpack(sb.pack(), size, backend.spec)  # what attach will check, before anything is made
        if backend.exists() and not force:
            existing = None
            with contextlib.suppress(PoolError):
                existing = backend.open()
            if existing is not None:
                try:
                    occupied = _has_superblock(existing) or backend.creates_storage
                finally:
                    existing.close()
                if occupied:
                    raise PoolError(
                        f"{backend.spec} already holds a pool or file; pass --force "
                        "(force=True) to replace it, or 'beluga pool destroy' it first"
                    )
        mode = resolve_mode(coherence)
        mapping = backend.create(size)
        try:
            fmt = attach(mapping.buffer, mode, model)
            try:  # a device keeps old bytes: clear our regions
                format_pool(fmt, sb, clear=not backend.creates_storage)
            finally:
                fmt.release()
            mapping.close()
            backend.commit()
        except BaseException:
            mapping.close()
            backend.abort()
            raise
        return cls.attach(backend, coherence=mode, model=model)

    @classmethod
    def attach(
        cls, spec: str | Backend, *, coherence: str | None = None, model: ModelConfig | None = None
    ) -> Pool:
        """Map an existing pool and validate its superblock."""
        backend = parse_spec(spec)
        mode = resolve_mode(coherence)
        mapping = backend.open()
        memory = None
        try:
            if not _has_superblock(mapping):  # before any access that assumes a pool's size
                raise _not_a_pool(backend.spec)
            memory = attach(mapping.buffer, mode, model)
            # needed on hardware (a CPU cache outlives the process that filled it), but no
            # sabotage point: a new attachment's model starts empty, so it can show no stale line
            memory.invalidate(0, SUPERBLOCK_BYTES)
            memory.mfence()
            raw = memory.load(0, SUPERBLOCK_BYTES)
            sb = unpack(raw, mapping.size, backend.spec)
            return cls(backend, mapping, sb, memory, raw)
        except BaseException:
            if memory is not None:
                memory.release()
            mapping.close()
            raise

    @staticmethod
    def destroy(spec: str | Backend) -> None:
        """Remove a pool (a file is unlinked, a device loses its superblock).

        Unchecked and always safe to repeat, like ``SharedMemory.unlink``: for
        cleanup by the code that made the pool.  What an operator asks for
        goes through :func:`removal_guard` first (``beluga pool destroy``).
        """
        parse_spec(spec).unlink()

    def changed(self) -> str | None:
        """Why this handle no longer maps the pool its spec names, or None while it does.

        The backend's path must still name the mapped object (not unlinked,
        not replaced by a file renamed over it) and the superblock must be
        the one read at attach (not reformatted or destroyed in place).  A
        few stores' worth of work: servers call it every refresh.
        """
        if self.memory is None or self.memory.released:
            return None
        if self.superblock_rewritten():
            return f"the superblock of {self.spec} was rewritten (reformatted or destroyed)"
        if not self.backend.names(self.mapping):
            return f"{self.spec} was unlinked or replaced by another file"
        return None

    def superblock_rewritten(self) -> bool:
        """Whether the mapped superblock differs from the one read at attach (a new pool in it)."""
        self.memory.invalidate(0, SUPERBLOCK_BYTES)
        self.memory.mfence()
        return self.memory.load(0, SUPERBLOCK_BYTES) != self._raw_superblock

    def check_unchanged(self) -> None:
        """Raise ``PoolChangedError`` if :meth:`changed` says this handle lost its pool."""
        why = self.changed()
        if why is not None:
            raise PoolChangedError(
                f"the pool changed under this process: {why}; nothing more is written "
                "through the old mapping: restart against the pool now there"
            )

    def close(self) -> None:
        """Detach this handle; safe to call twice."""
        if self.memory is not None and not self.memory.released:
            self.memory.release()
        if self.mapping is not None:
            self.mapping.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_reattach, (self.backend.spec, self.memory.mode))

    # -- facts -------------------------------------------------------------

    @property
    def spec(self) -> str:
        return self.backend.spec

    def index_reader(self, memory: Memory | None = None, **hints: int) -> Any:
        """A one-sided reader of the pool index (the C core's ``Index``: probes, confirms
        and reads by key with loads alone) through ``memory``, this host's view unless
        another is given; ``hints`` (``hint_off``, ``owner``) give it this host's hint lines."""
        sb = self.superblock
        return _core.Index(
            memory if memory is not None else self.memory,
            sb.index.offset,
            sb.nbuckets,
            sb.headers.offset,
            sb.payloads.offset,
            sb.block_size,
            sb.nblocks,
            **hints,
        )

    def claim_host(self, host_id: int | None = None, timeout: float = 10.0) -> HostEntry:
        """Ask the pool's server for a host id for this process (see HostTable.claim)."""
        return self.hosts.claim(host_id, timeout=timeout)

    def info(self) -> dict[str, Any]:
        """Superblock, backend and host facts, for ``beluga pool info``."""
        hosts = [
            {
                "host_id": e.host_id,
                "pid": e.pid,
                "state": e.state.name.lower(),
                "alive": self.hosts.is_alive(e),
                "generation": e.generation,
            }
            for e in self.hosts.entries()
        ]
        seat = self.hosts.seat()
        server = (
            {
                "pid": seat.identity.pid,
                "same_machine": seat.identity.same_kernel(),
                "since_ns": seat.since_ns,
            }
            if seat is not None and seat.epoch
            else None
        )
        return {
            **self.backend.info(),
            **self.superblock.describe(),
            "coherence": self.memory.mode,
            "server": server,
            "seats_taken": seat.seats if seat is not None else 0,
            "takeovers": seat.takeovers if seat is not None else 0,
            "members": hosts,
        }


def _occupants(pool: Pool) -> tuple[list[str], list[str]]:
    """Who uses a pool: (a live server of this kernel, others alive), each as words."""
    here: list[str] = []
    elsewhere: list[str] = []
    seat = pool.hosts.seat()
    if seat is not None and seat.epoch and seat.identity != Identity.mine():
        who = f"a Beluga server (pid {seat.identity.pid}"
        if seat.identity.same_kernel():
            if seat.identity.running():
                here.append(who + " on this machine)")
        elif pool.hosts.wall() - seat.heartbeat_ns < DEFAULT_STALE_S * 1e9:
            elsewhere.append(who + ", on another host)")
    for e in pool.hosts.entries():
        if pool.hosts.is_alive(e):
            where = "this machine" if e.identity.same_kernel() else "another host"
            elsewhere.append(f"host {e.host_id} (pid {e.pid} on {where})")
    return here, elsewhere


@contextlib.contextmanager
def removal_guard(
    spec: str | Backend, action: str, *, ignore_live_hosts: bool = False
) -> Iterator[Backend]:
    """Hold off servers of this kernel while an operator removes or replaces a pool.

    Refuses (``PoolError``, the pool untouched) when ``spec`` holds no pool,
    holds something that is not a Beluga pool, is served by a live server of
    this kernel (by its pid and start time, and by the seat's advisory lock
    that a server holds), or has a live server on another host or live
    hosts, naming their pids.  ``ignore_live_hosts`` overrides only the
    last: a server on this machine always refuses.  A Beluga superblock that
    is damaged counts as a pool nobody can be using.  The lock is held until
    the block ends, so that no server of this kernel starts meanwhile.
    """
    backend = parse_spec(spec)
    if not backend.exists():
        raise PoolError(f"no pool at {backend.spec}: nothing to {action}")
    mapping = backend.open()
    lock = -1
    try:
        if not _has_superblock(mapping):
            raise _not_a_pool(backend.spec)
        pool = None
        with contextlib.suppress(PoolError):
            pool = Pool.attach(backend, coherence="native")
        here: list[str] = []
        elsewhere: list[str] = []
        if pool is not None:
            with pool:
                here, elsewhere = _occupants(pool)
        if not here:
            try:
                lock = mapping.exclusive_lock(f"the server seat of {backend.spec}")
            except PoolError:
                here = ["a Beluga server that holds its seat's lock on this machine"]
        if here:
            raise PoolError(
                f"refusing to {action} {backend.spec}: it is served by {here[0]}; stop "
                "it first (no override: its clients would lose their pool)"
            )
        if elsewhere and not ignore_live_hosts:
            raise PoolError(
                f"refusing to {action} {backend.spec}: in use by {', '.join(elsewhere)}; "
                "stop them first, or pass --ignore-live-hosts if they are gone for good"
            )
        yield backend
    finally:
        if lock >= 0:
            os.close(lock)
        mapping.close()


def _reattach(spec: str, mode: str) -> Pool:
    return Pool.attach(spec, coherence=mode)
