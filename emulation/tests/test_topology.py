"""The QEMU command line and topology checks, without QEMU."""

from __future__ import annotations

from pathlib import Path

import pytest

from emulation.errors import TopologyError
from emulation.topology import TOPOLOGIES, GuestFiles, Topology, qemu_argv, topology_named


def files(root: Path) -> GuestFiles:
    return GuestFiles(
        console=root / "console-0.log",
        qemu_log=root / "qemu-0.log",
        wrapper=root / "guest-0.sh",
        label=root / "label-0.bin",
        numa_memory=root / "numa0",
        cxl_memory=root / "cxl",
    )


def argv(topology: Topology | str, root: Path = Path("/r"), accel: str = "tcg") -> list[str]:
    if isinstance(topology, str):
        topology = topology_named(topology)
    return qemu_argv(
        topology, files(root), qemu="qemu", kernel=Path("/k"), initramfs=Path("/i"), accel=accel
    )


def values(args: list[str], flag: str) -> list[str]:
    """Every value given to one QEMU option, in order."""
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_every_guest_boots_the_kernel_with_its_script_and_the_host_root() -> None:
    args = argv("dax")
    assert args[0] == "qemu"
    assert values(args, "-kernel") == ["/k"] and values(args, "-initrd") == ["/i"]
    (append,) = values(args, "-append")
    assert "beluga.run=/r/guest-0.sh" in append.split()
    assert "console=ttyS0" in append.split()
    assert values(args, "-fsdev") == [
        "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap"
    ]
    assert "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot,bus=pcie.0" in values(args, "-device")
    assert values(args, "-serial") == ["chardev:console"]
    assert values(args, "-chardev") == ["file,id=console,path=/r/console-0.log"]
    assert "-no-reboot" in args and values(args, "-nic") == ["none"]


def test_software_emulation_uses_the_max_cpu_and_kvm_the_host_cpu() -> None:
    tcg = argv("dax")
    assert values(tcg, "-accel") == ["tcg"] and values(tcg, "-cpu") == ["max"]
    kvm = argv("dax", accel="kvm")
    assert values(kvm, "-accel") == ["kvm"] and values(kvm, "-cpu") == ["host"]


def test_dax_has_a_cxl_host_bridge_two_root_ports_and_a_type3_device_with_labels() -> None:
    args = argv("dax")
    (machine,) = values(args, "-M")
    assert machine.split(",") == [
        "q35",
        "cxl=on",
        "cxl-fmw.0.targets.0=cxl.0",
        "cxl-fmw.0.size=4096M",
    ]
    devices = values(args, "-device")
    assert "pxb-cxl,bus_nr=12,bus=pcie.0,id=cxl.0" in devices
    assert sum(d.startswith("cxl-rp,") for d in devices) == 2
    assert "cxl-type3,bus=cxl-rp0,memdev=cxl-mem0,lsa=cxl-lsa0,id=cxl-pmem0" in devices
    objects = values(args, "-object")
    assert "memory-backend-file,id=cxl-mem0,share=on,mem-path=/r/cxl,size=256M" in objects
    assert any(
        o.startswith("memory-backend-file,id=cxl-lsa0,share=on,mem-path=/r/label-0.bin")
        for o in objects
    )
    assert "-numa" not in args


def test_numa_adds_a_cpu_less_node_backed_by_a_file_and_m_is_the_sum() -> None:
    args = argv("numa")
    assert values(args, "-m") == ["768M"]
    assert values(args, "-numa") == [
        "node,nodeid=0,cpus=0-0,memdev=node0-mem",
        "node,nodeid=1,memdev=node1-mem",
    ]
    objects = values(args, "-object")
    assert "memory-backend-ram,id=node0-mem,size=512M" in objects
    assert "memory-backend-file,id=node1-mem,share=on,mem-path=/r/numa0,size=256M" in objects
    assert values(args, "-M") == ["q35"]


def test_shared_is_two_guests_on_one_cxl_memory_file() -> None:
    shared = TOPOLOGIES["shared"]
    assert shared.guests == 2 and shared.cxl_mib
    assert "mem-path=/r/cxl," in " ".join(values(argv(shared), "-object"))


def test_a_comma_in_a_path_is_doubled_for_qemu() -> None:
    args = argv("dax", root=Path("/a,b"))
    assert values(args, "-chardev") == ["file,id=console,path=/a,,b/console-0.log"]


def test_a_path_the_kernel_command_line_cannot_carry_is_refused() -> None:
    with pytest.raises(TopologyError, match="without them"):
        argv("dax", root=Path("/my checkout"))


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"cxl_mib": 256, "cxl_root_ports": 1}, "at least 2 root ports"),
        ({"cxl_mib": 100}, "cxl_mib must be 0 or a multiple of 256"),
        ({"cxl_mib": 512, "cxl_window_mib": 256}, "hold the 512 MiB device"),
        ({"numa_node_mib": 100}, "numa_node_mib must be 0 or a multiple of 128"),
        ({"guests": 2}, "share memory only through a CXL device"),
        ({"guests": 9, "cxl_mib": 256}, "guests must be 1..4"),
        ({"memory_mib": 64}, "memory_mib must be an even number >= 256"),
        ({"cpus": 0}, "cpus must be at least 1"),
    ],
)
def test_a_topology_that_cannot_work_is_refused_before_any_launch(
    fields: dict[str, int], complaint: str
) -> None:
    with pytest.raises(TopologyError, match=complaint):
        Topology("bad", **fields)


def test_an_unknown_topology_name_lists_the_known_ones() -> None:
    with pytest.raises(TopologyError, match="dax, shared"):
        topology_named("cxl3")
    assert isinstance(TopologyError("x"), ValueError)
