"""The numa: backend: binding before allocation, placement, and its refusals."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from beluga.errors import BackendUnavailableError
from beluga.pool import Geometry, Pool, ShmBackend, parse_spec
from beluga.pool import numa as numa_module
from beluga.pool.numa import NodeInfo, NumaBackend, list_nodes, memory_policy, page_node

MiB = 1 << 20
SMALL = Geometry(max_hosts=4, rpc_bytes_per_host=64 << 10, block_size=64 << 10)


def _numa_usable() -> str:
    """Why the NUMA system calls cannot run here, or '' when they can."""
    try:
        numa_module._libnuma(numa_module.LIBNUMA)
    except BackendUnavailableError as e:
        return str(e)
    return ""


needs_numa = pytest.mark.skipif(bool(_numa_usable()), reason=_numa_usable() or "n/a")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_spec_parses_and_round_trips() -> None:
    b = parse_spec("numa:1:/dev/shm/beluga-n1")
    assert isinstance(b, NumaBackend) and (b.node, b.path) == (1, "/dev/shm/beluga-n1")
    assert b.spec == "numa:1:/dev/shm/beluga-n1" and parse_spec(b.spec).spec == b.spec
    assert parse_spec("numa:0:rel/pool").spec == f"numa:0:{os.path.abspath('rel/pool')}"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("numa:x:/dev/shm/p", "numa:NODE:PATH"),
        ("numa:-1:/dev/shm/p", "numa:NODE:PATH"),
        ("numa:/dev/shm/p", "numa:NODE:PATH"),
        ("numa:0:", "needs a path"),
        ("numa:5000:/dev/shm/p", "integer in 0..1023"),
    ],
)
def test_bad_specs_are_refused(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_spec(spec)


def test_cpu_lists_are_expanded() -> None:
    assert numa_module._parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert numa_module._parse_cpu_list("\n") == []


def test_list_nodes_covers_this_machine() -> None:
    nodes = list_nodes()
    assert nodes and 0 in {n.node for n in nodes}
    for n in nodes:
        assert n.total_bytes >= n.free_bytes >= 0 and n.cpuless == (not n.cpus)
    assert os.sched_getaffinity(0) <= {cpu for n in nodes for cpu in n.cpus}


def test_list_nodes_reports_a_cpuless_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a CXL expander onlined as RAM looks like in sysfs."""
    (tmp_path / "online").write_text("0-1\n")
    for node, cpus, total_kb, free_kb in ((0, "0-3", 8192, 4096), (1, "", 262144, 262000)):
        d = tmp_path / f"node{node}"
        d.mkdir()
        (d / "cpulist").write_text(f"{cpus}\n")
        (d / "meminfo").write_text(
            f"Node {node} MemTotal:       {total_kb} kB\nNode {node} MemFree:        {free_kb} kB\n"
        )
    monkeypatch.setattr(numa_module, "SYS_NODES", str(tmp_path))
    assert list_nodes() == [
        NodeInfo(0, 8192 * 1024, 4096 * 1024, (0, 1, 2, 3), cpuless=False),
        NodeInfo(1, 262144 * 1024, 262000 * 1024, (), cpuless=True),
    ]
    monkeypatch.setattr(numa_module, "SYS_NODES", str(tmp_path / "absent"))
    assert list_nodes() == []


@needs_numa
def test_pages_are_bound_and_placed(shm_path: str) -> None:
    with Pool.create(f"numa:0:{shm_path}", 32 * MiB, geometry=SMALL) as pool:
        buf = pool.mapping.buffer
        for offset in (0, 4096, 17 * MiB + 5, 32 * MiB - 1):
            assert memory_policy(buf, offset) == ("bind", frozenset({0}))
            assert page_node(buf, offset) == 0
        with pytest.raises(ValueError, match="outside"):
            page_node(buf, 32 * MiB)
    # The binding belongs to the file, not to one mapping: a plain shm mapping sees it too.
    plain = ShmBackend(shm_path).open()
    try:
        assert memory_policy(plain.buffer, 9 * MiB) == ("bind", frozenset({0}))
    finally:
        plain.close()
    with Pool.attach(f"numa:0:{shm_path}") as again:
        assert again.info()["node"] == 0
    Pool.destroy(f"numa:0:{shm_path}")
    assert not os.path.exists(shm_path)


@needs_numa
def test_info_says_a_node_with_cpus_is_not_cxl_like(shm_path: str) -> None:
    info = NumaBackend(0, shm_path).info()
    assert info["node"] == 0 and info["cpuless"] is False and info["node_cpus"]
    assert info["path"] == shm_path and info["node_total_bytes"] > 0


@needs_numa
def test_a_missing_node_names_the_nodes_that_exist(shm_path: str) -> None:
    absent = max(n.node for n in list_nodes()) + 1
    b = NumaBackend(absent, shm_path)
    before = open_fds()
    for attempt in (lambda: Pool.create(b, 32 * MiB, geometry=SMALL), b.open):
        with pytest.raises(BackendUnavailableError, match=rf"node {absent} does not exist.*0 \("):
            attempt()
    assert open_fds() == before
    assert not os.path.exists(shm_path) and not os.path.exists(shm_path + ".creating")
    assert b.info()["cpuless"] is None


@needs_numa
def test_a_binding_that_cannot_stick_is_refused(tmp_path: Path) -> None:
    if os.statvfs(tmp_path).f_fsid == os.statvfs("/dev/shm").f_fsid:
        pytest.skip("the temporary directory is itself on tmpfs")
    b = NumaBackend(0, str(tmp_path / "pool"))
    before = open_fds()
    with pytest.raises(BackendUnavailableError, match=r"did not stick.*/dev/shm"):
        b.create(8 * MiB)
    assert open_fds() == before and list(tmp_path.iterdir()) == []


@needs_numa
def test_an_unbound_file_is_not_taken_for_a_numa_pool(shm_path: str) -> None:
    """Open refuses, so Pool.create cannot mistake a foreign file for an empty slot."""
    with Pool.create(shm_path, 32 * MiB, geometry=SMALL) as plain:
        uid = plain.superblock.uuid
    with pytest.raises(BackendUnavailableError, match="not a pool bound to NUMA node 0"):
        Pool.attach(f"numa:0:{shm_path}")
    with pytest.raises(BackendUnavailableError, match="attach it as shm:"):
        Pool.create(f"numa:0:{shm_path}", 32 * MiB, geometry=SMALL)
    with Pool.attach(shm_path) as still:
        assert still.superblock.uuid == uid
    with Pool.create(f"numa:0:{shm_path}", 32 * MiB, geometry=SMALL, force=True) as bound:
        assert memory_policy(bound.mapping.buffer) == ("bind", frozenset({0}))
    Pool.destroy(shm_path)


@needs_numa
def test_a_node_without_room_is_refused(shm_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    full = NodeInfo(0, 64 * MiB, 4 * MiB, (0,), cpuless=False)
    monkeypatch.setattr(numa_module, "list_nodes", lambda: [full])
    with pytest.raises(BackendUnavailableError, match="4194304 bytes free"):
        NumaBackend(0, shm_path).create(8 * MiB)
    assert not os.path.exists(shm_path + ".creating")


def test_missing_libnuma_says_what_to_install(
    shm_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(numa_module, "LIBNUMA", "libnuma-absent.so.0")
    b = NumaBackend(0, shm_path)
    for attempt in (lambda: b.create(8 * MiB), b.open):
        with pytest.raises(BackendUnavailableError, match="install libnuma1"):
            attempt()
    assert not os.path.exists(shm_path + ".creating")
