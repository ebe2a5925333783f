"""Pool backends: the only code that knows where the shared memory comes from.

A backend maps memory and nothing else: it never decides coherence and never
parses a protocol structure.  Each is named by a *spec* string, so a pool
handle pickles by name and another process re-attaches instead of copying::

    shm:/dev/shm/beluga            a file mapped MAP_SHARED (default; CI)
    numa:1:/dev/shm/beluga-n1      such a file with its pages bound to NUMA node 1
    dax:/dev/dax0.0                a device-DAX character device (QEMU CXL, a real switch)
    dax:/dev/dax0.0@4194304        ... using the device from a data offset on
    interleave:2097152:dax:/dev/dax0.0,dax:/dev/dax1.0
                                   several devices, striped every 2 MiB

A bare path is shorthand for ``shm:PATH``.  ``Mapping`` is what a backend
returns: a writable buffer, its size, and ``close()``.  Which pool a caller
means is :func:`resolve_pool`'s to say: its own argument, else
``$BELUGA_POOL``.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import fcntl
import importlib
import mmap
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from beluga.errors import BackendUnavailableError, PoolError, PoolNotNamedError
from beluga.units import MiB

HUGE_ALIGN = 2 * MiB
#: the environment variable that names the pool when a caller's own setting does not
POOL_ENV = "BELUGA_POOL"
#: the pool of the CLI and of the Mooncake drop-in when nothing names one
DEFAULT_POOL = "shm:/dev/shm/beluga"
POOL_FILE_MODE = 0o660  # shared with the group, never world-writable


@dataclass
class Mapping:
    """A writable shared buffer and how to let it go.

    ``buffer`` supports the buffer protocol (an ``mmap`` or a memoryview over
    stitched mappings).  ``fd`` is a descriptor of the backing file or device
    (for advisory locking, and for a backend that maps it again), or -1;
    ``buffer[0]`` is byte ``offset`` of it.
    """

    buffer: Any
    size: int
    fd: int = -1
    offset: int = 0
    _closers: list[Any] = field(default_factory=list)

    def close(self) -> None:
        """Unmap and close; safe to call twice.

        Steps run last-registered first and each is dropped only once it has
        succeeded, so a close refused while a view is alive (BufferError) can
        be retried after the view is released, instead of leaking the rest.
        """
        while self._closers:
            self._closers[-1]()
            self._closers.pop()
        self.buffer = None
        self.fd = -1

    def exclusive_lock(self, what: str) -> int:
        """Take this kernel's exclusive advisory lock on the backing object; returns its fd.

        The lock is taken on a *fresh* open file description, so it excludes
        every other process of this kernel, forked children of the holder
        included (a lock on an inherited descriptor would be shared with
        them).  Closing the returned descriptor releases it; so does the
        holder's death.  Raises ``PoolError`` naming ``what`` when another
        process holds it; returns -1 where there is nothing to lock.
        """
        if self.fd < 0 or os.environ.get("BELUGA_EMULATED_HOST"):
            return -1  # an emulated host is a kernel of its own (beluga.pool.hosts)
        fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise PoolError(
                f"{what} is held by another process of this machine; stop it first"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        return fd


class Backend(abc.ABC):
    """Where a pool's memory lives.  Subclasses only map memory."""

    scheme: ClassVar[str]
    #: True when ``create`` makes the memory (a file); False when it exists (a device).
    #: A class default that a backend made of others may override per instance.
    creates_storage: bool = True

    @classmethod
    def from_spec(cls, rest: str) -> Backend:
        """Build from the part of a spec after ``scheme:``."""
        return cls(rest)  # type: ignore[call-arg]

    @property
    @abc.abstractmethod
    def spec(self) -> str:
        """The spec string that names this backend (round-trips through parse_spec)."""

    @abc.abstractmethod
    def exists(self) -> bool:
        """Whether the backing memory is there to open."""

    @abc.abstractmethod
    def create(self, size: int) -> Mapping:
        """Make (or claim) ``size`` bytes and map them; the caller formats them."""

    @abc.abstractmethod
    def open(self) -> Mapping:
        """Map existing memory."""

    @abc.abstractmethod
    def unlink(self) -> None:
        """Remove the backing memory where that means anything; safe to repeat."""

    def names(self, mapping: Mapping) -> bool:
        """Whether this backend's path still names the object ``mapping`` maps.

        False once the file was unlinked or replaced (a new pool renamed over
        it).  The base class knows no path and answers True; the superblock
        check of :meth:`Pool.changed` still catches a pool reformatted in place.
        """
        return True

    def commit(self) -> None:  # noqa: B027 - most backends have nothing to publish
        """Make a freshly formatted pool visible (a rename for files; nothing for devices)."""

    def abort(self) -> None:  # noqa: B027 - most backends have nothing to undo
        """Undo a ``create`` that failed before ``commit``."""

    def info(self) -> dict[str, Any]:
        """A few facts about the backing memory, for ``beluga pool info``."""
        return {"backend": self.scheme, "spec": self.spec}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


def _map_fd(fd: int, size: int, offset: int = 0) -> mmap.mmap:
    """MAP_SHARED read-write mapping of an open descriptor."""
    return mmap.mmap(
        fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset
    )


def same_object(path: str, mapping: Mapping) -> bool:
    """Whether ``path`` names the file or device that ``mapping``'s descriptor is open on."""
    if mapping.fd < 0:
        return False
    try:
        named = os.stat(path)
    except OSError:
        return False
    mapped = os.fstat(mapping.fd)
    return (named.st_dev, named.st_ino) == (mapped.st_dev, mapped.st_ino)


def _mapping_of(fd: int, size: int, offset: int = 0) -> Mapping:
    """Map fd and wrap it so that close() unmaps and closes, in that order."""
    try:
        mm = _map_fd(fd, size, offset)
    except BaseException:
        os.close(fd)
        raise
    return Mapping(
        buffer=mm, size=size, fd=fd, offset=offset, _closers=[lambda: os.close(fd), mm.close]
    )


class ShmBackend(Backend):
    """A regular file mapped MAP_SHARED; each attaching process is one emulated host."""

    scheme = "shm"

    def __init__(self, path: str) -> None:
        if not path:
            raise ValueError("the shm backend needs a path, e.g. shm:/dev/shm/beluga")
        self.path = os.path.abspath(path)

    @property
    def spec(self) -> str:
        return f"shm:{self.path}"

    def exists(self) -> bool:
        return os.path.exists(self.path)

    def create(self, size: int) -> Mapping:
        """Create the file at a temporary name; ``Pool.create`` renames it in when formatted."""
        tmp = self.staging_path()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, POOL_FILE_MODE)
        except OSError as e:
            raise BackendUnavailableError(
                f"cannot create {tmp}: {e.strerror}; choose a path you can write "
                "(e.g. shm:/dev/shm/NAME) or run as a user with access"
            ) from e
        try:
            os.fchmod(fd, POOL_FILE_MODE)  # the umask must not widen or narrow it
            self._allocate(fd, size)
        except BaseException as e:
            os.close(fd)
            os.unlink(tmp)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EFBIG):
                raise BackendUnavailableError(
                    f"no room for a {size}-byte pool at {self.path}: {e.strerror}; "
                    "pick a smaller --size or free space"
                ) from e
            raise
        return _mapping_of(fd, size)

    def _allocate(self, fd: int, size: int) -> None:
        """Give the new, empty file its pages now, so a full disk fails here and not later.

        A subclass that places pages (NUMA binding) overrides this to set the
        policy before any page exists; whatever it raises, ``create`` removes
        the file.
        """
        os.posix_fallocate(fd, 0, size)

    def staging_path(self) -> str:
        """Where ``create`` builds the file before it is published by rename."""
        return f"{self.path}.creating"

    def commit(self) -> None:
        """Atomically move the formatted file into place (replacing any old pool)."""
        os.replace(self.staging_path(), self.path)

    def abort(self) -> None:
        """Remove a half-created file."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.staging_path())

    def open(self) -> Mapping:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError as e:
            raise PoolError(
                f"no pool at {self.path}; create one with 'beluga pool create --pool {self.spec}'"
            ) from e
        except PermissionError as e:
            raise BackendUnavailableError(
                f"cannot open {self.path}: permission denied; the pool file is mode "
                f"{POOL_FILE_MODE:o}, so run as its owner or a member of its group"
            ) from e
        size = os.fstat(fd).st_size
        if size == 0:
            os.close(fd)
            raise PoolError(
                f"{self.path} is an empty file, not a Beluga pool; remove it yourself or "
                "choose another path for 'beluga pool create'"
            )
        return _mapping_of(fd, size)

    def names(self, mapping: Mapping) -> bool:
        return same_object(self.path, mapping)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.abort()

    def info(self) -> dict[str, Any]:
        out = super().info()
        out["path"] = self.path
        return out


_BACKENDS: dict[str, type[Backend]] = {"shm": ShmBackend}
#: built-in backends imported on first use ("module:Class"), so that a plain
#: shm user never loads libnuma or ctypes mapping code
_LAZY: dict[str, str] = {
    "numa": "beluga.pool.numa:NumaBackend",
    "dax": "beluga.pool.dax:DaxBackend",
    "interleave": "beluga.pool.interleave:InterleaveBackend",
}


def register_backend(cls: type[Backend]) -> type[Backend]:
    """Class decorator: make a backend reachable by its spec scheme."""
    if cls.scheme in _BACKENDS and _BACKENDS[cls.scheme] is not cls:
        raise ValueError(f"backend scheme {cls.scheme!r} is already registered")
    _BACKENDS[cls.scheme] = cls
    return cls


def _backend_class(scheme: str) -> type[Backend] | None:
    if scheme not in _BACKENDS and scheme in _LAZY:
        module, _, name = _LAZY[scheme].partition(":")
        _BACKENDS[scheme] = getattr(importlib.import_module(module), name)
    return _BACKENDS.get(scheme)


def parse_spec(spec: str | Backend) -> Backend:
    """Turn a spec string (see the module docstring) into a backend."""
    if isinstance(spec, Backend):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(
            f"a pool spec is a non-empty string like 'shm:/dev/shm/beluga', not {spec!r}"
        )
    scheme, sep, rest = spec.partition(":")
    if not sep or scheme.startswith("/") or scheme.startswith("."):
        return ShmBackend(spec)
    cls = _backend_class(scheme)
    if cls is None:
        known = ", ".join(sorted({*_BACKENDS, *_LAZY}))
        raise ValueError(f"unknown pool backend {scheme!r} in {spec!r}; known: {known}")
    return cls.from_spec(rest)


def resolve_pool(spec: str | None, *, setting: str, default: str | None = None) -> str:
    """The pool spec to use: ``spec`` when given, else ``$BELUGA_POOL``, else ``default``.

    The one rule for every caller that names a pool (the CLI, the Mooncake
    drop-in, the framework integrations).  ``setting`` is where the caller's
    users give ``spec`` (``--pool``, an ``extra_config`` key), so that the
    error says what to set.

    Raises:
        PoolNotNamedError: none of the three names a pool.
    """
    for candidate in (spec, os.environ.get(POOL_ENV), default):
        if candidate:
            return candidate
    raise PoolNotNamedError(
        f"no pool is named: set {setting} to a pool spec (e.g. {DEFAULT_POOL}), "
        f"or the {POOL_ENV} environment variable"
    )
