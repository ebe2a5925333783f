"""The hardware configuration (see conftest.py) and the checks that judge it."""

from __future__ import annotations

import os
import stat
import uuid
from dataclasses import dataclass

from beluga.errors import BackendUnavailableError
from beluga.pool.dax import DaxBackend, device_size

MiB = 1 << 20
#: the least a device or node must hold: a quick certification run fits in it
MIN_BYTES = 64 * MiB
STRIPE = 2 * MiB


@dataclass(frozen=True)
class HwConfig:
    dax: tuple[str, ...]
    numa: str | None
    stand_in: bool

    @classmethod
    def from_env(cls) -> HwConfig:
        env = os.environ
        dax = tuple(d.strip() for d in env.get("BELUGA_HW_DAX", "").split(",") if d.strip())
        numa = env.get("BELUGA_HW_NUMA", "").strip() or None
        return cls(dax, numa, env.get("BELUGA_HW_STAND_IN") == "1")


def dax_problems(config: HwConfig) -> list[str]:
    """Why the configured devices cannot be tested (empty when they can)."""
    problems, seen = [], set()
    for entry in config.dax:
        try:
            backend = DaxBackend.from_spec(entry)
        except ValueError as e:
            problems.append(f"BELUGA_HW_DAX entry {entry!r}: {e}")
            continue
        where = f"BELUGA_HW_DAX device {backend.path}"
        if (backend.path, backend.offset) in seen:
            problems.append(f"{where} is named twice")
        seen.add((backend.path, backend.offset))
        try:
            st = os.stat(backend.path)
        except OSError as e:
            problems.append(f"{where} cannot be examined: {e.strerror}")
            continue
        if stat.S_ISREG(st.st_mode) and not config.stand_in:
            problems.append(
                f"{where} is a regular file, not a device-DAX device (only CI sets "
                "BELUGA_HW_STAND_IN=1 to accept stand-in files)"
            )
            continue
        try:
            room = device_size(st, backend.path) - backend.offset
        except BackendUnavailableError as e:
            problems.append(f"{where}: {e}")
            continue
        if room < MIN_BYTES:
            problems.append(
                f"{where} holds {max(room, 0)} bytes after offset {backend.offset}, less than "
                f"the {MIN_BYTES} the hardware tests need"
            )
    return problems


def numa_problems(config: HwConfig) -> list[str]:
    """Why the configured node cannot be tested (empty when it can)."""
    from beluga.pool.numa import list_nodes

    assert config.numa is not None
    if not config.numa.isdigit():
        return [f"BELUGA_HW_NUMA must be a node number, not {config.numa!r}"]
    node = int(config.numa)
    nodes = {n.node: n for n in list_nodes()}
    if node not in nodes:
        return [f"BELUGA_HW_NUMA={node}: no such NUMA node here (nodes: {sorted(nodes)})"]
    info = nodes[node]
    problems = []
    if info.cpus and not config.stand_in:
        problems.append(
            f"BELUGA_HW_NUMA={node} has CPUs {list(info.cpus)}: CXL memory onlined as RAM is a "
            "CPU-less node ('beluga pool nodes' lists them)"
        )
    if info.free_bytes < MIN_BYTES:
        problems.append(
            f"BELUGA_HW_NUMA={node} has {info.free_bytes} bytes free, less than the "
            f"{MIN_BYTES} the hardware tests need"
        )
    return problems


def numa_spec(node: int) -> str:
    return f"numa:{node}:/dev/shm/beluga-hwtest-{uuid.uuid4().hex[:8]}"
