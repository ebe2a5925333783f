"""Topologies: what each guest sees, and the QEMU command line that builds it.

A topology is checked when it is made, so a layout QEMU would refuse, or one
it accepts but that silently does not work, never reaches a launch.  The rules
come from trying QEMU 7.2 (Debian bookworm):

- a CXL Type-3 device needs a host bridge (``pxb-cxl``) with **two** root
  ports: with one, region and namespace creation succeed but reads return
  zeros and writes are lost;
- CXL capacities and the fixed memory window are multiples of 256 MiB;
- with NUMA nodes every node needs a memory backend and ``-m`` is their sum;
- 9p must sit on ``pcie.0`` once a CXL host bridge exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from emulation.errors import TopologyError

CXL_UNIT_MIB = 256
NUMA_UNIT_MIB = 128  # Linux onlines memory in 128 MiB sections
LABEL_BYTES = 1 << 20  # the label storage area: ample for one namespace
MAX_GUESTS = 4
MIN_MEMORY_MIB = 256  # the guest runs the host's Python and numpy from 9p
KERNEL_ARGS = "console=ttyS0 quiet loglevel=3 panic=-1"


@dataclass(frozen=True)
class Topology:
    """One sandbox layout.

    ``numa_node_mib`` adds a CPU-less NUMA node (node 1) to each guest, backed
    by a file.  ``cxl_mib`` adds a CXL Type-3 persistent-memory device to each
    guest; every guest of the topology maps the *same* memory file, each with
    its own label area, which is how two guests share a CXL pool.  ``check``
    names the script in ``emulation/guest`` that runs when the caller gives none.
    """

    name: str
    guests: int = 1
    memory_mib: int = 512
    cpus: int = 1
    numa_node_mib: int = 0
    cxl_mib: int = 0
    cxl_root_ports: int = 2
    cxl_window_mib: int = 4096
    check: str = ""

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise TopologyError(f"topology {self.name!r} cannot work: {'; '.join(problems)}")

    def _problems(self) -> list[str]:
        out = []
        if not 1 <= self.guests <= MAX_GUESTS:
            out.append(f"guests must be 1..{MAX_GUESTS}, not {self.guests}")
        if self.cpus < 1:
            out.append(f"cpus must be at least 1, not {self.cpus}")
        if self.memory_mib < MIN_MEMORY_MIB or self.memory_mib % 2:
            out.append(
                f"memory_mib must be an even number >= {MIN_MEMORY_MIB}, not {self.memory_mib}"
            )
        if self.numa_node_mib < 0 or self.numa_node_mib % NUMA_UNIT_MIB:
            numa = self.numa_node_mib
            out.append(f"numa_node_mib must be 0 or a multiple of {NUMA_UNIT_MIB}, not {numa}")
        if self.cxl_mib < 0 or self.cxl_mib % CXL_UNIT_MIB:
            out.append(f"cxl_mib must be 0 or a multiple of {CXL_UNIT_MIB}, not {self.cxl_mib}")
        if self.cxl_mib:
            if self.cxl_root_ports < 2:
                out.append(
                    f"a CXL device needs at least 2 root ports, not {self.cxl_root_ports} "
                    "(with one, QEMU 7.2 boots but guest reads return zeros and writes are lost)"
                )
            if self.cxl_window_mib < self.cxl_mib or self.cxl_window_mib % CXL_UNIT_MIB:
                out.append(
                    f"cxl_window_mib must be a multiple of {CXL_UNIT_MIB} and hold the "
                    f"{self.cxl_mib} MiB device, not {self.cxl_window_mib}"
                )
        if self.guests > 1 and not self.cxl_mib:
            out.append("several guests share memory only through a CXL device: set cxl_mib")
        return out

    @property
    def total_memory_mib(self) -> int:
        """What ``-m`` must say: the sum of every NUMA node's memory."""
        return self.memory_mib + self.numa_node_mib


@dataclass(frozen=True)
class GuestFiles:
    """The host files one guest of a run uses."""

    console: Path  # the serial console, the guest's only output
    qemu_log: Path  # QEMU's own stdout and stderr
    wrapper: Path  # the shell script the guest init runs in the chroot
    label: Path  # this guest's CXL label storage area (fresh every boot)
    numa_memory: Path  # backing of the CPU-less NUMA node
    cxl_memory: Path  # the CXL device's memory, one file for all guests


def qemu_argv(
    topology: Topology, files: GuestFiles, *, qemu: str, kernel: Path, initramfs: Path, accel: str
) -> list[str]:
    """The full QEMU command line of one guest."""
    machine = "q35,cxl=on" if topology.cxl_mib else "q35"
    if topology.cxl_mib:
        machine += f",cxl-fmw.0.targets.0=cxl.0,cxl-fmw.0.size={topology.cxl_window_mib}M"
    argv = [
        qemu,
        *("-accel", accel, "-cpu", "max" if accel == "tcg" else "host"),
        *("-smp", str(topology.cpus), "-m", f"{topology.total_memory_mib}M", "-M", machine),
        *("-nodefaults", "-display", "none", "-no-reboot", "-nic", "none"),
        *("-chardev", f"file,id=console,path={_opt(files.console)}", "-serial", "chardev:console"),
        *("-kernel", str(kernel), "-initrd", str(initramfs)),
        *("-append", f"{KERNEL_ARGS} beluga.run={_kernel_arg(files.wrapper)}"),
        "-fsdev",
        "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
        *("-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot,bus=pcie.0"),
    ]
    if topology.numa_node_mib:
        argv += _numa_args(topology, files)
    if topology.cxl_mib:
        argv += _cxl_args(topology, files)
    return argv


def _numa_args(topology: Topology, files: GuestFiles) -> list[str]:
    """Node 0 holds the CPUs and RAM; node 1 is CPU-less memory backed by a file."""
    return [
        *("-object", f"memory-backend-ram,id=node0-mem,size={topology.memory_mib}M"),
        *("-numa", f"node,nodeid=0,cpus=0-{topology.cpus - 1},memdev=node0-mem"),
        "-object",
        f"memory-backend-file,id=node1-mem,share=on,mem-path={_opt(files.numa_memory)},"
        f"size={topology.numa_node_mib}M",
        *("-numa", "node,nodeid=1,memdev=node1-mem"),
    ]


def _cxl_args(topology: Topology, files: GuestFiles) -> list[str]:
    """One host bridge, its root ports, and a Type-3 device on the first port."""
    argv = [
        "-object",
        f"memory-backend-file,id=cxl-mem0,share=on,mem-path={_opt(files.cxl_memory)},"
        f"size={topology.cxl_mib}M",
        "-object",
        f"memory-backend-file,id=cxl-lsa0,share=on,mem-path={_opt(files.label)},size={LABEL_BYTES}",
        *("-device", "pxb-cxl,bus_nr=12,bus=pcie.0,id=cxl.0"),
    ]
    for port in range(topology.cxl_root_ports):
        argv += [
            "-device",
            f"cxl-rp,port={port},bus=cxl.0,id=cxl-rp{port},chassis=0,slot={port + 2}",
        ]
    argv += ["-device", "cxl-type3,bus=cxl-rp0,memdev=cxl-mem0,lsa=cxl-lsa0,id=cxl-pmem0"]
    return argv


def _opt(path: Path) -> str:
    """A path as a QEMU option value, where a comma is written twice."""
    return str(path).replace(",", ",,")


def _kernel_arg(path: Path) -> str:
    """A path as one kernel command-line word, which cannot hold blanks or quotes."""
    text = str(path)
    if any(c.isspace() or c in "\"'" for c in text):
        raise TopologyError(
            f"the guest cannot be told to run {text}: the kernel command line cannot "
            "carry blanks or quotes; move the checkout to a path without them"
        )
    return text


TOPOLOGIES: dict[str, Topology] = {
    t.name: t
    for t in (
        Topology("numa", numa_node_mib=256, check="numa_check.py"),
        Topology("dax", cxl_mib=256, check="dax_check.py"),
        Topology("shared", guests=2, cxl_mib=256, check="shared_check.py"),
    )
}


def topology_named(name: str) -> Topology:
    """A predefined topology by name, or a ValueError that lists them."""
    try:
        return TOPOLOGIES[name]
    except KeyError:
        raise TopologyError(
            f"no topology {name!r}; choose one of {', '.join(TOPOLOGIES)}"
        ) from None
