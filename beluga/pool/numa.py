"""``numa:NODE:PATH``: a shared tmpfs file whose pages all live on one NUMA node.

A CXL memory expander onlined as system RAM (``daxctl reconfigure-device -m
system-ram``) shows up as a CPU-less NUMA node, and so does the extra node of
the QEMU sandbox.  Binding the pool's pages to that node puts the pool in CXL
memory while every host still maps it as an ordinary file.  Any node is
accepted (CI has only node 0), but ``info()`` reports ``cpuless`` so nobody
mistakes a node with CPUs for CXL memory.

Why the binding comes before the pages: ``mbind()`` on a MAP_SHARED mapping of
a tmpfs file sets the file's *shared* policy, which lives in the inode rather
than in the mapping, and every page later allocated for the file obeys it,
whoever maps it.  Pages that already exist are never moved, so ``create``
makes a sparse file, binds it, and only then allocates.  On any other file
system the policy would stay with the one mapping and die with it; ``create``
catches that by reading the policy back through a fresh mapping, and checks
that the pages really sit on the node.

libnuma is called through ctypes: the PyPI bindings are years out of date.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
from dataclasses import dataclass
from typing import Any

from beluga.errors import BackendUnavailableError
from beluga.pool._libc import address_of
from beluga.pool.backends import HUGE_ALIGN, Mapping, ShmBackend, register_backend

LIBNUMA = "libnuma.so.1"
SYS_NODES = "/sys/devices/system/node"

MPOL_BIND = 2
_MPOL_F_NODE = 1
_MPOL_F_ADDR = 2
_MPOL_MODE_FLAGS = (1 << 15) | (1 << 14) | (1 << 13)  # static/relative/numa-balancing bits
_POLICY_NAMES = {
    0: "default",
    1: "preferred",
    2: "bind",
    3: "interleave",
    4: "local",
    5: "preferred-many",
    6: "weighted-interleave",
}
_MASK_BITS = 1024  # the largest MAX_NUMNODES any Linux build has
_NodeMask = ctypes.c_ulong * (_MASK_BITS // 64)


@dataclass(frozen=True)
class NodeInfo:
    """One NUMA node as the kernel reports it."""

    node: int
    total_bytes: int
    free_bytes: int
    cpus: tuple[int, ...]
    #: True for a memory-only node: what CXL memory onlined as RAM looks like.
    cpuless: bool


def _parse_cpu_list(text: str) -> list[int]:
    """Expand a kernel list such as ``0-3,8,10-11``."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return out


def _node_memory(node: int) -> tuple[int, int]:
    """(total, free) bytes of a node, from its meminfo (values are in kB)."""
    fields: dict[str, int] = {}
    with open(os.path.join(SYS_NODES, f"node{node}", "meminfo")) as f:
        for line in f:
            words = line.split()  # "Node 0 MemTotal: 4155608 kB"
            if len(words) >= 4:
                fields[words[2].rstrip(":")] = int(words[3]) * 1024
    return fields.get("MemTotal", 0), fields.get("MemFree", 0)


def list_nodes() -> list[NodeInfo]:
    """The online NUMA nodes with their memory and CPUs (empty on a kernel without NUMA)."""
    try:
        with open(os.path.join(SYS_NODES, "online")) as f:
            online = _parse_cpu_list(f.read())
    except FileNotFoundError:
        return []
    nodes = []
    for node in online:
        with open(os.path.join(SYS_NODES, f"node{node}", "cpulist")) as f:
            cpus = tuple(_parse_cpu_list(f.read()))
        total, free = _node_memory(node)
        nodes.append(NodeInfo(node, total, free, cpus, cpuless=not cpus))
    return nodes


def _describe(nodes: list[NodeInfo]) -> str:
    return ", ".join(
        f"{n.node} ({'CPU-less' if n.cpuless else 'with CPUs'}, {n.total_bytes >> 20} MiB)"
        for n in nodes
    )


@functools.cache
def _libnuma(name: str) -> ctypes.CDLL:
    """Load libnuma once and declare the two system-call wrappers we use."""
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as e:
        raise BackendUnavailableError(
            f"the numa backend needs libnuma ({name}), which is not installed; install "
            "libnuma1 (Debian/Ubuntu: apt-get install libnuma1; Fedora: dnf install numactl-libs) "
            "or use an shm: pool"
        ) from e
    if lib.numa_available() < 0:
        raise BackendUnavailableError(
            "libnuma reports no NUMA support in this kernel (numa_available() < 0); "
            "use an shm: pool, or a kernel built with CONFIG_NUMA"
        )
    lib.mbind.argtypes = [
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_uint,
    ]
    lib.mbind.restype = ctypes.c_long
    lib.get_mempolicy.argtypes = [
        ctypes.POINTER(ctypes.c_int),
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
    ]
    lib.get_mempolicy.restype = ctypes.c_long
    return lib


def _refused(call: str) -> BackendUnavailableError:
    err = ctypes.get_errno()
    if err == errno.EPERM:
        return BackendUnavailableError(
            f"the kernel refused {call} (EPERM); in a container, grant CAP_SYS_NICE or use a "
            "seccomp profile that allows the NUMA system calls"
        )
    return BackendUnavailableError(f"{call} failed: {os.strerror(err)}")


def _address(buffer: Any, offset: int) -> int:
    if not 0 <= offset < len(buffer):
        raise ValueError(f"offset {offset} is outside the {len(buffer)}-byte buffer")
    return address_of(buffer) + offset


def memory_policy(buffer: Any, offset: int = 0) -> tuple[str, frozenset[int]]:
    """The NUMA policy that governs the page at ``offset`` of a mapping: (name, nodes).

    For a tmpfs file this is the file's shared policy, whoever set it.
    """
    lib = _libnuma(LIBNUMA)
    mode = ctypes.c_int()
    mask = _NodeMask()
    if lib.get_mempolicy(
        ctypes.byref(mode), mask, _MASK_BITS + 1, _address(buffer, offset), _MPOL_F_ADDR
    ):
        raise _refused("get_mempolicy")
    nodes = frozenset(i for i in range(_MASK_BITS) if mask[i // 64] >> (i % 64) & 1)
    kind = mode.value & ~_MPOL_MODE_FLAGS
    return _POLICY_NAMES.get(kind, f"mode {kind}"), nodes


def page_node(buffer: Any, offset: int = 0) -> int:
    """The node that holds the page at ``offset`` of a mapping (faulting it in if needed)."""
    lib = _libnuma(LIBNUMA)
    node = ctypes.c_int()
    if lib.get_mempolicy(
        ctypes.byref(node), None, 0, _address(buffer, offset), _MPOL_F_NODE | _MPOL_F_ADDR
    ):
        raise _refused("get_mempolicy")
    return node.value


@register_backend
class NumaBackend(ShmBackend):
    """A file mapped MAP_SHARED, its pages bound to one NUMA node (shm's lifecycle)."""

    scheme = "numa"

    def __init__(self, node: int, path: str) -> None:
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < _MASK_BITS:
            raise ValueError(f"a NUMA node is an integer in 0..{_MASK_BITS - 1}, not {node!r}")
        if not path:
            raise ValueError("the numa backend needs a path, e.g. numa:1:/dev/shm/beluga")
        super().__init__(path)
        self.node = node

    @classmethod
    def from_spec(cls, rest: str) -> NumaBackend:
        node, sep, path = rest.partition(":")
        if not sep or not node.isdigit():
            raise ValueError(
                f"a numa spec is numa:NODE:PATH (e.g. numa:1:/dev/shm/beluga), not 'numa:{rest}'"
            )
        return cls(int(node), path)

    @property
    def spec(self) -> str:
        return f"numa:{self.node}:{self.path}"

    def _node_info(self) -> NodeInfo | None:
        return next((n for n in list_nodes() if n.node == self.node), None)

    def _ready(self) -> tuple[ctypes.CDLL, NodeInfo]:
        """libnuma and the node, or an error that says what is missing."""
        lib = _libnuma(LIBNUMA)
        info = self._node_info()
        if info is None:
            raise BackendUnavailableError(
                f"NUMA node {self.node} does not exist here; nodes: "
                f"{_describe(list_nodes()) or 'none'}. CXL memory becomes a CPU-less node "
                "after 'daxctl reconfigure-device -m system-ram daxX.Y'"
            )
        return lib, info

    def _binding_problem(self, buffer: Any) -> str | None:
        """Why the mapping is not bound to our node, or None if it is."""
        policy, nodes = memory_policy(buffer)
        if policy == "bind" and nodes == {self.node}:
            return None
        return f"its NUMA policy is {policy} {sorted(nodes)}, not bind [{self.node}]"

    def _allocate(self, fd: int, size: int) -> None:
        """Bind the sparse file to the node, then allocate, then prove both took."""
        lib, info = self._ready()
        if size > info.free_bytes:
            raise BackendUnavailableError(
                f"NUMA node {self.node} has {info.free_bytes} bytes free, fewer than the "
                f"{size} asked; pick a smaller --size or free memory on that node"
            )
        os.ftruncate(fd, size)
        mask = _NodeMask()
        mask[self.node // 64] = 1 << (self.node % 64)
        with mmap.mmap(fd, size) as mm:
            if lib.mbind(address_of(mm), size, MPOL_BIND, mask, _MASK_BITS + 1, 0):
                raise _refused("mbind")
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno == errno.ENOMEM:
                raise BackendUnavailableError(
                    f"NUMA node {self.node} ran out of memory for a {size}-byte pool; "
                    "pick a smaller --size"
                ) from e
            raise
        with mmap.mmap(fd, size) as mm:
            problem = self._binding_problem(mm)
            if problem:
                raise BackendUnavailableError(
                    f"the NUMA binding did not stick to {self.path}: {problem}. Only tmpfs "
                    "files keep a binding; put the pool under /dev/shm"
                )
            for offset in range(0, size, HUGE_ALIGN):
                found = page_node(mm, offset)
                if found != self.node:
                    raise BackendUnavailableError(
                        f"the page at offset {offset} of {self.path} landed on NUMA node "
                        f"{found}, not {self.node}; check the node's memory and any "
                        "cpuset that confines this process"
                    )

    def open(self) -> Mapping:
        """Map the file and check that it really is bound to our node."""
        self._ready()
        mapping = super().open()
        try:
            problem = self._binding_problem(mapping.buffer)
        except BaseException:
            mapping.close()
            raise
        if problem:
            mapping.close()
            raise BackendUnavailableError(
                f"{self.path} is not a pool bound to NUMA node {self.node}: {problem}; attach "
                f"it as shm:{self.path}, or recreate it with 'beluga pool create --force'"
            )
        return mapping

    def info(self) -> dict[str, Any]:
        out = super().info()
        node = self._node_info()
        out["node"] = self.node
        out["cpuless"] = node.cpuless if node else None
        out["node_cpus"] = list(node.cpus) if node else []
        out["node_total_bytes"] = node.total_bytes if node else 0
        out["node_free_bytes"] = node.free_bytes if node else 0
        return out
