"""A pool: a backend's mapping, its validated superblock, and this host's view of it.

Like ``multiprocessing.shared_memory``: :meth:`Pool.close` lets go of this
handle, :meth:`Pool.destroy` removes the shared object, both are always safe
to call, and a handle pickles by spec so another process re-attaches.
"""

from __future__ import annotations

import contextlib
from typing import Any

from beluga.coherence import Memory, ModelConfig, attach, resolve_mode
from beluga.errors import PoolError
from beluga.pool.backends import Backend, Mapping, parse_spec
from beluga.pool.hosts import HostEntry, HostTable
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


def _has_superblock(mapping: Mapping) -> bool:
    return mapping.size >= len(MAGIC) and bytes(mapping.buffer[: len(MAGIC)]) == MAGIC


def _zero(mem: Memory, offset: int, length: int) -> None:
    """Clear a region with stores that reach memory."""
    for off in range(offset, offset + length, len(_ZERO_CHUNK)):
        mem.nt_store(off, _ZERO_CHUNK[: min(len(_ZERO_CHUNK), offset + length - off)])
    mem.sfence()


class Pool:
    """An attached pool.  Build one with :meth:`create` or :meth:`attach`."""

    def __init__(
        self, backend: Backend, mapping: Mapping, superblock: Superblock, memory: Memory
    ) -> None:
        self.backend = backend
        self.mapping = mapping
        self.superblock = superblock
        self.memory = memory
        self.hosts = HostTable(memory, superblock.hosts, superblock.max_hosts)

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
        place only when complete; a device gets its superblock magic last.
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
        mapping = backend.create(size)
        try:
            fmt = Memory(mapping.buffer, "native")
            try:
                fmt.nt_store(0, bytes(SUPERBLOCK_BYTES))
                fmt.sfence()
                if not backend.creates_storage:  # a device keeps old bytes: clear our regions
                    for region in (sb.hosts, sb.rpc, sb.headers):
                        _zero(fmt, region.offset, region.length)
                packed = sb.pack()
                fmt.nt_store(len(MAGIC), packed[len(MAGIC) :])
                fmt.sfence()
                fmt.nt_store(0, packed[: len(MAGIC)])
                fmt.sfence()
            finally:
                fmt.release()
            mapping.close()
            backend.commit()
        except BaseException:
            mapping.close()
            backend.abort()
            raise
        return cls.attach(backend, coherence=coherence, model=model)

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
            memory = attach(mapping.buffer, mode, model)
            memory.invalidate(0, SUPERBLOCK_BYTES)
            memory.mfence()
            sb = unpack(memory.load(0, SUPERBLOCK_BYTES), mapping.size, backend.spec)
            return cls(backend, mapping, sb, memory)
        except BaseException:
            if memory is not None:
                memory.release()
            mapping.close()
            raise

    @staticmethod
    def destroy(spec: str | Backend) -> None:
        """Remove a pool (a file is unlinked, a device loses its superblock)."""
        parse_spec(spec).unlink()

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
            {"pid": seat.identity.pid, "same_machine": seat.identity.same_kernel()}
            if seat is not None and seat.epoch
            else None
        )
        return {
            **self.backend.info(),
            **self.superblock.describe(),
            "coherence": self.memory.mode,
            "server": server,
            "members": hosts,
        }


def _reattach(spec: str, mode: str) -> Pool:
    return Pool.attach(spec, coherence=mode)
